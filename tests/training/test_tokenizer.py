"""Tokenizers: byte, HuggingFace tokenizer.json (the shipped one), SentencePiece; error messages."""
import os
import pickle
from pathlib import Path

import pytest

from mixerlab.training.tokenizer import KINDS, load_tokenizer

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "data" / "embedded" / "tokenizer.json"
SENTENCE = "The quick brown fox jumps over the lazy dog. Ünïcödé and émoji 🐍 too!"


def test_byte_round_trip():
    tok = load_tokenizer("byte", None)
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    ids = tok.encode(SENTENCE)
    assert ids == list(SENTENCE.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == SENTENCE
    assert tok.decode(ids + [tok.eos_id]) == SENTENCE  # EOS is dropped when decoding
    assert tok.encode_batch([SENTENCE, ""]) == [ids, []]
    assert tok.name == "byte"


def test_hf_shipped_tokenizer_round_trip():
    tok = load_tokenizer("hf", str(SHIPPED))
    assert tok.vocab_size == 8192
    assert tok.eos_id == 0  # "<|endoftext|>" is the only special token
    ids = tok.encode(SENTENCE)
    assert tok.eos_id not in ids
    assert len(ids) < len(SENTENCE.encode("utf-8"))  # BPE merges something
    assert tok.decode(ids) == SENTENCE
    assert tok.encode_batch([SENTENCE, "def f(x):\n    return x"]) == [ids, tok.encode("def f(x):\n    return x")]
    assert max(ids) < tok.vocab_size
    assert "tokenizer.json" in tok.name
    # picklable (grain worker processes), by path
    tok2 = pickle.loads(pickle.dumps(tok))
    assert tok2.encode(SENTENCE) == ids


def test_hf_relative_path_from_repo_root(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # resolved against the repository root when not found from the cwd
    tok = load_tokenizer("hf", "data/embedded/tokenizer.json")
    assert tok.vocab_size == 8192


def test_hf_eos_fallback_and_missing_eos(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    def make(specials):
        vocab = {"a": 0, "b": 1, "[UNK]": 2}
        t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        t.pre_tokenizer = pre_tokenizers.Whitespace()
        t.add_special_tokens(specials)
        p = tmp_path / f"tok{len(specials)}.json"
        t.save(str(p))
        return str(p)

    tok = load_tokenizer("hf", make(["<eos>", "</s>"]))
    assert tok.eos_id == tok._tok.token_to_id("</s>")  # "</s>" is preferred over "<eos>"
    path = make([])
    with pytest.raises(ValueError) as e:
        load_tokenizer("hf", path)
    msg = str(e.value)
    assert path in msg and "<|endoftext|>" in msg and "</s>" in msg and "<eos>" in msg


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    import sentencepiece as spm

    d = tmp_path_factory.mktemp("sp")
    words = ["alpha", "beta", "gamma", "delta", "token", "mixer", "linear", "attention", "state", "space"]
    lines = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(8 + i % 5)) + f" number {i}."
             for i in range(400)]
    (d / "corpus.txt").write_text("\n".join(lines))
    spm.SentencePieceTrainer.train(input=str(d / "corpus.txt"), model_prefix=str(d / "sp"), vocab_size=64,
                                   model_type="bpe", character_coverage=1.0, num_threads=1,
                                   minloglevel=2)
    return str(d / "sp.model")


def test_sentencepiece_round_trip(sp_model):
    tok = load_tokenizer("sentencepiece", sp_model)
    assert tok.vocab_size == 64
    assert 0 <= tok.eos_id < tok.vocab_size
    text = "alpha beta mixer attention number 12."
    ids = tok.encode(text)
    assert ids and tok.eos_id not in ids
    assert tok.decode(ids) == text
    assert tok.encode_batch([text, "gamma"]) == [ids, tok.encode("gamma")]
    assert pickle.loads(pickle.dumps(tok)).encode(text) == ids


def test_sentencepiece_without_eos(tmp_path):
    import sentencepiece as spm

    (tmp_path / "c.txt").write_text("\n".join(f"hello world line {i} of text" for i in range(200)))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "c.txt"), model_prefix=str(tmp_path / "noeos"),
                                   vocab_size=40, eos_id=-1, num_threads=1, minloglevel=2)
    with pytest.raises(ValueError, match="eos"):
        load_tokenizer("sentencepiece", str(tmp_path / "noeos.model"))


def test_unknown_kind():
    with pytest.raises(ValueError) as e:
        load_tokenizer("tiktoken", None)
    msg = str(e.value)
    assert "data.tokenizer.kind" in msg and "tiktoken" in msg
    assert all(k in msg for k in KINDS)


@pytest.mark.parametrize("kind", ["hf", "sentencepiece"])
def test_missing_file(kind, tmp_path):
    missing = str(tmp_path / "nope" / "tokenizer.model")
    with pytest.raises(FileNotFoundError) as e:
        load_tokenizer(kind, missing)
    assert "data.tokenizer.path" in str(e.value) and missing in str(e.value)


def test_path_rules():
    with pytest.raises(ValueError, match="data.tokenizer.path"):
        load_tokenizer("byte", str(SHIPPED))
    with pytest.raises(ValueError, match="data.tokenizer.path"):
        load_tokenizer("hf", None)
    assert os.path.exists(SHIPPED)


@pytest.mark.parametrize("kind, name, content, expected", [
    ("hf", "tokenizer.json", '{"model": {"type": "BPE"', "is not valid JSON (Expecting"),  # truncated
    ("hf", "tokenizer.json", '{"vocab": [1, 2, 3]}', "is JSON but not a tokenizer"),
    ("hf", "tokenizer.json", b"\x80\x81\xfe binary", "is not a text file"),
    ("sentencepiece", "tok.model", "not a protobuf", "is not a SentencePiece model"),
])
def test_a_file_that_is_not_a_tokenizer_names_key_file_and_expectation(tmp_path, kind, name, content, expected):
    path = tmp_path / name
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    with pytest.raises(ValueError) as e:
        load_tokenizer(kind, str(path))
    msg = str(e.value)
    assert msg.startswith("data.tokenizer.path: ") and str(path) in msg and expected in msg, msg
    assert f"data.tokenizer.kind='{kind}' expects" in msg and "\n" not in msg
