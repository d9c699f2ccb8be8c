"""tools/bench_torch_lm.py (the PyTorch anchor) on the CPU: its model is mixerlab's initial weights exported and
loaded by the target library (same loss), its table refuses nothing silently, and a machine without a GPU gets
one line saying so. The timing itself needs the GPU machine."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))

import bench_torch_lm  # noqa: E402

TINY = ["model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.ffn_dim=64", "data.seq_len=16",
        "train.batch_size=2", "model.mixer=softmax", "model.norm_eps=1e-5"]


def test_anchor_model_is_our_initial_weights_in_transformers():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import jax.numpy as jnp

    from mixerlab.models.decoder import build_model

    cfg, vocab, target, net, params = bench_torch_lm.torch_model("configs/base.yaml", TINY, device="cpu")
    assert target == "llama" and "embed" in params
    tokens = np.random.default_rng(0).integers(0, vocab, (2, 16))
    with torch.no_grad():
        theirs = net(input_ids=torch.from_numpy(tokens), labels=torch.from_numpy(tokens))
    ours = build_model(cfg, vocab, seed=cfg.train.seed)(jnp.asarray(tokens))
    np.testing.assert_allclose(theirs.logits.numpy(), np.asarray(ours), atol=2e-4)
    assert np.isfinite(float(theirs.loss))


def test_rows_and_errors_are_printed():
    ok = {"target": "llama", "batch": 2, "seq_len": 16, "first_step_s": 3.0, "step_s": 0.01, "tokens_per_s": 3200.0,
          "model_tflops_per_s": 0.1, "mfu": 0.25, "mfu_measured_peak": None, "peak_gib": 1.0}
    assert "| a | llama | 2×16 | 3.0 s | 0.010 s | 3K | 0.1 | 25.0 % | n/a | 1.0 |" == bench_torch_lm._row("a", ok)
    assert "out of memory" in bench_torch_lm._row("b", {"error": "x / CUDA out of memory"})


def test_without_a_gpu_the_run_says_so():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench_torch_lm.measure("configs/base.yaml", TINY, steps=1, warmup=1, autotune=1)
