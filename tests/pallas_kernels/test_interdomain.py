"""The interdomain op (pallas_kernels.interdomain) and the S4D-only core: chunked xla == token reference in
float64, gradients, decode, packed segments, the real-ified readout against a complex128 computation, and
measured float32 / bf16 accuracy."""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mixerlab.pallas_kernels.interdomain import api as ia


@contextlib.contextmanager
def x64():
    with jax.enable_x64(True):
        yield


B, T, H, R, V, M = 2, 37, 2, 5, 3, 6
SEG = [15, 10, 12]  # three documents per row; T = 37 is not a multiple of any chunk size tested


def _segments(lengths, batch=B):
    ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])
    return jnp.asarray(np.repeat(ids[None], batch, 0), jnp.int32)


def _case(seed=0, *, t=T, selective=False, conjugate=True, initial=True, dtype=np.float64, dt_max=0.5, m=M):
    """Random op inputs (numpy float64 complex parameters kept for the complex128 check)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, t, H, R))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k = rng.standard_normal((B, t, H, R))
    v = rng.standard_normal((B, t, H, V))
    delta = np.exp(rng.uniform(np.log(1e-3), np.log(dt_max), H))
    a_re = -np.exp(rng.uniform(np.log(0.3), np.log(1.0), (H, m)))
    a_im = np.broadcast_to(np.asarray(ia.s4d_inv_imag(m)), (H, m)).astype(np.float64)
    c = (rng.standard_normal((H, m, m)) + 1j * rng.standard_normal((H, m, m))) / np.sqrt(2 * m)
    scale = rng.uniform(0.5, 2.0, (B, t, H, 1)) if selective else np.ones((1, 1, H, 1))
    log_mod = scale * (delta[:, None] * a_re)
    if not selective:
        log_mod = log_mod[0, 0]
    with x64():
        gain = np.asarray(ia.zoh_input_gain(jnp.asarray(a_re), jnp.asarray(a_im), jnp.asarray(delta)))
        readout = np.asarray(ia.readout_matrix(jnp.asarray(c.real), jnp.asarray(c.imag), conjugate=conjugate))
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    state = None
    if initial:
        state = ia.InterdomainState(cast(rng.standard_normal((B, H, 2 * m, R))),
                                    cast(rng.standard_normal((B, H, 2 * m, V))))
    args = (cast(q), cast(k), cast(v))
    kw = dict(log_modulus=cast(log_mod), phase=cast(delta[:, None] * a_im), input_gain=cast(gain),
              readout=cast(readout),
              initial_state=state)
    raw = dict(q=q, k=k, v=v, log_mod=log_mod, delta=delta, a_im=a_im, a_re=a_re, c=c, state=state)
    return args, kw, raw


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def _rms_rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


# (chunk_size, sub_chunk_size); None = the default min(16, chunk). T = 37 is a multiple of none of them; 12/5
# and 8/3 leave a ragged last sub-chunk in every chunk, 64 > T is one partial chunk of four sub-chunks.
@pytest.mark.parametrize("selective,conjugate,sizes", [
    (False, True, ((4, None), (64, None), (12, 5))),
    (True, True, ((16, None), (16, 3), (37, 37))),
    (True, False, ((8, 3), (64, 16), (5, 1))),
])
def test_chunked_equals_reference_float64(selective, conjugate, sizes):
    with x64():
        args, kw, _ = _case(1, selective=selective, conjugate=conjugate)
        seg = _segments(SEG)
        ref_o, ref_s = ia.interdomain(*args, **kw, segment_ids=seg, implementation="reference")
        for chunk, sub in sizes:  # measured: ≤ 2e-15 relative (max-abs) for all
            o, s = ia.interdomain(*args, **kw, segment_ids=seg, implementation="xla", chunk_size=chunk,
                                  sub_chunk_size=sub)
            assert o.dtype == jnp.float64 and s.key.dtype == jnp.float64
            assert _rel(o, ref_o) <= 1e-10, (chunk, sub)
            assert _rel(s.key, ref_s.key) <= 1e-10 and _rel(s.value, ref_s.value) <= 1e-10, (chunk, sub)


def test_realified_readout_equals_complex128_readout():
    """o_t = Re(ξ(q)ᵀ (C X^k_t)ᴴ (C X^v_t)) (Hermitian) and Re(ξᵀ Uᵀ Γ) (bilinear), computed with complex
    numbers in numpy, equal the real 2×2-block op (reference and xla)."""
    for conjugate in (True, False):
        with x64():
            args, kw, raw = _case(2, selective=True, conjugate=conjugate, initial=False)
            outs = [ia.interdomain(*args, **kw, implementation=impl)[0] for impl in ("reference", "xla")]
        lam = np.exp(raw["log_mod"] + 1j * (raw["delta"][:, None] * raw["a_im"]))  # [B, T, H, M] complex
        A = raw["a_re"] + 1j * raw["a_im"]  # a_re < 0
        b = (np.exp(raw["delta"][:, None] * A) - 1.0) / A  # [H, M] ZOH with B = 1
        c = raw["c"]
        want = np.zeros((B, T, H, V))
        for bi in range(B):
            for h in range(H):
                xk = np.zeros((M, R), complex)
                xv = np.zeros((M, V), complex)
                for t in range(T):
                    xk = lam[bi, t, h][:, None] * xk + b[h][:, None] * raw["k"][bi, t, h][None, :]
                    xv = lam[bi, t, h][:, None] * xv + b[h][:, None] * raw["v"][bi, t, h][None, :]
                    U, G = c[h] @ xk, c[h] @ xv
                    Uq = U @ raw["q"][bi, t, h]  # (M,) = U ξ
                    want[bi, t, h] = np.real((np.conj(Uq) if conjugate else Uq) @ G)
        for o in outs:
            assert _rel(o, want) <= 1e-12


def test_decode_steps_equal_parallel_forward():
    with x64():
        args, kw, _ = _case(3, selective=True, t=11)
        o_par, s_par = ia.interdomain(*args, **kw, implementation="xla", chunk_size=4)
        state = kw["initial_state"]
        q, k, v = args
        outs = []
        for t in range(q.shape[1]):
            o, state = ia.interdomain_step(q[:, t], k[:, t], v[:, t], log_modulus=kw["log_modulus"][:, t],
                                           phase=kw["phase"], input_gain=kw["input_gain"], readout=kw["readout"],
                                           state=state)
            outs.append(o)
        assert _rel(jnp.stack(outs, 1), o_par) <= 1e-12
        assert _rel(state.key, s_par.key) <= 1e-12 and _rel(state.value, s_par.value) <= 1e-12


def test_segments_equal_separate_documents():
    """State → 0 at every boundary; the initial state applies only to the first segment."""
    with x64():
        args, kw, _ = _case(4, selective=True)
        seg = _segments(SEG)
        # boundaries at 15 and 25 fall inside sub-chunks (chunk 8, sub-chunks of 3, 3, 2)
        o, s = ia.interdomain(*args, **kw, segment_ids=seg, implementation="xla", chunk_size=8, sub_chunk_size=3)
        start = 0
        for i, n in enumerate(SEG):
            sl = slice(start, start + n)
            part = [a[:, sl] for a in args]
            kwp = dict(kw, log_modulus=kw["log_modulus"][:, sl], initial_state=kw["initial_state"] if i == 0 else None)
            o_i, s_i = ia.interdomain(*part, **kwp, implementation="reference")
            assert _rel(o[:, sl], o_i) <= 1e-12, i
            start += n
        assert _rel(s.key, s_i.key) <= 1e-12 and _rel(s.value, s_i.value) <= 1e-12


@pytest.mark.parametrize("chunk,sub", [(8, 3), pytest.param(12, 5, marks=pytest.mark.extended)])
def test_gradients_match_reference_float64(chunk, sub):
    with x64():
        args, kw, _ = _case(5, selective=True, t=21)
        seg = _segments([9, 12])
        w = jnp.asarray(np.random.default_rng(0).standard_normal((B, 21, H, V)))

        def loss(impl, q, k, v, log_mod, phase, gain, readout, key0, value0):
            o, s = ia.interdomain(q, k, v, log_modulus=log_mod, phase=phase, input_gain=gain, readout=readout,
                                  initial_state=ia.InterdomainState(key0, value0), segment_ids=seg,
                                  implementation=impl, chunk_size=chunk, sub_chunk_size=sub)
            return jnp.sum(o * w) + jnp.sum(jnp.sin(s.key)) + jnp.sum(s.value ** 2)

        flat = (*args, kw["log_modulus"], kw["phase"], kw["input_gain"], kw["readout"], *kw["initial_state"])
        # every array argument (loss's 0 is the implementation); compiled: eager is about twice as slow
        grads = jax.jit(jax.grad(loss, argnums=tuple(range(1, len(flat) + 1))), static_argnums=0)
        g_ref, g_xla = grads("reference", *flat), grads("xla", *flat)
        for i, (a, b) in enumerate(zip(g_xla, g_ref)):  # measured: max 1.4e-15 over the 10 inputs
            assert _rel(a, b) <= 1e-10, i


def _range_case(lo, hi, seed=0, t=75):
    """Op arguments (numpy float64) with a selective log-modulus r ~ U[lo, hi] per token, mode and head; odd T
    (one full and one partial default chunk), three documents per row, an initial state, and a loss weight."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, t, H, R))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    c = rng.standard_normal((H, 2 * M, 2 * M)) / 4
    arrays = [q, rng.standard_normal((B, t, H, R)), rng.standard_normal((B, t, H, V)),
              rng.uniform(lo, hi, (B, t, H, M)), rng.uniform(-3.0, 3.0, (H, M)), rng.standard_normal((H, 2 * M)),
              np.einsum("hki,hkj->hij", c, c), rng.standard_normal((B, H, 2 * M, R)),
              rng.standard_normal((B, H, 2 * M, V))]
    return arrays, _segments([30, 20, t - 50]), rng.standard_normal((B, t, H, V))


