"""Tokenizers behind one small protocol: ``load_tokenizer(kind, path)``.

Kinds (``data.tokenizer.kind``):
  * ``byte``: UTF-8 bytes 0..255 plus one EOS id (256); vocab_size 257; no file.
  * ``hf``: any HuggingFace ``tokenizer.json`` (``tokenizers.Tokenizer.from_file``); EOS is the id of
    ``<|endoftext|>``, else ``</s>``, else ``<eos>``.
  * ``sentencepiece``: any SentencePiece ``.model``; EOS is the model's ``eos_id``.

The path may be a gs:// or s3:// URL: the file is downloaded once into the storage cache (training.storage).

Every tokenizer has ``vocab_size``, ``eos_id``, ``name`` (for logs), ``encode(text) -> list[int]`` (no EOS or
BOS added), ``encode_batch(texts) -> list[list[int]]`` and ``decode(ids) -> str`` (EOS and other special/control
tokens are dropped, as each library does by default). Tokenizers pickle (by path), so grain worker processes
can use them.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Protocol, Sequence, runtime_checkable

from mixerlab.training import storage

KINDS = ("byte", "hf", "sentencepiece")
HF_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>")
_REPO_ROOT = Path(__file__).resolve().parents[1]


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int
    name: str

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def resolve_path(path: str, key: str) -> str:
    """``path`` as given if it exists; a relative path not found from the working directory is also tried
    from the repository root (so ``data/embedded/...`` works from anywhere). Else FileNotFoundError naming
    the config key."""
    p = os.path.expanduser(path)
    if os.path.exists(p):
        return p
    if not os.path.isabs(p):
        alt = _REPO_ROOT / p
        if alt.exists():
            return str(alt)
    raise FileNotFoundError(f"{key}: {path!r} does not exist (working directory: {os.getcwd()})")


def _as_int_list(ids) -> list[int]:
    return [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]


class ByteTokenizer:
    """UTF-8 bytes; id 256 is EOS."""

    vocab_size = 257
    eos_id = 256
    name = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in _as_int_list(ids) if 0 <= i < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A HuggingFace ``tokenizers`` tokenizer.json."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _HFTok

        self.path = path
        self._tok = _read_hf_tokenizer(path, _HFTok)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        for token in HF_EOS_CANDIDATES:
            tid = self._tok.token_to_id(token)
            if tid is not None:
                self.eos_id, self.eos_token = int(tid), token
                break
        else:
            raise ValueError(f"data.tokenizer.path: {path!r} has no end-of-text token; looked for "
                             f"{', '.join(repr(t) for t in HF_EOS_CANDIDATES)} (in that order)")
        self.vocab_size = max(self.vocab_size, self.eos_id + 1)
        self.name = f"hf:{os.path.basename(path)}"
        self._fast = getattr(self._tok, "encode_batch_fast", None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        fn = self._fast or self._tok.encode_batch
        return [e.ids for e in fn(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(_as_int_list(ids))

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def _read_hf_tokenizer(path: str, loader):
    """``tokenizers.Tokenizer.from_file`` with errors that name the config key and what was expected (the
    library's own is a bare ``Exception: EOF while parsing ...``)."""
    import json

    expected = ("data.tokenizer.kind='hf' expects a HuggingFace tokenizer.json (tokenizers' Tokenizer.save, "
                "or mixerlab-train-tokenizer)")
    try:
        with open(path, encoding="utf-8") as f:
            json.load(f)
    except UnicodeDecodeError:
        raise ValueError(f"data.tokenizer.path: {path!r} is not a text file; {expected}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"data.tokenizer.path: {path!r} is not valid JSON ({e.msg} at line {e.lineno}, "
                         f"column {e.colno}); {expected}") from None
    try:
        return loader.from_file(path)
    except Exception as e:  # valid JSON, but not a tokenizer (the library raises a bare Exception)
        raise ValueError(f"data.tokenizer.path: {path!r} is JSON but not a tokenizer ({str(e).strip()}); "
                         f"{expected}") from None


class SentencePieceTokenizer:
    """A SentencePiece ``.model``."""

    def __init__(self, path: str):
        import sentencepiece as spm

        self.path = path
        try:
            self._sp = spm.SentencePieceProcessor(model_file=path)
        except (RuntimeError, OSError) as e:  # "INTERNAL: could not parse ModelProto from ..."
            raise ValueError(f"data.tokenizer.path: {path!r} is not a SentencePiece model (data.tokenizer.kind="
                             f"'sentencepiece' expects the .model file written by spm.SentencePieceTrainer or "
                             f"mixerlab-train-tokenizer): {str(e).strip()}") from None
        self.vocab_size = int(self._sp.get_piece_size())
        eos = int(self._sp.eos_id())
        if eos < 0:
            raise ValueError(f"data.tokenizer.path: the SentencePiece model {path!r} has no EOS piece "
                             f"(eos_id = -1); train it with eos_id >= 0")
        self.eos_id = eos
        self.name = f"sentencepiece:{os.path.basename(path)}"

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts), out_type=int)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode(_as_int_list(ids))

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.path!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def load_tokenizer(kind: str, path: str | None = None) -> Tokenizer:
    """Loads the tokenizer of ``data.tokenizer.kind`` from ``data.tokenizer.path``."""
    if kind not in KINDS:
        raise ValueError(f"data.tokenizer.kind: unknown tokenizer kind {kind!r}; valid kinds: {', '.join(KINDS)}")
    if kind == "byte":
        if path is not None:
            raise ValueError(f"data.tokenizer.path: must be null for data.tokenizer.kind='byte' (got {path!r})")
        return ByteTokenizer()
    if not path:
        raise ValueError(f"data.tokenizer.path: data.tokenizer.kind={kind!r} needs a path "
                         f"({'tokenizer.json' if kind == 'hf' else 'a .model file'}), got {path!r}")
    if storage.is_url(path):  # the tokenizer libraries read local files: a cached download of the object
        if not storage.isfile(path, "data.tokenizer.path"):
            raise storage.describe(FileNotFoundError(path), path, "data.tokenizer.path")
        resolved = storage.local_copy(path, "data.tokenizer.path")
    else:
        resolved = resolve_path(path, "data.tokenizer.path")
    if os.path.isdir(resolved):
        raise FileNotFoundError(f"data.tokenizer.path: {path!r} is a directory, expected a file")
    if kind == "hf":
        return HFTokenizer(resolved)
    return SentencePieceTokenizer(resolved)
