"""The grain data pipeline (training/data.py) and the shipped corpus (data/embedded)."""
import json
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mixerlab.training import data
from mixerlab.training.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
EMBEDDED = REPO / "data" / "embedded"
T = 32
BYTE = load_tokenizer("byte", None)
EOS = BYTE.eos_id


def make_cfg(train_path, *, val_path=None, seq_len=T, shuffle=True, kind="byte", tok_path=None, num_workers=0,
             text_column="text"):
    return types.SimpleNamespace(
        train_path=str(train_path), val_path=None if val_path is None else str(val_path), text_column=text_column,
        seq_len=seq_len, tokenizer=types.SimpleNamespace(kind=kind, path=tok_path), shuffle=shuffle,
        num_workers=num_workers)


def write_parquet(path, texts, row_group_size=16, column="text"):
    path.parent.mkdir(parents=True, exist_ok=True)
    n = len(texts)
    table = pa.table({column: texts, "id": [f"<urn:test:{i}>" for i in range(n)],
                      "token_count": pa.array([len(t) for t in texts], pa.int64())})
    pq.write_table(table, path, row_group_size=row_group_size, compression="zstd")


def prose_docs(n=60, seed=0):
    rng = np.random.default_rng(seed)
    words = "the a linear attention mixer state space token model learns gate decay über naïve café".split()
    docs = []
    for i in range(n):
        length = int(rng.choice([3, 8, 20, 60]))  # some documents are longer than a row (T + 1 = 33 bytes)
        docs.append(f"doc{i:03d}: " + " ".join(rng.choice(words, size=length)) + ".")
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two train files (several row groups each) of prose-like documents and a val file."""
    root = tmp_path_factory.mktemp("corpus")
    docs = prose_docs(60)
    write_parquet(root / "train" / "part-00000.parquet", docs[:35])
    write_parquet(root / "train" / "part-00001.parquet", docs[35:])
    val = prose_docs(9, seed=1)
    write_parquet(root / "val" / "part-00000.parquet", val, row_group_size=4)
    return types.SimpleNamespace(root=root, docs=docs, val=val)


@pytest.fixture(scope="module")
def letters(tmp_path_factory):
    """40 documents, each one repeated character: every piece of a row tells which document it came from."""
    root = tmp_path_factory.mktemp("letters")
    docs = [chr(ord("A") + i) * (5 + (i * 7) % 23) if i < 26 else chr(ord("a") + i - 26) * (5 + (i * 7) % 23)
            for i in range(40)]
    write_parquet(root / "train.parquet", docs, row_group_size=8)
    return types.SimpleNamespace(path=root / "train.parquet", docs=docs)


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_same(batches_a, batches_b):
    assert len(batches_a) == len(batches_b)
    for a, b in zip(batches_a, batches_b):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def segments(batch, r):
    """[(segment id, start, end)] of row r (non-padding)."""
    seg = batch["segment_ids"][r]
    out, start = [], 0
    for i in range(1, len(seg) + 1):
        if i == len(seg) or seg[i] != seg[i - 1]:
            if seg[start] != 0:
                out.append((int(seg[start]), start, i))
            start = i
    return out


def letter_docs(batch):
    """Which documents (by character) a batch contains."""
    seen = set()
    for r in range(batch["inputs"].shape[0]):
        for _, a, b in segments(batch, r):
            chars = {c for c in batch["inputs"][r, a:b].tolist() if c != EOS}
            assert len(chars) <= 1
            seen |= chars
    return seen


# ------------------------------------------------------------------------------------------- batches
def test_shapes_and_dtypes(corpus):
    it = data.train_iterator(make_cfg(corpus.root / "train"), BYTE, global_batch_size=4, seed=0)
    b = next(it)
    assert set(b) == set(data.BATCH_KEYS)
    for k in ("inputs", "targets", "segment_ids", "positions"):
        assert b[k].shape == (4, T) and b[k].dtype == np.int32, k
    assert b["loss_mask"].shape == (4, T) and b["loss_mask"].dtype == np.float32


def test_packing_invariants(corpus):
    it = data.train_iterator(make_cfg(corpus.root / "train"), BYTE, global_batch_size=4, seed=3)
    haystack = "\x00".join(corpus.docs).encode("utf-8")
    n_segments = 0
    for b in take(it, 12):  # > 1 epoch of 60 documents
        inp, tgt, seg, pos, mask = (b[k] for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask"))
        # targets are the next input token wherever the loss counts
        i, j = np.nonzero(mask[:, :-1] == 1)
        np.testing.assert_array_equal(tgt[i, j], inp[i, j + 1])
        # loss counts exactly where input and target belong to the same document piece
        for r in range(inp.shape[0]):
            assert np.all(np.diff(seg[r]) >= 0), "segment ids must be non-decreasing within a row"
            assert seg[r, 0] == 1 and pos[r, 0] == 0
            for k in range(1, T):
                if seg[r, k] != seg[r, k - 1]:
                    assert pos[r, k] == 0, "positions restart at each segment"
                    assert mask[r, k - 1] == 0, "no loss across documents"
                else:
                    assert pos[r, k] == pos[r, k - 1] + 1
            segs = segments(b, r)
            for idx, (sid, a, e) in enumerate(segs):
                n_segments += 1
                piece = inp[r, a:e].tolist()
                assert EOS not in piece[:-1], "EOS only ends a document"
                if idx + 1 < len(segs):  # a piece followed by another document ends with that document's EOS
                    assert piece[-1] == EOS and mask[r, e - 1] == 0
                assert np.all(mask[r, a:e - 1] == 1)
                text_bytes = bytes(t for t in piece if t != EOS)
                assert text_bytes in haystack and b"\x00" not in text_bytes
                if piece[-1] == EOS:  # a document's last piece is a suffix of the document
                    assert any(d.encode("utf-8").endswith(text_bytes) for d in corpus.docs)
            # the last input of a row with a full-length piece still predicts the row's extra token
            if seg[r, -1] != 0 and inp[r, -1] != EOS:
                assert mask[r, -1] == 1
    assert n_segments > 50


def test_documents_end_with_eos_and_long_documents_continue(corpus):
    """Unshuffled, row r of the batches concatenated is exactly its slot's documents (+EOS) in file order,
    continuations included: slot r of B owns documents [N*r/B, N*(r+1)/B)."""
    it = data.train_iterator(make_cfg(corpus.root / "train", shuffle=False), BYTE, global_batch_size=2, seed=0)
    n = len(corpus.docs)
    expected = [[t for d in corpus.docs[n * r // 2:n * (r + 1) // 2] for t in list(d.encode("utf-8")) + [EOS]]
                for r in range(2)]
    streams = [[], []]
    while min(len(s) for s in streams) < max(len(e) for e in expected):
        b = next(it)
        for r in range(2):
            streams[r].extend(b["inputs"][r].tolist() + [int(b["targets"][r, -1])])
    for r in range(2):
        assert streams[r][:len(expected[r])] == expected[r]


@pytest.mark.parametrize("shuffle", [True, False])
def test_global_batches_do_not_depend_on_the_number_of_processes(corpus, shuffle):
    """Row slots: the global batch (process rows concatenated) is the same on 1, 2 or 4 hosts."""
    cfg = make_cfg(corpus.root / "train", shuffle=shuffle)
    one = take(data.train_iterator(cfg, BYTE, global_batch_size=4, seed=9), 6)
    for procs in (2, 4):
        parts = [take(data.train_iterator(cfg, BYTE, global_batch_size=4, seed=9, process_index=p,
                                          process_count=procs), 6) for p in range(procs)]
        joined = [{k: np.concatenate([parts[p][s][k] for p in range(procs)]) for k in one[s]} for s in range(6)]
        assert_same(joined, one)


def test_fewer_documents_than_batch_rows(corpus):
    with pytest.raises(ValueError, match="train.batch_size"):
        data.train_iterator(make_cfg(corpus.root / "train"), BYTE, global_batch_size=64, seed=0)


def test_hf_tokenizer_pipeline_on_embedded_corpus():
    tok = load_tokenizer("hf", str(EMBEDDED / "tokenizer.json"))
    cfg = make_cfg(EMBEDDED / "train", seq_len=128, kind="hf", tok_path=str(EMBEDDED / "tokenizer.json"))
    b = next(data.train_iterator(cfg, tok, global_batch_size=2, seed=0))
    texts = pq.read_table(EMBEDDED / "train", columns=["text"]).column("text").to_pylist()
    assert b["inputs"].max() < tok.vocab_size
    checked = 0
    for r in range(2):
        for _, a, e in segments(b, r):
            piece = [t for t in b["inputs"][r, a:e].tolist() if t != tok.eos_id]
            if len(piece) < 8:
                continue
            # trim one token at each end: a byte-level token cut off from its neighbour may not decode alone
            text = tok.decode(piece[1:-1])
            assert any(text in d for d in texts), text[:80]
            checked += 1
    assert checked >= 1


def test_batch_tokenised_documents_equal_per_document_encode(letters):
    """The reader tokenises a row group with one encode_batch call, only the rows its blocks use: each element
    must equal encode(text) + EOS of the same document, in the same order as the text reader's."""
    tok = load_tokenizer("hf", str(EMBEDDED / "tokenizer.json"))
    groups = data._RowGroups([str(letters.path)])
    half = groups.num_docs // 2
    for lo, hi in ((0, groups.num_docs), (half - 3, half + 5)):  # a block that starts inside a row group too
        texts = data._ParquetDocs(groups, groups.blocks(lo, hi), "text", seed=3, infinite=False)
        tokens = data._ParquetDocs(groups, groups.blocks(lo, hi), "text", seed=3, infinite=False, tokenizer=tok)
        assert len(texts) == len(tokens) == hi - lo
        for i in range(len(texts)):
            np.testing.assert_array_equal(tokens[i], np.asarray([*tok.encode(texts[i]), tok.eos_id], np.int32))


