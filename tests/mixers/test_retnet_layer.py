"""The RetNet multi-scale retention mixer (mixers/retnet.py) against float64 re-statements of its block:

* the paper's recurrent form token by token (numpy, float64): S_t = gamma_h S_{t-1} + k_t^T v_t,
  o_t = d_k^-1/2 q_t S_t with RoPE on q, k at positions restarting in every document, gamma_h = 1 - 2^(-5-h),
  the per-head RMSNorm with its swish output gate and the projections around it;
* FLA's parallel form (``naive_retention``: the decay mask gamma^(i-j)) restated in numpy, and FLA's own pieces
  (``naive_retention``, ``rotary_embedding_ref``, ``rms_norm_ref``) on the same weights (behind importorskip);
* float32 / bfloat16 against the float64 oracle, gradients of the op path ("xla" against "reference"), packed
  documents with a reused id, decode / prefill / extend against the parallel forward, a train step through the
  config, and TPU compiles through libtpu.
Tolerances: float64 1e-6 relative to the output's largest entry (the shared RoPE helper and per-head norm compute
in float32 by design; 1e-7 seen), float32 2e-4, bfloat16 6e-2.
"""
from __future__ import annotations

import importlib
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from mixerlab import mixers  # noqa: E402,F401  (registers every mixer)
from mixerlab.mixers import registry  # noqa: E402
from mixerlab.mixers.base import DynamicsParam, MixerSpec  # noqa: E402

D_MODEL, T = 16, 37
CHUNKING = dict(chunk_size=8, leaf_size=4)
SEG = np.array([[1] * 9 + [2] * 13 + [1] * 15, [3] * T], np.int32)  # a reused id: three documents in row 0
POS = np.stack([np.concatenate([np.arange(9), np.arange(13), np.arange(15)]), np.arange(T)]).astype(np.int32)
SHAPES = [(4, 8, 16), (2, 16, 16)]  # (heads, d_k = model.head_dim, d_v = model.value_head_dim)
F64_TOL = 1e-6
TOPOLOGIES = {"v5e": "v5e:2x2", "v6e": "v6e:2x2", "v5p": "v5p:2x2x1"}  # tests/pallas_kernels/tpu_topologies.py


def build(heads, dk, dv, dtype=jnp.float32, seed=0, **opts):
    spec = MixerSpec(d_model=D_MODEL, num_heads=heads, head_dim=dk, value_head_dim=dv, layer_index=0, num_layers=2,
                     dtype=dtype)
    layer = registry.build("retnet", spec, registry.get("retnet").options(**{**CHUNKING, **opts}),
                           rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed + 7)  # move the unit norm scale so that it is seen by the checks
    layer.g_norm.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, layer.g_norm.scale[...].shape), jnp.float32)
    for proj in (layer.q_proj, layer.k_proj):  # N(0, 0.2): q·k of order 1, so RoPE and the decay matter
        proj.kernel[...] = proj.kernel[...] * 10
    return layer


def params64(layer) -> dict:
    f = lambda a: np.asarray(a[...], np.float64)  # noqa: E731
    return dict(wq=f(layer.q_proj.kernel), wk=f(layer.k_proj.kernel), wv=f(layer.v_proj.kernel),
                wg=f(layer.g_proj.kernel), norm_w=f(layer.g_norm.scale), wo=f(layer.o_proj.kernel))


def x_input(b=2, t=T, seed=0):
    return np.random.default_rng(100 + seed).normal(size=(b, t, D_MODEL))


def documents(seg):
    return np.concatenate([np.zeros((seg.shape[0], 1), int), np.cumsum(seg[:, 1:] != seg[:, :-1], axis=1)], axis=1)


def rope(x, pos, theta=10000.0):
    """Half-split RoPE (GPT-NeoX / FLA ``interleaved=False``): x [B, T, H, D], pos [B, T]."""
    d = x.shape[-1]
    ang = pos[..., None, None] * theta ** (-np.arange(0, d // 2) * 2.0 / d)
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], axis=-1)


def gammas(heads):
    return 1.0 - 2.0 ** (-5.0 - np.arange(heads))


def qkvg(p, x, pos, heads):
    b, t = x.shape[:2]
    q = rope((x @ p["wq"]).reshape(b, t, heads, -1), pos)
    k = rope((x @ p["wk"]).reshape(b, t, heads, -1), pos)
    return q, k, (x @ p["wv"]).reshape(b, t, heads, -1), (x @ p["wg"]).reshape(b, t, heads, -1)


def block_output(p, o, g, eps=1e-5):
    y = o / np.sqrt(np.mean(o ** 2, axis=-1, keepdims=True) + eps) * p["norm_w"] * (g / (1.0 + np.exp(-g)))
    return y.reshape(*y.shape[:2], -1) @ p["wo"]


