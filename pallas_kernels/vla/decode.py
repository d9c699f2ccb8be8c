"""One-token VLA step for inference (docs/math/vla.md, 'Decode and cost'): the recurrence's loop body,
                                     ≈ 6 d² MACs per head."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mixerlab.pallas_kernels.vla.reference import floored_norm

_HIGHEST = jax.lax.Precision.HIGHEST


def step(q_BHK, k_hat_BHK, u_BHK, v_BHV, S_BHKV, A_BHKK, refresh_B, *, refresh_magnitude, eps,
         normalize_write_direction=True):
    """Normalised inputs in the compute dtype; returns (o [B,H,V], (S, A))."""
    z = jnp.einsum("bhij,bhj->bhi", A_BHKK, u_BHK, precision=_HIGHEST)
    delta = jnp.maximum(1.0 + jnp.sum(u_BHK * z, axis=-1), eps)
    A = A_BHKK - z[..., :, None] * z[..., None, :] / delta[..., None, None]
    A = 0.5 * (A + jnp.swapaxes(A, -1, -2))
    g = jnp.einsum("bhij,bhj->bhi", A, k_hat_BHK, precision=_HIGHEST)
    alpha = g / floored_norm(g, eps) if normalize_write_direction else g
    e = v_BHV - jnp.einsum("bhk,bhkv->bhv", k_hat_BHK, S_BHKV, precision=_HIGHEST)
    S = S_BHKV + alpha[..., :, None] * e[..., None, :]
    A = A + jnp.where(refresh_B[:, None, None, None], refresh_magnitude, 0.0) * jnp.eye(A.shape[-1], dtype=A.dtype)
    o = jnp.einsum("bhk,bhkv->bhv", q_BHK, S, precision=_HIGHEST)
    return o, (S, A)
