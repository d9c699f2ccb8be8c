"""The short convolution written out tap by tap: the oracle the other implementations are tested against.

    y_t = act(Σ_{i<K} W[K−1−i] · x_{t−i} · [seg_{t−i} = seg_t])        (depthwise: per channel)

Tap i looks i tokens back; a tap that reaches before the row's start or into another document adds nothing.
``seg`` here is the document index that the op's entry derives from the segment ids (``common.document_index``:
equal values = same document); raw ids would join a reused id to the earlier document of the same id.
Accumulates in float32, or float64 for float64 inputs (so tests can compare against float64); differentiated
by plain autodiff.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def shift(x_BTC, i):
    """x[:, t − i] (zeros before the start)."""
    return jnp.pad(x_BTC, ((0, 0), (i, 0), (0, 0)))[:, :x_BTC.shape[1]]


def unshift(x_BTC, i):
    """x[:, t + i] (zeros after the end)."""
    return jnp.pad(x_BTC, ((0, 0), (0, i), (0, 0)))[:, i:]


def same_segment(segment_ids_BT, i):
    """[B, T, 1]: token t − i is in token t's document (``segment_ids_BT``: the document index; None without
    segments)."""
    if segment_ids_BT is None:
        return None
    back = jnp.pad(segment_ids_BT, ((0, 0), (i, 0)), constant_values=-1)[:, :segment_ids_BT.shape[1]]
    return (back == segment_ids_BT)[..., None]


def acc_dtype(x):
    """float32 accumulation (float64 for float64 inputs)."""
    return jnp.promote_types(x.dtype, jnp.float32)


def taps(x_BTC, segment_ids_BT, kernel_size):
    """(i, x[t − i] masked to t's segment, in the accumulation dtype) for the taps that fit in T."""
    for i in range(min(kernel_size, x_BTC.shape[1])):
        x_shift = shift(x_BTC, i).astype(acc_dtype(x_BTC))
        same = same_segment(segment_ids_BT, i)
        yield i, x_shift if same is None else jnp.where(same, x_shift, 0.0)


def pre_activation(x_BTC, w_KC, segment_ids_BT):
    """Σ_i W[K−1−i] x_{t−i} [seg_{t−i} = seg_t] in the accumulation dtype."""
    k = w_KC.shape[0]
    acc = jnp.zeros(x_BTC.shape, acc_dtype(x_BTC))
    for i, x_shift in taps(x_BTC, segment_ids_BT, k):  # tap i looks i tokens back
        acc = acc + x_shift * w_KC[k - 1 - i]
    return acc


def causal_conv_reference(x_BTC, w_KC, segment_ids_BT, activation: bool, out_dtype):
    """act(pre_activation) in ``out_dtype``; act = SiLU when ``activation``."""
    acc = pre_activation(x_BTC, w_KC, segment_ids_BT)
    return (jax.nn.silu(acc) if activation else acc).astype(out_dtype)