def oracle(p, x, seg, pos, heads):
    """The recurrent form, token by token; returns (out, final states of each row's last document)."""
    q, k, v, g = qkvg(p, x, pos, heads)
    doc, gam, s = documents(seg), gammas(heads), q.shape[-1] ** -0.5
    o = np.zeros_like(v)
    final = np.zeros((x.shape[0], heads, k.shape[-1], v.shape[-1]))
    for b in range(x.shape[0]):
        state = np.zeros(final.shape[1:])
        for t in range(x.shape[1]):
            if t and doc[b, t] != doc[b, t - 1]:
                state = np.zeros_like(state)
            state = gam[:, None, None] * state + k[b, t, :, :, None] * v[b, t, :, None, :]
            o[b, t] = s * np.einsum("hk,hkv->hv", q[b, t], state)
        final[b] = state
    return block_output(p, o, g), final


def fla_parallel(p, x, seg, pos, heads):
    """FLA's ``naive_retention``: o = (d_k^-1/2 Q K^T ⊙ M) V, M[i, j] = gamma^(i-j) for j <= i (here also within a
    document), restated in numpy."""
    q, k, v, g = qkvg(p, x, pos, heads)
    doc, n = documents(seg), np.arange(x.shape[1])
    causal = (n[:, None] >= n[None, :])[None] & (doc[:, :, None] == doc[:, None, :])  # [B, T, T]
    mask = gammas(heads)[None, :, None, None] ** (n[:, None] - n[None, :])[None, None] * causal[:, None]
    scores = np.einsum("bihd,bjhd->bhij", q * q.shape[-1] ** -0.5, k) * np.where(causal[:, None], mask, 0.0)
    return block_output(p, np.einsum("bhij,bjhd->bihd", scores, v), g)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


# ---------------------------------------------------------------------------------------------------------
# float64 oracles


@pytest.mark.parametrize("heads, dk, dv", SHAPES)
def test_forward_and_final_state_match_the_f64_recurrence(heads, dk, dv):
    """T = 37 over packed documents (a reused id; positions restart at each), float64: outputs against the token
    recurrence and FLA's parallel form, and the prefill state of each row's last document."""
    with jax.enable_x64(True):
        layer = build(heads, dk, dv, dtype=jnp.float64, implementation="xla")
        x = x_input()
        y, cache = layer.prefill(jnp.asarray(x), segment_ids=jnp.asarray(SEG), positions=jnp.asarray(POS))
        p = params64(layer)
        want, final = oracle(p, x, SEG, POS, heads)
        assert rel_err(fla_parallel(p, x, SEG, POS, heads), want) < 1e-12
        assert rel_err(y, want) < F64_TOL
        assert rel_err(cache["state"], final) < F64_TOL


def test_positions_default_to_restarting_in_every_document():
    """Without ``positions`` the layer places RoPE at each token's place in its document (what the decoder passes).
    RoPE only enters through q_t·k_s, a function of t - s, so positions running on across documents give the same
    output (the state resets at each document anyway); positions that are not a shift of 0..n-1 do not."""
    heads, dk, dv = SHAPES[0]
    layer = build(heads, dk, dv)
    x, seg = jnp.asarray(x_input(), jnp.float32), jnp.asarray(SEG)
    run = nnx.jit(lambda m, x, s, p: m(x, segment_ids=s, positions=p))
    with jax.default_matmul_precision("float32"):
        given = run(layer, x, seg, jnp.asarray(POS))
        derived = nnx.jit(lambda m, x, s: m(x, segment_ids=s))(layer, x, seg)
        running = run(layer, x, seg, jnp.broadcast_to(jnp.arange(T), (2, T)))
        unrotated = run(layer, x, seg, jnp.zeros((2, T), jnp.int32))
    np.testing.assert_allclose(np.asarray(derived), np.asarray(given), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(running), np.asarray(given), rtol=1e-4, atol=1e-5)
    assert rel_err(unrotated, given) > 1e-2


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-4), (jnp.bfloat16, 6e-2)])
def test_float32_and_bfloat16_against_the_f64_oracle(dtype, tol):
    heads, dk, dv = SHAPES[0]
    layer = build(heads, dk, dv, dtype=dtype)
    x = jnp.asarray(x_input(), dtype)
    with jax.default_matmul_precision("float32"):
        y = nnx.jit(lambda m, x, s, p: m(x, segment_ids=s, positions=p))(layer, x, jnp.asarray(SEG), jnp.asarray(POS))
    want, _ = oracle(params64(layer), np.asarray(x.astype(jnp.float32)), SEG, POS, heads)
    assert y.dtype == dtype
    assert rel_err(y, want) < tol


