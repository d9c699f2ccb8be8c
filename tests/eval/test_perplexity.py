"""eval/perplexity.py and eval/checkpoint.py: validation loss / bits per byte, the length-extrapolation tail
differential and streaming through decode, each against a direct computation from the model's parallel
forward; the CLI's outputs; load_run's errors."""
import functools
import json
import math
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mixerlab.eval import perplexity as ppl
from mixerlab.eval.checkpoint import load_run
from mixerlab.models.decoder import build_model
from mixerlab.training.config import load_config

TOL = 1e-4
tiny_group = pytest.mark.xdist_group("eval_tiny_run")


@pytest.fixture(autouse=True)
def _full_precision_matmuls():
    with jax.default_matmul_precision("float32"):
        yield


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens_BT):
    return nnx.merge(graphdef, state)(tokens_BT)


def _nll(model, tokens) -> np.ndarray:
    """Reference: NLL of tokens[1:] from one parallel forward of tokens[:-1] alone (positions from 0)."""
    tokens = np.asarray(tokens, np.int64)
    logits = np.asarray(_forward(*nnx.split(model), jnp.asarray(tokens[None, :-1], jnp.int32))[0], np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return logz - logits[np.arange(len(tokens) - 1), tokens[1:]]


def _docs(vocab, eos, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(1, vocab, n - 1), eos).astype(np.int32) for n in lengths]


@pytest.mark.parametrize("mixer", ["softmax", "s4d"])
def test_streaming_nll_equals_the_full_sequence_nll(mixer):
    """Chunks of 16 (the last one ragged), each in parallel from the cache the previous one left (s4d: its
    ``extend``; softmax: its decode step over the chunk), give the parallel forward's NLL. test_generate.py
    checks chunked decode against the parallel logits for every registered mixer."""
    cfg = load_config("configs/tiny.yaml", ["model.d_model=32", "model.num_layers=2", "model.num_heads=2",
                                            "model.ffn_dim=64", f"model.mixer={mixer}"])
    model = build_model(cfg, 61, seed=1)
    (stream,) = _docs(61, 0, [41])
    np.testing.assert_allclose(ppl.streaming_nll(model, stream, chunk=16), _nll(model, stream), rtol=TOL, atol=TOL)
    short, long = ppl.cache_bytes(model, 1, 16), ppl.cache_bytes(model, 1, 4096)
    if mixer == "softmax":
        assert long == 256 * short  # the KV cache grows with the stream
    else:
        assert long == short  # a constant-size recurrent state


@tiny_group
def test_validation_and_length_extrapolation_against_direct_computation(tiny_run):
    run = load_run(tiny_run)
    model, tok, t = run.model, run.tokenizer, run.cfg.data.seq_len
    docs = _docs(tok.vocab_size, tok.eos_id, [20, 50, 2 * t + 1, 2 * t + 40])

    val = ppl.validation(model, tok, docs, t, batch_size=4)
    per_doc = []
    for d in docs:  # windows of t inputs, the context restarting in each
        per_doc.append(np.concatenate([_nll(model, d[s:min(s + t, len(d) - 1) + 1]) for s in range(0, len(d) - 1, t)]))
    total = sum(x.sum() for x in per_doc)
    n_bytes = sum(len(tok.decode(d[1:].tolist()).encode("utf-8")) for d in docs)
    assert val["tokens"] == sum(len(d) - 1 for d in docs) and val["bytes"] == n_bytes
    assert math.isclose(val["loss"], total / val["tokens"], rel_tol=1e-5)
    assert math.isclose(val["perplexity"], math.exp(total / val["tokens"]), rel_tol=1e-4)
    assert math.isclose(val["bits_per_byte"], total / (math.log(2) * n_bytes), rel_tol=1e-5)

    ext = ppl.length_extrapolation(model, docs, t, [1, 2], batch_size=4)
    assert ext["documents"] == 2 and ext["tail_tokens"] == t // 4
    one, two = ext["lengths"]
    assert abs(one["delta_tail"]) < TOL  # the same tokens in the same window
    w = t // 4
    full = [_nll(model, d[:2 * t + 1]) for d in docs[2:]]
    window = [_nll(model, d[t:2 * t + 1]) for d in docs[2:]]
    diffs = [f[2 * t - w:].mean() - g[t - w:].mean() for f, g in zip(full, window)]
    assert math.isclose(two["delta_tail"], np.mean(diffs), abs_tol=TOL)
    assert math.isclose(two["delta_tail_se"], np.std(diffs, ddof=1) / math.sqrt(2), rel_tol=1e-3, abs_tol=TOL)
    assert math.isclose(two["nll"], np.mean(full), abs_tol=TOL)
    assert math.isclose(one["nll"], np.mean([f[:t] for f in full]), abs_tol=TOL)
    np.testing.assert_allclose(ext["nll_full_context"], np.mean(full, axis=0).reshape(-1, w).mean(axis=1), atol=TOL)

    with pytest.raises(ValueError, match=r"no document has 257 tokens .* the longest has 168 tokens"):
        ppl.length_extrapolation(model, docs, t, [4])
    with pytest.raises(ValueError, match="0.5 is below 1"):
        ppl.length_extrapolation(model, docs, t, [0.5, 1])


