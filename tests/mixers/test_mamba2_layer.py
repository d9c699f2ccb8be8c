"""The Mamba-2 mixer (mixers/mamba2.py) against float64 re-statements of its block:

* the paper's recurrence token by token (numpy, float64): h_t = exp(dt_t A) h_{t-1} + dt_t B_t^T x_t,
  y_t = C_t h_t + D x_t, with the conv over [x, B, C], the gated group RMSNorm and the projections around it;
* FLA's chunked SSD formulation (``Mamba2.torch_forward``: segment sums, diagonal and off-diagonal blocks) restated
  in numpy, and FLA's own layer run on CPU in float64 with the same weights (behind importorskip);
* float32 / bfloat16 against the float64 oracle, gradients of the op path ("xla" against "reference"), packed
  documents with a reused id, decode / prefill / extend against the parallel forward, a train step through the
  config, and TPU compiles through libtpu.
Tolerances: float64 1e-9 (relative to the output's largest entry), float32 2e-4, bfloat16 6e-2.
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

from mixerlab import mixers, pallas_kernels  # noqa: E402,F401  (mixers: registers every mixer)
from mixerlab.mixers import registry  # noqa: E402
from mixerlab.mixers.base import DynamicsParam, MixerSpec  # noqa: E402

D_MODEL, T = 16, 37
CHUNKING = dict(chunk_size=8, leaf_size=4)
SEG = np.array([[1] * 9 + [2] * 13 + [1] * 15, [3] * T], np.int32)  # a reused id: three documents in row 0
# (heads, state N = model.head_dim, head width P = model.value_head_dim, groups)
SHAPES = [(4, 8, 16, 2), (2, 16, 8, 1)]
TOPOLOGIES = {"v5e": "v5e:2x2", "v6e": "v6e:2x2", "v5p": "v5p:2x2x1"}


def build(heads, n, p, groups=1, dtype=jnp.float32, seed=0, **opts):
    spec = MixerSpec(d_model=D_MODEL, num_heads=heads, head_dim=n, value_head_dim=p, layer_index=0, num_layers=2,
                     dtype=dtype)
    layer = registry.build("mamba2", spec, registry.get("mamba2").options(n_groups=groups, **{**CHUNKING, **opts}),
                           rngs=nnx.Rngs(seed))
    # move the unit / zero inits so that D, the conv bias and the norm scale are seen by the checks
    rng = np.random.default_rng(seed + 7)
    layer.D[...] = jnp.asarray(rng.uniform(0.5, 1.5, layer.D[...].shape), jnp.float32)
    layer.conv_bias[...] = jnp.asarray(rng.normal(0, 0.3, layer.conv_bias[...].shape), jnp.float32)
    layer.norm_scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, layer.norm_scale[...].shape), jnp.float32)
    layer.in_proj.kernel[...] = layer.in_proj.kernel[...] * 10  # N(0, 0.2): larger dt, B, C, so the state matters
    return layer


def params64(layer) -> dict:
    f = lambda a: np.asarray(a[...], np.float64)  # noqa: E731
    return dict(w_in=f(layer.in_proj.kernel), conv_w=f(layer.conv.kernel), conv_b=f(layer.conv_bias),
                a_log=f(layer.A_log), dt_bias=f(layer.dt_bias), d=f(layer.D), norm_w=f(layer.norm_scale),
                w_out=f(layer.out_proj.kernel))


def x_input(b=2, t=T, seed=0):
    return np.random.default_rng(100 + seed).normal(size=(b, t, D_MODEL))


def documents(seg):
    return np.concatenate([np.zeros((seg.shape[0], 1), int), np.cumsum(seg[:, 1:] != seg[:, :-1], axis=1)], axis=1)


def silu(x):
    return x / (1.0 + np.exp(-x))


def softplus(x):
    return np.logaddexp(0.0, x)


def block_inputs(p, x, seg, heads, n, pdim, groups):
    """Projection, conv (within documents) + bias + SiLU, split, dt: the SSM's inputs (float64)."""
    inner = heads * pdim
    conv_dim = inner + 2 * groups * n
    proj = x @ p["w_in"]
    z, xbc, dt_raw = proj[..., :inner], proj[..., inner:inner + conv_dim], proj[..., inner + conv_dim:]
    doc = documents(seg)
    k = p["conv_w"].shape[0]
    conv = np.zeros_like(xbc)
    for t in range(x.shape[1]):
        for i in range(k):
            if t - i >= 0:
                conv[:, t] += p["conv_w"][k - 1 - i] * xbc[:, t - i] * (doc[:, t - i] == doc[:, t])[:, None]
    xbc = silu(conv + p["conv_b"])
    xs = xbc[..., :inner].reshape(*x.shape[:2], heads, pdim)
    bm = xbc[..., inner:inner + groups * n].reshape(*x.shape[:2], groups, n)
    cm = xbc[..., inner + groups * n:].reshape(*x.shape[:2], groups, n)
    dt = softplus(dt_raw + p["dt_bias"])
    return z, xs, bm, cm, dt, doc