def test_gradients_of_the_xla_op_equal_the_reference_op():
    heads, dk, dv = SHAPES[0]
    x = x_input(seed=3)
    w = np.random.default_rng(5).normal(size=(2, T, D_MODEL))
    grads = {}
    with jax.enable_x64(True):
        for impl in ("xla", "reference"):
            layer = build(heads, dk, dv, dtype=jnp.float64, implementation=impl)
            graphdef, state = nnx.split(layer)

            def loss(state, x):
                y = nnx.merge(graphdef, state)(x, segment_ids=jnp.asarray(SEG), positions=jnp.asarray(POS))
                return jnp.sum(y * w)

            grads[impl] = jax.jit(jax.grad(loss, argnums=(0, 1)))(state, jnp.asarray(x))
        for got, want in zip(jax.tree.leaves(grads["xla"]), jax.tree.leaves(grads["reference"])):
            assert np.max(np.abs(want)) > 0
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-8, atol=1e-10)


# ---------------------------------------------------------------------------------------------------------
# decode, prefill, extend


def test_decode_prefill_and_extend_equal_the_parallel_forward():
    heads, dk, dv = SHAPES[0]
    layer = build(heads, dk, dv)
    x = jnp.asarray(x_input(), jnp.float32)
    seg, pos = jnp.asarray(SEG), jnp.asarray(POS)
    with jax.default_matmul_precision("float32"):
        full = nnx.jit(lambda m, x, s, p: m(x, segment_ids=s, positions=p))(layer, x, seg, pos)
        step = nnx.jit(lambda m, x, c, p: m.decode(x, c, p))
        cache, ys = layer.init_cache(2), []
        for t in range(T):
            y, cache = step(layer, x[:, t:t + 1], cache, pos[:, t])
            ys.append(y)
        np.testing.assert_allclose(np.asarray(jnp.concatenate(ys, 1)), np.asarray(full), rtol=1e-4, atol=1e-5)
        one = nnx.jit(lambda m, x: m(x))(layer, x)
        y0, cache = nnx.jit(lambda m, x: m.prefill(x))(layer, x[:, :20])
        np.testing.assert_allclose(np.asarray(y0), np.asarray(one[:, :20]), rtol=1e-4, atol=1e-5)
        y1, _ = step(layer, x[:, 20:21], cache, jnp.full((2,), 20))
        np.testing.assert_allclose(np.asarray(y1[:, 0]), np.asarray(one[:, 20]), rtol=1e-4, atol=1e-5)
        ext = nnx.jit(lambda m, x, c, p: m.extend(x, c, p))
        c, outs = cache, []
        for s in range(20, T, 5):
            e = min(s + 5, T)
            y, c = ext(layer, x[:, s:e], c, jnp.broadcast_to(jnp.arange(s, e), (2, e - s)))
            outs.append(y)
        np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)), np.asarray(one[:, 20:]), rtol=1e-4,
                                   atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# parameters, options, model


