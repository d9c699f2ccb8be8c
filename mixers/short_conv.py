"""Causal depthwise short convolution with segment resets and a decode cache.

The same block as FLA's ``ShortConvolution`` [FLA ``fla/modules/conv/short_conv.py``]: depthwise (one kernel
per channel), causal (left padding K-1), no bias, SiLU after the convolution. Two additions for mixerlab:

* **Segment resets.** With packed documents the window of token t only sees tokens t-i of the *same*
  segment: ``y_t = sum_i W[K-1-i] * x_{t-i} * [seg_{t-i} == seg_t]``. Nothing crosses a boundary.
* **Decode cache.** The last K-1 *pre-conv* inputs per channel, ``[B, K-1, C]`` (oldest first).

Kernel init is PyTorch's ``nn.Conv1d`` default (what FLA gets): U(-1/sqrt(K), 1/sqrt(K)), fan_in = K for a
depthwise conv. The kernel is a ``ShortConvKernel`` (an ``nnx.Param`` subclass) so that parameter accounting
can leave it out of the "matrices only" count by type (models/param_count.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx


def _shift(x_BTC, i):
    """x[:, t - i] (zeros before the start)."""
    return jnp.pad(x_BTC, ((0, 0), (i, 0), (0, 0)))[:, :x_BTC.shape[1]]


def _unshift(x_BTC, i):
    """x[:, t + i] (zeros after the end)."""
    return jnp.pad(x_BTC, ((0, 0), (0, i), (0, 0)))[:, i:]


def _same_segment(segment_ids_BT, i):
    """[B, T, 1]: token t - i is in token t's segment."""
    if segment_ids_BT is None:
        return None
    back = jnp.pad(segment_ids_BT, ((0, 0), (i, 0)), constant_values=-1)[:, :segment_ids_BT.shape[1]]
    return (back == segment_ids_BT)[..., None]


def _acc_dtype(x):
    """float32 accumulation (float64 for float64 inputs, so tests can check against float64)."""
    return jnp.promote_types(x.dtype, jnp.float32)


def _taps(x_BTC, segment_ids_BT, kernel_size):
    """(i, x[t - i] masked to t's segment, in the accumulation dtype) for the taps that fit in T."""
    for i in range(min(kernel_size, x_BTC.shape[1])):
        x_shift = _shift(x_BTC, i).astype(_acc_dtype(x_BTC))
        same = _same_segment(segment_ids_BT, i)
        yield i, x_shift if same is None else jnp.where(same, x_shift, 0.0)


def _pre_activation(x_BTC, w_KC, segment_ids_BT):
    k = w_KC.shape[0]
    acc = jnp.zeros(x_BTC.shape, _acc_dtype(x_BTC))
    for i, x_shift in _taps(x_BTC, segment_ids_BT, k):  # tap i looks i tokens back
        acc = acc + x_shift * w_KC[k - 1 - i]
    return acc


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def causal_conv(x_BTC, w_KC, segment_ids_BT, activation: bool, out_dtype):
    """y_t = act(sum_i W[K-1-i] x_{t-i} [seg_{t-i} == seg_t]) in ``out_dtype``, float32 inside.

    Custom VJP: the backward pass keeps only x and W and recomputes the pre-activation inside its fusions,
    instead of the float32 [B, T, C] intermediates autodiff would store and reload (the short convs were the
    largest non-matmul cost of a GDN-2 training step on the GPU)."""
    acc = _pre_activation(x_BTC, w_KC, segment_ids_BT)
    return (jax.nn.silu(acc) if activation else acc).astype(out_dtype)


def _causal_conv_fwd(x_BTC, w_KC, segment_ids_BT, activation, out_dtype):
    return causal_conv(x_BTC, w_KC, segment_ids_BT, activation, out_dtype), (x_BTC, w_KC, segment_ids_BT)


def _causal_conv_bwd(activation, out_dtype, residuals, dy_BTC):
    x_BTC, w_KC, segment_ids_BT = residuals
    k, acc_dtype = w_KC.shape[0], _acc_dtype(x_BTC)
    d_acc = dy_BTC.astype(acc_dtype)
    if activation:
        acc = _pre_activation(x_BTC, w_KC, segment_ids_BT)
        sig = jax.nn.sigmoid(acc)
        d_acc = d_acc * sig * (1.0 + acc * (1.0 - sig))
    d_acc = d_acc.astype(x_BTC.dtype)  # stored once, in the activations' dtype, for the shifted reads below
    d_x = jnp.zeros(x_BTC.shape, acc_dtype)
    d_w = []
    for i, x_shift in _taps(x_BTC, segment_ids_BT, k):
        same = _same_segment(segment_ids_BT, i)
        d_tap = d_acc.astype(acc_dtype) if same is None else jnp.where(same, d_acc.astype(acc_dtype), 0.0)
        d_x = d_x + _unshift(d_tap, i) * w_KC[k - 1 - i]
        d_w.append(jnp.sum(x_shift * d_tap, axis=(0, 1)))
    d_w += [jnp.zeros(w_KC.shape[1:], acc_dtype)] * (k - len(d_w))  # taps longer than T
    d_w_KC = jnp.stack(d_w[::-1]).astype(w_KC.dtype)  # tap i is row K-1-i
    return d_x.astype(x_BTC.dtype), d_w_KC, None


causal_conv.defvjp(_causal_conv_fwd, _causal_conv_bwd)


class ShortConvKernel(nnx.Param):
    """Depthwise short-conv kernel ``[K, C]`` (an ordinary weight; not a "matrix" for parameter accounting)."""


class ShortConv(nnx.Module):
    """Causal depthwise conv over ``[B, T, C]`` + SiLU (optional), resetting at segment boundaries."""

    def __init__(self, channels: int, kernel_size: int = 4, *, activation: bool = True, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.channels = channels
        self.kernel_size = kernel_size
        self.activation = activation
        self.dtype = dtype
        bound = 1.0 / kernel_size ** 0.5
        self.kernel = ShortConvKernel(
            jax.random.uniform(rngs.params(), (kernel_size, channels), jnp.float32, -bound, bound))

    def _act(self, y):
        return jax.nn.silu(y) if self.activation else y

    def __call__(self, x_BTC: jax.Array, segment_ids_BT: jax.Array | None = None) -> jax.Array:
        return causal_conv(x_BTC, self.kernel[...], segment_ids_BT, self.activation, jnp.dtype(self.dtype))

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

    def cache_from_sequence(self, x_BTC: jax.Array, segment_ids_BT: jax.Array | None = None) -> jax.Array:
        """The decode cache after a prefill of ``x``: its last K-1 inputs of the last token's segment."""
        B, T, C = x_BTC.shape
        km1 = self.kernel_size - 1
        x = jnp.pad(x_BTC, ((0, 0), (max(km1 - T, 0), 0), (0, 0)))[:, -km1:]
        if segment_ids_BT is not None:
            seg = jnp.pad(segment_ids_BT, ((0, 0), (max(km1 - T, 0), 0)), constant_values=-1)[:, -km1:]
            x = jnp.where((seg == segment_ids_BT[:, -1:])[..., None], x, 0)
        return x.astype(self.dtype)
