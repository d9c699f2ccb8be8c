"""VLA and the VLA paper's "DeltaNet" as mixers (docs/math/vla.md): registry defaults, causality, packing,
decode == forward, and the paper_deltanet recurrence against a direct loop of the §2.3 formula."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mixerlab.mixers.vla as vla_mixers
from mixerlab.mixers import registry
from mixerlab.mixers.base import DynamicsParam, MixerSpec

SPEC = MixerSpec(d_model=64, num_heads=2, head_dim=32, value_head_dim=32, layer_index=0, num_layers=2)
NAMES = ("vla", "paper_deltanet")


@pytest.fixture(autouse=True)
def _full_precision_matmuls():
    with jax.default_matmul_precision("float32"):
        yield


def _build(name, **options):
    opts = registry.get(name).options(**options)
    return registry.build(name, SPEC, opts, rngs=nnx.Rngs(0))


def _x(seed, b, t):
    return jax.random.normal(jax.random.key(seed), (b, t, SPEC.d_model), jnp.float32)


# One jitted forward for the module: a call with the same options and shapes reuses its compiled program.
_FORWARD = nnx.jit(lambda m, x, s: m(x, segment_ids=s))


def _forward(m, x, seg=None):
    return _FORWARD(m, x, seg)


def _decode_all(m, x, positions):
    step = nnx.jit(lambda m, x, c, p: m.decode(x, c, p))
    cache = m.init_cache(x.shape[0], x.shape[1])
    outs = []
    for t in range(x.shape[1]):
        y, cache = step(m, x[:, t:t + 1], cache, positions[:, t])
        outs.append(y[:, 0])
    return jnp.stack(outs, 1)


@pytest.mark.parametrize("name", NAMES)
def test_registry_defaults_build_and_keep_float32_params(name):
    m = _build(name)
    y = _forward(m, _x(0, 2, 9))
    assert y.shape == (2, 9, 64) and y.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(y)))
    params = nnx.state(m, nnx.Param)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    if name == "vla":
        f_theta = nnx.state(m, DynamicsParam)
        (w,) = jax.tree.leaves(f_theta)
        np.testing.assert_array_equal(np.asarray(w), np.broadcast_to(np.eye(32), (2, 32, 32)))


@pytest.mark.parametrize("name", NAMES)
def test_causal_prefix_property(name):
    m = _build(name)
    x = _x(1, 1, 27)
    full = _forward(m, x)
    prefix = _forward(m, x[:, :11])
    np.testing.assert_allclose(np.asarray(full[:, :11]), np.asarray(prefix), rtol=2e-5, atol=2e-6)


VARIANTS = [
    ("vla", dict(refresh_period=5)),
    ("vla", dict(refresh_period=6, refresh_placement="before_update", key_feature_map="identity",
                 penalty_map="none", normalize_query=True, use_short_conv=True, use_output_norm=True)),
    ("paper_deltanet", dict(normalize_keys=True, feature_map="elu_plus_one", use_short_conv=True)),
]


@pytest.mark.parametrize("variant", [0] + [pytest.param(v, marks=pytest.mark.extended)
                                     for v in range(1, len(VARIANTS))])
def test_decode_equals_packed_forward_and_packing_equals_separate(variant):
    """A row of three documents: parallel forward with segment_ids == decode with positions restarting at 0
    (refreshes land at the same document positions) == each document run alone.

    "Alone" = the document at the start of a row of the same length, followed by another document (other
    tokens): the packed forward's compiled program serves it, and a leak from the following document, or from
    the documents before it in the packed row, shows as a difference. The segment_ids=None path is checked by
    the causal-prefix test."""
    name, options = VARIANTS[variant]
    m = _build(name, **options)
    lengths = (9, 13, 6)
    total = sum(lengths)
    x = _x(2, 1, total)
    seg = jnp.asarray(np.repeat([1, 2, 3], lengths)[None], jnp.int32)
    pos = jnp.asarray(np.concatenate([np.arange(n) for n in lengths])[None], jnp.int32)
    packed = _forward(m, x, seg)
    decoded = _decode_all(m, x, pos)
    np.testing.assert_allclose(np.asarray(decoded), np.asarray(packed), rtol=1e-4, atol=1e-5)
    x_np, filler = np.asarray(x), np.asarray(_x(9, 1, total))
    start = 0
    for n in lengths:
        row = jnp.asarray(np.concatenate([x_np[:, start:start + n], filler[:, n:]], axis=1))
        alone = _forward(m, row, jnp.asarray(np.repeat([1, 2], [n, total - n])[None], jnp.int32))
        np.testing.assert_allclose(np.asarray(packed[:, start:start + n]), np.asarray(alone[:, :n]), rtol=2e-5,
                                   atol=2e-6)
        start += n


def test_paper_deltanet_is_the_papers_formula():
    """S_t = β_t S_{t−1} + (v_t − S_{t−1} k_t) k_tᵀ (value-major), o_t = S_t q_t, with the layer's own q, k, v, β."""
    m = _build("paper_deltanet")
    x = _x(3, 1, 12)
    q, k, erase, v, log_beta = m._inputs(x, *m._qkv(x, None))
    q, k, v, beta = (np.asarray(a, np.float64)[0] for a in (q, k, v, jnp.exp(log_beta)))
    H, Dk, Dv = 2, 32, 32
    S = np.zeros((H, Dv, Dk))
    outs = []
    for t in range(12):
        for h in range(H):
            S[h] = beta[t, h] * S[h] + np.outer(v[t, h] - S[h] @ k[t, h], k[t, h])
        outs.append(np.einsum("hvk,hk->hv", S, q[t]))
    o_ref = np.stack(outs)[None]
    y_ref = np.asarray(m.o_proj(jnp.asarray(o_ref.reshape(1, 12, -1), jnp.float32)))
    np.testing.assert_allclose(np.asarray(_forward(m, x)), y_ref, rtol=1e-4, atol=1e-6)


