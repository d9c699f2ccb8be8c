"""data.format=pretokenized: token shards written by training.prepare_data give the same batches as the text
pipeline over the Parquet shards of the same prepared corpus, resume from a saved state, and refuse shards of
another tokenizer."""
import dataclasses
import json

import numpy as np
import pytest

from mixerlab.training import data as data_lib
from mixerlab.training import prepare_data, pretokenized
from mixerlab.training.config import load_config
from mixerlab.training.tokenizer import ByteTokenizer, load_tokenizer

TOKENIZER = "data/embedded/tokenizer.json"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The embedded train split re-sharded (2 shards, row groups of 32 documents) and pretokenised."""
    out = tmp_path_factory.mktemp("prepared") / "corpus"
    assert prepare_data.main(["--source", "data/embedded/train", "--out", str(out), "--val_fraction", "0.1",
                              "--shard_docs", "250", "--row_group_docs", "32", "--tokenizer", TOKENIZER,
                              "--pretokenize", "--no_progress"]) == 0
    return out


def _cfg(prepared, fmt, **data):
    split = "tokens/train" if fmt == "pretokenized" else "train"
    val = "tokens/val" if fmt == "pretokenized" else "val"
    cfg = load_config("configs/tiny.yaml", [f"data.format={fmt}", f"data.train_path={prepared / split}",
                                            f"data.val_path={prepared / val}", "data.seq_len=48"])
    return dataclasses.replace(cfg.data, **data)


def _batches(it, n):
    return [next(it) for _ in range(n)]


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert sorted(x) == sorted(y) == sorted(data_lib.BATCH_KEYS)
        for k in data_lib.BATCH_KEYS:
            assert x[k].dtype == y[k].dtype, k
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


@pytest.mark.parametrize("shuffle", [False, True])
def test_same_batches_as_the_text_pipeline(prepared, shuffle):
    tok = load_tokenizer("hf", TOKENIZER)
    kw = dict(global_batch_size=4, seed=3)
    text = _batches(data_lib.train_iterator(_cfg(prepared, "text", shuffle=shuffle), tok, **kw), 6)
    toks = _batches(data_lib.train_iterator(_cfg(prepared, "pretokenized", shuffle=shuffle), tok, **kw), 6)
    _assert_same(text, toks)
    assert text[0]["loss_mask"].sum() > 0


def test_eval_batches_match(prepared):
    tok = load_tokenizer("hf", TOKENIZER)
    text = data_lib.eval_batches(_cfg(prepared, "text"), tok, batch_size=3, max_batches=3)
    toks = data_lib.eval_batches(_cfg(prepared, "pretokenized"), tok, batch_size=3, max_batches=3)
    assert len(text) == 3
    _assert_same(text, toks)


def test_resume_from_state(prepared):
    tok = load_tokenizer("hf", TOKENIZER)
    cfg = _cfg(prepared, "pretokenized", shuffle=True)
    it = data_lib.train_iterator(cfg, tok, global_batch_size=2, seed=1)
    _batches(it, 3)
    state = it.get_state()
    assert state["pipeline"]["format"] == "pretokenized"
    expected = _batches(it, 3)
    again = data_lib.train_iterator(cfg, tok, global_batch_size=2, seed=1)
    again.set_state(state)
    _assert_same(_batches(again, 3), expected)


def test_other_tokenizer_is_refused(prepared):
    with pytest.raises(ValueError, match="another tokenizer"):
        data_lib.train_iterator(_cfg(prepared, "pretokenized"), ByteTokenizer(), global_batch_size=2, seed=0)


def test_text_directory_with_pretokenized_format_is_named(prepared):
    cfg = dataclasses.replace(_cfg(prepared, "pretokenized"), train_path=str(prepared / "train"))
    with pytest.raises(FileNotFoundError, match="data.train_path.*index.json"):
        data_lib.train_iterator(cfg, load_tokenizer("hf", TOKENIZER), global_batch_size=2, seed=0)
    with pytest.raises(FileNotFoundError, match="index.json"):
        pretokenized.check_token_data(str(prepared / "train"), "data.train_path")


def test_a_glob_of_token_directories_reads_like_the_text_glob(prepared, tmp_path):
    """Two prepared corpora read as one: the token glob gives the batches of the Parquet glob."""
    second = tmp_path / "corpus-b"
    assert prepare_data.main(["--source", "data/embedded/val", "--out", str(second), "--val_fraction", "0",
                              "--row_group_docs", "16", "--tokenizer", TOKENIZER, "--pretokenize",
                              "--no_progress"]) == 0
    first = tmp_path / "corpus-a"
    first.symlink_to(prepared)
    tok = load_tokenizer("hf", TOKENIZER)
    base = _cfg(prepared, "text", shuffle=True)
    text = dataclasses.replace(base, train_path=str(tmp_path / "corpus-*" / "train" / "*.parquet"))
    toks = dataclasses.replace(base, format="pretokenized", train_path=str(tmp_path / "corpus-*" / "tokens" / "train"))
    index, _ = pretokenized.read_index(toks.train_path, "data.train_path")
    assert index["docs"] == data_lib._RowGroups(data_lib.resolve_parquet_files(text.train_path, "k")).num_docs
    kw = dict(global_batch_size=4, seed=5)
    _assert_same(_batches(data_lib.train_iterator(text, tok, **kw), 4),
                 _batches(data_lib.train_iterator(toks, tok, **kw), 4))


def test_tokenize_only_equals_pretokenize_in_one_pass(prepared, tmp_path):
    """Prepare text first (to train a tokenizer on it), add the token shards later: the same shards."""
    out = tmp_path / "two-pass"
    assert prepare_data.main(["--source", "data/embedded/train", "--out", str(out), "--val_fraction", "0.1",
                              "--shard_docs", "250", "--row_group_docs", "32", "--no_progress"]) == 0
    assert prepare_data.main(["--out", str(out), "--tokenize_only", "--tokenizer", TOKENIZER, "--no_progress"]) == 0
    for split in ("train", "val"):
        one = json.loads((prepared / "tokens" / split / "index.json").read_text())
        two = json.loads((out / "tokens" / split / "index.json").read_text())
        assert [s["sha256"] for s in one["shards"]] == [s["sha256"] for s in two["shards"]]
        assert one["tokens"] == two["tokens"] > 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["splits"]["train"]["tokens"] == manifest["tokens"]["train"]["tokens"]


@pytest.mark.slow  # ~25 s: one tiny training run (its compile)
def test_training_runs_on_token_shards_and_checkpoints_the_data_position(prepared, tmp_path):
    """train() end to end with data.format=pretokenized: start-up check, validation batches, and the data state
    stored with checkpoint 1 resumes a fresh iterator at the batch after the first one."""
    import orbax.checkpoint as ocp

    from mixerlab.training.loop import _check_data, train

    out = tmp_path / "run"
    cfg = load_config("configs/tiny.yaml", [
        "data.format=pretokenized", f"data.train_path={prepared / 'tokens' / 'train'}",
        f"data.val_path={prepared / 'tokens' / 'val'}", "data.seq_len=32", "train.batch_size=2", "train.steps=2",
        "train.log_every=1", "train.eval_every=2", "train.eval_batches=1", "optim.warmup_steps=1",
        "checkpoint.every=1", "train.prefetch=0", f"train.output_dir={out}", "model.d_model=32", "model.ffn_dim=32",
        "model.num_layers=1"])
    assert _check_data(cfg) == []
    result = train(cfg, progress=False)
    assert sorted(result.train_losses) == [1, 2] and np.isfinite(result.val_loss)

    manager = ocp.CheckpointManager(str(out / "checkpoints"))
    saved = manager.restore(1, args=ocp.args.Composite(data=ocp.args.JsonRestore())).data["per_process"][0]
    manager.close()
    assert saved["pipeline"]["format"] == "pretokenized"
    tok = load_tokenizer(cfg.data.tokenizer.kind, cfg.data.tokenizer.path)
    fresh = data_lib.train_iterator(cfg.data, tok, global_batch_size=2, seed=cfg.train.seed)
    next(fresh)
    resumed = data_lib.train_iterator(cfg.data, tok, global_batch_size=2, seed=cfg.train.seed)
    resumed.set_state(saved)
    _assert_same([next(resumed)], [next(fresh)])

    bad = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, train_path=str(prepared / "train")))
    with pytest.raises(FileNotFoundError, match="data.train_path"):
        _check_data(bad)
