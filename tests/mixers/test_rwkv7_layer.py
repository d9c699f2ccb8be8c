"""The RWKV-7 layer (mixers/rwkv7.py): the whole block against a float64 numpy restatement of fla's
``RWKV7Attention`` written here (token by token), against fla's own reference functions (behind importorskip),
op-path gradients (reference vs xla), f32/bf16, packed documents, decode/prefill, the config route and a TPU
compile."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mixerlab import mixers  # noqa: F401  (registers every mixer)
from mixerlab.mixers import registry
from mixerlab.mixers.base import MixerSpec

D = 32
CHUNKING = dict(chunk_size=16, leaf_size=8)
SEG = np.repeat([[3, 5, 3], [1, 1, 1]], [11, 9, 17], axis=1)  # row 0: id 3 reused after id 5 (three documents)


def build(dk=16, dv=16, heads=2, dtype=jnp.float32, seed=0, layer_index=1, **overrides):
    spec = MixerSpec(d_model=D, num_heads=heads, head_dim=dk, value_head_dim=dv, layer_index=layer_index,
                     num_layers=3, dtype=dtype)
    options = registry.get("rwkv7").options(**{**CHUNKING, **overrides})
    layer = registry.build("rwkv7", spec, options, rngs=nnx.Rngs(seed))
    # move every parameter off its init (LoRA down-projections start at zero) so every path is exercised
    key = jax.random.key(seed + 7)
    for path, var in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
        key, sub = jax.random.split(key)
        var[...] = var[...] + 0.3 * jax.random.normal(sub, var[...].shape, var[...].dtype)
    return layer


def forward(layer, x, seg=None):
    """The layer's parallel forward, compiled once (eagerly every op of the chunked form compiles on its own)."""
    return nnx.jit(lambda m, x, s: m(x, segment_ids=s))(layer, x, seg)


def params64(layer) -> dict:
    return {".".join(map(str, path)): np.asarray(v[...], np.float64)
            for path, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))}


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def numpy_rwkv7(p, x, seg, heads, dk, dv, norm_eps=1e-5):
    """fla's RWKV7Attention (no value residual) in float64, one token at a time, per document: returns (y, the
    final state of each row's last document [B, H, K, V])."""
    x = np.asarray(x, np.float64)
    b, t, _ = x.shape
    y = np.zeros_like(x)
    finals = np.zeros((b, heads, dk, dv))
    for row in range(b):
        state, prev = np.zeros((heads, dk, dv)), np.zeros(D)
        for i in range(t):
            if i > 0 and seg[row, i] != seg[row, i - 1]:
                state, prev = np.zeros((heads, dk, dv)), np.zeros(D)
            xt = x[row, i]
            delta = prev - xt
            prev = xt
            xs = {s: xt + delta * p[f"mu_{s}"] for s in "rwkvag"}
            r = (xs["r"] @ p["r_proj.kernel"]).reshape(heads, dk)
            k = xs["k"] @ p["k_proj.kernel"]
            v = (xs["v"] @ p["v_proj.kernel"]).reshape(heads, dv)
            w = -0.6065306597126334 * sigmoid(np.tanh(xs["w"] @ p["w_lora.down.kernel"]) @ p["w_lora.up.kernel"]
                                              + p["w_lora.bias"])
            a = sigmoid(xs["a"] @ p["a_lora.down.kernel"] @ p["a_lora.up.kernel"] + p["a_lora.bias"])
            g = sigmoid(xs["g"] @ p["g_lora.down.kernel"]) @ p["g_lora.up.kernel"]
            kk = (k * p["k_k"]).reshape(heads, dk)
            kk = kk / np.maximum(np.linalg.norm(kk, axis=-1, keepdims=True), 1e-12)
            k = (k + k * (a - 1) * p["k_a"]).reshape(heads, dk)
            w, a = w.reshape(heads, dk), a.reshape(heads, dk)
            # fla dplr: S ← S·exp(w) + kᵀv + βᵀ(α S_old), α = −κ̂, β = κ̂⊙a;  o = r S
            read = np.einsum("hk,hkv->hv", -kk, state)
            state = state * np.exp(w)[..., None] + k[..., None] * v[:, None, :] + (kk * a)[..., None] * read[:, None]
            o = np.einsum("hk,hkv->hv", r, state)
            mean = o.mean(-1, keepdims=True)
            var = ((o - mean) ** 2).mean(-1, keepdims=True)
            o = (o - mean) / np.sqrt(var + dk * norm_eps)
            o = o * p["norm_scale"].reshape(heads, dv) + p["norm_bias"].reshape(heads, dv)
            o = (o + (r * k * p["r_k"]).sum(-1, keepdims=True) * v).reshape(-1) * g
            y[row, i] = o @ p["o_proj.kernel"]
        finals[row] = state
    return y, finals


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def x_input(b, t, seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(100 + seed), (b, t, D), jnp.float32).astype(dtype)


