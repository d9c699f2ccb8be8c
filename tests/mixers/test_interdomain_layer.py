"""The ``interdomain`` and ``s4d`` mixers: registered, build with defaults, causal, decode == forward, packed
documents isolated, every optional flag, parameter kinds for the optimizer."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mixerlab.mixers.interdomain  # noqa: F401  (registration; the lead adds it to mixers/__init__.py)
from mixerlab import mixers
import mixerlab.mixers.s4d  # noqa: F401
from mixerlab.mixers import registry
from mixerlab.mixers.base import DynamicsParam, MixerSpec, SSMParam

SPEC = MixerSpec(d_model=64, num_heads=2, head_dim=32, value_head_dim=32, layer_index=0, num_layers=2)
ALL_FLAGS = dict(num_modes=8, query_mlp_hidden=16, value_conv=True, d_skip=True, output_gate="silu",
                 selective_write=True, selective_decay=True, readout="bilinear", rope_placement="post_l2",
                 s4d_inv_n="2M", c_init="normal", chunk_size=8)


@pytest.fixture(autouse=True)
def _full_precision_matmuls():
    with jax.default_matmul_precision("float32"):
        yield


# jit the layer calls: eager op-by-op dispatch of the many small feature ops dominates otherwise
_fwd = nnx.jit(lambda layer, x, seg, pos: layer(x, segment_ids=seg, positions=pos))
_dec = nnx.jit(lambda layer, x, cache, p: layer.decode(x, cache, p))
_pre = nnx.jit(lambda layer, x, seg, pos: layer.prefill(x, segment_ids=seg, positions=pos))


def _build(name, spec=SPEC, **flags):
    entry = registry.get(name)
    return registry.build(name, spec, entry.options(**flags), rngs=nnx.Rngs(0))


def _inputs(t, b=2, seed=0):
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((b, t, SPEC.d_model)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return x, jnp.ones((b, t), jnp.int32), pos


def _perturb_params(layer, seed=1):
    """Give zero-init parameters (query-MLP W_2, gate weights) non-trivial values so the flags matter."""
    state = nnx.state(layer, nnx.Param)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [x + 0.05 * jax.random.normal(kk, x.shape, x.dtype) for x, kk in zip(leaves, keys)]
    nnx.update(layer, jax.tree.unflatten(tree, leaves))


def test_registered_with_frozen_options():
    for name, cls in (("interdomain", mixers.interdomain.InterdomainOptions), ("s4d", mixers.s4d.S4DOptions)):
        entry = registry.get(name)
        assert entry.options is cls and dataclasses.is_dataclass(cls)
        with pytest.raises(dataclasses.FrozenInstanceError):
            cls().num_modes = 3


@pytest.mark.parametrize("name", ["interdomain", "s4d"])
def test_defaults_build_and_are_causal(name):
    layer = _build(name)
    x, seg, pos = _inputs(20)
    y = _fwd(layer, x, seg, pos)
    assert y.shape == x.shape and bool(jnp.all(jnp.isfinite(y)))
    x2 = x.at[:, 12:].set(jax.random.normal(jax.random.key(3), x[:, 12:].shape))
    y2 = _fwd(layer, x2, seg, pos)
    np.testing.assert_array_equal(np.asarray(y2[:, :12]), np.asarray(y[:, :12]))  # prefix property
    assert not np.allclose(y2[:, 12:], y[:, 12:])


def test_parameter_kinds_for_the_optimizer():
    layer = _build("interdomain")
    core = layer.core
    for p in (core.a_re, core.a_im, core.log_dt, layer.k_norm.scale, layer.k_norm.bias, layer.v_norm.scale):
        assert isinstance(p, SSMParam)
    assert isinstance(core.c_re, DynamicsParam) and not isinstance(core.c_re, SSMParam)  # IAs: main LR
    assert isinstance(_build("interdomain", c_lr_group="ssm").core.c_im, SSMParam)  # IA1
    assert core.a_re[...].shape == (2, 64) and core.c_re[...].shape == (2, 64, 64)
    dt = np.exp(np.asarray(core.log_dt[...]))
    assert ((dt >= 1e-3) & (dt <= 1e-1)).all()


@pytest.mark.parametrize("name,flags", [("interdomain", ALL_FLAGS), ("s4d", dict(num_modes=8, use_rope=True,
                         chunk_size=8))])
def test_decode_and_packing_match_forward(name, flags):
    layer = _build(name, **flags)
    _perturb_params(layer)
    t = 11
    x, seg, pos = _inputs(t)
    y = _fwd(layer, x, seg, pos)
    cache = layer.init_cache(2, t)
    steps = []
    for i in range(t):
        out, cache = _dec(layer, x[:, i:i + 1], cache, jnp.full((2,), i, jnp.int32))
        steps.append(out[:, 0])
    np.testing.assert_allclose(np.asarray(jnp.stack(steps, 1)), np.asarray(y), rtol=2e-5, atol=2e-5)
    # prefill's cache continues the sequence
    _, cache = _pre(layer, x[:, :7], seg[:, :7], pos[:, :7])
    out, _ = _dec(layer, x[:, 7:8], cache, jnp.full((2,), 7, jnp.int32))
    np.testing.assert_allclose(np.asarray(out[:, 0]), np.asarray(y[:, 7]), rtol=2e-5, atol=2e-5)
    # two packed documents == each alone; "alone" = the second document at the start of a row of the same length,
    # followed by another document of other tokens (the compiled forward above serves it)
    seg2 = jnp.asarray(np.repeat([[1] * 5 + [2] * 6], 2, 0), jnp.int32)
    pos2 = jnp.asarray(np.repeat([list(range(5)) + list(range(6))], 2, 0), jnp.int32)
    packed = _fwd(layer, x, seg2, pos2)
    x_alone = jnp.concatenate([x[:, 5:], _inputs(t, seed=1)[0][:, 6:]], axis=1)
    seg_alone = jnp.asarray(np.repeat([[1] * 6 + [2] * 5], 2, 0), jnp.int32)
    pos_alone = jnp.asarray(np.repeat([list(range(6)) + list(range(5))], 2, 0), jnp.int32)
    alone = _fwd(layer, x_alone, seg_alone, pos_alone)
    np.testing.assert_allclose(np.asarray(packed[:, 5:]), np.asarray(alone[:, :6]), rtol=2e-5, atol=2e-5)


def test_flags_change_the_output_and_bad_combinations_fail():
    x, seg, pos = _inputs(9)
    base = _build("interdomain", num_modes=8)
    _perturb_params(base)
    y0 = _fwd(base, x, seg, pos)
    for flag, value in (("selective_decay", True), ("readout", "bilinear")):
        layer = _build("interdomain", num_modes=8, **{flag: value})
        _perturb_params(layer)
        assert not np.allclose(_fwd(layer, x, seg, pos), y0), flag
    spec = dataclasses.replace(SPEC, value_head_dim=16)
    with pytest.raises(ValueError, match="selective_write"):
        _build("interdomain", spec, selective_write=True)
    with pytest.raises(ValueError, match="s4d_inv_n"):
        _build("interdomain", s4d_inv_n="3M")
    with pytest.raises(ValueError, match="value_head_dim"):
        _build("s4d", spec)


def test_decode_of_a_packed_row_resets_at_each_document():
    """Decoding a row of two documents with positions restarting at 0 equals the packed parallel forward
    (the decode cache, conv caches included, is reset at position 0). Shapes as the test above, so the jitted
    calls compile once per process."""
    layer = _build("interdomain", **ALL_FLAGS)
    _perturb_params(layer)
    x, _, _ = _inputs(11)
    seg = jnp.asarray(np.repeat([[1] * 5 + [2] * 6], 2, 0), jnp.int32)
    pos = jnp.asarray(np.repeat([list(range(5)) + list(range(6))], 2, 0), jnp.int32)
    y = _fwd(layer, x, seg, pos)
    cache = layer.init_cache(2, 11)
    steps = []
    for i in range(11):
        out, cache = _dec(layer, x[:, i:i + 1], cache, pos[:, i])
        steps.append(out[:, 0])
    np.testing.assert_allclose(np.asarray(jnp.stack(steps, 1)), np.asarray(y), rtol=2e-5, atol=2e-5)  # as above


EXTREME = (-np.inf, -1e30, -1e4, -100.0, 0.0, 100.0, 1e4, 1e30, np.inf)


def test_log_modulus_is_nonpositive_and_finite_for_any_parameters():
    """r = −exp(a_re)·exp(log_dt) with both logs smoothly capped: ≤ 0 and finite (and the phase and the ZOH
    gain finite) for every combination of extreme a_re and log_dt, including ±inf; the S4D initialisation is
    unchanged by the cap (exactly −exp(a_re)·exp(log_dt) in float32)."""
    from mixerlab.mixers.s4d_core import S4DCore

    core = S4DCore(1, 4, s4d_inv_n="2M", dt_min=1e-3, dt_max=1e-1, c_init="identity", c_lr_group="main",
                   rngs=nnx.Rngs(0))
    r0, _, _ = core.dynamics()
    want = -np.exp(np.asarray(core.a_re[...])) * np.exp(np.asarray(core.log_dt[...]))[:, None]
    np.testing.assert_array_equal(np.asarray(r0), want.astype(np.float32))
    grid = np.array(np.meshgrid(EXTREME, EXTREME, indexing="ij"), np.float32).reshape(2, -1)
    for a_re, log_dt in grid.T:
        core.a_re[...] = jnp.full((1, 4), a_re)
        core.log_dt[...] = jnp.full((1,), log_dt)
        r, phase, gain = (np.asarray(x) for x in core.dynamics())
        assert np.isfinite(r).all() and (r <= 0).all(), (a_re, log_dt, r)
        assert np.isfinite(phase).all() and np.isfinite(gain).all(), (a_re, log_dt, phase, gain)


@pytest.mark.parametrize("name", ["interdomain", "s4d"])
def test_extreme_decay_parameters_keep_the_layer_finite(name):
    """A run that drives a_re and log_dt to huge values (decays of e^{−1e17} per token) or −inf (no decay)
    stays finite under jit: the op never sees an r it would reject (which would poison the output to NaN)."""
    flags = dict(selective_decay=True) if name == "interdomain" else {}
    layer = _build(name, num_modes=8, chunk_size=8, **flags)
    x, seg, pos = _inputs(13)
    for value in (1e4, np.inf, -np.inf):
        layer.core.a_re[...] = jnp.full_like(layer.core.a_re[...], value)
        layer.core.log_dt[...] = jnp.full_like(layer.core.log_dt[...], value)
        y = _fwd(layer, x, seg, pos)
        assert bool(jnp.all(jnp.isfinite(y))), value


def test_bias_reduced_apart_matches_autodiff():
    """The GPU form of the biased short conv's bias add (the bias gradient as a reduction of its own) gives
    autodiff's gradients, for both inputs, bf16 activations included."""
    from mixerlab.mixers.s4d_core import _bias_reduced_apart

    y = jax.random.normal(jax.random.key(0), (2, 7, 3, 6))
    b = jax.random.normal(jax.random.key(1), (6,))
    weights = jnp.linspace(-1.0, 1.0, 6)
    for dtype in (jnp.float32, jnp.bfloat16):
        yd = y.astype(dtype)
        ours = jax.grad(lambda y_, b_: jnp.sum(jnp.sin(_bias_reduced_apart(y_, b_)) * weights), (0, 1))(yd, b)
        plain = jax.grad(lambda y_, b_: jnp.sum(jnp.sin(y_ + b_) * weights), (0, 1))(yd, b)
        for got, want in zip(ours, plain):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend, apart", [("gpu", True), ("tpu", False), ("cpu", False)])
def test_bias_gradient_is_reduced_apart_only_on_gpu(monkeypatch, backend, apart):
    """The backward of ``add_channel_bias`` holds an optimization barrier (the reduction kept out of the
    cotangent's producer) exactly when the traced-for backend is a GPU."""
    from mixerlab.mixers import s4d_core

    monkeypatch.setattr(s4d_core.dispatch, "target_backend", lambda: backend)
    grad = jax.grad(lambda y, b: jnp.sum(jnp.sin(s4d_core.add_channel_bias(y, b))), (0, 1))
    text = str(jax.make_jaxpr(grad)(jnp.ones((2, 5, 4)), jnp.ones((4,))))
    assert ("optimization_barrier" in text) == apart, text
