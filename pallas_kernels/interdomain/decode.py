"""One-token step of the interdomain (complex diagonal S4D) recurrence, in real arithmetic.

Complex state rows are stacked ``[Re; Im]``: ``X̂ = [Re X; Im X]`` of shape ``[.., 2M, C]``.
Per head, one token (docs/math/interdomain.md 'Recurrence and readout', "contract the query first"):

    X   ← Λ ⊙ X + b zᵀ                       Λ = exp(r + iθ) applied as a 2×2 rotation-scaling per mode
    â   = X̂ᵏ ξq                  (2M)          O(M R)
    ω   = Ĝ â                    (2M)          O(M²)
    o   = ωᵀ X̂ᵛ                  (d_v)         O(M d_v)

Cost O(M(R + d_v) + M²) per head and token (IAs; IA1's O(M²(R+d)) is the "form U, Γ first" order).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def split(x, axis=-2):
    """``[.., 2M, ..]`` stacked [Re; Im] -> (Re, Im)."""
    m = x.shape[axis] // 2
    return jax.lax.slice_in_dim(x, 0, m, axis=axis), jax.lax.slice_in_dim(x, m, 2 * m, axis=axis)


def rotate(x_BH2MC, log_modulus_BHM, cos_HM, sin_HM):
    """Λ ⊙ X for stacked complex rows: Λ_m = exp(r_m) (cos θ_m + i sin θ_m)."""
    re, im = split(x_BH2MC)
    mag = jnp.exp(log_modulus_BHM)[..., None]
    c, s = cos_HM[..., None], sin_HM[..., None]
    return jnp.concatenate([mag * (c * re - s * im), mag * (s * re + c * im)], axis=-2)


def write(x_BH2MC, gain_H2M, z_BHC):
    """X + b zᵀ with b = gain (stacked [Re b; Im b]) broadcast over the columns."""
    return x_BH2MC + gain_H2M[..., :, None] * z_BHC[..., None, :]


def interdomain_step(q_BHR, k_BHR, v_BHV, log_modulus_BHM, cos_HM, sin_HM, gain_H2M, readout_H2M2M,
                     key_BH2MR, value_BH2MV):
    """Inputs in the compute dtype. Returns (o [B,H,V], new key state, new value state)."""
    key = write(rotate(key_BH2MR, log_modulus_BHM, cos_HM, sin_HM), gain_H2M, k_BHR)
    value = write(rotate(value_BH2MV, log_modulus_BHM, cos_HM, sin_HM), gain_H2M, v_BHV)
    a = jnp.einsum("bhmr,bhr->bhm", key, q_BHR, precision=HIGHEST)
    w = jnp.einsum("hmn,bhn->bhm", readout_H2M2M, a, precision=HIGHEST)
    o = jnp.einsum("bhm,bhmv->bhv", w, value, precision=HIGHEST)
    return o, key, value


def s4d_step(z_BHC, log_modulus_BHM, cos_HM, sin_HM, gain_H2M, readout_H2M, state_BH2MC):
    """S4D-only: X ← Λ ⊙ X + b zᵀ;  o = ωᵀ X̂ (a fixed real 2M readout vector per head)."""
    state = write(rotate(state_BH2MC, log_modulus_BHM, cos_HM, sin_HM), gain_H2M, z_BHC)
    o = jnp.einsum("hm,bhmc->bhc", readout_H2M, state, precision=HIGHEST)
    return o, state
