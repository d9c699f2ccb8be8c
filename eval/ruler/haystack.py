"""Haystack text cut into pieces (sentences) between which needles are inserted.

Two sources, as in RULER:

* ``repeat``: RULER's noise, the five sentences "The grass is green. The sky is blue. The sun is yellow. Here we
  go. There and back again." repeated, one repetition per line;
* ``essay``: RULER uses Paul Graham's essays; this repository ships none, so the essay haystack is the embedded
  corpus (data/embedded/*/*.parquet, the CPython 3.11 documentation in FineWeb-Edu's schema, ``text`` column,
  read with pyarrow). Heading underlines (lines of only ``= - ~ ^ * #``) are dropped, white space is collapsed
  to single spaces (as RULER does with the essays), the text is split into sentences after ``.``, ``!`` or
  ``?``, and sentences longer than ``MAX_PIECE_WORDS`` words are cut into pieces of at most that many words, so
  that a needle's depth can be placed to within one short piece. Each sample starts at a random document
  (seeded) and continues through the following documents, wrapping around.

A ``Piece`` is a piece of text with the separator that follows it; the context is the concatenation.
"""
from __future__ import annotations

import dataclasses
import functools
import re

from mixerlab.training.data import resolve_parquet_files
from mixerlab.training.tokenizer import Tokenizer

NOISE_SENTENCES = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
                   "There and back again.")
DEFAULT_ESSAY_PATH = "data/embedded/*/*.parquet"
MAX_PIECE_WORDS = 12
_UNDERLINE = re.compile(r"^\s*[=\-~^*#]{3,}\s*$", re.MULTILINE)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclasses.dataclass(frozen=True)
class Piece:
    text: str
    sep: str = " "

    def render(self) -> str:
        return self.text + self.sep


def noise_pieces(count: int) -> list[Piece]:
    """``count`` noise sentences; a line break after every fifth."""
    n = len(NOISE_SENTENCES)
    return [Piece(NOISE_SENTENCES[i % n], "\n" if i % n == n - 1 else " ") for i in range(count)]


def noise_text() -> str:
    return " ".join(NOISE_SENTENCES)


def clean_document(text: str) -> str:
    return " ".join(_UNDERLINE.sub(" ", text).split())


def split_pieces(text: str, max_words: int = MAX_PIECE_WORDS) -> list[str]:
    """Sentences of ``text`` (already white-space collapsed), long ones cut every ``max_words`` words."""
    out = []
    for sentence in _SENTENCE_END.split(text):
        words = sentence.split()
        out.extend(" ".join(words[i:i + max_words]) for i in range(0, len(words), max_words))
    return out


@functools.lru_cache(maxsize=4)
def load_essay_documents(path: str = DEFAULT_ESSAY_PATH) -> tuple[str, ...]:
    """The cleaned, non-empty documents of the Parquet file(s) at ``path`` (a file, directory or glob)."""
    import pyarrow.parquet as pq

    docs = []
    for f in resolve_parquet_files(path, "essay_path"):
        for text in pq.read_table(f, columns=["text"]).column("text").to_pylist():
            cleaned = clean_document(text or "")
            if cleaned:
                docs.append(cleaned)
    if not docs:
        raise ValueError(f"essay_path: {path!r} holds no non-empty 'text' rows")
    return tuple(docs)


@functools.lru_cache(maxsize=4)
def essay_corpus_text(path: str = DEFAULT_ESSAY_PATH) -> str:
    """All essay text, lower-cased: random needle strings must not occur in it."""
    return "\n".join(load_essay_documents(path)).lower()


def essay_pieces(start: int, tokenizer: Tokenizer, min_tokens: int,
                 path: str = DEFAULT_ESSAY_PATH) -> tuple[list[Piece], list[int]]:
    """Pieces from document ``start`` on (wrapping around), until their token count (piece by piece) reaches
    ``min_tokens`` or every document was used once; with each piece's token count."""
    docs = load_essay_documents(path)
    pieces, tokens, total = [], [], 0
    for i in range(len(docs)):
        texts = split_pieces(docs[(start + i) % len(docs)])
        counts = [len(ids) for ids in tokenizer.encode_batch([t + " " for t in texts])]
        for text, count in zip(texts, counts):
            pieces.append(Piece(text))
            tokens.append(count)
            total += count
            if total >= min_tokens:
                return pieces, tokens
    return pieces, tokens


def repeat_pieces(tokenizer: Tokenizer, min_tokens: int) -> tuple[list[Piece], list[int]]:
    """Noise sentences until their token count reaches ``min_tokens``; with each piece's token count."""
    per_sentence = [len(ids) for ids in tokenizer.encode_batch([p.render() for p in noise_pieces(5)])]
    count = 0
    total = 0
    while total < min_tokens:
        total += per_sentence[count % 5]
        count += 1
    return noise_pieces(count), [per_sentence[i % 5] for i in range(count)]
