"""The static-decay Toeplitz form of the interdomain and S4D ops (pallas_kernels/interdomain/toeplitz.py)
against the float64 token reference: outputs, final states and all gradients, packed documents, odd T, several
chunk sizes and head dims, float32 over the whole log-modulus range, bf16 inputs; and its dispatch."""
from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from interdomain_cases import both_ops_loss, op_call, NAMES, _inputs, _loss, _reference, _weights
from tpu_topologies import TOPOLOGIES, replicated
from mixerlab.pallas_kernels.interdomain import api as ia
from mixerlab.pallas_kernels.interdomain import toeplitz


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def _op(impl, chunk, document):
    def fn(q, k, v, log_modulus, phase, gain, readout, key0, value0):
        o, s = ia.interdomain(q, k, v, log_modulus=log_modulus[0, 0], phase=phase, input_gain=gain,
                              readout=readout, initial_state=ia.InterdomainState(key0, value0),
                              segment_ids=document, implementation=impl, chunk_size=chunk)
        return o, s.key, s.value
    return fn


def _run(args, document, weights, chunk, dtype):
    """Outputs, states and the gradients of all nine inputs through the Toeplitz form. ``_loss`` broadcasts the
    static log-modulus [H, M] to [B, T, H, M] (as for the reference); ``_op`` hands the op one [H, M] slice of
    it, whose cotangent the broadcast's transpose sums back into the [H, M] gradient."""
    shape = (*args[0].shape[:3], args[4].shape[-1])
    loss = _loss(_op("toeplitz", chunk, document), [jnp.asarray(w, dtype) for w in weights], shape)
    grad = jax.jit(jax.grad(loss, argnums=tuple(range(9)), has_aux=True))
    grads, outs = grad(*(jnp.asarray(a, dtype) for a in args))
    return outs, grads


# B, T, H, R, Dv, M; T odd and a multiple of none of the chunk sizes; documents start inside and at chunk edges
# and the chunk sizes (1: every token a chunk; 64 > T: one partial chunk)
CASES = [((2, 37, 2, 5, 3, 6), (1, 8, 64)), ((1, 45, 3, 16, 8, 4), (16,))]


@pytest.mark.parametrize("shape,chunks", CASES)
def test_float64_outputs_states_and_gradients_equal_the_reference(shape, chunks):
    """Measured (2026-12-02): ≤ 1.5e-15 relative (max-abs) for outputs,
    states and all nine gradients."""
    b, t, h, r, dv, m = shape
    args, document = _inputs(1, b, t, h, r, dv, m, boundaries=(0, 7, 16, 30), selective=False)
    weights = _weights(2, b, t, h, r, dv, m)
    want_outs, want_grads = _reference(args, document, weights)
    for chunk in chunks:
        with jax.enable_x64(True):
            outs, grads = _run(args, document, weights, chunk, jnp.float64)
        for name, got, want in zip(("o", "key", "value"), outs, want_outs):
            assert got.dtype == jnp.float64
            assert _rel(got, want) <= 1e-12, (chunk, name)
        for name, got, want in zip(NAMES, grads, want_grads):
            assert _rel(got, want) <= 1e-12, (chunk, name)


def test_chunk_states_by_gemm_equal_the_serial_scan():
    """Pass (ii) as transfer-matrix GEMMs (up to MAX_GEMM_CHUNKS chunks) and as the serial scan beyond: the same
    outputs and final states (float64, documents starting inside chunks and at a chunk edge, an initial state)."""
    args, document = _inputs(9, 2, 61, 2, 4, 3, 5, boundaries=(0, 8, 19, 40), selective=False)
    with jax.enable_x64(True):
        x = [jnp.asarray(a) for a in args]
        runs = [toeplitz.interdomain_toeplitz(*x, document, chunk_size=4, max_gemm_chunks=limit)
                for limit in (toeplitz.MAX_GEMM_CHUNKS, 0)]
    for got, want in zip(*runs):
        assert _rel(got, want) <= 1e-12


def test_float64_without_documents_or_initial_state():
    with jax.enable_x64(True):
        args, _ = _inputs(3, 2, 70, 2, 8, 8, 4, selective=False)
        x = [jnp.asarray(a) for a in args]
        kw = dict(log_modulus=x[3], phase=x[4], input_gain=x[5], readout=x[6])
        o_ref, s_ref = ia.interdomain(*x[:3], **kw, implementation="reference")
        o, s = ia.interdomain(*x[:3], **kw, implementation="toeplitz", chunk_size=32)
    assert _rel(o, o_ref) <= 1e-12 and _rel(s.key, s_ref.key) <= 1e-12 and _rel(s.value, s_ref.value) <= 1e-12