def _loss_and_grads(impl, arrays, seg, w, dtype):
    """(o, state, gradients of a loss over outputs and both final states w.r.t. all nine op arguments)."""
    def loss(q, k, v, log_mod, phase, gain, readout, key0, value0):
        o, s = ia.interdomain(q, k, v, log_modulus=log_mod, phase=phase, input_gain=gain, readout=readout,
                              initial_state=ia.InterdomainState(key0, value0), segment_ids=seg,
                              implementation=impl)
        return jnp.sum(o * w.astype(dtype)) + jnp.sum(jnp.sin(s.key)) + jnp.sum(s.value ** 2), (o, s)

    (_, (o, s)), g = jax.value_and_grad(loss, argnums=tuple(range(9)), has_aux=True)(
        *(jnp.asarray(a, dtype) for a in arrays))
    return o, s, g


def _f32_against_f64(arrays, seg, w):
    with x64():
        o64, s64, g64 = _loss_and_grads("reference", arrays, seg, jnp.asarray(w), jnp.float64)
        o64, s64, g64 = np.asarray(o64), [np.asarray(x) for x in s64], [np.asarray(x) for x in g64]
    o, s, g = _loss_and_grads("xla", arrays, seg, jnp.asarray(w, jnp.float32), jnp.float32)
    assert o.dtype == jnp.float32 and s.key.dtype == jnp.float32
    return (o, o64), list(zip(s, s64)), list(zip(g, g64))