# ---- float64 oracle ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dk, dv, heads", [(16, 16, 2), (8, 12, 4)])
def test_layer_matches_float64_oracle_over_packed_documents(dk, dv, heads):
    """T = 37 (odd, three chunks of 16), three documents in row 0 with a reused id: outputs and final state."""
    with jax.enable_x64(True):
        layer = build(dk, dv, heads, dtype=jnp.float64)
        x = x_input(2, 37, dtype=jnp.float64)
        seg = jnp.asarray(SEG)
        y, cache = nnx.jit(lambda m, x, s: m.prefill(x, segment_ids=s))(layer, x, seg)
        want_y, want_state = numpy_rwkv7(params64(layer), x, SEG, heads, dk, dv)
        assert rel_err(y, want_y) < 1e-9
        assert rel_err(cache["state"], want_state) < 1e-5  # the cache is float32
        assert np.array_equal(np.asarray(cache["shift"]), np.asarray(x[:, -1]))


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 6e-2)])
def test_low_precision_against_float64_oracle(dtype, tol):
    """f32: 1e-4 relative to max |y| (float32 projections and state); bf16 activations (float32 parameters and
    state): 6e-2 (bf16 rounding of every projection input and output, ≈ 2^-8 each)."""
    layer = build(dtype=dtype)
    x = x_input(2, 37, dtype=dtype)
    y = forward(layer, x, jnp.asarray(SEG))
    assert y.dtype == dtype
    want, _ = numpy_rwkv7(params64(layer), np.asarray(x.astype(jnp.float32)), SEG, 2, 16, 16)
    assert rel_err(y.astype(jnp.float32), want) < tol


@pytest.mark.parametrize("implementation", ["xla", "auto"])
def test_op_path_gradients_against_the_token_scan(implementation):
    """Every parameter's gradient and the input's, the chunked op ("xla"; "auto" = the delta-rule op on token
    pairs) vs the token scan, float64."""
    with jax.enable_x64(True):
        x = x_input(2, 21, seed=1, dtype=jnp.float64)
        seg = jnp.asarray(SEG[:, :21])

        def grads(implementation):
            layer = build(dtype=jnp.float64, implementation=implementation)
            loss = lambda m, x: jnp.sum(jnp.sin(m(x, segment_ids=seg)))  # noqa: E731
            return nnx.jit(nnx.grad(loss, argnums=(0, 1)))(layer, x)

        (want_p, want_x), (got_p, got_x) = grads("reference"), grads(implementation)
        assert rel_err(got_x, want_x) < 1e-9
        for (path, g), (_, w) in zip(nnx.to_flat_state(got_p), nnx.to_flat_state(want_p)):
            assert rel_err(g[...], w[...]) < 1e-9, path


# ---- fla's own functions -------------------------------------------------------------------------------------


