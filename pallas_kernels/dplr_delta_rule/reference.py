"""Token-by-token diagonal-plus-low-rank delta rule (docs/math/dplr_delta_rule.md, 'The recurrence'): the
oracle the chunked form is tested against. Differentiated by plain ``jax.grad``; exact to rounding in float64.

Arguments arrive normalised by ``api.py``: one compute dtype, channel-wise log-decay, a state, and
``document_BT`` = the running count of segment boundaries (a reset happens where it increases).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def dplr_reference(q_BTHK, k_BTHK, v_BTHV, alpha_BTHK, beta_BTHK, log_decay_BTHK, state_BHKV, document_BT):
    """S_t = Diag(e^{λ_t}) S_{t−1} + β_tᵀ (α_t S_{t−1}) + k_tᵀ v_t,   o_t = q_t S_t   (row vectors, S key-major)."""
    reset_BT = jnp.concatenate(
        [jnp.zeros_like(document_BT[:, :1], dtype=bool), document_BT[:, 1:] != document_BT[:, :-1]], axis=1)
    time_major = [jnp.moveaxis(x, 1, 0)
                  for x in (q_BTHK, k_BTHK, v_BTHV, alpha_BTHK, beta_BTHK, log_decay_BTHK, reset_BT)]

    def step(state_BHKV, token):
        q_BHK, k_BHK, v_BHV, alpha_BHK, beta_BHK, log_decay_BHK, reset_B = token
        state_BHKV = jnp.where(reset_B[:, None, None, None], jnp.zeros_like(state_BHKV), state_BHKV)
        read_BHV = jnp.einsum("bhk,bhkv->bhv", alpha_BHK, state_BHKV, precision=_HIGHEST)
        state_BHKV = (jnp.exp(log_decay_BHK)[..., None] * state_BHKV + beta_BHK[..., :, None] * read_BHV[..., None, :]
                      + k_BHK[..., :, None] * v_BHV[..., None, :])
        out_BHV = jnp.einsum("bhk,bhkv->bhv", q_BHK, state_BHKV, precision=_HIGHEST)
        return state_BHKV, out_BHV

    final_BHKV, out_TBHV = jax.lax.scan(step, state_BHKV, time_major)
    return jnp.moveaxis(out_TBHV, 0, 1), final_BHKV