GRAD_NAMES = ("q", "k", "v", "log_modulus", "phase", "input_gain", "readout", "key0", "value0")


# The float32 range tests run the op eagerly at one set of shapes (``_range_case``): in one process the first
# compiles the primitives (≈ 30 s on CI) and the others reuse them (< 1 s each); one xdist worker runs them all.
RANGE_GROUP = pytest.mark.xdist_group("interdomain_float32_range")


@RANGE_GROUP
@pytest.mark.parametrize("lo,hi", [(-20.0, 0.0), pytest.param(-5.6, -5.2, marks=pytest.mark.extended)])
def test_float32_exact_over_the_whole_log_modulus_range(lo, hi):
    """Float32 xla (default chunk 64, sub-chunk 8) against the float64 reference for r ∈ [−20, 0] per token
    and in the band just below −5.5, where factorising inside 16-token sub-chunks (exp of a difference of
    prefix sums) lost accuracy (3.2e-2 at r = −5.4) and overflowed below. Measured (2026-12-01), max-abs
    relative: outputs 2.0e-7 / 8.2e-8, final states ≤ 6.8e-8 / 8.3e-8, all nine gradients ≤ 5.3e-7 / 4.5e-7."""
    (o, o64), states, grads = _f32_against_f64(*_range_case(lo, hi))
    assert _rel(o, o64) <= 1e-4
    for i, (a, b) in enumerate(states):
        assert _rel(a, b) <= 1e-4, ("key", "value")[i]
    for name, (a, b) in zip(GRAD_NAMES, grads):
        assert _rel(a, b) <= 1e-4, name


