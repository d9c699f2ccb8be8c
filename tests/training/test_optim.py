"""Optimizer parameter groups (training/optim.py): which parameters weight decay and the SSM LR cap reach.

The groups are decided by a parameter's NNX type and rank (mixers/base.py): plain matrices are decayed;
vectors (norm scales, biases) and every DynamicsParam are not; SSMParam is not decayed and LR-capped."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mixerlab.mixers.base import DynamicsParam, SSMParam
from mixerlab.models.decoder import Decoder
from mixerlab.training.config import load_config
from mixerlab.training.optim import make_optimizer, param_groups, schedule


class _Kinds(nnx.Module):
    """One parameter of every kind the optimizer distinguishes."""

    def __init__(self):
        self.matrix = nnx.Param(jnp.full((3, 4), 2.0))  # decayed
        self.embedding = nnx.Param(jnp.full((5, 2, 2), 2.0))  # rank 3: still decayed
        self.norm_scale = nnx.Param(jnp.full((4,), 2.0))  # vector: not decayed
        self.gate_bias = DynamicsParam(jnp.full((2, 3), 2.0))  # dynamics matrix: not decayed
        self.a_log = SSMParam(jnp.full((2, 3), 2.0))  # SSM: not decayed, LR-capped


def _params(module):
    _, params, _ = nnx.split(module, nnx.Param, ...)
    return params


def _leaves_by_name(tree):
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def test_param_groups_by_kind_and_rank():
    labels = param_groups(_params(_Kinds()))
    assert labels == {"matrix": "decay", "embedding": "decay", "norm_scale": "no_decay",
                      "gate_bias": "no_decay", "a_log": "ssm"}


def test_decoder_norms_and_dynamics_are_never_decayed():
    """On a real (abstract) tiny decoder with a gated-delta mixer: every vector and DynamicsParam is out of
    the decay group, every plain matrix (embeddings, projections) is in it, and both groups are non-empty."""
    cfg = load_config("configs/tiny.yaml", ["model.mixer=gdn2"])
    abstract = nnx.eval_shape(lambda: Decoder(cfg.model, 64, mixer_options=cfg.mixers, rngs=nnx.Rngs(0)))
    _, params, _ = nnx.split(abstract, nnx.Param, ...)
    labels = param_groups(params)
    kinds = {}
    for path, var in nnx.to_flat_state(params):
        name = "/".join(map(str, path))
        label = labels
        for key in path:
            label = label[key]
        if isinstance(var, SSMParam):
            expected = "ssm"
        elif isinstance(var, DynamicsParam) or len(var.shape) < 2:
            expected = "no_decay"
        else:
            expected = "decay"
        assert label == expected, (name, label, type(var).__name__, var.shape)
        kinds.setdefault(label, []).append(name)
    assert kinds.get("decay") and kinds.get("no_decay"), kinds
    assert any("scale" in n for n in kinds["no_decay"]), kinds["no_decay"]  # norm scales


def _one_step(grad_value, lr=0.1, wd=0.5, ssm_cap=1e-3):
    """Parameters (all 2.0) after one optimizer step of the tiny config with every gradient = grad_value."""
    cfg = load_config("configs/tiny.yaml", [f"optim.lr={lr}", f"optim.weight_decay={wd}", "optim.warmup_steps=0",
                                            f"optim.ssm_lr_cap={ssm_cap}"])
    state = _params(_Kinds())
    tx = make_optimizer(cfg, state)  # groups from the Variable types; updates on the pure dict (as the Trainer)
    params = nnx.to_pure_dict(state)
    grads = jax.tree.map(lambda p: jnp.full_like(p, grad_value), params)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    return _leaves_by_name(optax.apply_updates(params, updates))


def _assert_step(new, expected):
    for name, value in new.items():
        key = next(k for k in expected if k in name)
        # float32, a few roundings; Adam's eps/|g| ≈ 5e-8 relative on the unit-gradient step
        np.testing.assert_allclose(np.asarray(value), expected[key], rtol=1e-6, err_msg=name)


def test_one_zero_gradient_adamw_step_shrinks_only_matrices():
    """With g = 0 Adam's moment update is exactly 0, so one step is pure decoupled weight decay:
    p ← p (1 − lr·wd) for the decay group (matrices of any rank), p unchanged for every other group."""
    shrunk = 2.0 * (1 - 0.1 * 0.5)
    _assert_step(_one_step(0.0), {"matrix": shrunk, "embedding": shrunk, "norm_scale": 2.0, "gate_bias": 2.0,
                                  "a_log": 2.0})


def test_one_unit_gradient_adamw_step_caps_the_ssm_learning_rate():
    """Adam's first step moves every parameter by its group's learning rate times sign(g) (m̂/√v̂ = g/|g|, also
    after global-norm clipping), plus lr·wd·p in the decay group: SSM parameters move by the cap (1e-3), all
    others by the schedule's lr (0.1)."""
    decayed = 2.0 - 0.1 - 0.1 * 0.5 * 2.0
    _assert_step(_one_step(1.0), {"matrix": decayed, "embedding": decayed, "norm_scale": 1.9, "gate_bias": 1.9,
                                  "a_log": 2.0 - 1e-3})


def _expected_lr(i, *, lr, warmup, steps, floor_ratio):
    """The intended schedule written out: linear warmup 0 → lr over ``warmup`` steps, then a half cosine from
    lr at step ``warmup`` to lr·min_lr_ratio at step ``train.steps`` (the decay spans steps − warmup), flat after."""
    floor = lr * floor_ratio
    if i < warmup:
        return lr * i / warmup
    frac = min(i - warmup, steps - warmup) / (steps - warmup)
    return floor + (lr - floor) * 0.5 * (1 + np.cos(np.pi * frac))


@pytest.mark.parametrize("steps, warmup", [(100, 10), (37, 0), (12, 11)])
def test_schedule_warmup_peak_cosine_end_and_floor(steps, warmup):
    """Every step 0…steps+5 against the closed form, and its landmarks: 0 at step 0 (with a warmup), linear
    warmup, the peak lr at ``warmup_steps``, the half-way value at the middle of the decay, the floor
    lr·min_lr_ratio reached exactly at ``train.steps`` and not before, monotone decay after the peak."""
    lr, ratio = 3e-3, 0.1
    cfg = load_config("configs/tiny.yaml", [f"optim.lr={lr}", f"optim.warmup_steps={warmup}",
                                            f"optim.min_lr_ratio={ratio}", f"train.steps={steps}"])
    sched = schedule(cfg)
    got = np.asarray([float(sched(i)) for i in range(steps + 6)])
    want = np.asarray([_expected_lr(i, lr=lr, warmup=warmup, steps=steps, floor_ratio=ratio)
                       for i in range(steps + 6)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-10)
    if warmup:
        assert got[0] == 0.0 and np.all(np.diff(got[:warmup + 1]) > 0)
        np.testing.assert_allclose(got[warmup // 2], lr * (warmup // 2) / warmup, rtol=1e-6)
    np.testing.assert_allclose(got[warmup], lr, rtol=1e-6)
    assert got.max() == pytest.approx(lr, rel=1e-6)
    if (steps - warmup) % 2 == 0:
        np.testing.assert_allclose(got[warmup + (steps - warmup) // 2], lr * (1 + ratio) / 2, rtol=1e-5)
    assert np.all(np.diff(got[warmup:]) <= 1e-12)
    np.testing.assert_allclose(got[steps:], lr * ratio, rtol=1e-6)
    assert got[steps - 1] > lr * ratio * (1 + 1e-4)  # the floor is reached at train.steps, not earlier
