"""training.prepare_data and training.train_tokenizer on the embedded corpus (offline): shards and manifest,
the trainer's data loader over the result, a small BPE that loads through training.tokenizer."""
import hashlib
import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from mixerlab.training import data as data_lib
from mixerlab.training import prepare_data, train_tokenizer
from mixerlab.training.config import load_config
from mixerlab.training.tokenizer import load_tokenizer

SOURCE = "data/embedded/train/part-00000.parquet"


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_shards_manifest_and_loader(tmp_path, capsys):
    out = tmp_path / "corpus"
    assert prepare_data.main(["--source", SOURCE, "--out", str(out), "--val_fraction", "0.2", "--shard_docs", "150",
                              "--row_group_docs", "40", "--no_progress"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    source_rows = pq.read_table(SOURCE, columns=["text", "id"]).to_pylist()
    splits = manifest["splits"]
    assert splits["train"]["docs"] + splits["val"]["docs"] == len(source_rows) == 438
    assert splits["val"]["docs"] > 0 and splits["train"]["docs"] > splits["val"]["docs"]
    assert splits["train"]["bytes"] + splits["val"]["bytes"] == sum(len(r["text"].encode()) for r in source_rows)
    assert manifest["source"] == SOURCE and manifest["tool_version"] == prepare_data.TOOL_VERSION
    written = []
    for split in ("train", "val"):
        for shard in splits[split]["shards"]:
            path = out / shard["path"]
            assert shard["sha256"] == _sha(path)
            md = pq.read_metadata(path)
            assert md.num_rows == shard["docs"] == sum(shard["row_groups"]) and max(shard["row_groups"]) <= 40
            assert pq.read_schema(path).names == ["text", "id"]
            written += pq.read_table(path).to_pylist()
    assert len(splits["train"]["shards"]) == -(-splits["train"]["docs"] // 150)
    assert sorted(r["id"] for r in written) == sorted(r["id"] for r in source_rows)
    by_id = {r["id"]: r["text"] for r in source_rows}
    assert all(by_id[r["id"]] == r["text"] for r in written)
    for r in pq.read_table(out / "val").to_pylist():  # the hash rule puts each document in its split
        assert prepare_data.is_val(r["id"], r["text"], 0.2)

    cfg = load_config("configs/tiny.yaml", [f"data.train_path={out / 'train'}", f"data.val_path={out / 'val'}"])
    tok = load_tokenizer(cfg.data.tokenizer.kind, cfg.data.tokenizer.path)
    assert data_lib.check_text_data(cfg.data.train_path, "data.train_path") == []
    batch = next(data_lib.train_iterator(cfg.data, tok, global_batch_size=4, seed=0))
    assert batch["inputs"].shape == (4, cfg.data.seq_len) and batch["loss_mask"].sum() > 0
    assert data_lib.eval_batches(cfg.data, tok, batch_size=2, max_batches=1)[0]["inputs"].shape == (2, 64)

    assert prepare_data.main(["--source", SOURCE, "--out", str(out), "--no_progress"]) == 2  # no silent overwrite
    assert "--overwrite" in capsys.readouterr().err


def test_jsonl_source_and_pretokenized_counts(tmp_path):
    src = tmp_path / "docs.jsonl"
    rows = [{"text": f"document number {i} " * (i + 1)} for i in range(30)]
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out"
    assert prepare_data.main(["--source", str(src), "--out", str(out), "--val_fraction", "0", "--pretokenize",
                              "--tokenizer", "data/embedded/tokenizer.json", "--seq_len", "16",
                              "--no_progress"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    tok = load_tokenizer("hf", "data/embedded/tokenizer.json")
    want_tokens = sum(len(tok.encode(r["text"])) + 1 for r in rows)
    assert manifest["splits"]["train"]["docs"] == 30 and manifest["splits"]["val"]["docs"] == 0
    assert manifest["splits"]["train"]["tokens"] == manifest["tokens"]["train"]["tokens"] == want_tokens
    assert manifest["tokens"]["train"]["rows_at_seq_len"] == {"seq_len": 16, "rows": want_tokens // 17}
    assert manifest["tokenizer"]["eos_id"] == tok.eos_id
    index = json.loads((out / "tokens" / "train" / "index.json").read_text())
    assert index["shards"][0]["sha256"] == _sha(out / "tokens" / "train" / index["shards"][0]["path"])
    ids = pq.read_table(out / "train").column("id").to_pylist()
    assert ids[0] == "docs.jsonl:0"  # a source without ids gets <file>:<row>


@pytest.mark.parametrize("argv, message", [
    (["--source", "nope/missing.parquet"], "--source"),
    (["--source", SOURCE, "--text_column", "body"], "--text_column"),
    (["--source", "hf://just-a-name"], "hf://OWNER/NAME"),
    (["--source", "hf://a/b?colour=red"], "unknown option"),
])
def test_bad_sources_are_named(tmp_path, argv, message, capsys):
    assert prepare_data.main(argv + ["--out", str(tmp_path / "o"), "--no_progress"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--val_fraction", "1.0"], "--val_fraction"),
    (["--shard_docs", "0"], "--shard_docs"),
    (["--pretokenize"], "--tokenizer"),
    (["--seq_len", "8"], "--seq_len"),
])
def test_bad_flags_are_named(tmp_path, argv, message, capsys):
    with pytest.raises(SystemExit):
        prepare_data.main(["--source", SOURCE, "--out", str(tmp_path / "o")] + argv)
    assert message in capsys.readouterr().err


def test_hub_source_offline_gives_a_clear_error(tmp_path):
    """In a subprocess: the hub library reads its offline switch when it is imported."""
    pytest.importorskip("datasets")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "mixerlab.training.prepare_data", "--source",
                           "hf://HuggingFaceFW/fineweb-edu?name=sample-10BT", "--out", str(tmp_path / "o"),
                           "--max_docs", "10", "--no_progress"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "cannot stream HuggingFaceFW/fineweb-edu" in proc.stderr and "OFFLINE" in proc.stderr, proc.stderr[-800:]


def test_train_tokenizer_loads_through_the_project_loader(tmp_path):
    out = tmp_path / "tok" / "tokenizer.json"
    assert train_tokenizer.main(["--corpus", "data/embedded/val", "--vocab_size", "400", "--out", str(out),
                                 "--no_progress"]) == 0
    tok = load_tokenizer("hf", str(out))
    assert tok.vocab_size == 400 and tok.eos_id == 0
    text = "def f(x):\n    return x ** 2  # ünïcode ✓"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and max(ids) < 400
    assert len(ids) < len(text.encode())  # merges were learned
    with pytest.raises(SystemExit):
        train_tokenizer.main(["--corpus", "data/embedded/val", "--vocab_size", "100", "--out", str(out)])