@RANGE_GROUP
@pytest.mark.parametrize("r", [-50.0, -100.0])
def test_float32_decays_underflow_to_zero_far_below_the_range(r):
    """r = −50, −100 per token: every decay past one token underflows (e^{−100} is below float32's range);
    outputs, states and gradients stay finite and accurate. The gradients w.r.t. r, θ and the initial state
    are themselves O(e^{r}) (≈ 1e-43 at r = −100, 0 in float32): absolute error below 1e-35 there."""
    (o, o64), states, grads = _f32_against_f64(*_range_case(r, r))
    assert _rel(o, o64) <= 1e-4
    for a, b in states:
        assert _rel(a, b) <= 1e-4
    for name, (a, b) in zip(GRAD_NAMES, grads):
        assert np.isfinite(np.asarray(a)).all(), name
        err = np.max(np.abs(np.asarray(a, np.float64) - b))
        assert err <= 1e-4 * np.max(np.abs(b)) + 1e-35, name


@RANGE_GROUP
def test_float32_no_overflow_for_any_nonpositive_log_modulus():
    """Per-token r from −1e30 up to 0 (range sums reach −6e31): finite outputs and states equal to the float64
    reference; the old factorised form was non-finite below r ≈ −5.5."""
    arrays, seg, _ = _range_case(-1.0, 0.0, seed=3)
    rng = np.random.default_rng(3)
    arrays[3] = -(10.0 ** rng.uniform(-3.0, 30.0, arrays[3].shape))
    with x64():
        o64, s64 = ia.interdomain(*(jnp.asarray(a) for a in arrays[:3]), **_op_kw(arrays, jnp.float64),
                                  segment_ids=seg, implementation="reference")
    o, s = ia.interdomain(*(jnp.asarray(a, jnp.float32) for a in arrays[:3]), **_op_kw(arrays, jnp.float32),
                          segment_ids=seg, implementation="xla")
    assert _rel(o, o64) <= 1e-4 and _rel(s.key, s64.key) <= 1e-4 and _rel(s.value, s64.value) <= 1e-4


def _op_kw(arrays, dtype):
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return dict(log_modulus=cast(arrays[3]), phase=cast(arrays[4]), input_gain=cast(arrays[5]),
                readout=cast(arrays[6]), initial_state=ia.InterdomainState(cast(arrays[7]), cast(arrays[8])))


def test_float32_and_bfloat16_accuracy():
    """Against the float64 reference on the unrounded inputs (T=37, chunk 32 with the default sub-chunks,
    selective decay, segments). Measured (xla, 2026-11-29, factorised sub-chunks of 16): float32 outputs
    1.5e-7 RMS-relative, key/value states 1.7e-7 / 1.5e-7 (the float32 token reference: 3.0e-7 / 1.6e-7 /
    1.2e-7); bfloat16 inputs 2.6e-3 / 2.1e-3 / 1.2e-3 (dominated by rounding the inputs to bf16)."""
    with x64():
        args, kw, _ = _case(6, selective=True, dt_max=0.1)
        seg = _segments(SEG)
        o64, s64 = ia.interdomain(*args, **kw, segment_ids=seg, implementation="reference")
    kw32 = dict(kw, **{n: kw[n].astype(jnp.float32) for n in ("log_modulus", "phase", "input_gain", "readout")},
                initial_state=ia.InterdomainState(*(x.astype(jnp.float32) for x in kw["initial_state"])))
    for dtype, bound in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
        o, s = ia.interdomain(*(a.astype(dtype) for a in args), **kw32, segment_ids=seg, implementation="xla",
                              chunk_size=32)
        assert o.dtype == dtype and s.key.dtype == jnp.float32
        assert _rms_rel(o, o64) <= bound and _rms_rel(s.value, s64.value) <= bound, dtype


