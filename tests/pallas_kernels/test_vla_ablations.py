"""The VLA paper's ablations (Tables 2 and 4) as op flags: unnormalised key, unnormalised write direction, fixed
penalty. Each implementation against a float64 numpy loop of the ablated recurrence written out below (not the
op's own reference), outputs, states and gradients."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mixerlab.pallas_kernels.delta_rule.api import delta_rule
from mixerlab.pallas_kernels.vla import api, pallas_triton

_STATIC = ("refresh_period", "refresh_magnitude", "chunk_size", "implementation", "normalize_key",
           "normalize_write_direction", "penalty_update")
jvla = jax.jit(api.vla, static_argnames=_STATIC)
jstep = jax.jit(api.vla_step, static_argnames=_STATIC[:2] + _STATIC[4:])

LAMBDA0, EPS, PERIOD, RHO = 0.1, 1e-4, 6, 0.2
# (normalize_key, normalize_write_direction, penalty_update): each ablation alone, and the paper's "VLAv2"
# (neither normalised); the default is covered by tests/pallas_kernels/test_vla.py.
ABLATIONS = [(True, False, "sherman_morrison"), (False, True, "sherman_morrison"), (True, True, "fixed"),
             (False, False, "sherman_morrison"), (True, False, "fixed")]


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _inputs(seed, B=2, T=23, H=2, K=4, V=3):
    """ELU+1 keys scaled down (‖k‖ ≈ 0.3–0.6) so that the unnormalised ablations stay finite over T tokens."""
    rng = np.random.default_rng(seed)
    elu1 = lambda x: np.where(x > 0, x + 1.0, np.exp(x))  # noqa: E731
    q = elu1(rng.normal(size=(B, T, H, K)))
    k = 0.25 * elu1(rng.normal(size=(B, T, H, K)))
    v = rng.normal(size=(B, T, H, V))
    p = rng.normal(size=(B, T, H, K)) + 0.5
    S0 = rng.normal(size=(B, H, K, V))
    M = rng.normal(size=(B, H, K, K)) / np.sqrt(K)
    A0 = np.eye(K) * 2.0 + M @ np.swapaxes(M, -1, -2)
    return q, k, v, p, S0, A0


def _numpy_ablated_loop(q, k, p, v, S0, A0, starts, normalize_key, normalize_write_direction, penalty_update):
    """One head, float64, value-major S as in the VLA paper (o = S q). ``starts``: tokens where a new document
    starts (S → 0, A → I/λ₀). Refresh after document positions P−1, 2P−1, … (the op's default placement)."""
    d, dv = k.shape[1], v.shape[1]
    S, A, pos, outs = S0.T.copy(), A0.copy(), 0, []
    for t in range(len(k)):
        if t in starts:
            S, A, pos = np.zeros((dv, d)), np.eye(d) / LAMBDA0, 0
        kh = k[t] / max(np.linalg.norm(k[t]), EPS) if normalize_key else k[t]
        if penalty_update == "sherman_morrison":
            u = p[t] / max(np.linalg.norm(p[t]), EPS)
            z = A @ u
            A = A - np.outer(z, z) / max(1 + u @ z, EPS)
        g = A @ kh
        alpha = g / max(np.linalg.norm(g), EPS) if normalize_write_direction else g
        S = S + np.outer(v[t] - S @ kh, alpha)
        if penalty_update == "sherman_morrison" and (pos + 1) % PERIOD == 0:
            A = A + RHO * np.eye(d)
        pos += 1
        outs.append(S @ q[t])
    return np.stack(outs), S.T, A


def _segments(T):
    starts = [9, 17]
    return jnp.asarray(np.searchsorted(starts, np.arange(T), side="right")[None].repeat(2, 0), jnp.int32), starts


def _flags(ablation):
    return dict(zip(("normalize_key", "normalize_write_direction", "penalty_update"), ablation))


def _case(seed=1):
    q, k, v, p, S0, A0 = _inputs(seed)
    seg, starts = _segments(q.shape[1])
    args = [jnp.asarray(x) for x in (q, k, v)]
    kw = dict(penalty_key=jnp.asarray(p), initial_state=(jnp.asarray(S0), jnp.asarray(A0)), segment_ids=seg,
              refresh_period=PERIOD, refresh_magnitude=RHO)
    return (q, k, v, p, S0, A0, starts), args, kw


def _loop_all_heads(arrays, ablation):
    q, k, v, p, S0, A0, starts = arrays
    want = [[], [], []]
    for b, h in itertools.product(range(2), range(2)):
        o, S, A = _numpy_ablated_loop(q[b, :, h], k[b, :, h], p[b, :, h], v[b, :, h], S0[b, h], A0[b, h], starts,
                                      *ablation)
        for out, x in zip(want, (o, S, A)):
            out.append(x)
    o_w = np.stack(want[0]).reshape(2, 2, *want[0][0].shape).transpose(0, 2, 1, 3)
    S_w, A_w = (np.stack(w).reshape(2, 2, *w[0].shape) for w in want[1:])
    return o_w, S_w, A_w


def test_reference_matches_the_ablated_loop(x64):
    """Every ablation (and the VLAv2 pair) of the reference scan == the numpy loop; each one changes o."""
    arrays, args, kw = _case()
    o_default, _ = jvla(*args, **kw, implementation="reference")
    for ablation in ABLATIONS:
        o_w, S_w, A_w = _loop_all_heads(arrays, ablation)
        o, (S, A) = jvla(*args, **kw, **_flags(ablation), implementation="reference")
        for name, got, ref in (("o", o, o_w), ("S", S, S_w), ("A", A, A_w)):
            np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-10, atol=1e-10, err_msg=f"{ablation} {name}")
        assert np.max(np.abs(np.asarray(o_default) - o_w)) > 1e-3, f"{ablation} changed nothing"


