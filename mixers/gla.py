"""GLA, Gated Linear Attention (Yang, Wang, Shen, Panda, Kim, "Gated Linear Attention Transformers with
Hardware-Efficient Training", ICML 2024, §4); the block of FLA ``fla/layers/gla.py``.

    q, k, v  = x W_q, x W_k, x W_v                     (no biases, no feature map, no short conv by default)
    lambda_t = max(logsigmoid(x_t W_down W_up + b) / tau, clamp_min)   channel-wise [B,T,H,d_k]
               (W_down: d -> 16, W_up: 16 -> H d_k, bias b init 0; tau = gate_logit_normalizer = 16:
                alpha_t = sigmoid(.)^(1/tau), GLA paper §4)
    S_t = Diag(exp lambda_t) S_{t-1} + k_t^T v_t,   o_t = s q_t S_t,  s = d_k^-1/2
    y   = RMSNorm(o) * omega * SiLU(x W_g)   per head (FLA FusedRMSNormGated), W_g dense d -> H d_v
    out = concat_heads(y) W_o
    op inputs: q_hat = s q, k_hat = k, v_hat = v, erase_key None, log_decay channel-wise.

Head layout: d_k = model.head_dim, d_v = model.value_head_dim, H = model.num_heads. FLA sizes keys and values
by ratios of d instead (expand_k = 0.5, expand_v = 1, 4 heads): its layout is model.head_dim = d / (2H) and
model.value_head_dim = d / H, which is what configs/paper/gla_166m.yaml and configs/lm_compare/gla.yaml set.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from mixerlab.mixers.gated_norm import GatedRMSNorm
from mixerlab.mixers.gates import LowRank, dense, split_heads
from mixerlab.mixers.gla_common import Features, GatedLinearMixer
from mixerlab.mixers.registry import register


@dataclasses.dataclass(frozen=True)
class GLAOptions:
    """GLA options (docs/mixers.md, 'gla').

    gate_low_rank_dim: int = 16        rank of the forget-gate projection W_down W_up [FLA, GLA paper §4].
    gate_logit_normalizer: float = 16  tau: lambda = logsigmoid(.) / tau [FLA, GLA paper §4].
    clamp_min: float = 0.0             lower clamp of lambda (FLA clamp_min); 0 = no clamp (FLA's None: a clamp
                                       at 0 would remove the decay, so 0 is free to mean "off"); else < 0 [FLA].
    use_output_gate: bool = True       RMSNorm(o) * omega * SiLU(x W_g); False: plain RMSNorm * omega [FLA].
    use_short_conv: bool = False       causal depthwise conv (K=conv_size, no bias) + SiLU on q, k, v [FLA].
    conv_size: int = 4                 its kernel width [FLA].
    norm_eps: float = 1e-6             eps of the per-head output RMSNorm [FLA GLAConfig; the bare layer: 1e-5].
    init_scheme: "normal"              N(0, spec.init_std) for input-side matrices, bias 0 (FLA _init_weights)
                                       | "xavier_uniform" (gain 2^-2.5) [ours]. W_o: N(0, spec.out_init_std).
    implementation: str = "auto"       which implementation of the op.
    chunk_size: int = 0                chunk length of the chunkwise op; 0 = the op's default.
    leaf_size: int = 0                 leaf size of the op's block inverse; 0 = the op's default.
    """

    gate_low_rank_dim: int = 16
    gate_logit_normalizer: float = 16.0
    clamp_min: float = 0.0
    use_output_gate: bool = True
    use_short_conv: bool = False
    conv_size: int = 4
    norm_eps: float = 1e-6
    init_scheme: Literal["normal", "xavier_uniform"] = "normal"
    implementation: str = "auto"
    chunk_size: int = 0
    leaf_size: int = 0

    def __post_init__(self):
        if self.clamp_min > 0:
            raise ValueError(f"mixers.gla.clamp_min must be <= 0 (0 = no clamp), got {self.clamp_min}")
        if self.gate_logit_normalizer <= 0:
            raise ValueError(f"mixers.gla.gate_logit_normalizer must be > 0, got {self.gate_logit_normalizer}")
        if self.gate_low_rank_dim < 1:
            raise ValueError(f"mixers.gla.gate_low_rank_dim must be >= 1, got {self.gate_low_rank_dim}")


def gla_log_decay(z: jax.Array, normalizer: float, clamp_min: float) -> jax.Array:
    """lambda = logsigmoid(z) / normalizer, clamped below at clamp_min (0 = no clamp); float32 at least, <= 0."""
    lam = jax.nn.log_sigmoid(z.astype(jnp.promote_types(z.dtype, jnp.float32))) / normalizer
    return jnp.maximum(lam, clamp_min) if clamp_min < 0 else lam


@register("gla", GLAOptions)
class GLA(GatedLinearMixer):
    CONV_ACTIVATION = True  # FLA's GLA: ShortConvolution(activation='silu')

    def _build_gates(self, rngs):
        d, H, Dk, Dv = self.spec.d_model, self.num_heads, self.head_dim, self.value_head_dim
        o = self.options
        kw = self._gate_kw(rngs)
        self.gk_proj = LowRank(d, o.gate_low_rank_dim, H * Dk, use_bias=True, **kw)
        if o.use_output_gate:
            self.g_proj = dense(d, H * Dv, **kw)
        self.o_norm = GatedRMSNorm(Dv, eps=o.norm_eps, activation="silu", dtype=self.dtype)

    def _features(self, x, q, k, v):
        H, o = self.num_heads, self.options
        s = self.head_dim ** -0.5
        q = (split_heads(q, H).astype(self.gate_dtype) * s).astype(self.dtype)
        lam = split_heads(gla_log_decay(self.gk_proj(x), o.gate_logit_normalizer, o.clamp_min), H)
        g = split_heads(self.g_proj(x), H) if o.use_output_gate else None
        return Features(q, split_heads(k, H).astype(self.dtype), split_heads(v, H).astype(self.dtype), lam, g)

    def _output(self, o, out_gate):
        y = self.o_norm(o, out_gate)
        return y.reshape(*y.shape[:-2], -1)
