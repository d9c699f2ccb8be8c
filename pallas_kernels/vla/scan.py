"""Associative-scan forms of VLA (docs/math/vla.md, 'Scan forms'): test oracles, O(T d³) work.

* ``affine_state_scan``: S_t = F_t S_{t−1} + G_t with F_t = I − α̂_tᵀ k̂_t (d_k×d_k), G_t = α̂_tᵀ v_t (key-major
  S, left multiplication; the transpose of the value-major form). NB the VLA paper's §3.4 form
  (G_t built from the residual e_t) is wrong: it double-counts the erase term (docs/math/vla.md, 'S-pass as a delta
  rule').
* ``mobius_penalty_scan``: A ↦ (aA + b)(cA + d)⁻¹ as 2d×2d block matrices, Sherman–Morrison
  [[I, 0], [uᵀu, I]], refresh [[I, ρI], [0, I]]; later maps multiply on the left.
Neither handles documents (single segment, no reset): they are oracles for the unsegmented case.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mixerlab.pallas_kernels.vla.reference import floored_norm

_HIGHEST = jax.lax.Precision.HIGHEST


def _mm(a, b):
    return jnp.matmul(a, b, precision=_HIGHEST)


def affine_state_scan(q_BTHK, k_hat_BTHK, alpha_BTHK, v_BTHV, state_BHKV):
    """(o [B,T,H,V], S_T) by ``lax.associative_scan`` over (F, G)."""
    dk = k_hat_BTHK.shape[-1]
    F = jnp.eye(dk, dtype=k_hat_BTHK.dtype) - alpha_BTHK[..., :, None] * k_hat_BTHK[..., None, :]
    G = alpha_BTHK[..., :, None] * v_BTHV[..., None, :]

    def combine(a, b):  # a earlier, b later: S ↦ F_b (F_a S + G_a) + G_b
        return _mm(b[0], a[0]), _mm(b[0], a[1]) + b[1]

    F_pre, G_pre = jax.lax.associative_scan(combine, (F, G), axis=1)
    S_all = _mm(F_pre, state_BHKV[:, None]) + G_pre          # [B,T,H,K,V]
    o = jnp.einsum("bthk,bthkv->bthv", q_BTHK, S_all, precision=_HIGHEST)
    return o, S_all[:, -1]


def mobius_penalty_scan(k_hat_BTHK, u_BTHK, penalty_BHKK, refresh_BT, *, refresh_magnitude, eps):
    """(α̂ [B,T,H,K], A_T) with every A_t from one associative scan of linear-fractional maps."""
    b, t, h, d = u_BTHK.shape
    dtype = u_BTHK.dtype
    eye = jnp.eye(d, dtype=dtype)
    zero = jnp.zeros((d, d), dtype)
    uu = u_BTHK[..., :, None] * u_BTHK[..., None, :]
    sm = jnp.block([[jnp.broadcast_to(eye, uu.shape), jnp.broadcast_to(zero, uu.shape)],
                    [uu, jnp.broadcast_to(eye, uu.shape)]])                      # [B,T,H,2d,2d]
    # element t = (SM of token t) after (refresh of token t−1)
    prev_refresh = jnp.concatenate([jnp.zeros((b, 1), bool), refresh_BT[:, :-1]], axis=1)
    rho = jnp.where(prev_refresh, refresh_magnitude, 0.0).astype(dtype)[:, :, None, None, None]
    refresh = jnp.block([[eye, eye * 0], [zero, eye]]) + rho * jnp.block([[zero, eye], [zero, zero]])
    elems = _mm(sm, refresh)
    prefix = jax.lax.associative_scan(lambda a, c: _mm(c, a), elems, axis=1)   # later on the left
    a, bb = prefix[..., :d, :d], prefix[..., :d, d:]
    c, dd = prefix[..., d:, :d], prefix[..., d:, d:]
    A0 = penalty_BHKK[:, None]
    num = _mm(a, A0) + bb
    den = _mm(c, A0) + dd
    A_all = jnp.swapaxes(jnp.linalg.solve(jnp.swapaxes(den, -1, -2), jnp.swapaxes(num, -1, -2)), -1, -2)
    g = jnp.einsum("bthij,bthj->bthi", A_all, k_hat_BTHK, precision=_HIGHEST)
    alpha = g / floored_norm(g, eps)
    A_T = A_all[:, -1] + jnp.where(refresh_BT[:, -1], refresh_magnitude, 0.0).astype(dtype)[:, None, None, None] * eye
    return alpha, A_T