@pytest.mark.parametrize("ablation", ABLATIONS[:3])
def test_xla_matches_the_ablated_loop(x64, ablation):
    """Chunk 4: documents start inside chunks (tokens 9, 17) and refreshes fall inside chunks."""
    arrays, args, kw = _case()
    o_w, S_w, A_w = _loop_all_heads(arrays, ablation)
    o, (S, A) = jvla(*args, **kw, **_flags(ablation), chunk_size=4, implementation="xla")
    for name, got, ref in (("o", o, o_w), ("S", S, S_w), ("A", A, A_w)):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-10, atol=1e-10, err_msg=name)


@pytest.mark.slow  # ~25 s: the XLA:CPU compile of both VJPs (chunked A-pass + delta rule, and the scan)
@pytest.mark.parametrize("ablation", [ABLATIONS[0], pytest.param(ABLATIONS[2], marks=pytest.mark.extended),
                                      pytest.param(ABLATIONS[3], marks=pytest.mark.extended)])
def test_xla_gradients_match_reference_float64(x64, ablation):
    q, k, v, p, S0, A0 = (jnp.asarray(x) for x in _inputs(2, B=1, T=17))
    seg = jnp.asarray(np.repeat([1, 2], [11, 6])[None], jnp.int32)
    rng = np.random.default_rng(3)
    wo, ws, wa = (jnp.asarray(rng.normal(size=s)) for s in ((1, 17, 2, 3), (1, 2, 4, 3), (1, 2, 4, 4)))

    def loss(impl, *a):
        o, (S, A) = jvla(*a[:3], penalty_key=a[3], initial_state=a[4:], segment_ids=seg, refresh_period=PERIOD,
                         refresh_magnitude=RHO, chunk_size=4, implementation=impl, **_flags(ablation))
        return jnp.sum(o * wo) + jnp.sum(S * ws) + jnp.sum(A * wa)

    args = (q, k, v, p, S0, A0)
    g_ref = jax.jit(jax.grad(lambda *a: loss("reference", *a), argnums=tuple(range(6))))(*args)
    g_xla = jax.jit(jax.grad(lambda *a: loss("xla", *a), argnums=tuple(range(6))))(*args)
    for name, gx, gr in zip(("q", "k", "v", "penalty_key", "S0", "A0"), g_xla, g_ref):
        assert np.all(np.isfinite(np.asarray(gx))), name
        np.testing.assert_allclose(np.asarray(gx), np.asarray(gr), rtol=1e-8, atol=1e-10, err_msg=name)
    if ablation[2] == "fixed":  # u is never read: no gradient reaches the penalty key
        assert float(jnp.max(jnp.abs(g_ref[3]))) == 0.0
    # a finite difference of the reference itself, along one random direction of k
    direction = jnp.asarray(rng.normal(size=k.shape))
    h = 1e-6
    fd = (loss("reference", q, k + h * direction, v, p, S0, A0)
          - loss("reference", q, k - h * direction, v, p, S0, A0)) / (2 * h)
    np.testing.assert_allclose(float(jnp.sum(g_ref[1] * direction)), float(fd), rtol=1e-6)


