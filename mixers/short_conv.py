"""Causal depthwise short convolution with segment resets and a decode cache.

The same block as FLA's ``ShortConvolution`` [FLA ``fla/modules/conv/short_conv.py``]: depthwise (one kernel
per channel), causal (left padding K-1), no bias, SiLU after the convolution. Two additions for mixerlab:

* **Segment resets.** With packed documents the window of token t only sees tokens t-i of the *same*
  document: ``y_t = sum_i W[K-1-i] * x_{t-i} * [d_{t-i} == d_t]``, d the document index (a new document
  wherever the segment id changes, so a reused id is a new document). Nothing crosses a boundary.
* **Decode cache.** The last K-1 *pre-conv* inputs per channel, ``[B, K-1, C]`` (oldest first).

Kernel init is PyTorch's ``nn.Conv1d`` default (what FLA gets): U(-1/sqrt(K), 1/sqrt(K)), fan_in = K for a
depthwise conv. The kernel is a ``ShortConvKernel`` (an ``nnx.Param`` subclass) so that parameter accounting
can leave it out of the "matrices only" count by type (models/param_count.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mixerlab.pallas_kernels import common
from mixerlab.pallas_kernels.short_conv import api, reference

# The op lives in pallas_kernels/short_conv/; these names stay importable from here.
_pre_activation = reference.pre_activation


def causal_conv(x_BTC, w_KC, segment_ids_BT, activation: bool, out_dtype, implementation: str = "auto"):
    """y_t = act(Σ_i W[K−1−i] x_{t−i} [d_{t−i} == d_t]) (d: document index) in ``out_dtype``, float32 inside (the op's
    ``causal_conv``: the Pallas-Triton kernels on GPU, the XLA custom VJP elsewhere)."""
    return api.causal_conv(x_BTC, w_KC, segment_ids_BT, activation, out_dtype, implementation)


class ShortConvKernel(nnx.Param):
    """Depthwise short-conv kernel ``[K, C]`` (an ordinary weight; not a "matrix" for parameter accounting)."""


class ShortConv(nnx.Module):
    """Causal depthwise conv over ``[B, T, C]`` + SiLU (optional), resetting at segment boundaries."""

    def __init__(self, channels: int, kernel_size: int = 4, *, activation: bool = True, dtype=jnp.float32,
                 implementation: str = "auto", rngs: nnx.Rngs):
        self.channels = channels
        self.implementation = implementation  # the op's implementation (pallas_kernels/short_conv/api.py)
        self.kernel_size = kernel_size
        self.activation = activation
        self.dtype = dtype
        bound = 1.0 / kernel_size ** 0.5
        self.kernel = ShortConvKernel(
            jax.random.uniform(rngs.params(), (kernel_size, channels), jnp.float32, -bound, bound))

    def _act(self, y):
        return jax.nn.silu(y) if self.activation else y

    def __call__(self, x_BTC: jax.Array, segment_ids_BT: jax.Array | None = None) -> jax.Array:
        return causal_conv(x_BTC, self.kernel[...], segment_ids_BT, self.activation, jnp.dtype(self.dtype),
                           self.implementation)

    def init_cache(self, batch_size: int) -> jax.Array:
        return jnp.zeros((batch_size, self.kernel_size - 1, self.channels), self.dtype)

    def step(self, x_BC: jax.Array, cache_BKC: jax.Array) -> tuple[jax.Array, jax.Array]:
        """One token: ``cache`` holds the previous K-1 pre-conv inputs (oldest first)."""
        window = jnp.concatenate([cache_BKC.astype(jnp.float32), x_BC[:, None].astype(jnp.float32)], axis=1)
        w_KC = self.kernel[...]
        acc = jnp.zeros(x_BC.shape, jnp.float32)
        for i in range(self.kernel_size):  # same summation order as __call__
            acc = acc + window[:, self.kernel_size - 1 - i] * w_KC[self.kernel_size - 1 - i]
        new_cache = window[:, 1:].astype(cache_BKC.dtype)
        return self._act(acc).astype(self.dtype), new_cache

    def extend(self, x_BTC: jax.Array, cache_BKC: jax.Array) -> tuple[jax.Array, jax.Array]:
        """T tokens of one document continuing ``cache`` (the previous K-1 pre-conv inputs): the convolution of
        [cache; x] without its first K-1 outputs, and the cache after the last token (chunked prefill)."""
        km1 = self.kernel_size - 1
        window = jnp.concatenate([cache_BKC.astype(x_BTC.dtype), x_BTC], axis=1)
        y = self(window)[:, km1:]
        return y, window[:, window.shape[1] - km1:].astype(cache_BKC.dtype)

    def cache_from_sequence(self, x_BTC: jax.Array, segment_ids_BT: jax.Array | None = None) -> jax.Array:
        """The decode cache after a prefill of ``x``: its last K-1 inputs of the last token's document."""
        B, T, C = x_BTC.shape
        km1 = self.kernel_size - 1
        x = jnp.pad(x_BTC, ((0, 0), (max(km1 - T, 0), 0), (0, 0)))[:, -km1:]
        if segment_ids_BT is not None:  # the document index: an id reused after another document is a new one
            document = common.document_index(segment_ids_BT, B, T)
            doc = jnp.pad(document, ((0, 0), (max(km1 - T, 0), 0)), constant_values=-1)[:, -km1:]
            x = jnp.where((doc == document[:, -1:])[..., None], x, 0)
        return x.astype(self.dtype)