def test_default_config_reads_the_embedded_corpus():
    from mixerlab.training.config import DataConfig

    cfg = DataConfig()
    tok = load_tokenizer(cfg.tokenizer.kind, cfg.tokenizer.path)
    b = next(data.train_iterator(cfg, tok, global_batch_size=2, seed=0))
    assert b["inputs"].shape == (2, cfg.seq_len)
    ev = data.eval_batches(cfg, tok, batch_size=2, max_batches=2)
    assert len(ev) == 2 and ev[0]["inputs"].shape == (2, cfg.seq_len)


# ------------------------------------------------------------------------------------------- order and state
def test_determinism_and_seed(corpus):
    cfg = make_cfg(corpus.root / "train")
    a = take(data.train_iterator(cfg, BYTE, global_batch_size=4, seed=7), 4)
    b = take(data.train_iterator(cfg, BYTE, global_batch_size=4, seed=7), 4)
    c = take(data.train_iterator(cfg, BYTE, global_batch_size=4, seed=8), 4)
    assert_same(a, b)
    assert any(not np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, c))


def test_each_epoch_is_a_new_permutation_of_all_documents(letters):
    groups = data._RowGroups([str(letters.path)])
    docs = data._ParquetDocs(groups, groups.blocks(0, groups.num_docs), "text", seed=5, infinite=True)
    n = len(letters.docs)
    epochs = [[docs[e * n + i] for i in range(n)] for e in range(3)]
    for ep in epochs:
        assert sorted(ep) == sorted(letters.docs)
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != letters.docs
    plain = data._ParquetDocs(groups, groups.blocks(0, groups.num_docs), "text", seed=None, infinite=False)
    assert [plain[i] for i in range(len(plain))] == letters.docs


