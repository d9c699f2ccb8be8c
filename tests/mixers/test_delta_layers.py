"""Layer-level tests of the delta-family mixers (linear_attention, deltanet, gated_deltanet, kda, gdn2, muir).

Tiny dims (d_model 64, 2 heads, d_k 16 != d_v 32 to catch transposed shapes), T in {8, 16}, float32.
"""
from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mixerlab import mixers  # noqa: F401  (registers every mixer)
from mixerlab.mixers import registry
from mixerlab.mixers.base import DynamicsParam, MixerSpec

# The layers run eagerly: the first test in a process compiles the op's primitives at these shapes (≈ 30–45 s),
# the rest reuse them (1–5 s each), so one xdist worker runs the whole file instead of both paying that compile.
pytestmark = pytest.mark.xdist_group("delta_layers")

D, H, DK, DV = 64, 2, 16, 32
# The op runs eagerly with its default ("auto") implementation. Every test uses B = 2 and T in {TS, TL}, so the
# op's primitives compile once per process and later tests reuse them (a new length costs seconds of compile).
B, TS, TL = 2, 8, 16
# The op's chunking for every layer built here: chunk 8 (one pivot level over leaves of 4) instead of the CPU
# default 64, so T = TL spans two chunks (the state crosses a chunk edge, documents start inside a chunk and at
# its edge) and the chunked form compiles a smaller program. The default chunking is run by the op tests
# (tests/pallas_kernels/test_delta_rule*.py) and the training tests.
CHUNKING = dict(chunk_size=8, leaf_size=4)
DELTA_NAMES = ["linear_attention", "deltanet", "gated_deltanet", "kda", "gdn2", "muir"]

# (id, mixer name, option overrides): every mixer with defaults, plus the non-default code paths.
CONFIGS = [
    ("la", "linear_attention", {}),
    ("la_unnorm", "linear_attention", dict(normalize=False, feature_map="identity", use_output_norm=True,
                                          use_short_conv=True)),
    ("deltanet", "deltanet", {}),
    ("deltanet_gate_neg", "deltanet", dict(use_output_gate=True, allow_neg_eigval=True)),
    ("gdn", "gated_deltanet", {}),
    ("kda", "kda", {}),
    ("kda_safe", "kda", dict(safe_gate=True, use_short_conv=False)),
    ("gdn2", "gdn2", {}),
    ("muir_none", "muir", dict(gamma="none")),
    ("muir_static", "muir", dict(gamma="static")),
    ("muir_dynamic", "muir", dict(gamma="dynamic", gamma_up_zero_init=False, gamma_phi="one_plus_tanh")),
]
IDS = [c[0] for c in CONFIGS]


def spec(dtype=jnp.float32, **kw) -> MixerSpec:
    base = dict(d_model=D, num_heads=H, head_dim=DK, value_head_dim=DV, layer_index=0, num_layers=2, dtype=dtype)
    base.update(kw)
    return MixerSpec(**base)


def build(name, seed=0, dtype=jnp.float32, spec_kw=None, **overrides):
    entry = registry.get(name)
    options = entry.options(**{**CHUNKING, **overrides})
    return registry.build(name, spec(dtype, **(spec_kw or {})), options, rngs=nnx.Rngs(seed))


def perturb_dynamics(layer, seed=1, scale=0.3):
    """Move zero-initialised biases / unit gains away from their init so every gate path is exercised."""
    key = jax.random.key(seed)
    for path, var in nnx.to_flat_state(nnx.state(layer, DynamicsParam)):
        key, sub = jax.random.split(key)
        name = path[-1]
        if name in ("b_bias", "w_bias", "g_bias", "q_bias", "bias"):
            var[...] = scale * jax.random.normal(sub, var[...].shape)
        if name == "gamma_static":
            var[...] = jnp.exp(scale * jax.random.normal(sub, var[...].shape))
    return layer


def x_input(B, T, seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(100 + seed), (B, T, D), jnp.float32).astype(dtype)


def ones_seg(B, T):
    return jnp.ones((B, T), jnp.int32), jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


