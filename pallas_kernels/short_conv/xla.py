"""The short convolution in pure JAX with a hand-written VJP: the portable implementation.

The backward pass keeps only x and W and recomputes the pre-activation inside its fusions, instead of the
float32 [B, T, C] intermediates autodiff would store and reload."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mixerlab.pallas_kernels.short_conv.reference import acc_dtype, pre_activation, same_segment, taps, unshift


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def causal_conv(x_BTC, w_KC, segment_ids_BT, activation: bool, out_dtype):
    """y_t = act(Σ_i W[K−1−i] x_{t−i} [seg_{t−i} = seg_t]) in ``out_dtype``, float32 inside."""
    acc = pre_activation(x_BTC, w_KC, segment_ids_BT)
    return (jax.nn.silu(acc) if activation else acc).astype(out_dtype)


def _causal_conv_fwd(x_BTC, w_KC, segment_ids_BT, activation, out_dtype):
    return causal_conv(x_BTC, w_KC, segment_ids_BT, activation, out_dtype), (x_BTC, w_KC, segment_ids_BT)


def _causal_conv_bwd(activation, out_dtype, residuals, dy_BTC):
    x_BTC, w_KC, segment_ids_BT = residuals
    k, dtype = w_KC.shape[0], acc_dtype(x_BTC)
    d_acc = dy_BTC.astype(dtype)
    if activation:
        acc = pre_activation(x_BTC, w_KC, segment_ids_BT)
        sig = jax.nn.sigmoid(acc)
        d_acc = d_acc * sig * (1.0 + acc * (1.0 - sig))
    d_acc = d_acc.astype(x_BTC.dtype)  # stored once, in the activations' dtype, for the shifted reads below
    d_x = jnp.zeros(x_BTC.shape, dtype)
    d_w = []
    for i, x_shift in taps(x_BTC, segment_ids_BT, k):
        same = same_segment(segment_ids_BT, i)
        d_tap = d_acc.astype(dtype) if same is None else jnp.where(same, d_acc.astype(dtype), 0.0)
        d_x = d_x + unshift(d_tap, i) * w_KC[k - 1 - i]
        d_w.append(jnp.sum(x_shift * d_tap, axis=(0, 1)))
    d_w += [jnp.zeros(w_KC.shape[1:], dtype)] * (k - len(d_w))  # taps longer than T
    d_w_KC = jnp.stack(d_w[::-1]).astype(w_KC.dtype)  # tap i is row K-1-i
    return d_x.astype(x_BTC.dtype), d_w_KC, None


causal_conv.defvjp(_causal_conv_fwd, _causal_conv_bwd)
