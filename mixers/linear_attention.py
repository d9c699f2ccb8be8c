"""Causal linear attention (Katharopoulos et al. 2020); math in docs/math/delta_rule.md,
'Normalised linear attention'. One of the two "spine" mixers.

Default (normalised, ELU+1):
    phi(x) = ELU(x) + 1 (> 0), per head on q = x W_q, k = x W_k (no bias); v = x W_v
    S_t = S_{t-1} + phi(k_t)^T v_t,  z_t = z_{t-1} + phi(k_t),  o_t = phi(q_t) S_t / (phi(q_t) z_t^T + eps)
    op: pallas_kernels.normalized_linear_attention(phi(q), phi(k), v) (augmented state [B,H,d_k,d_v+1])
    out = concat_heads(o) W_o
Un-normalised (``normalize=False``): o_t = s * f(q_t) S_t, S_t = S_{t-1} + f(k_t)^T v_t with f the feature map
(``identity`` or ``elu_plus_one``), run through ``pallas_kernels.delta_rule`` with no erase key and no decay.
FLA's LinearAttention layer puts an RMSNorm on the output; here that is ``use_output_norm`` (advisable for
the un-normalised form, whose output grows with t).
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from mixerlab import pallas_kernels
from mixerlab.mixers.base import MixerSpec, reset_rows
from mixerlab.mixers.gated_norm import GatedRMSNorm
from mixerlab.mixers.gates import build_qkv, dense, split_heads
from mixerlab.mixers.registry import register



@dataclasses.dataclass(frozen=True)
class LinearAttentionOptions:
    """Linear attention options.

    feature_map: "elu_plus_one"    phi(x) = ELU(x)+1 (Katharopoulos) | "identity" (un-normalised only) [FLA].
    normalize: bool = True         o = phi(q)S / (phi(q) z + eps) (Katharopoulos); False: o = s f(q) S [FLA].
    normalizer_eps: float = 1e-6   eps of that ratio; only guards an all-zero feature row since phi > 0
                                   (FLA's naive version: 1e-10) [ours].
    use_short_conv: bool = False   causal depthwise conv (no bias, no activation: phi is the nonlinearity)
                                   on q, k, v before the feature map; the original has none [ours].
    conv_size: int = 4             its kernel width.
    use_output_norm: bool = False  per-head RMSNorm (omega shared across heads, eps norm_eps) before W_o, as
                                   FLA's LinearAttention layer; off = Katharopoulos [FLA].
    norm_eps: float = 1e-5         eps of that RMSNorm.
    init_scheme: "normal"          N(0, spec.init_std) input projections | "xavier_uniform" (gain 2^-2.5);
                                   W_o is always N(0, spec.out_init_std).
    implementation: str = "auto"   which implementation of the op.
    chunk_size: int = 0            chunk length of the chunkwise op; 0 = the op's default.
    leaf_size: int = 0             leaf size of the op's block inverse; 0 = the op's default.
    """

    feature_map: Literal["elu_plus_one", "identity"] = "elu_plus_one"
    normalize: bool = True
    normalizer_eps: float = 1e-6
    use_short_conv: bool = False
    conv_size: int = 4
    use_output_norm: bool = False
    norm_eps: float = 1e-5
    init_scheme: Literal["normal", "xavier_uniform"] = "normal"
    implementation: str = "auto"
    chunk_size: int = 0
    leaf_size: int = 0

    def __post_init__(self):
        if self.normalize and self.feature_map != "elu_plus_one":
            raise ValueError("mixers.linear_attention.normalize=True needs a positive feature map: "
                             f"feature_map must be 'elu_plus_one', got {self.feature_map!r}")


def elu_plus_one(x):
    return jax.nn.elu(x) + 1.0


@register("linear_attention", LinearAttentionOptions)
class LinearAttention(nnx.Module):
    def __init__(self, spec: MixerSpec, options: LinearAttentionOptions, *, rngs: nnx.Rngs):
        self.spec, self.options = spec, options
        d, H, Dk, Dv = spec.d_model, spec.num_heads, spec.head_dim, spec.value_head_dim
        self.num_heads, self.head_dim, self.value_head_dim = H, Dk, Dv
        self.dtype = spec.dtype
        build_qkv(self, spec, options, rngs, conv_activation=False)
        if options.use_output_norm:
            self.o_norm = GatedRMSNorm(Dv, eps=options.norm_eps, dtype=spec.dtype)
        self.o_proj = dense(H * Dv, d, init_scheme="normal", std=spec.out_init_std, dtype=spec.dtype, rngs=rngs)

    def _features(self, q, k, v):
        """[.., H*D] streams -> per-head (q_feat, k_feat, v) as the op wants them."""
        H = self.num_heads
        q, k, v = split_heads(q, H), split_heads(k, H), split_heads(v, H)
        f = elu_plus_one if self.options.feature_map == "elu_plus_one" else (lambda t: t)
        q = f(q.astype(jnp.float32))
        k = f(k.astype(jnp.float32))
        if not self.options.normalize:
            q = q * self.head_dim ** -0.5
        return q.astype(self.dtype), k.astype(self.dtype), v.astype(self.dtype)

    def _core(self, q, k, v, segment_ids, initial_state):
        o = self.options
        kw = dict(initial_state=initial_state, segment_ids=segment_ids, implementation=o.implementation,
                  chunk_size=o.chunk_size or None, leaf_size=o.leaf_size or None)
        if o.normalize:
            return pallas_kernels.normalized_linear_attention(q, k, v, eps=o.normalizer_eps, **kw)
        return pallas_kernels.delta_rule(q, k, v, **kw)

    def _output(self, o_BTHV):
        y = self.o_norm(o_BTHV) if self.options.use_output_norm else o_BTHV.astype(self.dtype)
        return self.o_proj(y.reshape(*y.shape[:-2], -1)).astype(self.dtype)

    def _run(self, x_BTD, segment_ids):
        x = x_BTD.astype(self.dtype)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.options.use_short_conv:
            q, k, v = self.q_conv(q, segment_ids), self.k_conv(k, segment_ids), self.v_conv(v, segment_ids)
        o, state = self._core(*self._features(q, k, v), segment_ids, None)
        return self._output(o), state, (q, k, v)

    def __call__(self, x_BTD, *, segment_ids=None, positions=None):
        del positions
        return self._run(x_BTD, segment_ids)[0]

    def init_cache(self, batch_size: int, max_length: int = 0) -> dict:
        del max_length
        H, Dk, Dv = self.num_heads, self.head_dim, self.value_head_dim
        cache = {"state": jnp.zeros((batch_size, H, Dk, Dv + (1 if self.options.normalize else 0)), jnp.float32)}
        if self.options.use_short_conv:
            cache["conv_q"] = self.q_conv.init_cache(batch_size)
            cache["conv_k"] = self.k_conv.init_cache(batch_size)
            cache["conv_v"] = self.v_conv.init_cache(batch_size)
        return cache

    def prefill(self, x_BTD, *, segment_ids=None, positions=None):
        del positions
        y, state, (q, k, v) = self._run(x_BTD, segment_ids)
        cache = {"state": state.astype(jnp.float32)}
        if self.options.use_short_conv:
            x = x_BTD.astype(self.dtype)
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # pre-conv inputs
            cache["conv_q"] = self.q_conv.cache_from_sequence(q, segment_ids)
            cache["conv_k"] = self.k_conv.cache_from_sequence(k, segment_ids)
            cache["conv_v"] = self.v_conv.cache_from_sequence(v, segment_ids)
        return y, cache

    def decode(self, x_B1D, cache, positions_B):
        cache = reset_rows(cache, positions_B)
        x = x_B1D.astype(self.dtype)
        q, k, v = self.q_proj(x[:, 0]), self.k_proj(x[:, 0]), self.v_proj(x[:, 0])
        new_cache = {}
        if self.options.use_short_conv:
            q, new_cache["conv_q"] = self.q_conv.step(q, cache["conv_q"])
            k, new_cache["conv_k"] = self.k_conv.step(k, cache["conv_k"])
            v, new_cache["conv_v"] = self.v_conv.step(v, cache["conv_v"])
        q, k, v = self._features(q, k, v)  # [B, H, D]
        if self.options.normalize:
            # the op's augmented form (docs/math/delta_rule.md): value [v, 1], state column d_v is z; o = num / (den +
            # eps)
            v_aug = jnp.concatenate([v, jnp.ones((*v.shape[:-1], 1), v.dtype)], axis=-1)
            out, state = pallas_kernels.delta_rule_step(q, k, v_aug, state=cache["state"])
            out = out.astype(jnp.float32)
            o = (out[..., :-1] / (out[..., -1:] + self.options.normalizer_eps)).astype(self.dtype)
        else:
            o, state = pallas_kernels.delta_rule_step(q, k, v, state=cache["state"])
        new_cache["state"] = state.astype(jnp.float32)
        return self._output(o[:, None]), new_cache