def test_float32_over_the_whole_log_modulus_range():
    """Static r ~ −U[low, high] per head and mode for [low, high] = [0, 20], [5.2, 5.6] (where the old
    factorised sub-chunks lost accuracy) and [50, 100]; float32 against the float64 reference, T = 75 (a full
    and a partial chunk of 64), documents, an initial state. The decays are exp(lag · r): one rounding, no
    difference of sums. Measured (2026-12-02), max-abs relative: outputs ≤ 1.4e-7, states ≤ 7.8e-8, gradients
    ≤ 6.0e-7; at r ≤ −50 every decay past one token underflows and the gradients of r and θ are O(e^r)."""
    b, t, h, r, dv, m = 2, 75, 2, 5, 3, 6
    weights = _weights(5, b, t, h, r, dv, m)
    for low, high in ((0.0, 20.0), (5.2, 5.6), (50.0, 100.0)):
        args, document = _inputs(4, b, t, h, r, dv, m, boundaries=(0, 30, 50), selective=False,
                                 log_modulus=(low, high))
        want_outs, want_grads = _reference(args, document, weights)
        outs, grads = _run(args, document, weights, 64, jnp.float32)
        for name, got, want in zip(("o", "key", "value"), outs, want_outs):
            assert got.dtype == jnp.float32
            assert _rel(got, want) <= 1e-4, (low, name)
        for name, got, want in zip(NAMES, grads, want_grads):
            got = np.asarray(got, np.float64)
            assert np.isfinite(got).all(), (low, name)
            assert np.max(np.abs(got - want)) <= 1e-4 * np.max(np.abs(want)) + 1e-30, (low, name)


def test_float32_no_overflow_for_any_nonpositive_log_modulus():
    """r from −1e30 to 0: every exponent lag · r is finite or −inf-free (lag ≤ 63), the decays underflow to 0."""
    args, document = _inputs(6, 1, 75, 2, 5, 3, 6, boundaries=(0, 40), selective=False)
    args[3] = -(10.0 ** np.random.default_rng(6).uniform(-3.0, 30.0, args[3].shape))
    with jax.enable_x64(True):
        x = [jnp.asarray(a) for a in args]
        o64, s64 = ia.interdomain(*x[:3], log_modulus=x[3], phase=x[4], input_gain=x[5], readout=x[6],
                                  initial_state=ia.InterdomainState(x[7], x[8]), segment_ids=document,
                                  implementation="reference")
    x = [jnp.asarray(a, jnp.float32) for a in args]
    o, s = ia.interdomain(*x[:3], log_modulus=x[3], phase=x[4], input_gain=x[5], readout=x[6],
                          initial_state=ia.InterdomainState(x[7], x[8]), segment_ids=document,
                          implementation="toeplitz")
    assert _rel(o, o64) <= 1e-4 and _rel(s.key, s64.key) <= 1e-4 and _rel(s.value, s64.value) <= 1e-4


def test_bfloat16_inputs():
    """bf16 q, k, v against the float64 reference on the same rounded inputs: the data GEMMs run at DEFAULT
    precision (TF32 on a GPU), state and accumulation in float32. Measured (CPU, 2026-12-02), max-abs relative:
    outputs 1.9e-3 (their bf16 rounding), key / value states 2.3e-7 / 3.2e-7."""
    args, document = _inputs(7, 2, 100, 2, 16, 16, 8, boundaries=(0, 33, 64), selective=False)
    args[:3] = [np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64) for a in args[:3]]
    with jax.enable_x64(True):
        x = [jnp.asarray(a) for a in args]
        o64, s64 = ia.interdomain(*x[:3], log_modulus=x[3], phase=x[4], input_gain=x[5], readout=x[6],
                                  segment_ids=document, implementation="reference")
    x = [jnp.asarray(a, jnp.bfloat16 if i < 3 else jnp.float32) for i, a in enumerate(args)]
    o, s = ia.interdomain(*x[:3], log_modulus=x[3], phase=x[4], input_gain=x[5], readout=x[6],
                          segment_ids=document, implementation="toeplitz", chunk_size=32)
    assert o.dtype == jnp.bfloat16 and s.key.dtype == jnp.float32
    assert _rel(o, o64) <= 2e-2 and _rel(s.key, s64.key) <= 1e-3 and _rel(s.value, s64.value) <= 1e-3


