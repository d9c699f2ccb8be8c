"""cuDNN's fused flash attention in its packed-sequence layout (GPU, compute capability ≥ 9.0).

Each document of a row is a *segment* given by its start offset and its length, so the kernel runs causal
attention inside every segment and skips every cross-document tile: no T×T mask or score buffer, and none of
the masked work that a segment-id flash kernel still visits. JAX exposes the layout only in its cuDNN module
(``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``: ``q_offsets``/``q_seqlen`` of shape
[B, M+1]/[B, M], M = a static maximum number of segments per row, padded with −1).

M is static, documents are data: a row with more than ``max_documents`` documents cannot be described. Such a
batch takes the segment-id flash kernel (``pallas_triton``) instead, through ``lax.cond`` on the device (both
branches are compiled; no host sync), so no input is ever silently truncated.

Contract: ``run(q, k, v, document_BT, *, scale, max_documents=64) -> o`` with q, k, v [B, T, H, D] in one
16-bit dtype and ``document_BT`` the document index.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from mixerlab.pallas_kernels.attention import pallas_triton

MAX_DOCUMENTS = 64


def segment_layout(document_BT, max_documents: int):
    """(seqlen [B, M] int32, offsets [B, M+1] int32, documents per row [B]) in cuDNN's packed convention:
    segment i of a row starts at ``offsets[b, i]`` and holds ``seqlen[b, i]`` tokens; unused entries are −1.
    Exact when every row has ≤ M documents (the caller checks the count)."""
    b, t = document_BT.shape
    starts = jnp.concatenate([jnp.ones((b, 1), bool), document_BT[:, 1:] != document_BT[:, :-1]], axis=1)
    count = jnp.sum(starts, axis=1, dtype=jnp.int32)
    # the first M+1 start positions of each row; T where a row has fewer (so the last length ends at T)
    pos = jax.vmap(lambda s: jnp.nonzero(s, size=max_documents + 1, fill_value=t)[0])(starts).astype(jnp.int32)
    slots = jnp.arange(max_documents + 1, dtype=jnp.int32)[None]
    seqlen = jnp.where(slots[:, :-1] < count[:, None], pos[:, 1:] - pos[:, :-1], -1)
    offsets = jnp.where(slots < count[:, None], pos, -1)
    return seqlen, offsets, count


def run(q, k, v, document_BT, *, scale, max_documents: int = MAX_DOCUMENTS):
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    seqlen, offsets, count = segment_layout(document_BT.astype(jnp.int32), max_documents)

    def packed(q, k, v):
        return dot_product_attention(q, k, v, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets,
                                     kv_offsets=offsets, scale=float(scale), mask_type=MaskType.PADDING_CAUSAL,
                                     qkv_layout="BTNH")

    def flash(q, k, v):
        return pallas_triton.run(q, k, v, document_BT, scale=scale)

    return jax.lax.cond(jnp.max(count) <= max_documents, packed, flash, q, k, v)


def supports(call) -> Optional[str]:
    if call.backend != "gpu":
        return f"needs a GPU backend (got {call.backend!r})"
    if jnp.dtype(call.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(call.dtype).name} (cuDNN flash attention: bfloat16 or float16)"
    if call.head_dim > 128 or call.head_dim % 8:
        return f"head_dim={call.head_dim} (cuDNN packed attention: a multiple of 8, at most 128)"
    try:
        major, minor = (int(x) for x in jax.devices("gpu")[0].compute_capability.split("."))
    except Exception as e:  # no GPU client in this process (e.g. compiling for another target)
        return f"cannot read the GPU's compute capability ({type(e).__name__})"
    if (major, minor) < (9, 0):
        return f"compute capability {major}.{minor} (cuDNN's packed layout needs >= 9.0, e.g. H100/H200)"
    return None
