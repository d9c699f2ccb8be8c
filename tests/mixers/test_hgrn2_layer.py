"""HGRN2 (mixers/hgrn2.py): the whole layer against a float64 token-by-token restatement of FLA's HGRN2 layer with
its lower bound, gradients of the op path, f32/bf16 accuracy, decode/prefill/extend against the parallel forward,
FLA's naive GLA recurrence (FLA runs HGRN2 through chunk_gla), a train step through the config, the TPU compile."""
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
    one_train_step, op_on_layer_inputs, packed_segments, params64, prefill, rms_norm, spec, x_input)
from mixerlab.mixers.base import DynamicsParam  # noqa: E402
from mixerlab.mixers.hgrn2 import HGRN2Options, forget_log  # noqa: E402

pytestmark = pytest.mark.xdist_group("gla_hgrn2_layers")
T = 37
DIMS = [(2, 16, 32), (4, 8, 8)]  # (H, d_k = FLA's expand_ratio, d_v)
# Float64 layer: all float64 but the output RMSNorm (float32 by design, mixers/gated_norm.py): ~1e-7 against the
# oracle; the recurrence on the layer's own op inputs to 1e-12.
LAYER_TOL, OP_TOL = 2e-6, 1e-12


def make(H=2, Dk=16, Dv=32, dtype=jnp.float32, seed=0, layer_index=1, num_layers=2, **options):
    """An HGRN2 layer (layer 1 of 2: lower bound 1/2 at init) with its learned bound moved off its init."""
    layer = build("hgrn2", spec(H, Dk, Dv, layer_index=layer_index, num_layers=num_layers, dtype=dtype), seed=seed,
                  **options)
    if hasattr(layer, "lower_bound_logit"):
        theta = layer.lower_bound_logit
        theta[...] = theta[...] + jax.random.normal(jax.random.key(seed + 7), theta[...].shape, jnp.float32)
    return layer


def oracle(p, x, seg, H, Dk, Dv, *, bound=None, eps=1e-6):
    """FLA's HGRN2 layer (no short conv) in numpy float64: q = swish(x W_q), g = logsigmoid(x W_f) raised to the
    lower bound gamma (g = logaddexp(log gamma, log(1 − gamma) + g)), k = 1 − exp(g), v = x W_i; scale d_k^-1/2;
    one RMSNorm over all H·d_v channels; W_o. ``bound``: gamma per channel [H d_k], or None."""
    x = np.asarray(x, np.float64)
    B, T_ = x.shape[:2]
    heads = lambda a, d: a.reshape(B, T_, H, d)  # noqa: E731
    q, f, i = (x @ p[f"{n}_proj.kernel"] for n in "qkv")
    q = q / (1.0 + np.exp(-q))
    g = log_sigmoid(f)
    if bound is not None:
        g = np.logaddexp(np.log(bound), np.log1p(-bound) + g)
    k = 1.0 - np.exp(g)
    o, state = naive_recurrence(heads(q, Dk) * Dk ** -0.5, heads(k, Dk), heads(i, Dv), heads(g, Dk), seg)
    y = rms_norm(o.reshape(B, T_, H * Dv), p["o_norm.scale"], eps)
    return y @ p["o_proj.kernel"], state


def learned_bound(p):
    return 1.0 / (1.0 + np.exp(-p["lower_bound_logit"]))


@pytest.mark.parametrize("dims", DIMS)
def test_forward_and_final_state_match_the_float64_oracle(dims):
    """Float64 layer (packed documents, id reused; learned lower bound) == the token-by-token restatement:
    outputs and final state; the op on the layer's own inputs == the naive no-erase recurrence."""
    H, Dk, Dv = dims
    seg, _ = packed_segments(T)
    with jax.enable_x64(True):
        layer = make(H, Dk, Dv, dtype=jnp.float64)
        x = x_input(2, T).astype(jnp.float64)
        y, cache = prefill(layer, x, seg)
        p = params64(layer)
        y_ref, s_ref = oracle(p, x, seg, H, Dk, Dv, bound=learned_bound(p))
        assert y.dtype == jnp.float64
        assert max_rel_err(y, y_ref) < LAYER_TOL
        assert max_rel_err(cache["state"], s_ref) < LAYER_TOL
        f, (o, state) = op_on_layer_inputs(layer, x, seg)
        o_ref, s_ref = naive_recurrence(f.q, f.k, f.v, f.log_decay, seg)
        assert max_rel_err(o, o_ref) < OP_TOL and max_rel_err(state, s_ref) < OP_TOL


@pytest.mark.parametrize("mode", ["fixed", "none"])
def test_lower_bound_modes_reach_the_oracle(mode):
    """"fixed": gamma = l/L (here 3/4 in layer 3 of 4), no parameter; "none": no bound."""
    seg, _ = packed_segments(T)
    with jax.enable_x64(True):
        layer = make(dtype=jnp.float64, layer_index=3, num_layers=4, lower_bound=mode)
        assert not nnx.state(layer, DynamicsParam)
        x = x_input(2, T, seed=1).astype(jnp.float64)
        bound = np.full(32, 0.75) if mode == "fixed" else None
        y_ref, _ = oracle(params64(layer), x, seg, 2, 16, 32, bound=bound)
        assert max_rel_err(forward(layer, x, seg), y_ref) < LAYER_TOL