def assert_close(a, b, rtol=1e-4, atol=1e-6):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=rtol, atol=atol)


def make(cfg, seed=0):
    _, name, overrides = cfg
    return perturb_dynamics(build(name, seed=seed, **overrides), seed=seed + 1)


# --------------------------------------------------------------------------------------------------------
# registry and options


def test_every_name_registered_with_frozen_simple_options():
    allowed = {int, float, bool, str}
    for name in DELTA_NAMES:
        entry = registry.get(name)
        assert dataclasses.is_dataclass(entry.options)
        assert entry.options.__dataclass_params__.frozen
        hints = typing.get_type_hints(entry.options)
        for f in dataclasses.fields(entry.options):
            tp = hints[f.name]
            origin = typing.get_origin(tp)
            if origin is typing.Literal:
                assert all(isinstance(a, str) for a in typing.get_args(tp)), (name, f.name)
                assert f.default in typing.get_args(tp), (name, f.name)
            elif origin is tuple:
                assert typing.get_args(tp) == (int, Ellipsis), (name, f.name, tp)
            else:
                assert tp in allowed, (name, f.name, tp)
                assert isinstance(f.default, tp), (name, f.name)
        assert f"{name}" in registry.names()


@pytest.mark.parametrize("name", DELTA_NAMES)
def test_build_defaults_at_spec_dims(name):
    """Default options build at d_model 64, 2 heads, head_dim 32; shapes/dtypes by abstract evaluation (no
    compile: the numerics of every code path are covered at the test dims below)."""
    s = MixerSpec(d_model=64, num_heads=2, head_dim=32, value_head_dim=32, layer_index=0, num_layers=2)
    layer = registry.build(name, s, rngs=nnx.Rngs(0))
    assert layer.options == registry.get(name).options()
    seg = jnp.array([[1] * 5 + [2] * 11, [1] * TL], jnp.int32)
    pos = jnp.array([list(range(5)) + list(range(11)), list(range(TL))], jnp.int32)
    y = jax.eval_shape(lambda x: layer(x, segment_ids=seg, positions=pos), x_input(B, TL))
    assert y.shape == (B, TL, 64) and y.dtype == jnp.float32
    cache = layer.init_cache(B, TL)
    assert cache["state"].dtype == jnp.float32 and cache["state"].shape[:3] == (B, 2, 32)
    y1, cache1 = jax.eval_shape(lambda x, c: layer.decode(x, c, pos[:, 0]), x_input(B, 1), cache)
    assert y1.shape == (B, 1, 64)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), cache1) == jax.tree.map(lambda a: (a.shape, a.dtype), cache)
    for _, v in nnx.to_flat_state(nnx.state(layer, nnx.Param)):  # parameters float32
        assert v[...].dtype == jnp.float32


def test_default_options_follow_the_spec():
    get = lambda n: registry.get(n).options()  # noqa: E731
    assert get("linear_attention").feature_map == "elu_plus_one" and get("linear_attention").normalize
    assert get("gated_deltanet").gate_act == "silu" and get("gated_deltanet").use_output_gate
    assert not get("deltanet").use_output_gate
    assert get("kda").gate_act == "sigmoid"
    assert get("gdn2").gate_act == "silu" and get("muir").gate_act == "silu"
    assert get("muir").resolved_ranks() == (64, 64, 128, 128, 128)
    assert registry.get("muir").options(gamma="static").resolved_ranks() == (64, 64, 128, 256, 0)
    assert registry.get("muir").options(gamma="none").resolved_ranks() == (64, 64, 128, 256, 0)
    with pytest.raises(ValueError):
        registry.get("muir").options(gamma="static", ranks=(64, 64, 128, 128, 128))
    with pytest.raises(ValueError):
        registry.get("linear_attention").options(feature_map="identity")  # normalised needs phi > 0