@pytest.mark.parametrize("skip", [0, 1, 3, 7])
def test_get_state_set_state_resumes_exactly(corpus, skip):
    cfg = make_cfg(corpus.root / "train")
    it = data.train_iterator(cfg, BYTE, global_batch_size=4, seed=11)
    take(it, skip)
    state = it.get_state()
    state_json = json.dumps(state)  # must be plain JSON (saved with orbax as JSON)
    expected = take(it, 6)

    resumed = data.train_iterator(cfg, BYTE, global_batch_size=4, seed=11)
    take(resumed, 2)  # a used iterator can be rewound, too
    resumed.set_state(json.loads(state_json))
    assert_same(take(resumed, 6), expected)
    assert json.loads(json.dumps(resumed.get_state())) == json.loads(json.dumps(it.get_state()))


def test_set_state_from_other_pipeline_warns(corpus):
    it = data.train_iterator(make_cfg(corpus.root / "train"), BYTE, global_batch_size=4, seed=1)
    next(it)
    state = it.get_state()
    other = data.train_iterator(make_cfg(corpus.root / "train"), BYTE, global_batch_size=4, seed=2)
    with pytest.warns(UserWarning, match="seed"):
        other.set_state(state)


def test_process_sharding_is_disjoint(letters):
    cfg = make_cfg(letters.path, shuffle=True)
    seen = []
    for p in range(2):
        it = data.train_iterator(cfg, BYTE, global_batch_size=4, seed=0, process_index=p, process_count=2)
        docs = set()
        for b in take(it, 8):
            assert b["inputs"].shape == (2, T)
            docs |= letter_docs(b)
        seen.append(docs)
    assert seen[0] and seen[1] and not seen[0] & seen[1]
    first_half = {ord(d[0]) for d in letters.docs[:20]}
    assert seen[0] == first_half  # rows 0-1 own the first half (slots 0, 1); 8 batches cover it
    assert seen[1] == {ord(d[0]) for d in letters.docs[20:]}