def block_output(p, y, xs, z, groups, eps=1e-5):
    """y [B,T,H,P] from the SSM -> + D x, gated group RMSNorm (RMSNorm(y * SiLU(z)) * w), out projection."""
    y = y + p["d"][:, None] * xs
    y = y.reshape(*y.shape[:2], -1) * silu(z)
    yg = y.reshape(*y.shape[:2], groups, -1)
    yg = yg / np.sqrt(np.mean(yg ** 2, axis=-1, keepdims=True) + eps)
    return (yg.reshape(y.shape) * p["norm_w"]) @ p["w_out"]


def oracle(p, x, seg, heads, n, pdim, groups):
    """The paper's recurrence, token by token (head h reads group h // (H/G)); returns (out, final states)."""
    z, xs, bm, cm, dt, doc = block_inputs(p, x, seg, heads, n, pdim, groups)
    a = -np.exp(p["a_log"])
    y = np.zeros_like(xs)
    final = np.zeros((x.shape[0], heads, n, pdim))
    for b in range(x.shape[0]):
        s = np.zeros((heads, n, pdim))
        for t in range(x.shape[1]):
            if t and doc[b, t] != doc[b, t - 1]:
                s = np.zeros_like(s)
            for h in range(heads):
                g = h // (heads // groups)
                s[h] = np.exp(dt[b, t, h] * a[h]) * s[h] + np.outer(bm[b, t, g], dt[b, t, h] * xs[b, t, h])
                y[b, t, h] = cm[b, t, g] @ s[h]
        final[b] = s
    return block_output(p, y, xs, z, groups), final


def fla_ssd_chunked(p, x, heads, n, pdim, groups, chunk):
    """FLA's ``Mamba2.torch_forward`` SSD (one document per row): chunks, ``segment_sum``, diagonal blocks
    Y_diag, chunk states, the inter-chunk recurrence and Y_off, restated in numpy (groups broadcast by h // (H/G))."""
    seg = np.ones(x.shape[:2], np.int32)
    z, xs, bm, cm, dt, _ = block_inputs(p, x, seg, heads, n, pdim, groups)
    bsz, t = x.shape[:2]
    bm, cm = np.repeat(bm, heads // groups, axis=2), np.repeat(cm, heads // groups, axis=2)
    a = -np.exp(p["a_log"]) * dt  # [B, T, H]
    xd = xs * dt[..., None]
    pad = -t % chunk
    padt = lambda v: np.pad(v, [(0, 0), (0, pad)] + [(0, 0)] * (v.ndim - 2))  # noqa: E731
    chunks = lambda v: padt(v).reshape(bsz, -1, chunk, *v.shape[2:])  # noqa: E731
    xd, a, bm, cm = chunks(xd), chunks(a), chunks(bm), chunks(cm)
    a = a.transpose(0, 3, 1, 2)  # [B, H, nc, c]
    a_cum = np.cumsum(a, axis=-1)

    def segment_sum(v):  # [..., c] -> [..., c, c]: sum_{j < k <= i} v_k, -inf above the diagonal
        c = v.shape[-1]
        out = np.cumsum(v, -1)[..., :, None] - np.cumsum(v, -1)[..., None, :]
        return np.where(np.tril(np.ones((c, c), bool)), out, -np.inf)

    ell = np.exp(segment_sum(a))  # [B, H, nc, l, s]
    y_diag = np.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", cm, bm, ell, xd)
    decay_states = np.exp(a_cum[..., -1:] - a_cum)
    states = np.einsum("bclhn,bhcl,bclhp->bchpn", bm, decay_states, xd)
    states = np.concatenate([np.zeros_like(states[:, :1]), states], axis=1)
    decay_chunk = np.exp(segment_sum(np.pad(a_cum[..., -1], [(0, 0), (0, 0), (1, 0)])))  # [B, H, nc+1, nc+1]
    new_states = np.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)
    states = new_states[:, :-1]
    y_off = np.einsum("bclhn,bchpn,bhcl->bclhp", cm, states, np.exp(a_cum))
    y = (y_diag + y_off).reshape(bsz, -1, heads, pdim)[:, :t]
    return block_output(p, y, xs, z, groups)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