def test_options_are_validated():
    with pytest.raises(ValueError, match="lambda0"):
        vla_mixers.VLAOptions(lambda0=0.0)
    with pytest.raises(ValueError, match="before_update"):
        vla_mixers.VLAOptions(refresh_placement="before_update", refresh_period=1)
    with pytest.raises(ValueError, match="penalty_update"):
        vla_mixers.VLAOptions(penalty_update="frozen")


def test_ablation_options_reach_the_op(monkeypatch):
    """mixers.vla.{normalize_key, normalize_write_direction, penalty_update} are passed to the op (forward and
    decode); a fixed penalty builds no W_u and passes no penalty key."""
    seen = []
    real_vla, real_step = vla_mixers.vla_api.vla, vla_mixers.vla_api.vla_step
    monkeypatch.setattr(vla_mixers.vla_api, "vla", lambda *a, **kw: seen.append(kw) or real_vla(*a, **kw))
    monkeypatch.setattr(vla_mixers.vla_api, "vla_step", lambda *a, **kw: seen.append(kw) or real_step(*a, **kw))
    m = _build("vla", normalize_key=False, normalize_write_direction=False, penalty_update="fixed")
    assert not jax.tree.leaves(nnx.state(m, DynamicsParam))
    x = _x(3, 1, 4)
    _forward(m, x)  # jitted: the keyword arguments are recorded while tracing
    _decode_all(m, x[:, :1], jnp.zeros((1, 1), jnp.int32))
    assert len(seen) == 2
    for kw in seen:
        assert kw["normalize_key"] is False and kw["normalize_write_direction"] is False
        assert kw["penalty_update"] == "fixed" and kw["penalty_key"] is None
    defaults = vla_mixers.VLAOptions().op_kwargs
    assert defaults["normalize_key"] and defaults["normalize_write_direction"]
    assert defaults["penalty_update"] == "sherman_morrison"
