"""Backbone pieces of the decoder: RMSNorm and the feed-forward networks (the building blocks the mixers use too —
initialisers, rotary embeddings — live below the mixers, in mixers/blocks.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mixerlab.mixers.blocks import normal


class RMSNorm(nnx.Module):
    """y = x / rms(x) * scale, computed in float32, returned in x's dtype."""

    def __init__(self, dim: int, *, eps: float = 1e-6):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...]).astype(x.dtype)


class SwiGLU(nnx.Module):
    """Llama FFN: down(silu(gate(x)) * up(x)); the residual projection `down` gets the small init."""

    def __init__(self, d_model: int, ffn_dim: int, *, init_std: float, out_init_std: float, dtype, rngs: nnx.Rngs):
        lin = lambda i, o, std: nnx.Linear(i, o, use_bias=False, dtype=dtype, kernel_init=normal(std), rngs=rngs)
        self.gate = lin(d_model, ffn_dim, init_std)
        self.up = lin(d_model, ffn_dim, init_std)
        self.down = lin(ffn_dim, d_model, out_init_std)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": jax.nn.gelu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),
}


class MLP(nnx.Module):
    """Two-matrix FFN down(act(up(x))): the parameter accounting of the Muir paper's tables (Table 11)."""

    def __init__(self, d_model: int, ffn_dim: int, *, activation: str, init_std: float, out_init_std: float,
                 dtype, rngs: nnx.Rngs):
        self.activation = activation
        self.up = nnx.Linear(d_model, ffn_dim, use_bias=False, dtype=dtype, kernel_init=normal(init_std), rngs=rngs)
        self.down = nnx.Linear(ffn_dim, d_model, use_bias=False, dtype=dtype, kernel_init=normal(out_init_std),
                               rngs=rngs)

    def __call__(self, x):
        return self.down(_ACTIVATIONS[self.activation](self.up(x)))
