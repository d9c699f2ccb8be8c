"""The short convolution (mixers/short_conv.py) against its formula with packed documents:
y_t = act(Σ_i W[K−1−i] x_{t−i} [seg_{t−i} == seg_t]), the prefill cache of a packed row (the last K−1
inputs of the LAST document, zeros before its start), and token-by-token decode == the parallel form."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mixerlab.mixers.short_conv import ShortConv

K, C = 4, 3
SEG = np.array([[1, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3], [1, 2, 2, 2, 2, 2, 2, 2, 2, 4, 4, 4]], np.int32)
TOL = 1e-6  # float32; the formula is summed in the same order in float64


def _conv_and_inputs(seed=0):
    conv = ShortConv(C, K, activation=False, rngs=nnx.Rngs(seed))
    x = np.random.default_rng(seed).normal(size=(*SEG.shape, C)).astype(np.float32)
    return conv, x


def _formula(w, x, seg):
    y = np.zeros(x.shape, np.float64)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            for i in range(K):
                if t - i >= 0 and seg[b, t - i] == seg[b, t]:
                    y[b, t] += w[K - 1 - i] * x[b, t - i]
    return y


def test_parallel_equals_formula_with_segment_resets():
    conv, x = _conv_and_inputs()
    y = conv(jnp.asarray(x), jnp.asarray(SEG))
    np.testing.assert_allclose(np.asarray(y), _formula(np.asarray(conv.kernel[...]), x, SEG), atol=TOL)


def test_prefill_cache_and_decode_continue_the_last_document():
    """Cache after a prefill of tokens [0, 10) holds the last document's inputs only (row 0: document 3 began
    at 7, so the K−1 = 3 cached inputs are x_7..x_9; row 1: document 4 began at 9, so [0, 0, x_9]); decoding
    tokens 10, 11 from it equals the parallel output."""
    conv, x = _conv_and_inputs(1)
    t0 = 10
    cache = np.asarray(conv.cache_from_sequence(jnp.asarray(x[:, :t0]), jnp.asarray(SEG[:, :t0])))
    np.testing.assert_array_equal(cache[0], x[0, 7:10])
    np.testing.assert_array_equal(cache[1], np.concatenate([np.zeros((2, C), np.float32), x[1, 9:10]]))
    y_par = np.asarray(conv(jnp.asarray(x), jnp.asarray(SEG)))
    cache = jnp.asarray(cache)
    for t in range(t0, SEG.shape[1]):
        y_t, cache = conv.step(jnp.asarray(x[:, t]), cache)
        np.testing.assert_allclose(np.asarray(y_t), y_par[:, t], atol=TOL)