@tiny_group
def test_cli_writes_table_json_and_plot(tiny_run, tmp_path, capsys):
    src = tmp_path / "doc.txt"
    src.write_text(open("data/embedded/README.md").read() * 2)  # one long plain-text document
    out = tmp_path / "out"
    assert ppl.main(["--run", tiny_run, "--data", str(src), "--context_multipliers", "1,2", "--stream_tokens", "100",
                     "--chunk", "32", "--out_dir", str(out)]) == 0
    report = json.load(open(out / "perplexity.json"))
    newest = max(int(d) for d in os.listdir(os.path.join(tiny_run, "checkpoints")) if d.isdigit())
    assert report["step"] == newest == 2 and report["seq_len"] == 64 and report["mixers"] == ["softmax"]
    assert report["validation"]["documents"] == 1
    assert [r["length"] for r in report["length_extrapolation"]["lengths"]] == [64, 128]
    s = report["streaming"]
    assert s["tokens"] == 100 and s["chunk"] == 32 and len(s["bucket_start"]) == 2
    assert os.path.getsize(out / "perplexity.png") > 10_000
    printed = capsys.readouterr().out
    assert "bits/byte" in printed and "Δtail" in printed and "streaming" in printed
    # a refused input: one line on stderr, exit code 2 (training/cli_errors.py)
    assert ppl.main(["--run", tiny_run, "--data", str(src), "--context_multipliers", "100", "--out_dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(r"^mixerlab-eval: error: --context_multipliers 100: length extrapolation "
                                       r"needs documents of at least 6401 tokens .* the longest in .* has \d+", err[0])
    with pytest.raises(SystemExit):  # argparse: a multiplier below 1
        ppl.main(["--run", tiny_run, "--context_multipliers", "0.5,1"])
    assert "must be >= 1" in capsys.readouterr().err


@tiny_group
def test_load_run_takes_a_run_or_checkpoint_dir_and_names_what_is_wrong(tiny_run, tmp_path):
    assert load_run(os.path.join(tiny_run, "checkpoints"), step=1).step == 1
    with pytest.raises(ValueError, match=r"checkpoint step 7 is not in .*; available steps: 1, 2"):
        load_run(tiny_run, step=7)
    with pytest.raises(FileNotFoundError, match=r"neither it nor its parent holds config.yaml"):
        load_run(str(tmp_path))
    empty = tmp_path / "empty_run"
    (empty / "checkpoints").mkdir(parents=True)
    shutil.copy(os.path.join(tiny_run, "config.yaml"), empty / "config.yaml")
    with pytest.raises(FileNotFoundError, match=r"holds no checkpoint"):
        load_run(str(empty))