def test_muir_fused_projection_shapes():
    layer = build("muir", spec_kw=dict(head_dim=32), gamma="dynamic")
    assert layer.gate_down.kernel[...].shape == (D, 512)
    assert layer.q_up.kernel[...].shape == (128, H * 32)
    assert float(jnp.abs(layer.q_up.kernel[...]).max()) == 0.0  # W_q_up = 0 at init: gamma_t = gamma_stat
    assert layer.w_up.kernel[...].shape == (128, H * DV)
    static = build("muir", spec_kw=dict(head_dim=32), gamma="static")
    assert static.gate_down.kernel[...].shape == (D, 512) and static.w_up.kernel[...].shape == (256, H * DV)
    assert static.gamma_static[...].shape == (H * 32,) and not hasattr(static, "q_up")
    assert not hasattr(build("muir", gamma="none"), "gamma_static")


def test_inits():
    s32 = dict(head_dim=32, value_head_dim=32)
    g = build("gdn2", seed=0, spec_kw=s32)
    dt = jax.nn.softplus(g.dt_bias[...])
    assert float(dt.min()) >= 1e-4 - 1e-9 and float(dt.max()) <= 0.1 + 1e-6  # dt ~ logU(1e-3, 1e-1)
    a = jnp.exp(g.A_log[...])
    assert float(a.min()) >= 1.0 - 1e-5 and float(a.max()) <= 16.0 + 1e-4  # A ~ U(1, 16)
    assert g.dt_bias[...].shape == (H * 32,) and g.A_log[...].shape == (H,)
    assert isinstance(g.A_log, DynamicsParam) and isinstance(g.dt_bias, DynamicsParam)
    assert isinstance(g.g_proj.bias, DynamicsParam)
    std = lambda p: float(jnp.std(p.kernel[...]))  # noqa: E731
    assert abs(std(g.q_proj) - 0.02) < 0.004 and abs(std(g.b_proj) - 0.02) < 0.004
    assert abs(std(g.o_proj) - 0.02 / 2.0) < 0.002  # spec.out_init_std = 0.02 / sqrt(2 L), L = 2
    x = build("gdn2", seed=0, spec_kw=s32, init_scheme="xavier_uniform")
    want = 2.0 ** -2.5 * (2.0 / (D + H * 32)) ** 0.5  # xavier_uniform, gain 2^-2.5 [GDN2-code]
    assert abs(std(x.q_proj) - want) < 0.15 * want
    assert abs(std(x.o_proj) - 0.02 / 2.0) < 0.002
    gdn = build("gated_deltanet", seed=0)
    assert gdn.A_log[...].shape == (H,) and gdn.dt_bias[...].shape == (H,)  # per head
    m = build("muir", seed=0)
    assert float(jnp.abs(m.gamma_static[...] - 1.0).max()) == 0.0  # gamma_stat init 1
    for name in ("b_bias", "g_bias", "w_bias", "q_bias"):
        assert float(jnp.abs(getattr(m, name)[...]).max()) == 0.0
    assert float(jax.nn.softplus(m.f_bias[...]).max()) <= 0.1 + 1e-6  # c_f = inv_softplus(dt)