# ---------------------------------------------------------------------------------------------------------
# float64 oracles


@pytest.mark.parametrize("heads, n, pdim, groups", SHAPES)
def test_forward_and_final_state_match_the_f64_recurrence(heads, n, pdim, groups):
    """T = 37 over packed documents (a reused id), float64: outputs and the prefill state of each row's last
    document against the token-by-token recurrence."""
    with jax.enable_x64(True):
        layer = build(heads, n, pdim, groups, dtype=jnp.float64, implementation="xla")
        x = x_input()
        y, cache = layer.prefill(jnp.asarray(x), segment_ids=jnp.asarray(SEG))
        want, final = oracle(params64(layer), x, SEG, heads, n, pdim, groups)
        assert rel_err(y, want) < 1e-9
        assert rel_err(cache["state"], final) < 1e-9


def test_the_fla_chunked_ssd_formulation_in_numpy():
    """FLA's chunked SSD (chunks of 8 over T = 37) equals the token recurrence, and the layer equals both."""
    heads, n, pdim, groups = SHAPES[0]
    with jax.enable_x64(True):
        layer = build(heads, n, pdim, groups, dtype=jnp.float64, implementation="xla")
        x = x_input()
        p = params64(layer)
        chunked = fla_ssd_chunked(p, x, heads, n, pdim, groups, chunk=8)
        recurrent, _ = oracle(p, x, np.ones(x.shape[:2], np.int32), heads, n, pdim, groups)
        assert rel_err(chunked, recurrent) < 1e-10
        assert rel_err(layer(jnp.asarray(x)), chunked) < 1e-9


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-4), (jnp.bfloat16, 6e-2)])
def test_float32_and_bfloat16_against_the_f64_oracle(dtype, tol):
    heads, n, pdim, groups = SHAPES[0]
    layer = build(heads, n, pdim, groups, dtype=dtype)
    x = x_input()
    with jax.default_matmul_precision("float32"):
        y = nnx.jit(lambda m, x, s: m(x, segment_ids=s))(layer, jnp.asarray(x, dtype), jnp.asarray(SEG))
    want, _ = oracle(params64(layer), np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)), SEG, heads, n, pdim,
                     groups)
    assert y.dtype == dtype
    assert rel_err(y, want) < tol


def test_gradients_of_the_xla_op_equal_the_reference_op():
    """d(loss)/d(every parameter) and d/dx in float64 with the op's "xla" (chunked) and "reference" paths."""
    heads, n, pdim, groups = SHAPES[0]
    x = x_input(seed=3)
    w = np.random.default_rng(5).normal(size=(2, T, D_MODEL))
    grads = {}
    with jax.enable_x64(True):
        for impl in ("xla", "reference"):
            layer = build(heads, n, pdim, groups, dtype=jnp.float64, implementation=impl)
            graphdef, state = nnx.split(layer)

            def loss(state, x):
                return jnp.sum(nnx.merge(graphdef, state)(x, segment_ids=jnp.asarray(SEG)) * w)

            grads[impl] = jax.jit(jax.grad(loss, argnums=(0, 1)))(state, jnp.asarray(x))
        leaves = zip(jax.tree.leaves(grads["xla"]), jax.tree.leaves(grads["reference"]))
        for got, want in leaves:
            assert np.max(np.abs(want)) > 0
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-8, atol=1e-10)


