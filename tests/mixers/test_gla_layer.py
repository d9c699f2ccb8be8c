"""GLA (mixers/gla.py): the whole layer against a float64 token-by-token restatement of FLA's GLA layer, gradients
of the op path, f32/bf16 accuracy, decode/prefill/extend against the parallel forward, FLA's own naive recurrence,
a train step through the config, and the TPU compile."""
from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gated_linear_checks import (  # noqa: E402
    build, compile_layer_for_tpu, decode_all, extend, forward, log_sigmoid, max_rel_err, naive_recurrence,
    one_train_step, op_on_layer_inputs, packed_segments, params64, prefill, rms_norm, silu, spec, x_input)
from mixerlab.mixers.base import DynamicsParam  # noqa: E402
from mixerlab.mixers.gla import GLAOptions, gla_log_decay  # noqa: E402

pytestmark = pytest.mark.xdist_group("gla_hgrn2_layers")
T = 37
DIMS = [(2, 16, 32), (4, 8, 8)]  # (H, d_k, d_v)


def make(H=2, Dk=16, Dv=32, dtype=jnp.float32, seed=0, **options):
    """A GLA layer with its gate bias moved off its zero init, so that every term of the gate is exercised."""
    layer = build("gla", spec(H, Dk, Dv, dtype=dtype), seed=seed, **options)
    bias = layer.gk_proj.bias
    bias[...] = 2.0 * jax.random.normal(jax.random.key(seed + 7), bias[...].shape, jnp.float32)
    return layer


def oracle(p, x, seg, H, Dk, Dv, *, normalizer=16.0, clamp_min=0.0, eps=1e-6, output_gate=True):
    """FLA's GLA layer (no short conv, no feature map) in numpy float64 from the layer's parameters."""
    x = np.asarray(x, np.float64)
    B, T_ = x.shape[:2]
    heads = lambda a, d: a.reshape(B, T_, H, d)  # noqa: E731
    q, k, v = (x @ p[f"{n}_proj.kernel"] for n in "qkv")
    gk = x @ p["gk_proj.down.kernel"] @ p["gk_proj.up.kernel"] + p["gk_proj.bias"]
    lam = log_sigmoid(gk) / normalizer
    if clamp_min < 0:
        lam = np.maximum(lam, clamp_min)
    o, state = naive_recurrence(heads(q, Dk) * Dk ** -0.5, heads(k, Dk), heads(v, Dv), heads(lam, Dk), seg)
    y = rms_norm(o, p["o_norm.scale"], eps)
    if output_gate:
        y = y * silu(heads(x @ p["g_proj.kernel"], Dv))
    return y.reshape(B, T_, H * Dv) @ p["o_proj.kernel"], state


# The float64 layer computes in float64 except its low-rank gate projection and output RMSNorm, which stay float32
# by design (mixers/gates.py LowRank, mixers/gated_norm.py): the whole layer agrees with the oracle to ~1e-7, the
# recurrence on the layer's own op inputs to 1e-12.
LAYER_TOL, OP_TOL = 2e-6, 1e-12


@pytest.mark.parametrize("dims", DIMS)
def test_forward_and_final_state_match_the_float64_oracle(dims):
    """Float64 layer (packed documents, id reused) == the token-by-token restatement: outputs and final state."""
    H, Dk, Dv = dims
    seg, _ = packed_segments(T)
    with jax.enable_x64(True):
        layer = make(H, Dk, Dv, dtype=jnp.float64)
        x = x_input(2, T).astype(jnp.float64)
        y, cache = prefill(layer, x, seg)
        y_ref, s_ref = oracle(params64(layer), x, seg, H, Dk, Dv)
        assert y.dtype == jnp.float64
        assert max_rel_err(y, y_ref) < LAYER_TOL
        assert max_rel_err(cache["state"], s_ref) < LAYER_TOL
        # the op on the layer's own (q̂, k̂, v̂, λ): the naive no-erase recurrence, output and state
        f, (o, state) = op_on_layer_inputs(layer, x, seg)
        o_ref, s_ref = naive_recurrence(f.q, f.k, f.v, f.log_decay, seg)
        assert max_rel_err(o, o_ref) < OP_TOL and max_rel_err(state, s_ref) < OP_TOL


