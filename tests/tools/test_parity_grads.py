"""tools/parity_grads.py without torch: mixerlab's gradients leave through the export table under the target's
tensor names (so they meet the PyTorch model's by name), and the per-tensor comparison and its refusals."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))

import parity_grads  # noqa: E402
import parity_torch  # noqa: E402

TINY = ["--set", "model.num_layers=1", "--set", "model.d_model=32", "--set", "model.num_heads=2", "--set",
        "model.ffn_dim=64", "--set", "data.seq_len=32", "--set", "train.batch_size=2"]


def test_our_gradients_carry_the_targets_names_and_layouts(tmp_path):
    import jax

    from mixerlab.training.tokenizer import load_tokenizer
    from mixerlab.training.trainer import Trainer

    args = parity_grads.parse_args(["--mixer", "softmax", "--at", "0", "--steps", "3", "--out", str(tmp_path), *TINY,
                                    "--set", "optim.warmup_steps=1"])
    cfg = parity_torch.config(args)
    trainer = Trainer(cfg, load_tokenizer(cfg.data.tokenizer.kind, cfg.data.tokenizer.path).vocab_size)
    trainer.initialize()
    rows = parity_torch.make_batches(cfg, 3, str(tmp_path / "batches.npy"))[0]
    loss, grads = parity_grads.ours_grads(trainer, trainer.params, rows)
    (want_loss, _), want = jax.jit(trainer._loss_and_grads)(trainer.params, parity_torch.jax_batch(trainer, rows))
    assert loss == pytest.approx(float(want_loss))
    assert "model.layers.0.self_attn.q_proj.weight" in grads and "lm_head.weight" in grads
    np.testing.assert_array_equal(grads["model.embed_tokens.weight"], np.asarray(want["embed"]["embedding"]))
    np.testing.assert_array_equal(grads["lm_head.weight"], np.asarray(want["lm_head"]["kernel"]).T)  # [out, in]


def test_tensor_errors_and_refusals(capsys):
    g = {"a": np.array([1.0, -2.0]), "b": np.ones((2, 2))}
    err = parity_grads.tensor_errors({"a": g["a"] * (1 + 1e-6), "b": g["b"]}, g)
    assert err["a"][0] == pytest.approx(1e-6) and err["a"][1] == pytest.approx(1e-6) and err["b"] == (0.0, 0.0)
    with pytest.raises(SystemExit, match="names differ"):
        parity_grads.tensor_errors({"a": g["a"]}, g)
    with pytest.raises(SystemExit, match=r"b: ours \(4,\)"):
        parity_grads.tensor_errors({"a": g["a"], "b": np.ones(4)}, g)
    for at, message in (("x", "comma-separated"), ("0,300", "must lie in 0..299")):
        with pytest.raises(SystemExit):
            parity_grads.parse_args(["--mixer", "gdn2", "--at", at, "--out", "o"])
        assert message in capsys.readouterr().err
    assert parity_grads.parse_args(["--mixer", "gdn2", "--at", "60,0,60", "--out", "o"]).at == [0, 60]