def _dot_operand_dtypes(jaxpr, counts=None):
    """{(lhs dtype, rhs dtype): number of dot_generals} in a jaxpr and the jaxprs inside it."""
    counts = collections.Counter() if counts is None else counts
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            counts[tuple(jnp.dtype(v.aval.dtype).name for v in eqn.invars)] += 1
        for value in eqn.params.values():
            for item in value if isinstance(value, (list, tuple)) else (value,):
                sub = getattr(item, "jaxpr", item)
                if hasattr(sub, "eqns"):
                    _dot_operand_dtypes(sub, counts)
    return counts


def test_16bit_operands_with_bfloat16_inputs():
    """"toeplitz_16bit": bf16 q, k, v as the operands of every data GEMM (float32 results), forward and backward,
    against the float64 reference on the same rounded inputs: outputs, states and all nine gradients. Measured (CPU,
    2026-12-08), max-abs relative: outputs 6.3e-3, states 1.4e-3 / 1.6e-3, gradients 2.8e-3 (log-modulus) to
    1.1e-2 (input gain); "toeplitz" on the same inputs 2.2e-3 / 2.3e-7 / 3.2e-7 and ≤ 3.9e-3. Of the gradient's
    matmuls only the chunk-to-chunk state transfer (forward and its two transposes) keeps float32 operands."""
    b, t, h, r, dv, m = 2, 100, 2, 16, 16, 8
    args, document = _inputs(7, b, t, h, r, dv, m, boundaries=(0, 33, 64), selective=False)
    args[:3] = [np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64) for a in args[:3]]
    weights = _weights(2, b, t, h, r, dv, m)
    want_outs, want_grads = _reference(args, document, weights)
    loss = _loss(_op("toeplitz_16bit", 32, document), [jnp.asarray(w, jnp.float32) for w in weights], (b, t, h, m))
    x = [jnp.asarray(a, jnp.bfloat16 if i < 3 else jnp.float32) for i, a in enumerate(args)]
    grad = jax.grad(loss, argnums=tuple(range(9)), has_aux=True)
    grads, outs = jax.jit(grad)(*x)
    assert outs[0].dtype == jnp.bfloat16 and outs[1].dtype == jnp.float32
    for name, got, want in zip(("o", "key", "value"), outs, want_outs):
        assert _rel(got, want) <= 2e-2, name
    for name, got, want in zip(NAMES, grads, want_grads):
        assert got.dtype == x[NAMES.index(name)].dtype and _rel(got, want) <= 2e-2, name
    dots = _dot_operand_dtypes(jax.make_jaxpr(grad)(*x).jaxpr)
    assert dots[("float32", "float32")] == 3 and dots[("bfloat16", "bfloat16")] > 30, dict(dots)
    assert set(dots) == {("float32", "float32"), ("bfloat16", "bfloat16")}, dict(dots)