def test_worker_processes_match_in_process(letters):
    cfg0 = make_cfg(letters.path, shuffle=True)
    cfg1 = make_cfg(letters.path, shuffle=True, num_workers=1)
    a = take(data.train_iterator(cfg0, BYTE, global_batch_size=2, seed=4), 3)
    it = data.train_iterator(cfg1, BYTE, global_batch_size=2, seed=4)
    try:
        assert_same(take(it, 3), a)
        json.dumps(it.get_state())
    finally:
        it.close()


@pytest.mark.parametrize("batch,requested,used", [(2, 2, 2), (2, 4, 2), (6, 4, 3)])
def test_worker_processes_give_the_in_process_batches(letters, batch, requested, used):
    """Any number of workers gives the batches of the in-process pipeline (rows in slot order), with as many
    workers as divide the batch's rows (more would leave a worker without rows: IndexError inside grain)."""
    a = take(data.train_iterator(make_cfg(letters.path, shuffle=True), BYTE, global_batch_size=batch, seed=4), 4)
    it = data.train_iterator(make_cfg(letters.path, shuffle=True, num_workers=requested), BYTE,
                             global_batch_size=batch, seed=4)
    try:
        assert_same(take(it, 4), a)
        assert it.get_state()["pipeline"]["num_workers"] == used
    finally:
        it.close()


def test_worker_count_divides_the_rows():
    assert [data._worker_count(4, b) for b in (1, 2, 3, 4, 6, 16)] == [1, 2, 3, 4, 3, 4]
    assert data._worker_count(0, 16) == 0 and data._worker_count(5, 16) == 4


def test_worker_processes_resume_from_the_first_batches(letters):
    """With 2 worker processes, a state saved after 0 (before every worker has delivered: grain's own state of
    that moment cannot be restored), 1 or 3 batches resumes exactly where the uninterrupted run goes on."""
    cfg = make_cfg(letters.path, shuffle=True, num_workers=2)
    it = data.train_iterator(cfg, BYTE, global_batch_size=2, seed=4)
    try:
        states, batches = [], []
        for _ in range(5):
            states.append(json.loads(json.dumps(it.get_state())))
            batches.append(next(it))
    finally:
        it.close()
    assert "batches_from_start" in states[0] and "grain" in states[1] and "grain" in states[3]
    for k in (0, 1, 3):
        again = data.train_iterator(cfg, BYTE, global_batch_size=2, seed=4)
        try:
            again.set_state(states[k])
            assert_same(take(again, 2), batches[k:k + 2])
            with pytest.raises(ValueError, match="fresh iterator"):
                again.set_state(states[0])
        finally:
            again.close()