def test_fixed_penalty_is_a_delta_rule_with_unit_keys(x64):
    """A = I/λ₀ throughout gives α̂ = k̂: the delta rule with write and erase key k̂ (β = 1)."""
    q, k, v, p, _, _ = (jnp.asarray(x) for x in _inputs(4))
    o, (S, A) = jvla(q, k, v, penalty_key=p, refresh_period=PERIOD, refresh_magnitude=RHO, penalty_update="fixed",
                     implementation="xla")
    k_hat = api.normalize(k, EPS)
    o_d, S_d = delta_rule(q, k_hat, v, erase_key=k_hat, implementation="reference")
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_d), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(np.asarray(S), np.asarray(S_d), rtol=1e-10, atol=1e-10)
    np.testing.assert_array_equal(np.asarray(A), np.broadcast_to(np.eye(4) / LAMBDA0, A.shape))


@pytest.mark.parametrize("ablation", [ABLATIONS[0], ABLATIONS[2]])
def test_decode_steps_equal_the_parallel_op(x64, ablation):
    q, k, v, p, _, _ = (jnp.asarray(x) for x in _inputs(5, T=14))
    kw = dict(refresh_period=PERIOD, refresh_magnitude=RHO, **_flags(ablation))
    o_par, (S_par, A_par) = jvla(q, k, v, penalty_key=p, implementation="reference", **kw)
    S, A = api.initial_state(2, 2, 4, 3, dtype=jnp.float64)
    outs = []
    for t in range(14):
        o, (S, A) = jstep(q[:, t], k[:, t], v[:, t], penalty_key=p[:, t], state=(S, A),
                          position=jnp.full((2,), t, jnp.int32), **kw)
        outs.append(o)
    np.testing.assert_allclose(np.asarray(jnp.stack(outs, 1)), np.asarray(o_par), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.asarray(A), np.asarray(A_par), rtol=1e-10, atol=1e-12)


def test_triton_a_pass_honours_the_write_direction_flag():
    """Interpret mode on CPU: the kernel's unnormalised g is the reference's k̂A_t; u = 0 (fixed penalty)
    leaves A at A₀. (The whole pallas_triton op is checked against the reference in
    test_vla_pallas_triton.py; the flags act outside the kernels.)"""
    b, t, h, d = 1, 12, 1, 16
    rng = np.random.default_rng(6)
    k_hat = api.normalize(jnp.asarray(rng.normal(size=(b, t, h, d)) + 1.0, jnp.float32), EPS)
    u = api.normalize(jnp.asarray(rng.normal(size=(b, t, h, d)) + 0.5, jnp.float32), EPS)
    a0 = jnp.broadcast_to(jnp.eye(d, dtype=jnp.float32) / LAMBDA0, (b, h, d, d))
    document = jnp.zeros((b, t), jnp.int32)
    refresh = api.refresh_mask(api.document_positions(document), PERIOD, 0)
    run = jax.jit(lambda u, refresh, norm: pallas_triton.penalty_pass(
        k_hat, u, a0, document, refresh, lambda0=LAMBDA0, refresh_magnitude=RHO, eps=EPS,
        normalize_write_direction=norm, interpret=True, anchor_every=8), static_argnums=2)
    g, a_end = run(u, refresh, False)
    A, want = np.eye(d) / LAMBDA0, []
    kh, uu = np.asarray(k_hat, np.float64)[0, :, 0], np.asarray(u, np.float64)[0, :, 0]
    for i in range(t):
        z = A @ uu[i]
        A = A - np.outer(z, z) / (1 + uu[i] @ z)
        want.append(A @ kh[i])
        if (i + 1) % PERIOD == 0:
            A = A + RHO * np.eye(d)
    np.testing.assert_allclose(np.asarray(g)[0, :, 0], np.stack(want), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(a_end)[0, 0], A, rtol=2e-5, atol=2e-6)
    alpha, a_fixed = run(jnp.zeros_like(u), jnp.zeros_like(refresh), True)  # what the op passes for "fixed"
    np.testing.assert_allclose(np.asarray(a_fixed), np.asarray(a0), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(alpha), np.asarray(k_hat), rtol=1e-5, atol=1e-6)


def test_bad_ablation_flags_name_the_argument():
    x = jnp.ones((1, 3, 1, 4), jnp.float32)
    with pytest.raises(ValueError, match="penalty_update='frozen'.*sherman_morrison"):
        api.vla(x, x, x, penalty_update="frozen")
    with pytest.raises(ValueError, match="normalize_write_direction=1"):
        api.vla(x, x, x, normalize_write_direction=1)
    with pytest.raises(ValueError, match="normalize_key='no'"):
        api.vla_step(x[:, 0], x[:, 0], x[:, 0], state=api.initial_state(1, 1, 4, 4), position=jnp.zeros(1, jnp.int32),
                     normalize_key="no")
