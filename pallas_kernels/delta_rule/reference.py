"""Token-by-token delta rule (pseudo-value form, docs/math/delta_rule.md 'The recurrence'): the oracle every other
implementation is tested
against. Differentiated by plain ``jax.grad``; exact to rounding in float64 (under ``jax.enable_x64``).

All arguments arrive normalised by ``api.py``: one float compute dtype, channel-wise log-decay, a state, and
``document_BT`` = number of segment boundaries up to and including t (so a reset happens where it increases).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def delta_rule_reference(q_BTHK, k_BTHK, erase_BTHK, v_BTHV, log_decay_BTHK, state_BHKV, document_BT):
    """S_t = (I − k_tᵀ k̂_t) Diag(e^{λ_t}) S_{t−1} + k_tᵀ v̂_t,  o_t = q̂_t S_t  (row vectors, S key-major)."""
    reset_BT = jnp.concatenate(
        [jnp.zeros_like(document_BT[:, :1], dtype=bool), document_BT[:, 1:] != document_BT[:, :-1]], axis=1)
    time_major = [jnp.moveaxis(x, 1, 0) for x in (q_BTHK, k_BTHK, erase_BTHK, v_BTHV, log_decay_BTHK, reset_BT)]

    def step(state_BHKV, token):
        q_BHK, k_BHK, erase_BHK, v_BHV, log_decay_BHK, reset_B = token
        state_BHKV = jnp.where(reset_B[:, None, None, None], jnp.zeros_like(state_BHKV), state_BHKV)
        decayed_BHKV = jnp.exp(log_decay_BHK)[..., None] * state_BHKV
        read_BHV = jnp.einsum("bhk,bhkv->bhv", erase_BHK, decayed_BHKV, precision=_HIGHEST)
        pseudo_value_BHV = v_BHV - read_BHV
        state_BHKV = decayed_BHKV + k_BHK[..., :, None] * pseudo_value_BHV[..., None, :]
        out_BHV = jnp.einsum("bhk,bhkv->bhv", q_BHK, state_BHKV, precision=_HIGHEST)
        return state_BHKV, out_BHV

    final_BHKV, out_TBHV = jax.lax.scan(step, state_BHKV, time_major)
    return jnp.moveaxis(out_TBHV, 0, 1), final_BHKV