def test_decays_are_the_papers_fixed_constants_and_not_parameters():
    from mixerlab.mixers.retnet import retention_log_decay

    np.testing.assert_allclose(np.exp(retention_log_decay(8)), 1 - 2.0 ** -np.arange(5, 13), rtol=1e-7)
    layer = build(*SHAPES[0])
    assert not list(nnx.to_flat_state(nnx.state(layer, DynamicsParam)))
    names = {str(path[0]) for path, _ in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
    assert names == {"q_proj", "k_proj", "v_proj", "g_proj", "g_norm", "o_proj"}
    plain = build(*SHAPES[0], use_output_gate=False)
    assert not hasattr(plain, "g_proj")
    with pytest.raises(ValueError, match="even model.head_dim"):
        build(2, 7, 8)


def test_model_builds_from_the_config_and_one_train_step_is_finite():
    from mixerlab.models.decoder import build_model
    from mixerlab.training.config import load_config

    cfg = load_config("configs/tiny.yaml", ["model.mixer=retnet", "model.num_layers=1", "model.d_model=32",
                                            "model.num_heads=2", "model.head_dim=16", "model.value_head_dim=32",
                                            "model.ffn_dim=32", "mixers.retnet.chunk_size=8"])
    model = build_model(cfg, vocab_size=31, seed=0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 31, (2, 16)), jnp.int32)

    def loss(m):
        logits = m(tokens[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

    value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
    assert np.isfinite(float(value))
    mixer_grads = [np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(grads, nnx.Param))
                   if "mixer" in str(path)]
    assert mixer_grads and all(np.all(np.isfinite(a)) for a in mixer_grads)
    assert all(np.any(a != 0) for a in mixer_grads)


# ---------------------------------------------------------------------------------------------------------
# FLA itself (torch, CPU, float64)


def test_fla_retention_on_the_same_weights():
    """FLA's layer composed from its CPU references in float64 (its kernels are Triton): q, k through its
    ``rotary_embedding_ref`` with its ``RotaryEmbedding`` frequencies, ``naive_retention``, the swish-gated RMSNorm
    as ``rms_norm_ref``, and its projections holding our weights; one document per row (positions 0..T-1)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("fla")
    MultiScaleRetention = pytest.importorskip("fla.layers.multiscale_retention").MultiScaleRetention
    try:  # fla-core 0.6's layout; 0.5 kept both one level up (by name: either release may be the one here)
        rms_norm_ref = importlib.import_module("fla.modules.norm.layernorm_gated").rms_norm_ref
        rotary_embedding_ref = importlib.import_module("fla.modules.rotary.ops").rotary_embedding_ref
    except ImportError:
        rms_norm_ref = pytest.importorskip("fla.modules.layernorm_gated").rms_norm_ref
        rotary_embedding_ref = pytest.importorskip("fla.modules.rotary").rotary_embedding_ref
    naive_retention = pytest.importorskip("fla.ops.retention.naive").naive_retention

    heads, dk, dv = 2, 8, 16  # FLA's defaults: expand_k = 1, expand_v = 2
    with jax.enable_x64(True):
        layer = build(heads, dk, dv, dtype=jnp.float64, implementation="xla")
        x = x_input()
        ours = np.asarray(layer(jnp.asarray(x)))
    p = params64(layer)
    ref = MultiScaleRetention(hidden_size=D_MODEL, num_heads=heads).double()
    assert (ref.head_k_dim, ref.head_v_dim) == (dk, dv)
    t64 = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    with torch.no_grad():
        for name, w in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv"), ("g_proj", "wg"), ("o_proj", "wo")):
            getattr(ref, name).weight.copy_(t64(p[w].T))
        ref.g_norm_swish_gate.weight.copy_(t64(p["norm_w"]))
        h = t64(x)
        freqs = torch.outer(torch.arange(T, dtype=torch.float64), ref.rotary.inv_freq.double())
        heads_of = lambda a, d: a.reshape(2, T, heads, d)  # noqa: E731  ("b t (h d) -> b t h d")
        q = rotary_embedding_ref(heads_of(ref.q_proj(h), dk), freqs.cos(), freqs.sin())
        k = rotary_embedding_ref(heads_of(ref.k_proj(h), dk), freqs.cos(), freqs.sin())
        v = heads_of(ref.v_proj(h), dv)
        o = naive_retention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        g = heads_of(ref.g_proj(h), dv)
        y = rms_norm_ref(o, ref.g_norm_swish_gate.weight, None, g, eps=ref.g_norm_swish_gate.eps,
                         norm_before_gate=True)
        out = ref.o_proj(y.reshape(2, T, heads * dv))
    assert rel_err(ours, out.numpy()) < F64_TOL


# ---------------------------------------------------------------------------------------------------------
# TPU compiles through libtpu (no TPU needed)


@pytest.mark.tpu_compile
# make test compiles for v5p (mamba2 for v6e, gla/hgrn2 for v5e; the delta rule kernels for all three in
# test_delta_rule_pallas_tpu); v5e and v6e are extended
@pytest.mark.parametrize("gen", [pytest.param("v5e", marks=pytest.mark.extended),
                                 pytest.param("v6e", marks=pytest.mark.extended), "v5p"])
def test_compiles_forward_and_backward_for_tpu(gen):
    """Forward + backward traced under the topology's mesh: "auto" picks the delta rule's Pallas TPU kernels."""
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    try:
        devices = topologies.get_topology_desc(TOPOLOGIES[gen], "tpu").devices
    except Exception as err:  # noqa: BLE001 - no libtpu on this machine
        pytest.skip(f"libtpu topology {gen} unavailable: {err}")
    mesh = Mesh(np.array(devices[:1]), ("x",))
    rep = NamedSharding(mesh, P())
    t = 256
    spec = MixerSpec(d_model=256, num_heads=2, head_dim=128, value_head_dim=256, layer_index=0, num_layers=2,
                     dtype=jnp.bfloat16)
    graphdef, state = nnx.split(registry.build("retnet", spec, rngs=nnx.Rngs(0)))

    def fwd_bwd(state, x, seg, pos):
        def loss(state, x):
            y = nnx.merge(graphdef, state)(x, segment_ids=seg, positions=pos)
            return jnp.sum(y.astype(jnp.float32) ** 2)
        return jax.value_and_grad(loss, argnums=(0, 1))(state, x)

    sd = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep)  # noqa: E731
    rows = jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=rep)
    specs = (jax.tree.map(sd, state), jax.ShapeDtypeStruct((1, t, 256), jnp.bfloat16, sharding=rep), rows, rows)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        text = jax.jit(fwd_bwd).lower(*specs).compile().as_text()
    assert "delta_rule_fwd" in text and "delta_rule_bwd" in text
