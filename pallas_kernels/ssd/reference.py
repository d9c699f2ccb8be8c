"""Token-by-token grouped scalar-decay recurrence: the oracle of the SSD op (exact to rounding in float64 under
``jax.enable_x64``; differentiated by plain ``jax.grad``).

    S_t = e^{λ_t} S_{t−1} + k_tᵀ v_t,   o_t = q_t S_t     per head h, with q, k of its group g = h // (H/G)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def ssd_reference(q_BTGN, k_BTGN, v_BTHP, log_decay_BTH, state_BHNP, document_BT):
    """All in one float dtype; ``document_BT`` the running count of segment boundaries (a reset where it grows)."""
    heads_per_group = v_BTHP.shape[2] // q_BTGN.shape[2]
    q_BTHN, k_BTHN = (jnp.repeat(x, heads_per_group, axis=2) for x in (q_BTGN, k_BTGN))
    reset_BT = jnp.concatenate(
        [jnp.zeros_like(document_BT[:, :1], dtype=bool), document_BT[:, 1:] != document_BT[:, :-1]], axis=1)
    time_major = [jnp.moveaxis(x, 1, 0) for x in (q_BTHN, k_BTHN, v_BTHP, log_decay_BTH, reset_BT)]

    def step(state_BHNP, token):
        q_BHN, k_BHN, v_BHP, log_decay_BH, reset_B = token
        state_BHNP = jnp.where(reset_B[:, None, None, None], jnp.zeros_like(state_BHNP), state_BHNP)
        state_BHNP = jnp.exp(log_decay_BH)[..., None, None] * state_BHNP + k_BHN[..., :, None] * v_BHP[..., None, :]
        return state_BHNP, jnp.einsum("bhn,bhnp->bhp", q_BHN, state_BHNP, precision=_HIGHEST)

    final_BHNP, out_TBHP = jax.lax.scan(step, state_BHNP, time_major)
    return jnp.moveaxis(out_TBHP, 0, 1), final_BHNP
