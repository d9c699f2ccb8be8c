"""Public entry of the attention op: validation, defaults, dispatch.

    o_i = Σ_{j ≤ i, d_j = d_i} softmax_j(scale · q_i·k_j) v_j      (per head; d = document index)

Causal softmax attention in which a token reads only earlier tokens of its own document (packed documents,
marked by ``segment_ids`` as everywhere in the project). Implementations:
  * ``reference`` — dense scores in the compute dtype (float64 under x64): the test oracle;
  * ``xla`` — dense masked ``jax.nn.dot_product_attention``; materialises [B, H, T, T] scores: the portable
    fallback for CPU and short sequences;
  * ``pallas_tpu`` — splash attention (Mosaic), causal mask + segment ids, no T×T buffer;
  * ``cudnn_packed`` — cuDNN flash attention over packed segments (GPU, compute capability ≥ 9.0): each
    document is a segment, cross-document tiles are skipped, no T×T buffer;
  * ``pallas_triton`` — flash attention on GPU (Pallas' Triton backend) with segment ids, no T×T buffer;
  * ``cudnn`` — cuDNN's fused attention with the dense [B, 1, T, T] document mask (GPU; the mask is a T×T
    buffer): a baseline for benchmarks.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax.numpy as jnp

from mixerlab.pallas_kernels import common, dispatch
from mixerlab.pallas_kernels.attention import cudnn_packed, pallas_tpu, pallas_triton, reference

OP = "attention"


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """What an implementation's ``supports()`` may look at."""

    batch: int
    length: int
    heads: int
    head_dim: int
    dtype: jnp.dtype
    backend: str


def _run_reference(q, k, v, document_BT, *, scale):
    dtype = common.compute_dtype(q.dtype)
    out = reference.attention_reference(q.astype(dtype), k.astype(dtype), v.astype(dtype), document_BT, scale)
    return out.astype(v.dtype)


def _run_xla(q, k, v, document_BT, *, scale):
    import jax

    mask = reference.document_mask(document_BT)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="xla")


def _run_cudnn(q, k, v, document_BT, *, scale):
    import jax

    mask = reference.document_mask(document_BT)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="cudnn")


def _needs_gpu(call) -> Optional[str]:
    return None if call.backend == "gpu" else f"needs a GPU backend (got {call.backend!r})"


TABLE = dispatch.OpTable(OP, fallback="xla")
TABLE.register(dispatch.Implementation("reference", _run_reference))
TABLE.register(dispatch.Implementation("xla", _run_xla))
TABLE.register(dispatch.Implementation("pallas_tpu", pallas_tpu.run, pallas_tpu.supports, fast=True))
TABLE.register(dispatch.Implementation("cudnn_packed", cudnn_packed.run, cudnn_packed.supports, fast=True))
TABLE.register(dispatch.Implementation("pallas_triton", pallas_triton.run, pallas_triton.supports, fast=True))
TABLE.register(dispatch.Implementation("cudnn", _run_cudnn, _needs_gpu))


def attention(q, k, v, *, segment_ids=None, scale: Optional[float] = None, implementation: str = "auto"):
    """Causal attention within documents.

    Args:
      q, k, v: [B, T, H, D], one floating dtype (rotary embeddings already applied).
      segment_ids: [B, T] int; a token attends only to tokens of its own document (a document starts at every
        t with seg[t] != seg[t−1], as in every op of this package: an id reused after another document is a new
        document, docs/architecture.md 'Packing'). None = one document per row.
      scale: score scale; default 1/√D.
      implementation: "auto" (a Pallas kernel when the backend has one, else "xla") | "reference" | "xla" |
        "pallas_tpu" | "cudnn_packed" | "pallas_triton" | "cudnn".

    Returns: o [B, T, H, D] in v's dtype.
    """
    b, t, h, d, dv = common.check_qkv(OP, q, k, v)
    if dv != d:
        raise common.bad_argument(OP, "v", v, f"head dim {d} (as q and k)")
    common.check_segment_ids(OP, segment_ids, b, t)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif not common.is_real(scale) or not scale > 0:
        raise ValueError(f"{OP}: scale={scale!r}; expected a positive number (default 1/sqrt(head_dim))")
    call = AttentionCall(b, t, h, d, jnp.dtype(q.dtype), dispatch.target_backend())
    impl = TABLE.choose(implementation, call)
    run = impl.run
    if impl.name.startswith("pallas_") or impl.name == "cudnn_packed":
        run = common.per_shard(run, h, ("tokens", "tokens", "tokens", "rows"), "tokens")
    return run(q, k, v, common.document_index(segment_ids, b, t), scale=float(scale))
