"""Common skeleton of the gated linear-attention mixers without an erase term (GLA, HGRN2); math in
docs/mixers.md, 'Recurrent baselines'.

```
q, k, v = x W_q, x W_k, x W_v                           # no biases; optional causal short conv on each
q_hat, k_hat, v_hat, lambda, g = subclass features of (x, q, k, v)       # float32 gates
o, S    = pallas_kernels.delta_rule(q_hat, k_hat, v_hat, erase_key=None, log_decay=lambda, segment_ids=...)
          i.e. S_t = Diag(exp lambda_t) S_{t-1} + k_hat_t^T v_hat_t,  o_t = q_hat_t S_t   (S key-major [d_k, d_v])
out     = subclass output of (o, g), then concat_heads(.) W_o     W_o ~ N(0, spec.out_init_std), no bias
```
A subclass sets ``CONV_ACTIVATION`` (SiLU after the short conv or not) and implements ``_build_gates(rngs)``,
``_features(x, q, k, v) -> Features`` and ``_output(o, out_gate) -> [.., H*d_v]``; projections, convs, the op
call, prefill, extend, decode and the cache live here. The parallel forward calls ``pallas_kernels.delta_rule``
and decode ``pallas_kernels.delta_rule_step``, both with ``erase_key=None`` (no erase: linear attention with a
channel-wise decay).

Cache (``init_cache``): ``{"state": [B, H, d_k, d_v] float32, "conv_q"/"conv_k"/"conv_v": [B, K-1, C]}`` (conv
entries only with ``use_short_conv``); a row whose position is 0 starts from an empty cache.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mixerlab import pallas_kernels
from mixerlab.mixers.base import MixerSpec, reset_rows
from mixerlab.mixers.gates import (
    StateAndConvCache, advance_qkv_convs, build_qkv, dense)


class Features(NamedTuple):
    """What the op gets for a [B, T] (or one-token [B]) block, per head."""

    q: jax.Array  # q_hat [.., H, d_k], compute dtype (the d_k^-1/2 scale applied)
    k: jax.Array  # k_hat [.., H, d_k], compute dtype
    v: jax.Array  # v_hat [.., H, d_v], compute dtype
    log_decay: jax.Array  # lambda <= 0, [.., H, d_k] float32 (float64 for a float64 layer)
    out_gate: jax.Array | None  # [.., H, d_v] pre-activation output gate, or None


def _none_if_zero(n: int) -> int | None:
    return n if n > 0 else None


class GatedLinearMixer(StateAndConvCache):
    """Base layer. Subclasses: ``CONV_ACTIVATION``, ``_build_gates``, ``_features``, ``_output``."""

    CONV_ACTIVATION = True  # SiLU after the short conv (FLA's GLA); HGRN2's conv has none

    def __init__(self, spec: MixerSpec, options, *, rngs: nnx.Rngs):
        self.spec, self.options = spec, options
        d, H, Dk, Dv = spec.d_model, spec.num_heads, spec.head_dim, spec.value_head_dim
        self.num_heads, self.head_dim, self.value_head_dim = H, Dk, Dv
        self.dtype = spec.dtype
        self.gate_dtype = jnp.promote_types(spec.dtype, jnp.float32)  # gates: float32, or float64 in f64 tests
        build_qkv(self, spec, options, rngs, conv_activation=self.CONV_ACTIVATION)
        self._build_gates(rngs)
        self.o_proj = dense(H * Dv, d, init_scheme="normal", std=spec.out_init_std, dtype=spec.dtype, rngs=rngs)

    # ---- subclass hooks -------------------------------------------------------------------------------
    def _build_gates(self, rngs: nnx.Rngs) -> None:
        raise NotImplementedError

    def _features(self, x, q, k, v) -> Features:
        """x [.., d] and the post-conv streams q, k [.., H*d_k], v [.., H*d_v] -> the op's inputs."""
        raise NotImplementedError

    def _output(self, o_HV: jax.Array, out_gate: jax.Array | None) -> jax.Array:
        """o [.., H, d_v] -> [.., H*d_v] in the compute dtype (normalisation, output gate)."""
        raise NotImplementedError

    def _gate_kw(self, rngs: nnx.Rngs) -> dict:
        return dict(init_scheme=self.options.init_scheme, std=self.spec.init_std, dtype=self.dtype, rngs=rngs)

    # ---- shared pieces ---------------------------------------------------------------------------------
    def _project(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def _finish(self, o, out_gate):
        return self.o_proj(self._output(o, out_gate)).astype(self.dtype)

    def _mix(self, x, q, k, v, segment_ids, initial_state):
        f = self._features(x, q, k, v)
        o, state = pallas_kernels.delta_rule(
            f.q, f.k, f.v, erase_key=None, log_decay=f.log_decay, initial_state=initial_state,
            segment_ids=segment_ids, chunk_size=_none_if_zero(self.options.chunk_size),
            leaf_size=_none_if_zero(self.options.leaf_size), implementation=self.options.implementation)
        return self._finish(o, f.out_gate), state

    def _run(self, x_BTD, segment_ids, initial_state=None):
        x = x_BTD.astype(self.dtype)
        q, k, v = self._project(x)
        if self.options.use_short_conv:
            q, k, v = self.q_conv(q, segment_ids), self.k_conv(k, segment_ids), self.v_conv(v, segment_ids)
        return self._mix(x, q, k, v, segment_ids, initial_state)

    def _cached_convs(self, q, k, v, cache, new_cache, advance: str):
        """q, k, v through the short convs continuing their cached inputs (``advance``: "step" | "extend")."""
        if not self.options.use_short_conv:
            return q, k, v
        return advance_qkv_convs(self, q, k, v, cache, new_cache, advance)


    def extend(self, x_BCD: jax.Array, cache: dict, positions_BC: jax.Array) -> tuple[jax.Array, dict]:
        """C tokens of one document per row continuing ``cache``: the chunked op from the cached state."""
        cache = reset_rows(cache, positions_BC[:, 0])
        x = x_BCD.astype(self.dtype)
        new_cache = {}
        q, k, v = self._cached_convs(*self._project(x), cache, new_cache, "extend")
        y, state = self._mix(x, q, k, v, None, cache["state"])
        new_cache["state"] = state.astype(jnp.float32)
        return y, new_cache

    def decode(self, x_B1D: jax.Array, cache: dict, positions_B: jax.Array) -> tuple[jax.Array, dict]:
        cache = reset_rows(cache, positions_B)
        x = x_B1D[:, 0].astype(self.dtype)
        new_cache = {}
        q, k, v = self._cached_convs(*self._project(x), cache, new_cache, "step")
        f = self._features(x, q, k, v)  # [B, H, D]
        o, state = pallas_kernels.delta_rule_step(f.q, f.k, f.v, erase_key=None, log_decay=f.log_decay,
                                                  state=cache["state"])
        new_cache["state"] = state.astype(jnp.float32)
        return self._finish(o, f.out_gate)[:, None], new_cache