# --------------------------------------------------------------------------------------------------------
# causality, decode, packing, gradients


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_causal(cfg):
    """The output on the first TS tokens is the same whether the sequence stops there or runs on to TL."""
    layer = make(cfg)
    x = x_input(B, TL)
    seg, pos = ones_seg(B, TL)
    y_long = layer(x, segment_ids=seg, positions=pos)
    y_short = layer(x[:, :TS], segment_ids=seg[:, :TS], positions=pos[:, :TS])
    assert_close(y_short, y_long[:, :TS])


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_decode_matches_parallel_over_packed_documents(cfg):
    """Token-by-token decode (positions restart at 0 for the 2nd document) == packed parallel forward."""
    layer = make(cfg)
    n1, n2 = 7, 9
    T = n1 + n2
    x = x_input(B, T, seed=1)
    seg = jnp.array([[1] * n1 + [2] * n2] * B, jnp.int32)
    pos = jnp.array([list(range(n1)) + list(range(n2))] * B, jnp.int32)
    y_par = layer(x, segment_ids=seg, positions=pos)
    cache = layer.init_cache(B, T)
    ys = []
    for t in range(T):
        y_t, cache = layer.decode(x[:, t:t + 1], cache, pos[:, t])
        ys.append(y_t)
    assert cache["state"].dtype == jnp.float32
    assert_close(jnp.concatenate(ys, axis=1), y_par)


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_prefill_then_decode(cfg):
    layer = make(cfg)
    T, t0 = TL, TS
    x = x_input(B, T, seed=2)
    seg, pos = ones_seg(B, T)
    y_par = layer(x, segment_ids=seg, positions=pos)
    y0, cache = layer.prefill(x[:, :t0], segment_ids=seg[:, :t0], positions=pos[:, :t0])
    ys = [y0]
    for t in range(t0, T):
        y_t, cache = layer.decode(x[:, t:t + 1], cache, pos[:, t])
        ys.append(y_t)
    assert_close(jnp.concatenate(ys, axis=1), y_par)


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_packed_equals_separate(cfg):
    """[doc1 | doc2 | padding] in one row == each document alone (state and short-conv resets).

    "Alone" = the document at the start of a row followed by padding (segment 0) up to the same length TL."""
    layer = make(cfg)
    n1, n2 = 5, 8
    npad = TL - n1 - n2
    x = x_input(B, TL, seed=3)
    seg = jnp.array([[1] * n1 + [2] * n2 + [0] * npad] * B, jnp.int32)
    pos = jnp.array([list(range(n1)) + list(range(n2)) + [0] * npad] * B, jnp.int32)
    y = layer(x, segment_ids=seg, positions=pos)
    for lo, n in ((0, n1), (n1, n2)):
        x_alone = jnp.concatenate([x[:, lo:lo + n], x_input(B, TL - n, seed=9)], axis=1)
        seg1 = jnp.array([[1] * n + [0] * (TL - n)] * B, jnp.int32)
        pos1 = jnp.array([list(range(n)) + [0] * (TL - n)] * B, jnp.int32)
        y_alone = layer(x_alone, segment_ids=seg1, positions=pos1)
        assert_close(y[:, lo:lo + n], y_alone[:, :n])
    assert bool(jnp.all(jnp.isfinite(y)))


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_gradients_finite(cfg):
    layer = make(cfg)
    x = x_input(B, TL, seed=4)
    seg = jnp.array([[1] * 4 + [2] * 12, [1] * TL], jnp.int32)
    pos = jnp.array([list(range(4)) + list(range(12)), list(range(TL))], jnp.int32)

    def loss(m, x):
        return jnp.sum(m(x, segment_ids=seg, positions=pos) ** 2)

    grads, gx = nnx.grad(loss, argnums=(0, 1))(layer, x)
    flat = nnx.to_flat_state(grads)
    assert len(flat) > 0
    for path, g in flat:
        assert bool(jnp.all(jnp.isfinite(g[...]))), path
    assert bool(jnp.all(jnp.isfinite(gx))) and float(jnp.abs(gx).max()) > 0


@pytest.mark.parametrize("name", ["linear_attention", "muir"])
def test_bfloat16_activations(name):
    layer = build(name, dtype=jnp.bfloat16)
    seg, pos = ones_seg(B, TL)
    y = layer(x_input(B, TL, dtype=jnp.bfloat16), segment_ids=seg, positions=pos)
    assert y.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))
    y1, cache = layer.decode(x_input(B, 1, dtype=jnp.bfloat16), layer.init_cache(B, 4), pos[:, 0])
    assert y1.dtype == jnp.bfloat16 and cache["state"].dtype == jnp.float32
    for _, v in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
        assert v[...].dtype == jnp.float32


# --------------------------------------------------------------------------------------------------------
# layer-level reductions (docs/math/delta_rule.md, 'Mechanisms as substitutions')


def copy_common(dst, src):
    """q/k/v projections, short convs, output norm and projection: the skeleton shared by the family."""
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        getattr(dst, name).kernel[...] = getattr(src, name).kernel[...]
    for name in ("q_conv", "k_conv", "v_conv"):
        if hasattr(src, name):
            getattr(dst, name).kernel[...] = getattr(src, name).kernel[...]
    dst.o_norm.scale[...] = src.o_norm.scale[...]


