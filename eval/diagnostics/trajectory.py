"""Statistics of the delta-rule state S_t along a sequence, computed by the op itself.

``pallas_kernels.delta_rule`` returns only the final state, so the sequence is cut into blocks of ``block``
tokens and the op runs block after block with the previous block's final state as ``initial_state``
(``lax.scan``). ``reduce(S)`` is evaluated on the state after every block: with ``block=1`` that is S_t at
every token. No recurrence is written here.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from mixerlab import pallas_kernels


def frobenius_norm(state_BHKV):
    """‖S‖_F per batch row and head, [B, H]."""
    return jnp.sqrt(jnp.sum(jnp.square(state_BHKV), axis=(-2, -1)))


def row_energy(state_BHKV):
    """‖S_{j,:}‖² per key row j (Muir's state-row energy before the expectation), [B, H, Dk]."""
    return jnp.sum(jnp.square(state_BHKV), axis=-1)


def _blocks(x, block):
    """[B, T, ...] -> [T/block, B, block, ...]."""
    b, t = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, t // block, block, *x.shape[2:]), 1, 0)


def state_trajectory(q, k, v, *, erase_key=None, log_decay=None, initial_state=None, block: int = 1,
                     reduce: Callable = frobenius_norm, implementation: str = "reference"):
    """``reduce(S)`` after tokens block, 2·block, …, T of ``delta_rule(q, k, v, erase_key=, log_decay=)``.

    Arguments are those of ``pallas_kernels.delta_rule`` ([B, T, H, D]; log_decay [B, T, H, Dk] or
    [B, T, H]); T must be a multiple of ``block``. Returns (stacked reductions [T/block, ...], final state).
    """
    t = q.shape[1]
    if not isinstance(block, int) or block < 1 or t % block:
        raise ValueError(f"state_trajectory: block={block!r} must be a positive int dividing T={t}")
    b, _, h, dk = k.shape
    state = (jnp.zeros((b, h, dk, v.shape[-1]), jnp.float64 if v.dtype == jnp.float64 else jnp.float32)
             if initial_state is None else initial_state)
    streams = {"q": q, "k": k, "v": v, "erase_key": erase_key, "log_decay": log_decay}
    xs = {name: _blocks(x, block) for name, x in streams.items() if x is not None}

    def step(S, inputs):
        extra = {name: inputs[name] for name in ("erase_key", "log_decay") if name in inputs}
        _, S = pallas_kernels.delta_rule(inputs["q"], inputs["k"], inputs["v"], initial_state=S,
                                         implementation=implementation, **extra)
        return S, reduce(S)

    final, stats = jax.lax.scan(step, state, xs)
    return stats, final
