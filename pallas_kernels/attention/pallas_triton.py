"""Flash attention on GPU through Pallas' Triton backend, with a causal mask and segment ids: no T×T buffer.
JAX's ``pallas.ops.gpu.attention.mha`` (forward and backward Triton kernels, custom VJP) does the work; this
file adapts the op's layout, padding and rules.

Contract: ``run(q, k, v, document_BT, *, scale, interpret=False, block_q=128, block_k=128) -> o`` with
q, k, v [B, T, H, D] in one dtype and ``document_BT`` the document index.
"""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from mixerlab.pallas_kernels import common

BLOCK = 128


def run(q, k, v, document_BT, *, scale, interpret=False, block_q=BLOCK, block_k=BLOCK, num_warps=None,
        num_stages=2, backward_blocks=(64, 64, 64, 64)):
    from jax.experimental.pallas.ops.gpu import attention as flash

    t = q.shape[1]
    multiple = max(block_q, block_k)
    padded = [common.pad_time(x, multiple) for x in (q, k, v)]
    tp = padded[0].shape[1]
    # Padding gets its own document (−1): it never matches a real token, and its rows are cut off below.
    document = jnp.pad(document_BT.astype(jnp.int32), ((0, 0), (0, tp - t)), constant_values=-1)
    q_dkv, kv_dkv, q_dq, kv_dq = backward_blocks
    sizes = flash.BlockSizes(block_q=block_q, block_k=block_k, block_q_dkv=q_dkv, block_kv_dkv=kv_dkv,
                             block_q_dq=q_dq, block_kv_dq=kv_dq)
    out = flash.mha(*padded, document, sm_scale=float(scale), causal=True, block_sizes=sizes,
                    num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    return out[:, :t]


def supports(call) -> Optional[str]:
    if call.backend != "gpu":
        return f"needs a GPU backend (got {call.backend!r}); on CPU use pallas_triton.run(..., interpret=True)"
    if jnp.dtype(call.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        # float32 tiles at these block sizes exceed the shared memory of the backward kernels on an H200
        return (f"dtype {jnp.dtype(call.dtype).name} (GPU flash attention: bfloat16 or float16; set model.dtype="
                f"bfloat16)")
    if call.head_dim < 16 or call.head_dim & (call.head_dim - 1):
        return f"head_dim={call.head_dim} (GPU flash attention: a power of two >= 16)"
    return None
