"""Token-by-token Variational Linear Attention (docs/math/vla.md, 'Recurrence'): the oracle every other form is tested
against.

Per head, row-vector maths, key-major state (``o = q S``):

    A_0 = I/λ₀,  S_0 = 0    (or the caller's initial state; both reset at every document boundary)
    z = A u;  δ = max(1 + u·z, ε);  A ← A − zᵀz/δ;  A ← (A + Aᵀ)/2        Sherman–Morrison
    g = k̂ A  (post-update A);  α̂ = g / max(‖g‖, ε)   (or α = g: ``normalize_write_direction=False``)
    e = v − k̂ S;  S ← S + α̂ᵀ e                                          residual write
    if refresh_t:  A ← A + ρ I                                            identity refresh (after the write)
    o = q S

``k̂`` and ``u`` arrive unit-normalised with the ε floor (``api.normalize``); ``refresh_BT`` and
``document_BT`` are computed by ``api.py``. Differentiated by plain ``jax.grad``; float64 under x64.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def floored_norm(x, eps):
    """max(‖x‖₂, ε) along the last axis, as sqrt(max(‖x‖², ε²)): same value, but a zero gradient at x = 0
    where the gradient of ‖x‖ is NaN (zero and padded rows)."""
    return jnp.sqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), eps * eps))


def jacobian_norm(c):
    """‖I − α̂ k̂ᵀ‖₂ for unit vectors with c = α̂·k̂ (docs/math/vla.md,
                                                      'Jacobian norm'): sqrt((3 − 2c + sqrt(5 − 4c)) / 2) ∈ [1, 2]."""
    return jnp.sqrt((3.0 - 2.0 * c + jnp.sqrt(jnp.maximum(5.0 - 4.0 * c, 0.0))) / 2.0)


def vla_reference(q_BTHK, k_hat_BTHK, u_BTHK, v_BTHV, state_BHKV, penalty_BHKK, document_BT, refresh_BT, *,
                  lambda0, refresh_magnitude, eps, normalize_write_direction=True, diagnostics=False):
    """Returns (o [B,T,H,V], (S [B,H,K,V], A [B,H,K,K])), plus a dict of per-token diagnostics [B,T,H] if
    ``diagnostics``: ``state_norm`` ‖S_t‖_F, ``penalty_norm`` ‖A_t‖_F (after the refresh), ``alignment``
    c_t = α̂_t·k̂_t and ``jacobian_norm`` ‖I − α̂_t k̂_tᵀ‖₂ (closed form, valid for unit α̂ and k̂ only) — and
    ``alpha`` [B,T,H,K]. ``normalize_write_direction=False``: the write direction is g = k̂ A_t itself (the
    VLA paper's unnormalised ablation, Tables 2 and 4)."""
    dtype = state_BHKV.dtype
    dk = k_hat_BTHK.shape[-1]
    eye = jnp.eye(dk, dtype=dtype)
    reset_BT = jnp.concatenate(
        [jnp.zeros_like(document_BT[:, :1], dtype=bool), document_BT[:, 1:] != document_BT[:, :-1]], axis=1)
    seq = [jnp.moveaxis(x, 1, 0) for x in (q_BTHK, k_hat_BTHK, u_BTHK, v_BTHV, reset_BT, refresh_BT)]

    def step(carry, token):
        S, A = carry
        q, k_hat, u, v, reset, refresh = token
        S = jnp.where(reset[:, None, None, None], jnp.zeros_like(S), S)
        A = jnp.where(reset[:, None, None, None], eye / lambda0, A)
        z = jnp.einsum("bhij,bhj->bhi", A, u, precision=_HIGHEST)
        delta = jnp.maximum(1.0 + jnp.sum(u * z, axis=-1), eps)
        A = A - z[..., :, None] * z[..., None, :] / delta[..., None, None]
        A = 0.5 * (A + jnp.swapaxes(A, -1, -2))
        g = jnp.einsum("bhij,bhj->bhi", A, k_hat, precision=_HIGHEST)
        alpha = g / floored_norm(g, eps) if normalize_write_direction else g
        e = v - jnp.einsum("bhk,bhkv->bhv", k_hat, S, precision=_HIGHEST)
        S = S + alpha[..., :, None] * e[..., None, :]
        A = A + jnp.where(refresh[:, None, None, None], refresh_magnitude, 0.0) * eye
        o = jnp.einsum("bhk,bhkv->bhv", q, S, precision=_HIGHEST)
        extra = {}
        if diagnostics:
            c = jnp.sum(alpha * k_hat, axis=-1)
            extra = dict(state_norm=jnp.sqrt(jnp.sum(S * S, axis=(-1, -2))),
                         penalty_norm=jnp.sqrt(jnp.sum(A * A, axis=(-1, -2))),
                         alignment=c, jacobian_norm=jacobian_norm(c), alpha=alpha)
        return (S, A), (o, extra)

    (S, A), (o_TBHV, extra) = jax.lax.scan(step, (state_BHKV, penalty_BHKK), seq)
    o = jnp.moveaxis(o_TBHV, 0, 1)
    if diagnostics:
        return o, (S, A), {name: jnp.moveaxis(x, 0, 1) for name, x in extra.items()}
    return o, (S, A)