def test_lower_bound_init_follows_fla_hgrn2model():
    """gamma_l = l/L at init (FLA: cumsum of a uniform softmax over layers minus its first entry); layer 0 has no
    bound and no parameter; "learned" at init gives the same layer as "fixed"."""
    L = 4
    for li in range(L):
        layer = build("hgrn2", spec(layer_index=li, num_layers=L))
        if li == 0:
            assert not hasattr(layer, "lower_bound_logit")
            continue
        gamma = 1.0 / (1.0 + np.exp(-np.asarray(layer.lower_bound_logit[...], np.float64)))
        np.testing.assert_allclose(gamma, np.full(32, li / L), rtol=1e-6)
        assert isinstance(layer.lower_bound_logit, DynamicsParam)
    x = x_input(1, 9)
    learned = build("hgrn2", spec(layer_index=2, num_layers=L))
    fixed = build("hgrn2", spec(layer_index=2, num_layers=L), lower_bound="fixed")
    np.testing.assert_allclose(np.asarray(forward(learned, x)), np.asarray(forward(fixed, x)), rtol=1e-5,
                               atol=1e-7)


def test_forget_gate_is_bounded_below():
    """f = gamma + (1 − gamma) sigmoid(z) >= gamma however negative z is; k = 1 − f."""
    z = jnp.array([-80.0, -5.0, 0.0, 5.0])
    theta = jnp.log(0.3 / 0.7)
    f = np.exp(np.asarray(forget_log(z, theta), np.float64))
    np.testing.assert_allclose(f, 0.3 + 0.7 / (1 + np.exp(-np.asarray(z, np.float64))), rtol=1e-6)
    assert f.min() >= 0.3 - 1e-7
    np.testing.assert_allclose(np.asarray(forget_log(z, None)), log_sigmoid(np.asarray(z, np.float64)), rtol=1e-6)


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
        assert len(flat[0]) == len(flat[1]) == 7  # W_q, W_f, W_i, W_o, lower-bound logit, omega; x
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
    p = params64(layer)
    y_ref, _ = oracle(p, np.asarray(x.astype(dtype).astype(jnp.float32)), seg, 2, 16, 32, bound=learned_bound(p))
    assert max_rel_err(y.astype(jnp.float32), y_ref) < tol


@pytest.mark.parametrize("options", [{}, dict(use_short_conv=True)])
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
    """FLA's HGRN2 layer formulation in torch float64 (swish q, the lower bound in log space, k = 1 − exp(g)),
    through FLA's naive_recurrent_gla (its own d_k^-1/2 scale), then FLA's RMSNorm and W_o, == the float64
    layer; final states equal too."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("fla")
    from fla.ops.gla.naive import naive_recurrent_gla

    F = torch.nn.functional
    H, Dk, Dv = 2, 16, 32
    with jax.enable_x64(True):
        layer = make(H, Dk, Dv, dtype=jnp.float64)
        x = x_input(2, T, seed=4).astype(jnp.float64)
        y, cache = prefill(layer, x, None)
    p = {n: torch.tensor(a) for n, a in params64(layer).items()}
    xt = torch.tensor(np.asarray(x))
    lower_bound = torch.sigmoid(p["lower_bound_logit"])
    q = F.silu(xt @ p["q_proj.kernel"])
    g = F.logsigmoid(xt @ p["k_proj.kernel"])
    g = torch.logaddexp(lower_bound.log(), torch.log1p(-lower_bound) + g)  # as fla/layers/hgrn2.py
    k = 1 - g.exp()
    heads = lambda a, d: a.reshape(2, T, H, d)  # noqa: E731
    o, h = naive_recurrent_gla(heads(q, Dk), heads(k, Dk), heads(xt @ p["v_proj.kernel"], Dv), heads(g, Dk),
                               output_final_state=True)
    o = o.reshape(2, T, H * Dv)
    y_fla = (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * p["o_norm.scale"]) @ p["o_proj.kernel"]
    assert max_rel_err(y, y_fla.numpy()) < LAYER_TOL
    assert max_rel_err(cache["state"], h.numpy()) < LAYER_TOL


def test_defaults_and_parameters_follow_fla():
    """FLA's defaults (no short conv, learned lower bound); W_q, W_f: d -> H d_k, W_i: d -> H d_v, one RMSNorm
    scale over all H d_v channels, no output gate."""
    o = HGRN2Options()
    assert (o.lower_bound, o.use_short_conv, o.norm_eps) == ("learned", False, 1e-6)
    shapes = {n: a.shape for n, a in params64(build("hgrn2", spec(2, 16, 32))).items()}
    assert shapes == {"q_proj.kernel": (64, 32), "k_proj.kernel": (64, 32), "v_proj.kernel": (64, 64),
                      "lower_bound_logit": (32,), "o_norm.scale": (64,), "o_proj.kernel": (64, 64)}
    with pytest.raises(ValueError, match="mixers.hgrn2.lower_bound must be"):
        HGRN2Options(lower_bound="softmax")


@pytest.mark.slow  # the tiny trainer's step compile: ~20 s on a shared 2-core CPU
def test_one_train_step_through_the_config(tmp_path):
    """`model.mixer=hgrn2` with tiny dims builds (2 layers: layer 1 has a learned bound) and takes a finite step."""
    loss, grad_norm = one_train_step(tmp_path, "hgrn2", "model.num_layers=2")
    assert np.isfinite(loss) and np.isfinite(grad_norm) and grad_norm > 0


@pytest.mark.tpu_compile
# make test compiles for v5e; v6e and v5p are extended (the delta rule kernels' own compiles cover every generation)
@pytest.mark.parametrize("gen", ["v5e", pytest.param("v6e", marks=pytest.mark.extended),
                                 pytest.param("v5p", marks=pytest.mark.extended)])
def test_tpu_compile_forward_and_backward(gen):
    """bf16, FLA's head layout at d = 256 (2 heads of d_k = d_v = 128): "auto" takes the Pallas TPU kernels."""
    text = compile_layer_for_tpu(gen, "hgrn2", spec(2, 128, 128, dtype=jnp.bfloat16, d=256))
    assert "delta_rule_fwd" in text and "delta_rule_bwd" in text