def run(layer, x):
    seg, pos = ones_seg(*x.shape[:2])
    return layer(x, segment_ids=seg, positions=pos)


def test_muir_dynamic_with_zero_q_gate_equals_static():
    dyn = perturb_dynamics(build("muir", seed=0, gamma="dynamic", gamma_up_zero_init=False), seed=5)
    sta = build("muir", seed=1, gamma="static", ranks=(64, 64, 128, 128, 0))
    x = x_input(B, TL, seed=5)
    assert float(jnp.abs(dyn.q_up.kernel[...]).max()) > 0
    y_dyn_random = run(dyn, x)
    copy_common(sta, dyn)
    sta.gate_down.kernel[...] = dyn.gate_down.kernel[...][:, :384]
    for name in ("f_up", "b_up", "g_up", "w_up"):
        getattr(sta, name).kernel[...] = getattr(dyn, name).kernel[...]
    for name in ("f_bias", "b_bias", "g_bias", "w_bias", "A_log", "gamma_static"):
        getattr(sta, name)[...] = getattr(dyn, name)[...]
    dyn.q_up.kernel[...] = jnp.zeros_like(dyn.q_up.kernel[...])
    dyn.q_bias[...] = jnp.zeros_like(dyn.q_bias[...])
    y_dyn, y_sta = run(dyn, x), run(sta, x)
    assert_close(y_dyn, y_sta)
    assert float(jnp.abs(y_dyn - y_dyn_random).max()) > 1e-4  # the check is not vacuous


def _gdn2_from_muir(muir, seed=3):
    """GDN-2 whose gates equal Muir's at gamma = 1 (dense b, w = Muir's low-rank products; c_b = c_w = 0)."""
    r_f, r_b, r_g, r_w, _ = muir.ranks
    gdn2 = build("gdn2", seed=seed, decay_rank=r_f, gate_rank=r_g)
    copy_common(gdn2, muir)
    down = muir.gate_down.kernel[...]
    cut = np.cumsum([0, r_f, r_b, r_g, r_w])
    gdn2.f_proj.down.kernel[...] = down[:, cut[0]:cut[1]]
    gdn2.f_proj.up.kernel[...] = muir.f_up.kernel[...]
    gdn2.dt_bias[...] = muir.f_bias[...]
    gdn2.A_log[...] = muir.A_log[...]
    gdn2.b_proj.kernel[...] = down[:, cut[1]:cut[2]] @ muir.b_up.kernel[...]
    gdn2.g_proj.down.kernel[...] = down[:, cut[2]:cut[3]]
    gdn2.g_proj.up.kernel[...] = muir.g_up.kernel[...]
    gdn2.g_proj.bias[...] = muir.g_bias[...]
    gdn2.w_proj.kernel[...] = down[:, cut[3]:cut[4]] @ muir.w_up.kernel[...]
    return gdn2


@pytest.mark.parametrize("gamma", ["none", "static", "dynamic"])
def test_muir_with_unit_gamma_equals_gdn2(gamma):
    muir = build("muir", seed=0, gamma=gamma)
    muir.g_bias[...] = 0.3 * jax.random.normal(jax.random.key(7), muir.g_bias[...].shape)
    muir.f_bias[...] = muir.f_bias[...] + 0.5  # any value; GDN-2 gets it as dt_bias
    gdn2 = _gdn2_from_muir(muir)
    x = x_input(B, TL, seed=6)
    # gamma = 1: 'none' by construction; 'static' with gamma_stat = 1 (its init); dynamic with W_q_up = 0
    # (its init) and c_q = 0 (its init), phi(0) = 1.
    assert_close(run(muir, x), run(gdn2, x), rtol=2e-4, atol=2e-6)
    if gamma != "none":  # and a non-unit gain breaks the equality (the check is real)
        muir.gamma_static[...] = jnp.linspace(0.2, 3.0, muir.gamma_static[...].size)
        assert float(jnp.abs(run(muir, x) - run(gdn2, x)).max()) > 1e-4


