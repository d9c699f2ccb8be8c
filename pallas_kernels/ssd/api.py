"""Public entry of the SSD op (grouped scalar-decay linear attention, Mamba-2's SSD layer; docs/math/ssd.md):
validation, defaults, dispatch.

    S_t = e^{λ_t} S_{t−1} + k_tᵀ v_t,    o_t = q_t S_t        per head h; q, k shared by the H/G heads of a group

It is the delta-rule op's no-erase case with one decay per head and q, k shared by a group, so every backend
without a kernel of its own runs it through the delta-rule op (q and k repeated per head, λ broadcast over the
key channels). The GPU has its own kernels (``pallas_triton.py``, by name: not yet measured on a GPU), which never
repeat q and k and need no pivot tree for a decay that is one number per head.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp

from mixerlab.pallas_kernels import common, dispatch
from mixerlab.pallas_kernels.delta_rule import api as delta_api
from mixerlab.pallas_kernels.ssd import pallas_triton, reference

OP = "ssd"


@dataclasses.dataclass(frozen=True)
class SsdCall:
    """What an implementation's ``supports()`` may look at."""

    batch: int
    length: int
    heads: int
    groups: int
    state_dim: int  # N, the key width
    head_dim: int  # P, the value width
    dtype: jnp.dtype
    has_initial_state: bool
    has_segments: bool
    chunk_size: int
    leaf_size: int
    backend: str

    def as_delta_rule_call(self) -> delta_api.DeltaRuleCall:
        """The same call as the delta-rule op sees it (q, k repeated per head, no erase, one decay per head)."""
        return delta_api.DeltaRuleCall(self.batch, self.length, self.heads, self.state_dim, self.head_dim, self.dtype,
                                       False, "head", self.has_initial_state, self.has_segments, self.chunk_size,
                                       self.leaf_size, self.backend)


def validate(q, k, v, log_decay, initial_state, segment_ids, chunk_size, leaf_size) -> SsdCall:
    for name, x in (("q", q), ("k", k), ("v", v)):
        common.check_float(OP, name, x)
        if x.ndim != 4:
            raise common.bad_argument(OP, name, x, "rank 4 ([B, T, G, N] for q and k, [B, T, H, P] for v)")
    b, t, g, n = q.shape
    common.check_shape(OP, "k", k, (b, t, g, n), "BTGN")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise common.bad_argument(OP, name, x, f"dtype {jnp.dtype(q.dtype).name} (the dtype of q)")
    if tuple(v.shape[:2]) != (b, t) or v.shape[2] % g:
        raise common.bad_argument(OP, "v", v, f"[B={b}, T={t}, H, P] with H a multiple of the G={g} groups of q, k")
    h, p = v.shape[2], v.shape[3]
    common.check_float(OP, "log_decay", log_decay)
    common.check_shape(OP, "log_decay", log_decay, (b, t, h), "BTH")
    if initial_state is not None:
        common.check_shape(OP, "initial_state", initial_state, (b, h, n, p), "BHNP")
    common.check_segment_ids(OP, segment_ids, b, t)
    backend = dispatch.target_backend()
    chunk_size, leaf_size = delta_api.resolve_chunking(chunk_size, leaf_size, backend)
    return SsdCall(b, t, h, g, n, p, jnp.dtype(q.dtype), initial_state is not None, segment_ids is not None,
                   chunk_size, leaf_size, backend)


# ---------------------------------------------------------------------------------------------------------
# implementations. Contract: run(q, k, v, log_decay, state, document_BT, *, chunk_size, leaf_size) -> (o, final);
# q, k [B, T, G, N], v [B, T, H, P] in the caller's dtype, log_decay [B, T, H] and state [B, H, N, P] in the
# compute dtype, document_BT the running count of segment boundaries.


def _repeat_groups(q, k, heads):
    r = heads // q.shape[2]
    return jnp.repeat(q, r, axis=2), jnp.repeat(k, r, axis=2)


def _run_reference(q, k, v, log_decay, state, document_BT, **unused_tiling):
    dtype = log_decay.dtype
    return reference.ssd_reference(q.astype(dtype), k.astype(dtype), v.astype(dtype), log_decay, state, document_BT)