# ------------------------------------------------------------------------------------------- eval
def test_eval_batches(corpus):
    cfg = make_cfg(corpus.root / "train", val_path=corpus.root / "val")
    expected = [t for d in corpus.val for t in list(d.encode("utf-8")) + [EOS]]
    n_rows = -(-len(expected) // (T + 1))
    bs = next(k for k in (3, 4, 5, 7) if n_rows % k)  # so that the last batch is partial
    ev = data.eval_batches(cfg, BYTE, batch_size=bs, max_batches=100)
    assert len(ev) == -(-n_rows // bs)
    assert_same(ev, data.eval_batches(cfg, BYTE, batch_size=bs, max_batches=100))
    stream = [t for b in ev for r in range(bs) for t in b["inputs"][r].tolist() + [int(b["targets"][r, -1])]]
    assert stream[:len(expected)] == expected
    assert not any(stream[len(expected):])
    last = ev[-1]
    assert all(b[k].shape == (bs, T) for b in ev for k in data.BATCH_KEYS)
    pad_rows = bs * len(ev) - n_rows
    assert pad_rows > 0
    assert not last["segment_ids"][bs - pad_rows:].any() and not last["loss_mask"][bs - pad_rows:].any()
    assert last["segment_ids"][0].any()
    assert len(data.eval_batches(cfg, BYTE, batch_size=bs, max_batches=1)) == 1
    assert len(data.eval_batches(cfg, BYTE, batch_size=bs, max_batches=1, path=str(corpus.root / "train"))) == 1


def test_eval_without_val_path(corpus):
    with pytest.raises(ValueError, match="data.val_path"):
        data.eval_batches(make_cfg(corpus.root / "train"), BYTE, batch_size=2, max_batches=1)


# ------------------------------------------------------------------------------------------- errors
def test_resolve_parquet_files(corpus):
    files = data.resolve_parquet_files(str(corpus.root / "train"), "data.train_path")
    assert [Path(f).name for f in files] == ["part-00000.parquet", "part-00001.parquet"]
    assert data.resolve_parquet_files(str(corpus.root / "train" / "*.parquet"), "k") == files
    assert data.resolve_parquet_files(files[1], "k") == [files[1]]


def test_missing_path(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError) as e:
        data.train_iterator(make_cfg(missing), BYTE, global_batch_size=2, seed=0)
    assert "data.train_path" in str(e.value) and missing in str(e.value)


def test_empty_glob_and_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="no .parquet"):
        data.resolve_parquet_files(str(tmp_path / "*.parquet"), "data.train_path")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no .parquet") as e:
        data.resolve_parquet_files(str(tmp_path / "empty"), "data.val_path")
    assert "data.val_path" in str(e.value)


def test_file_without_text_column(tmp_path):
    bad = tmp_path / "bad.parquet"
    write_parquet(bad, ["hello world"] * 3, column="content")
    with pytest.raises(ValueError) as e:
        data.train_iterator(make_cfg(bad), BYTE, global_batch_size=2, seed=0)
    msg = str(e.value)
    assert str(bad) in msg and "'text'" in msg and "data.text_column" in msg and "content" in msg


@pytest.mark.parametrize("name, content", [
    ("docs.jsonl", '{"text": "hello world"}\n{"text": "more text here"}\n'),
    ("docs.txt", "hello\n"),  # shorter than a Parquet footer
    ("docs.parquet", "plain text under a Parquet name\n"),
])
def test_a_file_that_is_not_parquet_names_the_formats_and_the_converter(tmp_path, name, content):
    bad = tmp_path / name
    bad.write_text(content)
    with pytest.raises(ValueError) as e:
        data.check_text_data(str(bad), "data.train_path")
    msg = str(e.value)
    assert msg.startswith("data.train_path: ") and str(bad) in msg and "is not a Parquet file" in msg, msg
    assert "data.format=pretokenized" in msg and "mixerlab-prepare-data --source" in msg, msg
    assert "magic bytes" not in msg and "footer" not in msg, msg


def test_a_truncated_parquet_file_keeps_the_reader_error(tmp_path):
    bad = tmp_path / "cut.parquet"
    write_parquet(tmp_path / "whole.parquet", ["hello world"] * 3)
    bad.write_bytes((tmp_path / "whole.parquet").read_bytes()[:-20])
    with pytest.raises(ValueError, match="cannot read the Parquet schema"):
        data.check_text_data(str(bad), "data.train_path")


def test_batch_not_divisible_by_processes(corpus):
    with pytest.raises(ValueError) as e:
        data.train_iterator(make_cfg(corpus.root / "train"), BYTE, global_batch_size=5, seed=0,
                            process_index=0, process_count=2)
    assert "train.batch_size" in str(e.value) and "2" in str(e.value)


# ------------------------------------------------------------------------------------------- shipped corpus
def test_embedded_corpus_files():
    files = sorted(p for p in EMBEDDED.rglob("*") if p.is_file())
    assert sum(p.stat().st_size for p in files) <= 10 * 1024 * 1024
    expected = [("text", pa.string()), ("id", pa.string()), ("dump", pa.string()), ("url", pa.string()),
                ("date", pa.string()), ("file_path", pa.string()), ("language", pa.string()),
                ("language_score", pa.float64()), ("token_count", pa.int64()), ("score", pa.float64()),
                ("int_score", pa.int64())]
    tok = load_tokenizer("hf", str(EMBEDDED / "tokenizer.json"))
    ids = set()
    for split, min_docs in (("train", 300), ("val", 50)):
        path = EMBEDDED / split / "part-00000.parquet"
        schema = pq.read_schema(path)
        assert [(f.name, f.type) for f in schema] == expected
        table = pq.read_table(path)
        assert table.num_rows >= min_docs
        rows = table.slice(0, 3).to_pylist()
        for row in rows:
            assert row["language"] == "en" and len(row["text"]) >= 200
            assert row["token_count"] == len(tok.encode(row["text"]))
        split_ids = set(table.column("id").to_pylist())
        assert len(split_ids) == table.num_rows and not split_ids & ids
        ids |= split_ids
    assert (EMBEDDED / "README.md").exists()
