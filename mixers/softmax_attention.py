"""Causal softmax attention with RoPE (the Transformer baseline).

Training path: the ``pallas_kernels.attention`` op — causal attention within documents (``segment_ids``):
splash attention on TPU, flash attention on GPU (no T×T buffer), dense XLA on CPU. Decode path: a KV cache.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from mixerlab.mixers.base import MixerSpec
from mixerlab.mixers.blocks import normal, rotary
from mixerlab.mixers.registry import register
from mixerlab.pallas_kernels.attention import attention


@dataclasses.dataclass(frozen=True)
class SoftmaxOptions:
    """Options of ``softmax`` (config keys ``mixers.softmax.<field>``).

    rope_theta: RoPE base (10000, the Llama-2 value).
    implementation: the attention op's implementation: ``auto`` (splash attention on TPU, Pallas flash
        attention on GPU, dense ``xla`` elsewhere), or one forced: ``xla`` (dense, materialises T×T scores),
        ``pallas_tpu``, ``cudnn_packed`` (cuDNN flash attention over packed documents), ``pallas_triton``,
        ``cudnn`` (cuDNN with a dense T×T document mask), ``reference``.
    """

    rope_theta: float = 10000.0
    implementation: Literal["auto", "xla", "pallas_tpu", "cudnn_packed", "pallas_triton", "cudnn",
                            "reference"] = "auto"


@register("softmax", SoftmaxOptions)
class SoftmaxAttention(nnx.Module):
    def __init__(self, spec: MixerSpec, options: SoftmaxOptions, *, rngs: nnx.Rngs):
        if spec.head_dim != spec.value_head_dim:
            raise ValueError(f"softmax attention needs model.value_head_dim == head_dim ({spec.head_dim}), "
                             f"got {spec.value_head_dim}")
        self.spec, self.options = spec, options
        h, dh, d = spec.num_heads, spec.head_dim, spec.d_model
        lin = lambda i, o, std: nnx.Linear(i, o, use_bias=False, dtype=spec.dtype, kernel_init=normal(std), rngs=rngs)
        self.q_proj = lin(d, h * dh, spec.init_std)
        self.k_proj = lin(d, h * dh, spec.init_std)
        self.v_proj = lin(d, h * dh, spec.init_std)
        self.o_proj = lin(h * dh, d, spec.out_init_std)

    def _qkv(self, x, positions):
        b, t, _ = x.shape
        shape = (b, t, self.spec.num_heads, self.spec.head_dim)
        q = rotary(self.q_proj(x).reshape(shape), positions, theta=self.options.rope_theta)
        k = rotary(self.k_proj(x).reshape(shape), positions, theta=self.options.rope_theta)
        return q, k, self.v_proj(x).reshape(shape)

    def __call__(self, x_BTD, *, segment_ids, positions):
        b, t, _ = x_BTD.shape
        q, k, v = self._qkv(x_BTD, positions)
        o = attention(q, k, v, segment_ids=segment_ids, implementation=self.options.implementation)
        return self.o_proj(o.reshape(b, t, -1))

    def init_cache(self, batch_size: int, max_length: int):
        shape = (batch_size, max_length, self.spec.num_heads, self.spec.head_dim)
        return {"k": jnp.zeros(shape, self.spec.dtype), "v": jnp.zeros(shape, self.spec.dtype)}

    def decode(self, x_B1D, cache, positions_B):
        b = x_B1D.shape[0]
        q, k, v = self._qkv(x_B1D, positions_B[:, None])
        rows = jnp.arange(b)
        cache = {"k": cache["k"].at[rows, positions_B].set(k[:, 0]), "v": cache["v"].at[rows, positions_B].set(v[:, 0])}
        valid = jnp.arange(cache["k"].shape[1])[None, :] <= positions_B[:, None]  # [B,S]
        o = jax.nn.dot_product_attention(q, cache["k"], cache["v"], mask=valid[:, None, None, :])
        return self.o_proj(o.reshape(b, 1, -1)), cache