def test_s4d_core_chunked_reference_decode_and_complex():
    with x64():
        rng = np.random.default_rng(7)
        _, kw, raw = _case(7, initial=False)
        c_out = rng.standard_normal((H, M))
        z = jnp.asarray(rng.standard_normal((B, T, H, 4)))
        readout = ia.readout_vector(jnp.asarray(raw["c"].real), jnp.asarray(raw["c"].imag), jnp.asarray(c_out))
        x0 = jnp.asarray(rng.standard_normal((B, H, 2 * M, 4)))
        common = dict(log_modulus=kw["log_modulus"], phase=kw["phase"], input_gain=kw["input_gain"], readout=readout)
        seg = _segments(SEG)
        o_ref, s_ref = ia.s4d(z, **common, initial_state=x0, segment_ids=seg, implementation="reference")
        for chunk, sub in ((5, None), (64, None), (12, 5)):
            o, s = ia.s4d(z, **common, initial_state=x0, segment_ids=seg, implementation="xla", chunk_size=chunk,
                          sub_chunk_size=sub)
            assert _rel(o, o_ref) <= 1e-10 and _rel(s, s_ref) <= 1e-10, (chunk, sub)
        state, outs = x0, []
        for t in range(12):
            o_t, state = ia.s4d_step(z[:, t], **common, state=state)
            outs.append(o_t)
        assert _rel(jnp.stack(outs, 1), o_ref[:, :12]) <= 1e-12
        # complex128: o_t = Re(c_outᵀ C X_t), X_t = Λ X_{t−1} + b z_tᵀ (no segments, zero start)
        o0, _ = ia.s4d(z, **common, implementation="xla", chunk_size=8)
    A = raw["a_re"] + 1j * raw["a_im"]
    lam = np.exp(raw["delta"][:, None] * A)
    b = (lam - 1.0) / A
    x = np.zeros((B, H, M, 4), complex)
    want = np.zeros((B, T, H, 4))
    for t in range(T):
        x = lam[None, :, :, None] * x + b[None, :, :, None] * np.asarray(z)[:, t, :, None, :]
        want[:, t] = np.real(np.einsum("hm,hmn,bhnc->bhc", c_out, raw["c"], x))
    assert _rel(o0, want) <= 1e-12


def test_s4d_inv_frequencies_and_zoh_gain():
    a_im = np.asarray(ia.s4d_inv_imag(64))
    assert (a_im < 0).sum() == 32 and abs(a_im.min() + 10.1) < 0.1  # as printed in the IA paper
    a2 = np.asarray(ia.s4d_inv_imag(64, 128))
    assert (a2 > 0).all() and abs(a2.min() - 0.32) < 0.01 and abs(a2.max() - 5174) < 1  # S4 code, N = 2M
    with x64():
        A = np.array([[-0.5 + 3j, -0.5 - 0.2j]])
        delta = np.array([0.01])
        gain = np.asarray(ia.zoh_input_gain(jnp.asarray(A.real), jnp.asarray(A.imag), jnp.asarray(delta)))
    want = (np.exp(delta[:, None] * A) - 1) / A
    np.testing.assert_allclose(gain, np.concatenate([want.real, want.imag], -1), rtol=1e-12, atol=1e-15)


def test_bad_arguments_raise_clear_errors():
    args, kw, _ = _case(8, dtype=np.float32, initial=False)
    q, k, v = args
    with pytest.raises(ValueError, match="'k'"):
        ia.interdomain(q, k[:, :, :, :2], v, **kw)
    with pytest.raises(ValueError, match="'log_modulus'"):
        ia.interdomain(q, k, v, **dict(kw, log_modulus=kw["log_modulus"][:, :2]))
    with pytest.raises(ValueError, match="'readout'"):
        ia.interdomain(q, k, v, **dict(kw, readout=kw["readout"][:, :3]))
    with pytest.raises(ValueError, match="'input_gain'"):
        ia.interdomain(q, k, v, **dict(kw, input_gain=kw["input_gain"][:, :M]))
    with pytest.raises(ValueError, match="'segment_ids'"):
        ia.interdomain(q, k, v, **kw, segment_ids=jnp.ones((B, T), jnp.float32))
    with pytest.raises(ValueError, match="chunk_size"):
        ia.interdomain(q, k, v, **kw, chunk_size=0)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match=f"sub_chunk_size={bad!r}; expected a positive int"):
            ia.interdomain(q, k, v, **kw, sub_chunk_size=bad)
    with pytest.raises(ValueError, match="sub_chunk_size=32; .* <= chunk_size=16"):
        ia.interdomain(q, k, v, **kw, chunk_size=16, sub_chunk_size=32)
    with pytest.raises(ValueError, match="s4d: sub_chunk_size=0"):
        ia.s4d(v, **{n: kw[n] for n in ("log_modulus", "phase", "input_gain")}, readout=kw["readout"][:, 0],
               sub_chunk_size=0)
    with pytest.raises(ValueError, match="pallas_tpu.*needs a TPU backend"):
        ia.interdomain(q, k, v, **kw, implementation="pallas_tpu")
    with pytest.raises(ValueError, match="unknown implementation"):
        ia.interdomain(q, k, v, **kw, implementation="fast")
    with pytest.raises(ValueError, match="'v'"):
        ia.interdomain(q, k, v.astype(jnp.bfloat16), **kw)


