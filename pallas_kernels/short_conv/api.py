"""Public entry of the short-convolution op: validation, dispatch.

    y_t = act(Σ_{i<K} W[K−1−i] · x_{t−i} · [d_{t−i} = d_t])        (depthwise, causal, no bias; d = document index)

The causal depthwise convolution of FLA's ``ShortConvolution`` with packed-document resets: a tap never reads
a token of another document. The entry turns ``segment_ids`` into the document index (``common.document_index``:
a new document wherever the id changes) before any implementation compares them. Implementations:
  * ``reference`` — tap by tap in the accumulation dtype (float64 under x64), plain autodiff: the test oracle;
  * ``xla`` — the same forward with a hand-written VJP that recomputes the pre-activation (portable default);
  * ``pallas_triton`` — one forward and one backward kernel on GPU (Pallas' Triton backend).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from mixerlab.pallas_kernels import common, dispatch
from mixerlab.pallas_kernels.short_conv import pallas_triton, reference, xla

OP = "short_conv"


@dataclasses.dataclass(frozen=True)
class ShortConvCall:
    """What an implementation's ``supports()`` may look at."""

    batch: int
    length: int
    channels: int
    kernel_size: int
    dtype: jnp.dtype
    out_dtype: jnp.dtype
    activation: bool
    has_segments: bool
    backend: str


def validate(x_BTC, w_KC, segment_ids_BT, activation, out_dtype) -> ShortConvCall:
    common.check_float(OP, "x", x_BTC)
    if x_BTC.ndim != 3 or 0 in x_BTC.shape:
        raise common.bad_argument(OP, "x", x_BTC, "a non-empty rank-3 array [B, T, C]")
    b, t, c = x_BTC.shape
    common.check_float(OP, "w", w_KC)
    if w_KC.ndim != 2 or w_KC.shape[1] != c or w_KC.shape[0] < 1:
        raise common.bad_argument(OP, "w", w_KC, f"shape [K, C={c}] with K >= 1 (C as in x)")
    common.check_segment_ids(OP, segment_ids_BT, b, t)
    if not isinstance(activation, bool):
        raise common.bad_argument(OP, "activation", activation, "True (SiLU) or False (none)")
    try:
        out = jnp.dtype(out_dtype)
    except TypeError:
        out = None
    if out is None or not jnp.issubdtype(out, jnp.floating):
        raise common.bad_argument(OP, "out_dtype", out_dtype, "a floating-point dtype")
    return ShortConvCall(b, t, c, w_KC.shape[0], jnp.dtype(x_BTC.dtype), out, activation,
                         segment_ids_BT is not None, dispatch.target_backend())


# ---------------------------------------------------------------------------------------------------------
# implementations. Contract: run(x [B, T, C], w [K, C], document_BT [B, T] | None, activation, out_dtype)
# -> y [B, T, C] in out_dtype, differentiable in x and w.


def _triton_supports(call: ShortConvCall):
    return pallas_triton.supports(call.backend, call.dtype, call.kernel_size)


TABLE = dispatch.OpTable(OP, fallback="xla")
TABLE.register(dispatch.Implementation("reference", reference.causal_conv_reference))
TABLE.register(dispatch.Implementation("xla", xla.causal_conv))
TABLE.register(dispatch.Implementation("pallas_triton", pallas_triton.run, _triton_supports, fast=True))


def _per_shard(run, channels: int):
    """Under a device mesh (the trainer traces its step under one), run a kernel per shard: batch over
    (data, fsdp), channels over tensor when they divide. shard_map's transpose sums dW over the shards."""
    import jax

    axes = common.mesh_axes(channels)
    if axes is None:
        return run
    from jax.sharding import PartitionSpec as P

    mesh, batch, chan = axes

    def wrapped(x, w, seg, activation, out_dtype):
        specs = (P(batch, None, chan), P(None, chan)) + ((P(batch, None),) if seg is not None else ())
        body = lambda x, w, *seg_: run(x, w, seg_[0] if seg_ else None, activation, out_dtype)  # noqa: E731
        f = jax.shard_map(body, mesh=mesh, check_vma=False, in_specs=specs, out_specs=P(batch, None, chan))
        return f(x, w, *(() if seg is None else (seg,)))

    return wrapped


def causal_conv(x_BTC, w_KC, segment_ids_BT, activation: bool, out_dtype, implementation: str = "auto"):
    """Causal depthwise short convolution with segment resets.

    Args:
      x_BTC: [B, T, C] input (float32 / bfloat16 / float16; float64 for the reference and xla).
      w_KC: [K, C] kernel; row K−1 multiplies the current token, row K−1−i the token i steps back.
      segment_ids_BT: [B, T] int or None; a tap reads token t−i only when it lies in token t's document (a
        document starts at every t with seg[t] != seg[t−1], as in every op of this package: an id reused after
        another document is a new document).
      activation: SiLU after the convolution (True) or none (False).
      out_dtype: dtype of y. Accumulation is float32 (float64 for float64 x).
      implementation: "auto" (the Pallas-Triton kernels on GPU, else "xla"), "xla", "pallas_triton" or
        "reference".

    Returns:
      y [B, T, C] in ``out_dtype``; gradients: dx in x's dtype, dW in W's dtype.
    """
    call = validate(x_BTC, w_KC, segment_ids_BT, activation, out_dtype)
    impl = TABLE.choose(implementation, call)
    run = impl.run
    if impl.name.startswith("pallas_"):
        run = _per_shard(run, call.channels)
    # the implementations compare ids for equality: give them the document index, so that an id reused after
    # another document (0,0,1,1,0,0) is a new document as in every op (docs/architecture.md, 'Packing')
    document_BT = None if segment_ids_BT is None else common.document_index(segment_ids_BT, call.batch, call.length)
    return run(x_BTC, w_KC, document_BT, activation, call.out_dtype)