def test_options_reach_the_oracle():
    """clamp_min, the normaliser and the plain-RMSNorm output (no gate) are the layer's, at float64 (LAYER_TOL)."""
    opts = dict(clamp_min=-0.02, gate_logit_normalizer=4.0, use_output_gate=False, norm_eps=1e-5)
    seg, _ = packed_segments(T)
    with jax.enable_x64(True):
        layer = make(dtype=jnp.float64, **opts)
        assert not hasattr(layer, "g_proj")
        x = x_input(2, T, seed=1).astype(jnp.float64)
        y_ref, _ = oracle(params64(layer), x, seg, 2, 16, 32, normalizer=4.0, clamp_min=-0.02, eps=1e-5,
                          output_gate=False)
        assert max_rel_err(forward(layer, x, seg), y_ref) < LAYER_TOL


def test_gradients_of_the_op_path_match_the_reference():
    """d(loss)/d(parameters, x) through the chunked op ("xla") == through the f64 reference recurrence."""
    seg, _ = packed_segments(T)
    with jax.enable_x64(True):
        x = x_input(2, T).astype(jnp.float64)
        w = jax.random.normal(jax.random.key(5), (2, T, 64), jnp.float64)
        grads = []
        for impl in ("xla", "reference"):
            layer = make(dtype=jnp.float64, implementation=impl)
            graphdef, params = nnx.split(layer)

            def loss(params, x):
                return jnp.sum(nnx.merge(graphdef, params)(x, segment_ids=seg) * w)

            grads.append(jax.grad(loss, argnums=(0, 1))(params, x))
        flat = [jax.tree.leaves(g) for g in grads]
        assert len(flat[0]) == len(flat[1]) == 10  # W_q, W_k, W_v, W_g, W_o, gate down/up/bias, omega; x
        for a, b in zip(*flat):
            assert max_rel_err(a, b) < 1e-9


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 4e-2)])
def test_float32_and_bfloat16_against_the_oracle(dtype, tol):
    """Max error relative to the output's largest entry: float32 < 1e-4, bfloat16 activations < 4e-2."""
    seg, _ = packed_segments(T)
    layer = make(dtype=dtype)
    x = x_input(2, T, seed=2)
    y = forward(layer, x.astype(dtype), seg)
    assert y.dtype == dtype
    y_ref, _ = oracle(params64(layer), np.asarray(x.astype(dtype).astype(jnp.float32)), seg, 2, 16, 32)
    assert max_rel_err(y.astype(jnp.float32), y_ref) < tol


@pytest.mark.parametrize("options", [{}, dict(use_short_conv=True, use_output_gate=False, clamp_min=-0.05)])
def test_decode_prefill_and_extend_equal_the_parallel_forward(options):
    """Token-by-token decode over packed documents (positions restart at each) == the packed forward; prefill of
    a prefix then decode, and prefill then one extend of the rest, == the forward of the whole row."""
    layer = make(**options)
    seg, pos = packed_segments(T)
    x = x_input(2, T, seed=3)
    y = forward(layer, x, seg)
    y_dec, _ = decode_all(layer, x, pos)
    np.testing.assert_allclose(np.asarray(y_dec), np.asarray(y), rtol=1e-4, atol=1e-6)
    one = jnp.ones((2, T), jnp.int32)
    y1 = forward(layer, x, one)
    y_pre, cache = prefill(layer, x[:, :20], one[:, :20])
    np.testing.assert_allclose(np.asarray(y_pre), np.asarray(y1[:, :20]), rtol=1e-4, atol=1e-6)
    positions = jnp.broadcast_to(jnp.arange(20, T, dtype=jnp.int32), (2, T - 20))
    y_rest, _ = decode_all(layer, x[:, 20:], positions, cache)
    np.testing.assert_allclose(np.asarray(y_rest), np.asarray(y1[:, 20:]), rtol=1e-4, atol=1e-6)
    y_ext, _ = extend(layer, x[:, 20:], cache, positions)
    np.testing.assert_allclose(np.asarray(y_ext), np.asarray(y1[:, 20:]), rtol=1e-4, atol=1e-6)