@pytest.mark.parametrize("gamma", ["static", "dynamic"])
def test_rmsnorm_invariance_to_per_head_gamma_scale(gamma):
    layer = perturb_dynamics(build("muir", gamma=gamma, norm_eps=0.0, gamma_up_zero_init=False), seed=8)
    x = x_input(B, TL, seed=7)
    y0 = run(layer, x)
    g = layer.gamma_static[...].reshape(H, DK)
    layer.gamma_static[...] = (g * jnp.array([3.7, 0.4])[:, None]).reshape(-1)
    assert_close(run(layer, x), y0, rtol=1e-4, atol=1e-6)
    layer.gamma_static[...] = (g * jnp.linspace(0.5, 2.0, DK)[None]).reshape(-1)  # not a per-head scale
    assert float(jnp.abs(run(layer, x) - y0).max()) > 1e-5


def test_gdn2_with_per_head_b_w_equals_kda():
    """GDN-2(b = w = beta 1) = KDA (docs/math/delta_rule.md), built at the layer level with tied dense columns."""
    kda = perturb_dynamics(build("kda", seed=0, gate_act="silu"), seed=9)
    gdn2 = build("gdn2", seed=1)
    copy_common(gdn2, kda)
    for name in ("down", "up"):
        getattr(gdn2.f_proj, name).kernel[...] = getattr(kda.f_proj, name).kernel[...]
        getattr(gdn2.g_proj, name).kernel[...] = getattr(kda.g_proj, name).kernel[...]
    gdn2.g_proj.bias[...] = kda.g_proj.bias[...]
    gdn2.A_log[...], gdn2.dt_bias[...] = kda.A_log[...], kda.dt_bias[...]
    w_beta = kda.b_proj.kernel[...]  # [D, H]
    gdn2.b_proj.kernel[...] = jnp.repeat(w_beta, DK, axis=1)
    gdn2.w_proj.kernel[...] = jnp.repeat(w_beta, DV, axis=1)
    x = x_input(B, TL, seed=8)
    assert_close(run(gdn2, x), run(kda, x), rtol=2e-4, atol=2e-6)


def test_kda_with_scalar_decay_equals_gdn_and_gdn_without_decay_equals_deltanet():
    gdn = perturb_dynamics(build("gated_deltanet", seed=0), seed=10)
    kda = build("kda", seed=1, gate_act="silu", decay_rank=DK, gate_rank=H * DV)
    copy_common(kda, gdn)
    # KDA's f = x W_down W_up + dt_bias is channel-constant within a head when W_up's columns and dt_bias
    # are repeated per head: W_down = GDN's W_a padded, W_up = e_h repeated over d_k.
    w_a = gdn.a_proj.kernel[...]  # [D, H]
    down = jnp.zeros((D, DK)).at[:, :H].set(w_a)
    up = jnp.zeros((DK, H * DK)).at[:H].set(jnp.repeat(jnp.eye(H), DK, axis=1))
    kda.f_proj.down.kernel[...], kda.f_proj.up.kernel[...] = down, up
    kda.dt_bias[...] = jnp.repeat(gdn.dt_bias[...], DK)
    kda.A_log[...] = gdn.A_log[...]
    kda.b_proj.kernel[...] = gdn.b_proj.kernel[...]
    # GDN's dense output gate = a rank-(H d_v) factorisation with identity up-projection and no bias
    kda.g_proj.down.kernel[...] = gdn.g_proj.kernel[...]
    kda.g_proj.up.kernel[...] = jnp.eye(H * DV)
    kda.g_proj.bias[...] = jnp.zeros((H * DV,))
    x = x_input(B, TL, seed=9)
    assert_close(run(kda, x), run(gdn, x), rtol=2e-4, atol=2e-6)

    dn = build("deltanet", seed=2, use_output_gate=True)
    copy_common(dn, gdn)
    dn.b_proj.kernel[...] = gdn.b_proj.kernel[...]
    dn.g_proj.kernel[...] = gdn.g_proj.kernel[...]
    gdn.A_log[...] = jnp.full_like(gdn.A_log[...], -jnp.inf)  # exp(A_log) = 0: lambda = 0
    assert_close(run(gdn, x), run(dn, x), rtol=2e-4, atol=2e-6)
