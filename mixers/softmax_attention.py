"""Causal softmax attention with RoPE (the Transformer baseline).

Training path: the ``pallas_kernels.attention`` op — causal attention within documents (``segment_ids``):
splash attention on TPU, flash attention on GPU (no T×T buffer), dense XLA on CPU. Decode path: a KV cache.

Optional (``use_short_conv``, off by default: a Llama has none): a causal depthwise short convolution over the
projected q, k and v before RoPE, resetting at documents — the local token mixing every recurrent mixer here
has in front of its core, so that a comparison can separate the convolution from the mixer.
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
from mixerlab.mixers.short_conv import ShortConv
from mixerlab.pallas_kernels.attention import attention


@dataclasses.dataclass(frozen=True)
class SoftmaxOptions:
    """Options of ``softmax`` (config keys ``mixers.softmax.<field>``).

    rope_theta: RoPE base (10000, the Llama-2 value).
    implementation: the attention op's implementation: ``auto`` (splash attention on TPU, Pallas flash
        attention on GPU, dense ``xla`` elsewhere), or one forced: ``xla`` (dense, materialises T×T scores),
        ``pallas_tpu``, ``cudnn_packed`` (cuDNN flash attention over packed documents), ``pallas_triton``,
        ``cudnn`` (cuDNN with a dense T×T document mask), ``reference``.
    use_short_conv: a causal depthwise convolution (kernel ``conv_size``, one per channel, resetting at
        documents) over the projected q, k and v, before RoPE [ours: off by default, as in Llama; on, the
        Transformer gets the short convolution the recurrent mixers have (FLA's ``ShortConvolution``)].
    conv_size: its kernel width (4, as the delta mixers').
    conv_activation: SiLU after the convolution, as the delta mixers do on their q, k, v [ours: off].
    """

    rope_theta: float = 10000.0
    implementation: Literal["auto", "xla", "pallas_tpu", "cudnn_packed", "pallas_triton", "cudnn",
                            "reference"] = "auto"
    use_short_conv: bool = False
    conv_size: int = 4
    conv_activation: bool = False

    def __post_init__(self):
        if self.conv_size < 1:
            raise ValueError(f"mixers.softmax.conv_size must be >= 1, got {self.conv_size}")


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
        # one depthwise conv over [q, k, v] (3·H·dh channels): per channel it is the same as three
        self.conv = (ShortConv(3 * h * dh, options.conv_size, activation=options.conv_activation, dtype=spec.dtype,
                               rngs=rngs) if options.use_short_conv else None)

    def _qkv(self, x, positions, conv=None):
        """q, k (RoPE applied) and v [B, T, H, dh]; ``conv(qkv [B, T, 3·H·dh])`` the short conv when there is one."""
        b, t, _ = x.shape
        shape = (b, t, self.spec.num_heads, self.spec.head_dim)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if conv is not None:
            q, k, v = jnp.split(conv(jnp.concatenate([q, k, v], axis=-1)), 3, axis=-1)
        theta = self.options.rope_theta
        return (rotary(q.reshape(shape), positions, theta=theta), rotary(k.reshape(shape), positions, theta=theta),
                v.reshape(shape))

    def __call__(self, x_BTD, *, segment_ids, positions):
        b, t, _ = x_BTD.shape
        conv = None if self.conv is None else (lambda qkv: self.conv(qkv, segment_ids))
        q, k, v = self._qkv(x_BTD, positions, conv)
        o = attention(q, k, v, segment_ids=segment_ids, implementation=self.options.implementation)
        return self.o_proj(o.reshape(b, t, -1))

    def init_cache(self, batch_size: int, max_length: int):
        shape = (batch_size, max_length, self.spec.num_heads, self.spec.head_dim)
        cache = {"k": jnp.zeros(shape, self.spec.dtype), "v": jnp.zeros(shape, self.spec.dtype)}
        if self.conv is not None:
            cache["conv"] = self.conv.init_cache(batch_size)
        return cache

    def decode(self, x_B1D, cache, positions_B):
        b = x_B1D.shape[0]
        new = {}

        def conv(qkv_B1C):  # one token; a new document (position 0) starts from an empty window
            window = jnp.where((positions_B == 0)[:, None, None], jnp.zeros_like(cache["conv"]), cache["conv"])
            y, new["conv"] = self.conv.step(qkv_B1C[:, 0], window)
            return y[:, None]

        q, k, v = self._qkv(x_B1D, positions_B[:, None], None if self.conv is None else conv)
        rows = jnp.arange(b)
        new.update(k=cache["k"].at[rows, positions_B].set(k[:, 0]), v=cache["v"].at[rows, positions_B].set(v[:, 0]))
        valid = jnp.arange(cache["k"].shape[1])[None, :] <= positions_B[:, None]  # [B,S]
        o = jax.nn.dot_product_attention(q, new["k"], new["v"], mask=valid[:, None, None, :])
        return self.o_proj(o.reshape(b, 1, -1)), new