def _through_delta_rule(name, registered_as=None):
    """The delta-rule op's implementation ``name`` as an implementation of this op (called ``registered_as``,
    default ``name``): q and k repeated per head, λ broadcast over the key channels (its gradient sums them
    back), no erase."""
    delta = delta_api.TABLE.get(name)

    def run(q, k, v, log_decay, state, document_BT, *, chunk_size, leaf_size):
        q, k = _repeat_groups(q, k, v.shape[2])
        lam = jnp.broadcast_to(log_decay[..., None], q.shape)
        return delta.run(q, k, None, v, lam, state, document_BT, chunk_size=chunk_size, leaf_size=leaf_size)

    def supports(call: SsdCall) -> Optional[str]:
        return delta.supports(call.as_delta_rule_call())

    return dispatch.Implementation(registered_as or name, run, supports, fast=delta.fast)


def _run_triton(q, k, v, log_decay, state, document_BT, *, chunk_size, leaf_size):
    del leaf_size  # one decay per head: no block inverse, no leaves
    return pallas_triton.run(q, k, v, log_decay, state, document_BT, chunk_size=chunk_size)


TABLE = dispatch.OpTable(OP, fallback="xla")
TABLE.register(dispatch.Implementation("reference", _run_reference))
TABLE.register(_through_delta_rule("xla"))
# "auto" tries, in this order: on the GPU the SSD kernels, then (shapes they refuse) the delta-rule Triton kernels on
# this call (q, k repeated per head); on the TPU the delta-rule TPU kernel. On an H100 the SSD kernels took 19.3 ms
# forward + backward for a Mamba-2 166M layer against the delta-rule kernels' 27.6 ms in the same process
# (docs/math/ssd.md), and pass the float64 oracle there.
TABLE.register(dispatch.Implementation("pallas_triton", _run_triton, pallas_triton.supports, fast=True))
TABLE.register(_through_delta_rule("pallas_tpu"))
TABLE.register(_through_delta_rule("pallas_triton", registered_as="delta_rule_triton"))


def ssd(q, k, v, *, log_decay, initial_state=None, segment_ids=None, chunk_size: Optional[int] = None,
        leaf_size: Optional[int] = None, implementation: str = "auto"):
    """Grouped scalar-decay linear attention (Mamba-2's SSD layer).

    Args:
      q: [B, T, G, N] readout (Mamba-2's C), one row per group of heads.
      k: [B, T, G, N] write key (Mamba-2's B). q, k and v share a dtype.
      v: [B, T, H, P] write value (Mamba-2's dt·x); head h belongs to group h // (H/G).
      log_decay: [B, T, H] λ ≤ 0, one per head and token (Mamba-2's dt·A).
      initial_state: [B, H, N, P] state before token 0; None = zeros.
      segment_ids: [B, T] int; the state resets where the id changes (the delta-rule op's convention).
      chunk_size, leaf_size: the chunkwise tiling (``delta_rule.api.resolve_chunking``; the SSD kernels ignore the
        leaf: one decay per head needs no block inverse).
      implementation: "auto" | "reference" | "xla" | "pallas_triton" | "pallas_tpu" | "delta_rule_triton".

    Returns:
      (o [B, T, H, P] in v's dtype, final_state [B, H, N, P] float32, or float64 for float64 inputs).
    """
    call = validate(q, k, v, log_decay, initial_state, segment_ids, chunk_size, leaf_size)
    violation = common.check_nonpositive(OP, "log_decay", log_decay)
    impl = TABLE.choose(implementation, call)
    dtype = delta_api.compute_dtype(q.dtype)
    b, t, _, n = q.shape
    h, p = v.shape[2], v.shape[3]
    state = jnp.zeros((b, h, n, p), dtype) if initial_state is None else initial_state.astype(dtype)
    document = common.document_index(segment_ids, b, t)
    run = impl.run
    if impl.name not in ("reference", "xla"):  # a Pallas kernel: XLA cannot partition it
        # split heads over the mesh's tensor axis only where it divides the groups (then it divides H too and
        # every shard keeps whole groups)
        run = common.per_shard(run, q.shape[2], ("tokens", "tokens", "tokens", "token_heads", "state", "rows"),
                               ("tokens", "state"))
    out, final = run(q, k, v, log_decay.astype(dtype), state, document, chunk_size=call.chunk_size,
                     leaf_size=call.leaf_size)
    return common.poison(violation, out.astype(v.dtype), final)
