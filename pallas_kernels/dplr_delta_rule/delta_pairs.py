"""The DPLR recurrence run on the delta-rule op's kernels, two delta-rule tokens per DPLR token.

One DPLR step S_t = (Diag(e^{λ_t}) + β_tᵀ α_t) S_{t−1} + k_tᵀ v_t is two steps of the delta rule
S ← (I − k'ᵀ k̂') Diag(e^{λ'}) S + k'ᵀ v̂':
    token 2t     (the transition): q̂ = 0,  k' = −β_t, k̂' = α_t ⊙ e^{−λ_t}, v̂ = 0,   λ' = λ_t
    token 2t + 1 (the write):      q̂ = q_t, k' = k_t,  k̂' = 0,              v̂ = v_t, λ' = 0
The first gives Diag(e^λ) S + β_tᵀ (α_t ⊙ e^{−λ_t} ⊙ e^{λ_t}) S, the second adds k_tᵀ v_t and reads
o_t = q_t S_t. Exact in exact arithmetic; the only new rounding is α's rescaling by e^{−λ} in the operand
dtype. The delta rule's erase reads the decayed state, the DPLR term the old one: hence that rescaling,
which needs e^{−λ} finite — λ > −80 for float32 and bfloat16 operands. RWKV-7's λ lies in (−0.61, 0), so
its mixer picks this path; the op's own "auto" does not (it cannot see λ's values at trace time).

Cost: the delta-rule kernels on 2T tokens (the write tokens' erase rows are zero, which the kernels do not
exploit), so roughly twice a delta-rule call of the same shape — and every backend's Pallas kernels, custom
VJPs and packed-document handling come with it (docs/math/dplr_delta_rule.md, 'Two delta-rule tokens').
"""
from __future__ import annotations

import jax.numpy as jnp

from mixerlab.pallas_kernels.delta_rule import api as delta_rule_api


def interleave(first_BT_, second_BT_):
    """[B, T, ...] twice -> [B, 2T, ...] with first at even and second at odd positions."""
    b, t = first_BT_.shape[:2]
    return jnp.stack([first_BT_, second_BT_], axis=2).reshape(b, 2 * t, *first_BT_.shape[2:])


def run(q, k, v, alpha, beta, log_decay, state, document_BT, *, chunk_size, leaf_size):
    """q, k, v, alpha, beta [B, T, H, D*] in the caller's dtype; log_decay [B, T, H, Dk] and state in the
    compute dtype. chunk_size / leaf_size tile the 2T delta-rule tokens (None: the delta-rule op's per-backend
    defaults)."""
    erase = (alpha.astype(log_decay.dtype) * jnp.exp(-log_decay)).astype(q.dtype)
    none_k, none_v = jnp.zeros_like(q), jnp.zeros_like(v)
    out_B2THV, final = delta_rule_api.delta_rule(
        interleave(none_k, q), interleave(-beta, k), interleave(none_v, v),
        erase_key=interleave(erase, none_k), log_decay=interleave(log_decay, jnp.zeros_like(log_decay)),
        initial_state=state, segment_ids=jnp.repeat(document_BT, 2, axis=1),
        chunk_size=chunk_size, leaf_size=leaf_size)
    return out_B2THV[:, 1::2], final