def test_matches_fla_reference_functions():
    """The block composed from fla's CPU reference pieces (token_shift_ref, torch_addcmul_rwkv7, k_update_ref,
    naive dplr_recurrence, gate_output_correction_ref, torch GroupNorm) with our weights, float32."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("fla")
    from fla.modules.token_shift import token_shift_ref
    from fla.ops.generalized_delta_rule.dplr.naive import dplr_recurrence
    from fla.ops.rwkv7.fused_addcmul import torch_addcmul_rwkv7
    from fla.ops.rwkv7.fused_k_update import k_update_ref
    from fla.ops.rwkv7.gate_output_correction import gate_output_correction_ref

    heads, dk = 2, 16
    layer = build(dk, dk, heads)
    p = {n: torch.tensor(v, dtype=torch.float32) for n, v in params64(layer).items()}
    x = x_input(1, 29, seed=3)
    xt = torch.tensor(np.asarray(x))
    delta = token_shift_ref(xt)
    xr, xw, xk, xv, xa, xg = torch_addcmul_rwkv7(xt, delta, *(p[f"mu_{s}"] for s in "rwkvag"))
    r = xr @ p["r_proj.kernel"]
    w = -0.6065306597126334 * torch.sigmoid(torch.tanh(xw @ p["w_lora.down.kernel"]) @ p["w_lora.up.kernel"]
                                            + p["w_lora.bias"])
    k, v = xk @ p["k_proj.kernel"], xv @ p["v_proj.kernel"]
    a = torch.sigmoid(xa @ p["a_lora.down.kernel"] @ p["a_lora.up.kernel"] + p["a_lora.bias"])
    g = torch.sigmoid(xg @ p["g_lora.down.kernel"]) @ p["g_lora.up.kernel"]
    heads_of = lambda z: z.reshape(1, 29, heads, dk)  # noqa: E731
    kk = torch.nn.functional.normalize(heads_of(k * p["k_k"]), dim=-1, p=2.0)
    k = k_update_ref(k, a, p["k_a"])
    r, w, k, a, v = map(heads_of, (r, w, k, a, v))
    bhtd = lambda z: z.transpose(1, 2)  # noqa: E731
    o, _ = dplr_recurrence(bhtd(r) * dk ** 0.5, bhtd(k), bhtd(v), bhtd(-kk), bhtd(kk * a), bhtd(w))
    norm = torch.nn.GroupNorm(heads, heads * dk, eps=dk * 1e-5)
    norm.weight.data, norm.bias.data = p["norm_scale"], p["norm_bias"]
    o = norm(bhtd(o).reshape(29, heads * dk)).reshape(1, 29, heads * dk)
    want = gate_output_correction_ref(o, r, k, p["r_k"], v, g) @ p["o_proj.kernel"]
    y = forward(layer, x)
    assert rel_err(y, want.detach().numpy()) < 1e-4


# ---- decode, prefill, packing ----------------------------------------------------------------------------------


def test_decode_and_prefill_equal_the_parallel_forward():
    """Token-by-token decode over a row whose second document starts at position 0 (state and token shift
    reset), and prefill of 9 tokens then decode, both equal the packed parallel forward."""
    layer = build()
    seg = jnp.asarray(np.repeat([[1, 2], [4, 4]], [7, 12], axis=1))
    pos = jnp.asarray(np.concatenate([np.arange(7), np.arange(12)])[None].repeat(2, 0))
    pos = pos.at[1].set(jnp.arange(19))
    x = x_input(2, 19, seed=2)
    y = forward(layer, x, seg)
    decode = nnx.jit(lambda m, x, c, p: m.decode(x, c, p))
    cache, outs = layer.init_cache(2), []
    for t in range(19):
        y_t, cache = decode(layer, x[:, t:t + 1], cache, pos[:, t])
        outs.append(y_t)
    assert rel_err(jnp.concatenate(outs, 1), y) < 1e-5
    y0, cache = nnx.jit(lambda m, x, s: m.prefill(x, segment_ids=s))(layer, x[:, :9], seg[:, :9])
    outs = [y0]
    for t in range(9, 19):
        y_t, cache = decode(layer, x[:, t:t + 1], cache, pos[:, t])
        outs.append(y_t)
    assert rel_err(jnp.concatenate(outs, 1), y) < 1e-5


def test_token_shift_resets_at_a_reused_id():
    """Changing the token just before a document start (same id reused) leaves that document's outputs alone."""
    layer = build()
    seg = jnp.asarray(np.repeat([[0, 1, 0]], [6, 5, 8], axis=1))
    x = x_input(1, 19, seed=5)
    y, y2 = forward(layer, x, seg), forward(layer, x.at[:, 10].add(3.0), seg)
    assert rel_err(y2[:, 11:], y[:, 11:]) < 1e-6 and rel_err(y2[:, 10:11], y[:, 10:11]) > 1e-3


def test_value_residual_is_refused():
    with pytest.raises(ValueError, match="value_residual=true is not supported: .*v_first"):
        build(value_residual=True)


