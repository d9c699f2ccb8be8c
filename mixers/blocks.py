"""Building blocks shared by the mixers and the decoder: initialisers and rotary position embeddings.

They sit below the mixers (kernels ← blocks ← mixers ← models ← training/eval): nothing here imports a mixer,
a model or the trainer.
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx


def normal(std: float):
    return nnx.initializers.normal(stddev=std)


def rotary(x_BTHD, positions_BT, *, theta: float = 10000.0):
    """Rotary position embedding (half-split layout), in float32, returned in x's dtype."""
    d = x_BTHD.shape[-1]
    if d % 2:
        raise ValueError(f"rotary embedding needs an even head dimension, got {d}")
    freqs = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
    angles = positions_BT.astype(jnp.float32)[:, :, None, None] * freqs  # [B,T,1,D/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x = x_BTHD.astype(jnp.float32)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BTHD.dtype)