def test_log_modulus_outside_its_domain_is_rejected_eagerly_and_poisons_under_jit(monkeypatch):
    """r > 0 or non-finite: eagerly a ValueError naming the argument, the offending value, its index and the
    shape; under jit NaN outputs and states (no host sync); with MIXERLAB_CHECK_DOMAINS=1 the error at run
    time. The same for the decode steps and the S4D core."""
    from mixerlab.pallas_kernels import common

    args, kw, _ = _case(10, dtype=np.float32, selective=True, t=9)
    good = kw["log_modulus"]
    for value, shown in ((0.25, "0.25"), (np.inf, "inf"), (-np.inf, "-inf"), (np.nan, "nan")):
        bad = good.at[1, 4, 0, 2].set(value)
        with pytest.raises(ValueError, match=rf"interdomain: argument 'log_modulus' is outside its domain: expected "
                                             rf"every entry <= 0 and finite; found .*{shown}.* at index \(1, 4, 0, 2\) "
                                             rf"of shape \(2, 9, 2, 6\)"):
            ia.interdomain(*args, **dict(kw, log_modulus=bad))
        run = jax.jit(lambda r: ia.interdomain(*args, **dict(kw, log_modulus=r)))
        o, s = run(bad)
        assert np.isnan(np.asarray(o)).all() and np.isnan(np.asarray(s.key)).all(), value
    o, s = run(good)  # valid values pass through the same compiled function
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(s.value)).all()
    q, k, v = (a[:, 0] for a in args)
    step_kw = dict(phase=kw["phase"], input_gain=kw["input_gain"], readout=kw["readout"],
                   state=ia.InterdomainState(*(jnp.zeros((B, H, 2 * M, d)) for d in (R, V))))
    with pytest.raises(ValueError, match=r"interdomain_step: argument 'log_modulus' .* found -inf"):
        ia.interdomain_step(q, k, v, log_modulus=good[:, 0].at[0, 0, 0].set(-np.inf), **step_kw)
    step = jax.jit(lambda r: ia.interdomain_step(q, k, v, log_modulus=r, **step_kw)[0])
    assert np.isnan(np.asarray(step(good[:, 0].at[0, 0, 0].set(1.0)))).all()
    s4d_kw = dict(phase=kw["phase"], input_gain=kw["input_gain"], readout=kw["input_gain"])
    with pytest.raises(ValueError, match=r"s4d: argument 'log_modulus' .* found 0.25"):
        ia.s4d(args[2], log_modulus=good.at[0, 0, 0, 0].set(0.25), **s4d_kw)
    with pytest.raises(ValueError, match=r"s4d_step: argument 'log_modulus' .* found inf"):
        ia.s4d_step(v, log_modulus=good[:, 0].at[0, 0, 0].set(np.inf), **s4d_kw,
                    state=jnp.zeros((B, H, 2 * M, V)))
    monkeypatch.setattr(common, "CHECK_DOMAINS_UNDER_JIT", True)
    checked = jax.jit(lambda r: ia.interdomain(*args, **dict(kw, log_modulus=r))[0])
    with pytest.raises(Exception, match=r"log_modulus' is outside its domain"):
        np.asarray(checked(good.at[0, 0, 0, 0].set(-np.inf)))
