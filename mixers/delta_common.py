"""Common skeleton of the delta-rule mixers (DeltaNet, Gated DeltaNet, KDA, GDN-2, Muir); math in
docs/math/delta_rule.md, 'Mechanisms as substitutions'.

```
q, k, v = SiLU(ShortConv_K4(x W_q)), SiLU(ShortConv_K4(x W_k)), SiLU(ShortConv_K4(x W_v))   # no biases
q, k    = q / sqrt(sum q^2 + 1e-6), k / sqrt(sum k^2 + 1e-6)                        # per head, float32
gates   = functions of x (not of the conv output), produced by the subclass:
          erase (b or beta), write (w or beta), q_gain (gamma), log_decay (lambda), out_gate (g)
q_hat   = s * gamma * q,  k_hat = b * k,  v_hat = w * v,   s = d_k^-1/2
o, S    = pallas_kernels.delta_rule(q_hat, k, v_hat, erase_key=k_hat, log_decay=lambda, segment_ids=...)
y       = GatedRMSNorm(o; eps) * omega * act(g)      (plain RMSNorm * omega when there is no output gate)
out     = concat_heads(y) W_o                        W_o ~ N(0, spec.out_init_std), no bias
```
A subclass implements ``_build_gates(rngs)`` (create its gate parameters) and ``_gates(x_BTD) -> Gates``;
everything else (projections, convs, L2 norm, op call, decode, cache) lives here. The layer holds no
recurrence math: the parallel forward calls ``pallas_kernels.delta_rule`` and decode
``pallas_kernels.delta_rule_step``.

Cache (``init_cache``): ``{"state": [B, H, d_k, d_v] float32, "conv_q"/"conv_k"/"conv_v": [B, K-1, C]}`` (conv
entries only with ``use_short_conv``). ``decode`` resets a row's cache when its position is 0 (a new
document starts), mirroring the segment resets of the parallel forward.
"""
from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mixerlab import pallas_kernels
from mixerlab.mixers.base import MixerSpec, reset_rows
from mixerlab.mixers.gated_norm import GatedRMSNorm
from mixerlab.mixers.gates import (
    StateAndConvCache, advance_qkv_convs, build_qkv, dense, split_heads)


QK_L2_EPS = 1e-6  # inside the sqrt, per head [FLA l2norm / use_qk_l2norm_in_kernel]


@dataclasses.dataclass(frozen=True)
class DeltaOptions:
    """Fields shared by every delta-rule mixer (each subclass adds its own; docs/mixers.md lists all).

    use_short_conv: bool = True   causal depthwise conv (K=conv_size, no bias) + SiLU on q, k, v [FLA; Muir,
                                  Fig. 3b]. False: SiLU directly on the projections (FLA's fallback).
    conv_size: int = 4            short-conv kernel width [FLA ShortConvolution default, GDN2-code].
    init_scheme: "normal"         N(0, spec.init_std) for input-side matrices (FLA, and mixerlab's decoder);
                                  "xavier_uniform" = gain 2^-2.5 as the NVlabs GDN-2 code [GDN2-code]. The
                                  output projection is always N(0, spec.out_init_std).
    norm_eps: float = 1e-5        eps of the per-head output RMSNorm [FLA, GDN2-code].
    gate_act: "silu"              output-gate activation (silu = g*sigmoid(g) | sigmoid); per-mixer default.
    allow_neg_eigval: bool = False  erase gate x2 (beta in (0,2) / b in (0,2)): eigenvalues of the erase in
                                  (-1, 1] [FLA option, off by default there].
    implementation: str = "auto"  which implementation of the op (pallas_kernels dispatch names).
    chunk_size: int = 0           chunk length of the chunkwise op; 0 = the op's default.
    leaf_size: int = 0            leaf size of the op's block inverse; 0 = the op's default.
    """

    use_short_conv: bool = True
    conv_size: int = 4
    init_scheme: Literal["normal", "xavier_uniform"] = "normal"
    norm_eps: float = 1e-5
    gate_act: Literal["silu", "sigmoid"] = "silu"
    allow_neg_eigval: bool = False
    implementation: str = "auto"
    chunk_size: int = 0
    leaf_size: int = 0


class Gates(NamedTuple):
    """Gate values for a [B, T] block, all float32 and broadcastable against [B, T, H, D]."""

    erase: jax.Array | None  # k_hat = erase * k; [B,T,H,1] (scalar beta) or [B,T,H,Dk]; None: k_hat = k
    write: jax.Array | None  # v_hat = write * v; [B,T,H,1] or [B,T,H,Dv]; None: v_hat = v
    q_gain: jax.Array | None  # q_hat = s * q_gain * q; [B,T,H,Dk] or [H,Dk]; None: gain 1
    log_decay: jax.Array | None  # [B,T,H] (per head) or [B,T,H,Dk] (channel-wise); None: no decay
    out_gate: jax.Array | None  # [B,T,H,Dv] pre-activation g; None: plain RMSNorm output


def l2_normalize(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + QK_L2_EPS)


def _none_if_zero(n: int) -> int | None:
    return n if n > 0 else None