def test_matches_fla_naive_recurrent_gla():
    """FLA's naive_recurrent_gla on FLA's inputs (q, k, v, gk = logsigmoid(.)/16, its own d_k^-1/2 scale), then
    FLA's norm-gate-projection in torch float64, == the float64 layer; final states equal too."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("fla")
    from fla.ops.gla.naive import naive_recurrent_gla

    H, Dk, Dv = 2, 16, 32
    with jax.enable_x64(True):
        layer = make(H, Dk, Dv, dtype=jnp.float64)
        x = x_input(2, T, seed=4).astype(jnp.float64)
        y, cache = prefill(layer, x, None)
    p = {n: torch.tensor(a) for n, a in params64(layer).items()}
    xt = torch.tensor(np.asarray(x))
    heads = lambda a, d: a.reshape(2, T, H, d)  # noqa: E731
    q, k, v = (heads(xt @ p[f"{n}_proj.kernel"], d) for n, d in (("q", Dk), ("k", Dk), ("v", Dv)))
    gk = torch.nn.functional.logsigmoid(xt @ p["gk_proj.down.kernel"] @ p["gk_proj.up.kernel"] + p["gk_proj.bias"])
    o, h = naive_recurrent_gla(q, k, v, heads(gk / 16, Dk), output_final_state=True)
    g = heads(xt @ p["g_proj.kernel"], Dv)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * p["o_norm.scale"] * torch.nn.functional.silu(g)
    y_fla = o.reshape(2, T, H * Dv) @ p["o_proj.kernel"]
    assert max_rel_err(y, y_fla.numpy()) < LAYER_TOL
    assert max_rel_err(cache["state"], h.numpy()) < LAYER_TOL


def test_defaults_and_parameters_follow_fla():
    """FLA's defaults: rank-16 gate with a zero-init bias (a DynamicsParam), normaliser 16, no clamp, no short
    conv, swish output gate; parameter shapes at d_k != d_v."""
    o = GLAOptions()
    assert (o.gate_low_rank_dim, o.gate_logit_normalizer, o.clamp_min, o.use_short_conv, o.use_output_gate) == (
        16, 16.0, 0.0, False, True)
    layer = build("gla", spec(2, 16, 32))
    p = params64(layer)
    shapes = {n: a.shape for n, a in p.items()}
    assert shapes == {"q_proj.kernel": (64, 32), "k_proj.kernel": (64, 32), "v_proj.kernel": (64, 64),
                      "g_proj.kernel": (64, 64), "gk_proj.down.kernel": (64, 16), "gk_proj.up.kernel": (16, 32),
                      "gk_proj.bias": (32,), "o_norm.scale": (32,), "o_proj.kernel": (64, 64)}
    assert not np.any(p["gk_proj.bias"])
    dyn = [".".join(map(str, k)) for k, _ in nnx.to_flat_state(nnx.state(layer, DynamicsParam))]
    assert dyn == ["gk_proj.bias"]


def test_log_decay_and_option_errors():
    z = jnp.array([-50.0, -3.0, 0.0, 4.0])
    lam = gla_log_decay(z, 16.0, 0.0)
    np.testing.assert_allclose(np.asarray(lam), log_sigmoid(np.asarray(z, np.float64)) / 16, rtol=1e-6)
    clamped = gla_log_decay(z, 16.0, -0.1)
    np.testing.assert_allclose(np.asarray(clamped), np.maximum(np.asarray(lam), -0.1), rtol=1e-6)
    with pytest.raises(ValueError, match="mixers.gla.clamp_min must be <= 0"):
        GLAOptions(clamp_min=0.5)
    with pytest.raises(ValueError, match="mixers.gla.gate_logit_normalizer"):
        GLAOptions(gate_logit_normalizer=0.0)


@pytest.mark.slow  # the tiny trainer's step compile: ~20 s on a shared 2-core CPU
def test_one_train_step_through_the_config(tmp_path):
    """`model.mixer=gla` with tiny dims (fla's layout: d_k = d/(2H), d_v = d/H) builds and takes a finite step."""
    loss, grad_norm = one_train_step(tmp_path, "gla", "model.head_dim=16", "model.value_head_dim=32")
    assert np.isfinite(loss) and np.isfinite(grad_norm) and grad_norm > 0


@pytest.mark.tpu_compile
# make test compiles for v5e; v6e and v5p are extended (the delta rule kernels' own compiles cover every generation)
@pytest.mark.parametrize("gen", ["v5e", pytest.param("v6e", marks=pytest.mark.extended),
                                 pytest.param("v5p", marks=pytest.mark.extended)])
def test_tpu_compile_forward_and_backward(gen):
    """bf16, FLA's head layout at d = 256 (2 heads, d_k 64, d_v 128): "auto" takes the Pallas TPU kernels."""
    text = compile_layer_for_tpu(gen, "gla", spec(2, 64, 128, dtype=jnp.bfloat16, d=256))
    assert "delta_rule_fwd" in text and "delta_rule_bwd" in text