# ---------------------------------------------------------------------------------------------------------
# decode, prefill, extend


def test_decode_prefill_and_extend_equal_the_parallel_forward():
    """Decode token by token over packed documents (a new document at position 0 resets the cache); prefill of
    a prefix then decode; extend by chunks of 5 from the prefill cache."""
    heads, n, pdim, groups = SHAPES[0]
    layer = build(heads, n, pdim, groups)
    x = jnp.asarray(x_input(), jnp.float32)
    seg = jnp.asarray(SEG)
    pos = jnp.asarray(np.concatenate([np.arange(9), np.arange(13), np.arange(15)])[None].repeat(2, 0))
    pos = pos.at[1].set(jnp.arange(T))
    with jax.default_matmul_precision("float32"):
        full = nnx.jit(lambda m, x, s: m(x, segment_ids=s))(layer, x, seg)
        step = nnx.jit(lambda m, x, c, p: m.decode(x, c, p))
        cache, ys = layer.init_cache(2), []
        for t in range(T):
            y, cache = step(layer, x[:, t:t + 1], cache, pos[:, t])
            ys.append(y)
        np.testing.assert_allclose(np.asarray(jnp.concatenate(ys, 1)), np.asarray(full), rtol=1e-4, atol=1e-5)
        # one document per row from here: prefill 20, then decode and extend the rest
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


def test_inits_follow_fla_and_dynamics_are_not_decayed():
    spec = MixerSpec(d_model=64, num_heads=32, head_dim=16, value_head_dim=4, layer_index=0, num_layers=2)
    layer = registry.build("mamba2", spec, rngs=nnx.Rngs(0))
    a = np.exp(np.asarray(layer.A_log[...]))
    dt = np.asarray(jax.nn.softplus(layer.dt_bias[...]))
    assert a.min() >= 1.0 and a.max() <= 16.0 and a.max() - a.min() > 5
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
    assert np.all(np.asarray(layer.D[...]) == 1.0) and np.all(np.asarray(layer.conv_bias[...]) == 0.0)
    for name in ("A_log", "dt_bias", "D"):
        assert isinstance(getattr(layer, name), DynamicsParam), name
    # W_in: z, x (H·P each), B, C (G·N each), dt (H)
    assert layer.in_proj.kernel[...].shape == (64, 2 * 32 * 4 + 2 * 16 + 32)
    assert layer.out_proj.kernel[...].shape == (32 * 4, 64)


def test_without_the_conv_bias_the_layer_equals_a_zero_bias():
    """``use_conv_bias=False`` holds no bias and equals the default layer at its zero-bias init (same seed)."""
    spec = MixerSpec(d_model=D_MODEL, num_heads=4, head_dim=8, value_head_dim=16, layer_index=0, num_layers=2)
    options = registry.get("mamba2").options
    plain = registry.build("mamba2", spec, options(use_conv_bias=False, **CHUNKING), rngs=nnx.Rngs(0))
    biased = registry.build("mamba2", spec, options(**CHUNKING), rngs=nnx.Rngs(0))
    assert plain.conv_bias is None and "conv_bias" not in str(nnx.to_flat_state(nnx.state(plain, nnx.Param)))
    x = jnp.asarray(x_input(t=8), jnp.float32)
    np.testing.assert_array_equal(np.asarray(plain(x)), np.asarray(biased(x)))


def test_options_are_checked():
    with pytest.raises(ValueError, match="mixers.mamba2.n_groups=3 must divide model.num_heads=4"):
        build(4, 8, 16, groups=3)
    with pytest.raises(ValueError, match="mixers.mamba2.dt_min"):
        registry.get("mamba2").options(dt_min=0.2, dt_max=0.1)