class DeltaMixer(StateAndConvCache):
    """Base layer of the delta-rule family. Subclasses: ``_build_gates`` and ``_gates``."""

    def __init__(self, spec: MixerSpec, options: DeltaOptions, *, rngs: nnx.Rngs):
        self.spec = spec
        self.options = options
        d, H, Dk, Dv = spec.d_model, spec.num_heads, spec.head_dim, spec.value_head_dim
        self.num_heads, self.head_dim, self.value_head_dim = H, Dk, Dv
        self.dtype = spec.dtype
        build_qkv(self, spec, options, rngs)
        self._build_gates(rngs)
        self.o_norm = GatedRMSNorm(Dv, eps=options.norm_eps, activation=options.gate_act, dtype=spec.dtype)
        self.o_proj = dense(H * Dv, d, init_scheme="normal", std=spec.out_init_std, dtype=spec.dtype, rngs=rngs)

    # ---- subclass hooks -------------------------------------------------------------------------------
    def _build_gates(self, rngs: nnx.Rngs) -> None:
        raise NotImplementedError

    def _gates(self, x_BTD: jax.Array) -> Gates:
        raise NotImplementedError

    def _gate_kw(self, rngs: nnx.Rngs) -> dict:
        """Keyword arguments for gate projections (init scheme, std, dtype, rngs)."""
        return dict(init_scheme=self.options.init_scheme, std=self.spec.init_std, dtype=self.dtype, rngs=rngs)

    # ---- shared pieces ---------------------------------------------------------------------------------
    def _project(self, x_BTD):
        return self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)

    def _finish_qkv(self, q, k, v):
        """[B,T,H*D] post-conv streams -> per-head q, k (L2-normalised) and v, in the compute dtype."""
        H = self.num_heads
        q = l2_normalize(split_heads(q, H)).astype(self.dtype)
        k = l2_normalize(split_heads(k, H)).astype(self.dtype)
        return q, k, split_heads(v, H).astype(self.dtype)

    def _core_inputs(self, q, k, v, g: Gates):
        s = self.head_dim ** -0.5
        gain = s if g.q_gain is None else s * g.q_gain
        q_hat = (q.astype(jnp.float32) * gain).astype(self.dtype)
        k_hat = None if g.erase is None else (k.astype(jnp.float32) * g.erase).astype(self.dtype)
        v_hat = v if g.write is None else (v.astype(jnp.float32) * g.write).astype(self.dtype)
        return q_hat, k_hat, v_hat

    def _output(self, o_BTHV, g: Gates):
        y = self.o_norm(o_BTHV, g.out_gate)
        return self.o_proj(y.reshape(*y.shape[:-2], -1)).astype(self.dtype)

    def _run(self, x_BTD, segment_ids, initial_state=None):
        x = x_BTD.astype(self.dtype)
        q, k, v = self._project(x)
        if self.options.use_short_conv:
            q, k, v = self.q_conv(q, segment_ids), self.k_conv(k, segment_ids), self.v_conv(v, segment_ids)
        else:
            q, k, v = jax.nn.silu(q), jax.nn.silu(k), jax.nn.silu(v)
        return self._mix(x, q, k, v, segment_ids, initial_state)

    def _mix(self, x, q, k, v, segment_ids, initial_state):
        """Post-conv q, k, v [B,T,H*D] -> (y, final state): the gates, the delta-rule op and the output."""
        q, k, v = self._finish_qkv(q, k, v)
        g = self._gates(x)
        q_hat, k_hat, v_hat = self._core_inputs(q, k, v, g)
        if k_hat is None:
            k_hat = k
        o, state = pallas_kernels.delta_rule(
            q_hat, k, v_hat, erase_key=k_hat, log_decay=g.log_decay, initial_state=initial_state,
            segment_ids=segment_ids, chunk_size=_none_if_zero(self.options.chunk_size),
            leaf_size=_none_if_zero(self.options.leaf_size), implementation=self.options.implementation)
        return self._output(o, g), state


    def _cached_convs(self, q, k, v, cache, new_cache, advance: str):
        """q, k, v through the short convolutions continuing their cached inputs (``advance``: "step" for one
        token, "extend" for a chunk), the new conv caches written into ``new_cache``; SiLU alone without them."""
        if not self.options.use_short_conv:
            return jax.nn.silu(q), jax.nn.silu(k), jax.nn.silu(v)
        return advance_qkv_convs(self, q, k, v, cache, new_cache, advance)

    def extend(self, x_BCD: jax.Array, cache: dict, positions_BC: jax.Array) -> tuple[jax.Array, dict]:
        """C tokens of one document per row continuing ``cache``: the chunked kernel from the cached state."""
        cache = reset_rows(cache, positions_BC[:, 0])
        x = x_BCD.astype(self.dtype)
        q, k, v = self._project(x)
        new_cache = {}
        q, k, v = self._cached_convs(q, k, v, cache, new_cache, "extend")
        y, state = self._mix(x, q, k, v, None, cache["state"])
        new_cache["state"] = state.astype(jnp.float32)
        return y, new_cache

    def decode(self, x_B1D: jax.Array, cache: dict, positions_B: jax.Array) -> tuple[jax.Array, dict]:
        cache = reset_rows(cache, positions_B)
        x = x_B1D.astype(self.dtype)
        q, k, v = self._project(x[:, 0])
        new_cache = {}
        q, k, v = self._cached_convs(q, k, v, cache, new_cache, "step")
        q, k, v = self._finish_qkv(q, k, v)  # [B, H, D]
        g = self._gates(x)
        g_step = Gates(*(None if a is None else (a[:, 0] if a.ndim >= 3 else a) for a in g))
        q_hat, k_hat, v_hat = self._core_inputs(q, k, v, g_step)
        if k_hat is None:
            k_hat = k
        o, state = pallas_kernels.delta_rule_step(q_hat, k, v_hat, erase_key=k_hat, log_decay=g_step.log_decay,
                                                  state=cache["state"])
        new_cache["state"] = state.astype(jnp.float32)
        return self._output(o[:, None], g), new_cache
