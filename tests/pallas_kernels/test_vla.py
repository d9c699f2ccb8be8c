"""Variational Linear Attention op (docs/math/vla.md): every form against the float64 reference scan.

Measured on CPU (jax 0.10.2), inputs as ``_inputs`` (ELU+1 keys, N(0,1) values), relative errors vs the
float64 reference: chunked xla ~1e-14 (float64); float32 o rel-RMS 1.2e-6 (T=256, d=32); bfloat16 inputs
(compute float32) vs the float64 reference on the same rounded inputs: see test_low_precision_tolerances.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mixerlab.pallas_kernels.vla import api, reference, scan, xla


# One jitted entry per function: eager op-by-op dispatch compiles every primitive separately (slow on CPU).
_STATIC = ("lambda0", "refresh_period", "refresh_magnitude", "refresh_offset", "eps", "chunk_size", "implementation")
jvla = jax.jit(api.vla, static_argnames=_STATIC)
jdiag = jax.jit(api.vla_diagnostics, static_argnames=_STATIC[:5])
jstep = jax.jit(api.vla_step, static_argnames=_STATIC[1:5])


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _inputs(seed, B=2, T=53, H=2, K=8, V=6, dtype=np.float64, penalty=True, state=True):
    rng = np.random.default_rng(seed)
    q = jax.nn.elu(rng.normal(size=(B, T, H, K))) + 1.0
    k = jax.nn.elu(rng.normal(size=(B, T, H, K))) + 1.0
    v = rng.normal(size=(B, T, H, V))
    p = rng.normal(size=(B, T, H, K)) + 0.5
    S0 = rng.normal(size=(B, H, K, V))
    M = rng.normal(size=(B, H, K, K)) / np.sqrt(K)
    A0 = np.eye(K) * 5.0 + M @ np.swapaxes(M, -1, -2)
    cast = lambda a: jnp.asarray(np.asarray(a), dtype)  # noqa: E731
    return dict(q=cast(q), k=cast(k), v=cast(v), penalty_key=cast(p) if penalty else None,
                initial_state=(cast(S0), cast(A0)) if state else None)


def _segments(B, T, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(B):
        cuts = np.sort(rng.choice(np.arange(1, T), size=3, replace=False))
        rows.append(np.searchsorted(cuts, np.arange(T), side="right") + 1)
    return jnp.asarray(np.stack(rows), jnp.int32)


def _rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


def _rel_rms(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


CASES = [  # (kwargs of the op beyond the inputs, chunk sizes to try)
    (dict(penalty=False, state=False), dict(), (1, 20)),
    (dict(), dict(segments=True, initial_position=np.array([3, 15])), (5, None)),
    (dict(), dict(segments=True, refresh_period=7, refresh_magnitude=0.3, refresh_offset=1), (4, 6)),
]


# case 2 (refreshes) is extended: the ablation tests put refreshes inside chunks in make test
@pytest.mark.parametrize("case", [0, 1, pytest.param(2, marks=pytest.mark.extended)])
def test_xla_matches_reference_float64(x64, case):
    """T = 53 is not a multiple of any chunk; documents start inside chunks and at chunk starts."""
    make, kw, chunks = CASES[case]
    inp = _inputs(case, **make)
    kw = dict(kw)
    if kw.pop("segments", False):
        kw["segment_ids"] = _segments(2, 53, case)
    if "initial_position" in kw:
        kw["initial_position"] = jnp.asarray(kw["initial_position"], jnp.int32)
    o_r, (S_r, A_r) = jvla(**inp, **kw, implementation="reference")
    assert o_r.dtype == jnp.float64 and S_r.dtype == jnp.float64 and A_r.dtype == jnp.float64
    for c in chunks:
        o, (S, A) = jvla(**inp, **kw, chunk_size=c, implementation="xla")
        assert _rel(o, o_r) < 1e-10 and _rel(S, S_r) < 1e-10 and _rel(A, A_r) < 1e-10, c


def _numpy_a3_loop(q, k, p, v, lam0, P, rho, eps, offset=0):
    """The recurrence (docs/math/vla.md) written out in numpy for one head (value-major S, as the paper; o = S q)."""
    d, dv = k.shape[1], v.shape[1]
    S, A, outs = np.zeros((dv, d)), np.eye(d) / lam0, []
    for t in range(1, len(k) + 1):
        kh = k[t - 1] / max(np.linalg.norm(k[t - 1]), eps)
        u = p[t - 1] / max(np.linalg.norm(p[t - 1]), eps)
        z = A @ u
        A = A - np.outer(z, z) / max(1 + u @ z, eps)
        g = A @ kh
        alpha = g / max(np.linalg.norm(g), eps)
        e = v[t - 1] - S @ kh
        S = S + np.outer(e, alpha)
        if P and (t + offset) % P == 0:
            A = A + rho * np.eye(d)
        outs.append(S @ q[t - 1])
    return np.stack(outs), S, A


@pytest.mark.parametrize("offset", [0, 1])
def test_reference_is_the_spec_loop(x64, offset):
    """Refresh after the write of tokens P, 2P, … (offset 0) or before the update of those tokens."""
    inp = _inputs(3, B=1, T=14, H=1, K=4, V=3, state=False)
    o, (S, A) = jvla(**inp, refresh_period=6, refresh_magnitude=0.5, refresh_offset=offset,
                     implementation="reference")
    arrays = [np.asarray(inp[n])[0, :, 0] for n in ("q", "k", "penalty_key", "v")]
    o_np, S_np, A_np = _numpy_a3_loop(*arrays, 0.1, 6, 0.5, 1e-4, offset)
    np.testing.assert_allclose(np.asarray(o)[0, :, 0], o_np, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(S)[0, 0], S_np.T, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(A)[0, 0], A_np, rtol=1e-12, atol=1e-12)


def test_penalty_pass_equals_sequential_sherman_morrison(x64):
    """The Woodbury–Cholesky A-pass (all α̂ and the final A) == the token-by-token SM recursion."""
    inp = _inputs(4, T=41)
    seg = _segments(2, 41, 4)
    k_hat = api.normalize(inp["k"], 1e-4)
    u = api.normalize(inp["penalty_key"], 1e-4)
    doc = api.document_index(seg, 2, 41)
    ref = api.refresh_mask(api.document_positions(doc), 20, 0)
    o, (S, A), diag = jax.jit(lambda *a: reference.vla_reference(
        *a, lambda0=0.1, refresh_magnitude=1e-3, eps=1e-4, diagnostics=True))(
        inp["q"], k_hat, u, inp["v"], *inp["initial_state"], doc, ref)
    for c in (3, 20):
        alpha, A_end = jax.jit(lambda *a: xla.penalty_pass(*a, chunk_size=c, lambda0=0.1, refresh_magnitude=1e-3,
                                                           eps=1e-4))(k_hat, u, inp["initial_state"][1], doc, ref)
        assert _rel(alpha, diag["alpha"]) < 1e-12 and _rel(A_end, A) < 1e-12


@pytest.mark.extended  # an oracle cross-check; test_penalty_pass_equals_sequential_sherman_morrison stays in make test
def test_associative_scan_oracles_match_reference(x64):
    """The affine scan for S (key-major) and the Möbius scan for A, refresh included (docs/math/vla.md)."""
    inp = _inputs(5, T=45, penalty=True, state=True)
    kw = dict(refresh_period=10, refresh_magnitude=0.05)
    o_r, (S_r, A_r) = jvla(**inp, **kw, implementation="reference")
    diag = jdiag(**inp, **kw)
    k_hat = api.normalize(inp["k"], 1e-4)
    u = api.normalize(inp["penalty_key"], 1e-4)
    refresh = api.refresh_mask(api.document_positions(jnp.zeros((2, 45), jnp.int32)), 10, 0)
    alpha, A_T = jax.jit(lambda *a: scan.mobius_penalty_scan(*a, refresh_magnitude=0.05, eps=1e-4))(
        k_hat, u, inp["initial_state"][1], refresh)
    assert _rel(alpha, diag["alpha"]) < 1e-10 and _rel(A_T, A_r) < 1e-10
    o, S_T = jax.jit(scan.affine_state_scan)(inp["q"], k_hat, alpha, inp["v"], inp["initial_state"][0])
    assert _rel(o, o_r) < 1e-10 and _rel(S_T, S_r) < 1e-10


def test_gradients_of_xla_match_reference_float64(x64):
    inp = _inputs(6, B=1, T=23, H=2, K=4, V=3)
    seg = _segments(1, 23, 6)
    rng = np.random.default_rng(7)
    wo, ws, wa = (jnp.asarray(rng.normal(size=s)) for s in ((1, 23, 2, 3), (1, 2, 4, 3), (1, 2, 4, 4)))

    def loss(impl, q, k, v, p, S0, A0):
        o, (S, A) = jvla(q, k, v, penalty_key=p, initial_state=(S0, A0), segment_ids=seg, refresh_period=5,
                            refresh_magnitude=0.1, chunk_size=4, implementation=impl)
        return jnp.sum(o * wo) + jnp.sum(S * ws) + jnp.sum(A * wa)

    args = (inp["q"], inp["k"], inp["v"], inp["penalty_key"], *inp["initial_state"])
    g_ref = jax.jit(jax.grad(lambda *a: loss("reference", *a), argnums=tuple(range(6))))(*args)
    g_xla = jax.jit(jax.grad(lambda *a: loss("xla", *a), argnums=tuple(range(6))))(*args)
    for name, gx, gr in zip(("q", "k", "v", "penalty_key", "S0", "A0"), g_xla, g_ref):
        assert _rel(gx, gr) < 1e-9, name


def test_decode_loop_equals_parallel_with_document_resets(x64):
    inp = _inputs(8, T=29, penalty=True, state=False)
    seg = _segments(2, 29, 8)
    kw = dict(refresh_period=4, refresh_magnitude=0.2)
    o_par, (S_par, A_par) = jvla(**inp, segment_ids=seg, **kw)
    doc = api.document_index(seg, 2, 29)
    pos = api.document_positions(doc)
    S, A = api.initial_state(2, 2, 8, 6, dtype=jnp.float64)
    S0, A0 = S, A
    outs = []
    for t in range(29):
        new = (pos[:, t] == 0)[:, None, None, None]
        S, A = jnp.where(new, S0, S), jnp.where(new, A0, A)
        o, (S, A) = jstep(inp["q"][:, t], inp["k"][:, t], inp["v"][:, t],
                                 penalty_key=inp["penalty_key"][:, t], state=(S, A), position=pos[:, t], **kw)
        outs.append(o)
    assert _rel(jnp.stack(outs, 1), o_par) < 1e-10 and _rel(S, S_par) < 1e-10 and _rel(A, A_par) < 1e-10


def test_packed_segments_equal_separate_documents(x64):
    inp = _inputs(9, B=1, T=40, penalty=True, state=True)
    seg = jnp.asarray(np.repeat([3, 1, 3], [13, 20, 7])[None], jnp.int32)  # a reused id is still a new document
    o, (S, A) = jvla(**inp, segment_ids=seg, chunk_size=8)
    bounds = [(0, 13), (13, 33), (33, 40)]
    for i, (a, b) in enumerate(bounds):
        part = {n: (x[:, a:b] if n in ("q", "k", "v", "penalty_key") else x) for n, x in inp.items()}
        if i > 0:
            part["initial_state"] = None
        o_alone, (S_alone, A_alone) = jvla(**part, chunk_size=8)
        assert _rel(o[:, a:b], o_alone) < 1e-12
    assert _rel(S, S_alone) < 1e-12 and _rel(A, A_alone) < 1e-12


def test_low_precision_tolerances():
    """float32 and bfloat16 inputs (state and accumulation float32) vs the float64 reference.
    Measured (T=256, d=32, 2 documents): float32 xla o rel-RMS 1.2e-6, S 7.6e-7, A 4.4e-7 (bound 1.2e-5);
    bfloat16 inputs vs the float64 reference on the same rounded inputs: S 7.4e-7, A 4.5e-7 (the op computes in
    float32), bf16 output vs the bf16-rounded reference output 5.6e-5 (one-ulp rounding flips; bound 5e-4).
    Against the unrounded float32 inputs the bf16 error is 5.2e-3 (input rounding)."""
    base = _inputs(10, B=2, T=256, H=2, K=32, V=32, dtype=np.float32, penalty=False, state=False)
    seg = jnp.asarray(np.repeat([1, 2], [100, 156])[None].repeat(2, 0), jnp.int32)
    for dtype, bound in ((jnp.float32, 1.2e-5), (jnp.bfloat16, 5e-4)):
        low = {n: None if x is None else x.astype(dtype) for n, x in base.items()}
        o, (S, A) = jax.jit(lambda q, k, v: jvla(q, k, v, segment_ids=seg))(low["q"], low["k"], low["v"])
        with jax.enable_x64(True):
            exact = {n: jnp.asarray(np.asarray(low[n].astype(jnp.float32)), jnp.float64) for n in "qkv"}
            o_r, (S_r, A_r) = jvla(**exact, segment_ids=seg, implementation="reference")
            o_r, S_r, A_r = np.asarray(o_r), np.asarray(S_r), np.asarray(A_r)
        assert o.dtype == dtype and S.dtype == jnp.float32 and A.dtype == jnp.float32
        errs = [_rel_rms(np.asarray(o.astype(jnp.float32)), o_r), _rel_rms(S, S_r), _rel_rms(A, A_r)]
        # bfloat16 output rounding alone is ~2e-3 relative: compare the bf16 output with its own rounding bound
        if dtype == jnp.bfloat16:
            errs[0] = _rel_rms(np.asarray(o.astype(jnp.float32)), np.asarray(jnp.asarray(o_r).astype(jnp.bfloat16)
                                                                             .astype(jnp.float32)))
        assert max(errs) < bound, (dtype, errs)


def test_jacobian_closed_form_matches_svd(x64):
    """‖I − α̂k̂ᵀ‖₂ = sqrt((3 − 2c + sqrt(5 − 4c))/2); VLA keeps c > 0, so ‖J‖₂ ∈ [1, φ_golden)."""
    inp = _inputs(11, B=1, T=60, H=2, K=16, V=4, penalty=False, state=False)
    diag = jdiag(**inp)
    k_hat = np.asarray(api.normalize(inp["k"], 1e-4))
    alpha = np.asarray(diag["alpha"])
    J = np.eye(16) - alpha[..., :, None] * k_hat[..., None, :]
    svd = np.linalg.svd(J, compute_uv=False)[..., 0]
    np.testing.assert_allclose(np.asarray(diag["jacobian_norm"]), svd, rtol=1e-10)
    c = np.asarray(diag["alignment"])
    assert np.all(c > 0) and np.all(svd >= 1 - 1e-12) and np.all(svd < (1 + 5 ** 0.5) / 2)
    np.testing.assert_allclose(reference.jacobian_norm(jnp.asarray([1.0, 0.0, 0.5, -1.0])),
                               [1.0, (1 + 5 ** 0.5) / 2, 1.3660254037844386, 2.0], rtol=1e-12)
    w = api.jacobian_window_norm(jnp.asarray(k_hat), jnp.asarray(alpha), 3)
    prod = J[:, 2:] @ J[:, 1:-1] @ J[:, :-2]
    np.testing.assert_allclose(np.asarray(w), np.linalg.svd(prod, compute_uv=False)[..., 0], rtol=1e-10)
    assert set(diag) >= {"state_norm", "penalty_norm", "alignment", "jacobian_norm"}


def test_bad_arguments_raise_clear_errors():
    inp = _inputs(12, B=1, T=8, H=1, K=4, V=2, dtype=np.float32, penalty=False, state=False)
    q, k, v = inp["q"], inp["k"], inp["v"]
    with pytest.raises(ValueError, match="chunk_size=32 exceeds"):
        api.vla(q, k, v, chunk_size=32)
    with pytest.raises(ValueError, match="'k'"):
        api.vla(q, k[:, :4], v)
    with pytest.raises(ValueError, match="implementation='pallas_tpu'"):
        api.vla(q, k, v, implementation="pallas_tpu")
    with pytest.raises(ValueError, match="unknown implementation"):
        api.vla(q, k, v, implementation="fast")
    with pytest.raises(ValueError, match="initial_state"):
        api.vla(q, k, v, initial_state=jnp.zeros((1, 1, 4, 2)))
    with pytest.raises(ValueError, match="refresh_offset"):
        api.vla(q, k, v, refresh_period=4, refresh_offset=4)
    with pytest.raises(ValueError, match="lambda0"):
        api.vla(q, k, v, lambda0=0.0)
    with pytest.raises(ValueError, match="'segment_ids'"):
        api.vla(q, k, v, segment_ids=jnp.zeros((1, 8)))
