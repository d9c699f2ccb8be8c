"""One-token DPLR delta-rule step (docs/math/dplr_delta_rule.md, 'Decode step'): one read of the state.

    a = e^{λ};  [r ; p] = [α ; q⊙a] S          (both rows against the old state)
    o = p + ⟨q, β⟩ r + ⟨q, k⟩ v               (= q S_new without a second read)
    S ← Diag(a) S + βᵀ r + kᵀ v
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def fused_step(q_BHK, k_BHK, v_BHV, alpha_BHK, beta_BHK, log_decay_BHK, state_BHKV):
    """Inputs in the compute dtype; returns (o [B,H,V], new state [B,H,K,V])."""
    decay_BHK = jnp.exp(log_decay_BHK)
    rows_BH2K = jnp.stack([alpha_BHK, q_BHK * decay_BHK], axis=-2)
    read_BH2V = jnp.einsum("bhrk,bhkv->bhrv", rows_BH2K, state_BHKV, precision=_HIGHEST)
    read_BHV, carried_BHV = read_BH2V[..., 0, :], read_BH2V[..., 1, :]
    query_beta_BH = jnp.sum(q_BHK * beta_BHK, axis=-1)[..., None]
    query_key_BH = jnp.sum(q_BHK * k_BHK, axis=-1)[..., None]
    out_BHV = carried_BHV + query_beta_BH * read_BHV + query_key_BH * v_BHV
    new_state_BHKV = (decay_BHK[..., :, None] * state_BHKV + beta_BHK[..., :, None] * read_BHV[..., None, :]
                      + k_BHK[..., :, None] * v_BHV[..., None, :])
    return out_BHV, new_state_BHKV