def test_16bit_operands_with_float32_inputs_are_the_toeplitz_form():
    """For float32 inputs "toeplitz_16bit" runs "toeplitz" itself (the same numbers, bit for bit), and the S4D op's
    "toeplitz_16bit" with bf16 inputs stays within bf16 rounding of the float32 run."""
    args, document = _inputs(3, 2, 41, 2, 8, 8, 4, boundaries=(0, 20), selective=False)
    x = [jnp.asarray(a, jnp.float32) for a in args]
    run = {impl: _op(impl, 16, document)(*x[:3], jnp.broadcast_to(x[3], (2, 41, 2, 4)), *x[4:])
           for impl in ("toeplitz", "toeplitz_16bit")}
    for a, b in zip(run["toeplitz"], run["toeplitz_16bit"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    z = x[2]
    s4d = {dt: ia.s4d(z.astype(dt), log_modulus=x[3], phase=x[4], input_gain=x[5], readout=x[6][:, 0],
                      segment_ids=document, implementation="toeplitz_16bit", chunk_size=16)
           for dt in (jnp.float32, jnp.bfloat16)}
    assert _rel(s4d[jnp.bfloat16][0], s4d[jnp.float32][0]) <= 2e-2
    assert _rel(s4d[jnp.bfloat16][1], s4d[jnp.float32][1]) <= 2e-2


def test_s4d_float64_outputs_state_and_gradients_equal_the_reference():
    b, t, h, c, m = 2, 37, 3, 4, 6
    args, document = _inputs(8, b, t, h, c, c, m, boundaries=(0, 15, 25), selective=False)
    rng = np.random.default_rng(8)
    with jax.enable_x64(True):
        z = jnp.asarray(rng.standard_normal((b, t, h, c)))
        readout = jnp.asarray(rng.standard_normal((h, 2 * m)))
        x0 = jnp.asarray(rng.standard_normal((b, h, 2 * m, c)))
        w = jnp.asarray(rng.standard_normal((b, t, h, c)))
        flat = (z, *(jnp.asarray(a) for a in args[3:6]), readout, x0)

        def grads(impl, chunk=None):
            def loss(*xs):
                o, s = ia.s4d(xs[0], log_modulus=xs[1], phase=xs[2], input_gain=xs[3], readout=xs[4],
                              initial_state=xs[5], segment_ids=document, implementation=impl, chunk_size=chunk)
                return jnp.sum(o * w) + jnp.sum(jnp.sin(s)), (o, s)
            return jax.jit(jax.grad(loss, argnums=tuple(range(6)), has_aux=True))(*flat)

        want_g, want = grads("reference")
        for chunk in (5, 64):
            got_g, got = grads("toeplitz", chunk)
            assert _rel(got[0], want[0]) <= 1e-12 and _rel(got[1], want[1]) <= 1e-12, chunk
            for name, x, y in zip(("z", "log_modulus", "phase", "input_gain", "readout", "state"), got_g, want_g):
                assert _rel(x, y) <= 1e-12, (chunk, name)


# ---------------------------------------------------------------------------------------------------------
# dispatch


def _call(**kw):
    return op_call(**{"backend": "gpu", "selective": False, **kw})


def test_auto_takes_the_toeplitz_form_for_a_static_decay_on_every_backend():
    for backend in ("cpu", "gpu", "tpu"):
        assert ia.TABLE.choose("auto", _call(backend=backend)).name == "toeplitz", backend
        assert ia.S4D_TABLE.choose("auto", _call(op="s4d", key_dim=0, backend=backend)).name == "toeplitz"
    assert ia.TABLE.choose("auto", _call(selective=True, backend="cpu")).name == "xla"
    assert ia.TABLE.choose("auto", _call(selective=True, backend="tpu")).name == "pallas_tpu"
    assert "selective decay" in toeplitz.supports(_call(selective=True))


def test_skew_reindexes_rows_by_lag_and_is_its_own_inverse():
    x = np.tril(np.random.default_rng(0).standard_normal((2, 5, 5))).astype(np.float32)
    got = np.asarray(toeplitz.skew(jnp.asarray(x)))
    want = np.zeros_like(x)
    for s in range(5):
        for lag in range(s + 1):
            want[:, s, lag] = x[:, s, s - lag]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(toeplitz.skew(jnp.asarray(got))), x)


def test_explicit_request_with_a_selective_decay_fails_with_the_reason():
    args, _ = _inputs(0, 1, 20, 2, 8, 8, 4)  # selective: r is [B, T, H, M]
    x = [jnp.asarray(a, jnp.float32) for a in args]
    with pytest.raises(ValueError, match="toeplitz.*selective decay.*Valid choices"):
        ia.interdomain(*x[:3], log_modulus=x[3], phase=x[4], input_gain=x[5], readout=x[6],
                       implementation="toeplitz")


@pytest.mark.tpu_compile
@pytest.mark.parametrize("gen", ["v5e", pytest.param("v6e", marks=pytest.mark.extended),
                                 pytest.param("v5p", marks=pytest.mark.extended)])
def test_auto_compiles_for_tpu_without_a_kernel(gen):
    """With a static decay ``auto`` takes the Toeplitz form on a TPU too: the gradient of both ops at the 125M
    head shape (bf16 data) compiles through libtpu, as plain XLA (no Mosaic custom call)."""
    rep = replicated(gen)
    sd = lambda s, dt=jnp.float32: jax.ShapeDtypeStruct(s, dt, sharding=rep)  # noqa: E731
    b, t, h, d, m = 2, 512, 2, 64, 64
    specs = [sd((b, t, h, d), jnp.bfloat16)] * 3 + [sd((h, m)), sd((h, m)), sd((h, 2 * m)), sd((h, 2 * m, 2 * m)),
                                                     sd((b, t), jnp.int32)]

    assert gen in TOPOLOGIES
    lowered = jax.jit(jax.grad(both_ops_loss, argnums=(0, 1, 2, 3, 4, 5, 6))).trace(*specs).lower()
    assert "tpu_custom_call" not in lowered.as_text()
    lowered.compile()
