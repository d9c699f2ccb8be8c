"""Splash attention (Pallas, Mosaic TPU) with a causal mask and segment ids: no T×T buffer, fully masked
blocks skipped. JAX's ``splash_attention`` kernels do the work; this file adapts the op's layout and rules.

Contract: ``run(q, k, v, document_BT, *, scale, interpret=False) -> o`` with q, k, v [B, T, H, D] in one
dtype (bf16 or f32) and ``document_BT`` the document index (equal values = same document).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from mixerlab.pallas_kernels import common

BLOCK = 128  # the kernel's q and kv blocks are multiples of the 128-lane vreg width
LANES = 128


def _kernel(heads: int, length: int, block: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    mask = masks.MultiHeadMask([masks.CausalMask((length, length)) for _ in range(heads)])
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    # Built per trace (not cached): the kernel holds its block-sparsity tables as arrays of the trace.
    return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def run(q, k, v, document_BT, *, scale, interpret=False):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

    b, t, h, d = q.shape
    tp = -(-t // BLOCK) * BLOCK
    block = next(s for s in (512, 256, 128) if tp % s == 0)
    # Padding gets its own document (−1): it never matches a real token, and its rows are cut off below.
    document = jnp.pad(document_BT.astype(jnp.int32), ((0, 0), (0, tp - t)), constant_values=-1)
    heads_first = lambda x: jnp.swapaxes(common.pad_time(x, BLOCK), 1, 2)  # [B, H, Tp, D]
    kernel = _kernel(h, tp, block, bool(interpret))

    def one_row(q_, k_, v_, doc_):
        return kernel(q_, k_, v_, segment_ids=splash.SegmentIds(q=doc_, kv=doc_))

    out = jax.vmap(one_row)(heads_first(q * jnp.asarray(scale, q.dtype)), heads_first(k), heads_first(v), document)
    return jnp.swapaxes(out, 1, 2)[:, :t]


def supports(call) -> Optional[str]:
    if call.backend != "tpu":
        return f"needs a TPU backend (got {call.backend!r}); on CPU use pallas_tpu.run(..., interpret=True)"
    if jnp.dtype(call.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"dtype {jnp.dtype(call.dtype).name} (splash attention: bfloat16 or float32)"
    if call.head_dim % LANES and call.head_dim not in (64,):
        return f"head_dim={call.head_dim} (splash attention: 64 or a multiple of {LANES})"
    return None
