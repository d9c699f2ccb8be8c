"""One-token delta-rule step for inference: the fused single pass of docs/math/delta_rule.md, 'Decode step'.

    a = exp(λ);  [r ; p] = [k̂⊙a ; q̂⊙a] S   (one read of S);  u = v̂ − r
    o = p + ⟨q̂, k⟩ u   (= q̂ S_new without a second read);   S ← Diag(a) S + kᵀ u
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def fused_step(q_BHK, k_BHK, erase_BHK, v_BHV, log_decay_BHK, state_BHKV):
    """Normalised inputs in the compute dtype; returns (o [B,H,V], new state [B,H,K,V])."""
    decay_BHK = jnp.exp(log_decay_BHK)
    rows_BH2K = jnp.stack([erase_BHK * decay_BHK, q_BHK * decay_BHK], axis=-2)
    read_BH2V = jnp.einsum("bhrk,bhkv->bhrv", rows_BH2K, state_BHKV, precision=_HIGHEST)
    pseudo_value_BHV = v_BHV - read_BH2V[..., 0, :]
    query_key_BH = jnp.sum(q_BHK * k_BHK, axis=-1)
    out_BHV = read_BH2V[..., 1, :] + query_key_BH[..., None] * pseudo_value_BHV
    new_state_BHKV = decay_BHK[..., :, None] * state_BHKV + k_BHK[..., :, None] * pseudo_value_BHV[..., None, :]
    return out_BHV, new_state_BHKV