def test_fla_default_ranks_and_init():
    spec = MixerSpec(d_model=1024, num_heads=16, head_dim=64, value_head_dim=64, layer_index=0, num_layers=8)
    layer = jax.eval_shape(lambda: registry.build("rwkv7", spec, rngs=nnx.Rngs(0)))  # abstract: no big init
    assert layer.w_lora.down.kernel.shape == (1024, 64)  # max(32, round(2.5)·32), Python rounds 2.5 to 2 [FLA]
    assert layer.a_lora.down.kernel.shape == (1024, 64)
    assert layer.g_lora.down.kernel.shape == (1024, 160)  # round(5·32/32)·32 = 160
    small = registry.build("rwkv7", MixerSpec(d_model=D, num_heads=2, head_dim=16, value_head_dim=16,
                                              layer_index=0, num_layers=3), rngs=nnx.Rngs(0))
    assert float(jnp.abs(small.w_lora.down.kernel[...]).max()) == 0.0  # LoRA down zero-init [FLA]
    assert np.allclose(small.k_a[...], 1.02) and np.allclose(small.r_k[...], -0.04)


# ---- the model through the config, and a TPU compile ---------------------------------------------------------


def test_tiny_model_through_config_one_finite_train_step():
    import optax

    from mixerlab.models.decoder import build_model
    from mixerlab.training.config import load_config

    cfg = load_config("configs/tiny.yaml", ["model.mixer=rwkv7", "model.num_layers=2", "model.d_model=32",
                                           "model.num_heads=2", "model.ffn_dim=64",
                                           "mixers.rwkv7.chunk_size=16", "mixers.rwkv7.leaf_size=8"])
    model = build_model(cfg, vocab_size=61, seed=0)
    tokens = jax.random.randint(jax.random.key(0), (2, 24), 0, 61)

    def loss(m):
        logits = m(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()

    step = nnx.jit(nnx.value_and_grad(loss))
    value, grads = step(model)
    leaves = [g[...] for _, g in nnx.to_flat_state(grads)]
    assert np.isfinite(float(value)) and all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert any(float(jnp.abs(g).max()) > 0 for g in leaves)
    # one plain gradient step lowers the loss on the same batch
    nnx.update(model, jax.tree.map(lambda p, g: p - 0.05 * g, nnx.state(model, nnx.Param), grads))
    after, _ = step(model)
    assert np.isfinite(float(after)) and float(after) < float(value)


@pytest.mark.tpu_compile
# make test compiles for v5p (the cheapest); v5e and v6e are extended (test_dplr_delta_pairs compiles the op alone)
@pytest.mark.parametrize("gen", [pytest.param("v5e", marks=pytest.mark.extended),
                                 pytest.param("v6e", marks=pytest.mark.extended), "v5p"])
def test_layer_forward_backward_compiles_for_tpu(gen):
    """The layer's forward + backward (bf16 activations) for a TPU topology, traced under its mesh as the trainer
    traces: "auto" runs the DPLR op as delta-rule token pairs on the delta-rule Pallas TPU kernel (Mosaic calls in
    the program), at the op's default chunking."""
    import os
    import sys

    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pallas_kernels")
    if here not in sys.path:  # the topology helper of the kernel tests (its folder's conftest does the same)
        sys.path.insert(0, here)
    from tpu_topologies import one_device_mesh, replicated

    rep = replicated(gen)
    layer = build(dk=64, dv=64, heads=2, dtype=jnp.bfloat16, chunk_size=0, leaf_size=0)
    graphdef, state = nnx.split(layer)

    def loss(state, x, seg):
        return jnp.sum(nnx.merge(graphdef, state)(x, segment_ids=seg).astype(jnp.float32) ** 2)

    specs = (jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), state),
             jax.ShapeDtypeStruct((1, 256, D), jnp.bfloat16, sharding=rep),
             jax.ShapeDtypeStruct((1, 256), jnp.int32, sharding=rep))
    with jax.sharding.use_abstract_mesh(one_device_mesh(gen).abstract_mesh):
        lowered = jax.jit(jax.grad(loss)).trace(*specs).lower()
    assert lowered.as_text().count("tpu_custom_call") >= 2
    assert lowered.compile() is not None