def test_model_builds_from_the_config_and_one_train_step_is_finite():
    from mixerlab.models.decoder import build_model
    from mixerlab.training.config import load_config

    cfg = load_config("configs/tiny.yaml", ["model.mixer=mamba2", "model.num_layers=1", "model.d_model=32",
                                            "model.num_heads=2", "model.head_dim=16", "model.value_head_dim=32",
                                            "model.ffn_dim=32", "mixers.mamba2.chunk_size=8"])
    model = build_model(cfg, vocab_size=31, seed=0)
    assert model.blocks[0].mixer.inner == 64  # expand 2
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 31, (2, 16)), jnp.int32)

    def loss(m):
        logits = m(tokens[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

    value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
    assert np.isfinite(float(value))
    g = nnx.state(grads, nnx.Param)
    mixer_grads = [np.asarray(v[...]) for _, v in nnx.to_flat_state(g) if "mixer" in str(_)]
    assert mixer_grads and all(np.all(np.isfinite(a)) for a in mixer_grads)
    assert all(np.any(a != 0) for a in mixer_grads)


# ---------------------------------------------------------------------------------------------------------
# FLA itself (torch, CPU, float64)


def _fla_mamba2(torch, layer, heads, n, pdim, groups):
    """FLA's ``Mamba2`` layer in float64 holding ``layer``'s weights; its gated norm through ``rms_norm_ref`` and its
    SiLU through torch (the Triton kernels have no CPU path)."""
    try:  # fla-core 0.6 moved the gated norm into fla.modules.norm (by name: either release may be the one here)
        rms_norm_ref = importlib.import_module("fla.modules.norm.layernorm_gated").rms_norm_ref
    except ImportError:
        rms_norm_ref = pytest.importorskip("fla.modules.layernorm_gated").rms_norm_ref
    p = params64(layer)
    fla_mamba2 = pytest.importorskip("fla.layers.mamba2").Mamba2
    ref = fla_mamba2(num_heads=heads, head_dim=pdim, hidden_size=D_MODEL, state_size=n, expand=heads * pdim / D_MODEL,
                     n_groups=groups, chunk_size=8, backend="triton").double()
    t64 = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    with torch.no_grad():
        ref.in_proj.weight.copy_(t64(p["w_in"].T))
        ref.conv1d.weight.copy_(t64(p["conv_w"].T[:, None, :]))
        ref.conv1d.bias.copy_(t64(p["conv_b"]))
        ref.A_log.copy_(t64(p["a_log"]))
        ref.dt_bias.copy_(t64(p["dt_bias"]))
        ref.D.copy_(t64(p["d"]))
        ref.norm.weight.copy_(t64(p["norm_w"]))
        ref.out_proj.weight.copy_(t64(p["w_out"].T))
    ref.act = torch.nn.functional.silu
    norm = ref.norm
    norm.forward = lambda y, z: rms_norm_ref(y, norm.weight, None, z, eps=norm.eps, group_size=norm.group_size,
                                             norm_before_gate=norm.norm_before_gate)
    return ref


def test_fla_mamba2_layer_on_the_same_weights():
    """FLA's ``Mamba2.torch_forward`` prefill (float64) with our weights, one group (FLA's prefill tiles groups over
    heads, h mod G, unlike its decode path and Mamba-2's kernels, h // (H/G): the next test covers groups); and the
    op's output and final state against FLA's ``naive_recurrent_simple_gla`` on the same q = C, k = B, v = dt·x,
    g = dt·A."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("fla")
    heads, n, pdim = 4, 8, 8
    with jax.enable_x64(True):
        layer = build(heads, n, pdim, 1, dtype=jnp.float64, implementation="xla")
        x = x_input()
        ours = np.asarray(layer(jnp.asarray(x)))
    ref = _fla_mamba2(torch, layer, heads, n, pdim, 1)
    with torch.no_grad():
        out, _, _ = ref.torch_forward(torch.from_numpy(x))
    assert rel_err(ours, out.numpy()) < 1e-6  # FLA takes A = -exp(A_log.float()) in float32: 1.4e-7 seen
    # the core alone: FLA's naive simple-GLA recurrence (scalar decay per head) on the op's inputs, scale 1
    naive = pytest.importorskip("fla.ops.simple_gla.naive").naive_recurrent_simple_gla
    with jax.enable_x64(True):
        z, xbc, dt_raw = layer._project(jnp.asarray(x))
        q, k, v, lam, _ = layer._op_inputs(layer._conv_act(layer.conv(xbc)), dt_raw)
        core, state = pallas_kernels.ssd(q, k, v, log_decay=lam, chunk_size=8, leaf_size=4, implementation="xla")
    t = lambda a: torch.from_numpy(np.asarray(a))  # noqa: E731
    per_head = lambda a: t(np.repeat(np.asarray(a), heads // a.shape[2], axis=2))  # noqa: E731 - group h // (H/G)
    o_ref, s_ref = naive(per_head(q), per_head(k), t(v), t(lam), scale=1.0, output_final_state=True)
    # the naive function computes in float32 (``.float()``): 1.6e-7 seen
    assert rel_err(core, o_ref.numpy()) < 1e-5 and rel_err(state, s_ref.numpy()) < 1e-5


def test_fla_mamba2_decode_path_with_two_groups():
    """FLA's ``torch_forward`` decode path (one token at a time from its conv and SSM caches), 4 heads in 2 groups,
    T = 12, against our parallel forward: the group broadcast h // (H/G) and the caches' layout."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("fla")
    heads, n, pdim, groups, t = 4, 8, 8, 2, 12
    with jax.enable_x64(True):
        layer = build(heads, n, pdim, groups, dtype=jnp.float64, implementation="xla")
        x = x_input(t=t)
        ours = np.asarray(layer(jnp.asarray(x)))
    ref = _fla_mamba2(torch, layer, heads, n, pdim, groups)
    state = {"conv_state": torch.zeros(2, layer.conv_dim, 4, dtype=torch.float64),
             "recurrent_state": torch.zeros(2, heads, pdim, n, dtype=torch.float64)}
    outs = []
    with torch.no_grad():
        for i in range(t):
            out, conv, ssm = ref.torch_forward(torch.from_numpy(x[:, i:i + 1]), last_state=state)
            state = {"conv_state": conv, "recurrent_state": ssm}
            outs.append(out.numpy())
    assert rel_err(ours, np.concatenate(outs, axis=1)) < 1e-6


# ---------------------------------------------------------------------------------------------------------
# TPU compiles through libtpu (no TPU needed)


def one_device_mesh(gen):
    """One device of a libtpu topology of ``gen`` (tests/pallas_kernels/tpu_topologies.py's shapes); skips where
    libtpu cannot describe it."""
    from jax.experimental import topologies
    from jax.sharding import Mesh

    try:
        devices = topologies.get_topology_desc(TOPOLOGIES[gen], "tpu").devices
    except Exception as err:  # noqa: BLE001 - no libtpu on this machine
        pytest.skip(f"libtpu topology {gen} unavailable: {err}")
    return Mesh(np.array(devices[:1]), ("x",))


def _compile_layer(gen, dtype=jnp.bfloat16, t=256):
    """The layer's forward + backward traced under the topology's mesh ("auto" picks the TPU kernels)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = one_device_mesh(gen)
    rep = NamedSharding(mesh, P())
    spec = MixerSpec(d_model=256, num_heads=4, head_dim=128, value_head_dim=128, layer_index=0, num_layers=2,
                     dtype=dtype)
    layer = registry.build("mamba2", spec, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)

    def fwd_bwd(state, x, seg):
        def loss(state, x):
            return jnp.sum(nnx.merge(graphdef, state)(x, segment_ids=seg).astype(jnp.float32) ** 2)
        return jax.value_and_grad(loss, argnums=(0, 1))(state, x)

    sd = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep)  # noqa: E731
    specs = (jax.tree.map(sd, state), jax.ShapeDtypeStruct((1, t, 256), dtype, sharding=rep),
             jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=rep))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return jax.jit(fwd_bwd).lower(*specs).compile().as_text()


@pytest.mark.tpu_compile
# make test compiles for v6e (the gla and hgrn2 layers for v5e, retnet for v5p; the delta rule kernels
# for all three in test_delta_rule_pallas_tpu); v5e and v5p are extended
@pytest.mark.parametrize("gen", [pytest.param("v5e", marks=pytest.mark.extended), "v6e",
                                 pytest.param("v5p", marks=pytest.mark.extended)])
def test_compiles_forward_and_backward_for_tpu(gen):
    text = _compile_layer(gen)
    assert "delta_rule_fwd" in text and "delta_rule_bwd" in text  # the Pallas TPU kernels, not the XLA fallback
