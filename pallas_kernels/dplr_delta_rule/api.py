"""Public entry points of the diagonal-plus-low-rank (DPLR) delta-rule op (docs/math/dplr_delta_rule.md).

Recurrence (row vectors, state key-major [Dk, Dv]):
    S_t = (Diag(e^{λ_t}) + β_tᵀ α_t) S_{t−1} + k_tᵀ v_t,     o_t = q_t S_t
α reads the old state (r_t = α_t S_{t−1}) and β is the direction the read is written back along; unlike
``delta_rule`` (erase tied to the write key k) α, β and k are three independent vectors. RWKV-7 uses
α = −κ̂, β = κ̂ ⊙ a. Implementations: "xla" (the op's own chunked form in pure JAX, any λ ≤ 0) and
"delta_pairs" (two delta-rule tokens per token, on the delta-rule op's Pallas kernels; needs λ > −80).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp

from mixerlab.pallas_kernels import common, dispatch
from mixerlab.pallas_kernels.dplr_delta_rule import decode, delta_pairs, reference, xla

OP, STEP = "dplr_delta_rule", "dplr_delta_rule_step"
DEFAULT_CHUNK_SIZE = 64
DEFAULT_LEAF_SIZE = 16  # the blocks a chunk's pair matrices are built from (exact range-sum tensor inside one)


@dataclasses.dataclass(frozen=True)
class DplrCall:
    """What an implementation's ``supports()`` may look at."""

    batch: int
    length: int
    heads: int
    key_dim: int
    value_dim: int
    dtype: jnp.dtype
    chunk_size: int
    leaf_size: int
    backend: str


def resolve_chunking(chunk_size, leaf_size):
    """chunk_size: a positive int (default 64); leaf_size: a positive divisor of it (default 16 when it divides
    the chunk, else the chunk itself)."""
    if chunk_size is None:
        chunk_size = DEFAULT_CHUNK_SIZE
    if not common.is_int(chunk_size) or chunk_size < 1:
        raise ValueError(f"{OP}: chunk_size={chunk_size!r}; expected a positive int")
    if leaf_size is None:
        leaf_size = DEFAULT_LEAF_SIZE if chunk_size % DEFAULT_LEAF_SIZE == 0 else chunk_size
    if not common.is_int(leaf_size) or leaf_size < 1 or chunk_size % leaf_size:
        raise ValueError(f"{OP}: leaf_size={leaf_size!r} does not divide chunk_size={chunk_size}; expected a "
                         f"positive divisor (e.g. 16 with chunk 64, or leaf_size == chunk_size)")
    return int(chunk_size), int(leaf_size)


def _check_decay(op, log_decay, shape_3, labels_3):
    """log_decay of shape ``shape_3 + (Dk,)`` (channel-wise) or ``shape_3`` (one per head)."""
    common.check_float(op, "log_decay", log_decay)
    *lead, dk = shape_3
    if tuple(log_decay.shape) not in (tuple(shape_3), tuple(lead)):
        full = ", ".join(f"{a}={n}" for a, n in zip(labels_3, shape_3))
        head = ", ".join(f"{a}={n}" for a, n in zip(labels_3[:-1], lead))
        raise common.bad_argument(op, "log_decay", log_decay, f"[{full}] (channel-wise) or [{head}] (per head)")


def _channelwise(log_decay, shape, dtype):
    if log_decay is None:
        return jnp.zeros(shape, dtype)
    if log_decay.ndim == len(shape) - 1:
        return jnp.broadcast_to(log_decay.astype(dtype)[..., None], shape)
    return log_decay.astype(dtype)


def validate(q, k, v, alpha, beta, log_decay, initial_state, segment_ids, chunk_size, leaf_size) -> DplrCall:
    b, t, h, dk, dv = common.check_qkv(OP, q, k, v)
    for name, x in (("alpha", alpha), ("beta", beta)):
        common.check_shape(OP, name, x, (b, t, h, dk), "BTHK")
        common.check_same_dtype(OP, name, x, "q", q)
    if log_decay is not None:
        _check_decay(OP, log_decay, (b, t, h, dk), ("B", "T", "H", "Dk"))
    if initial_state is not None:
        common.check_shape(OP, "initial_state", initial_state, (b, h, dk, dv), "BHKV")
    common.check_segment_ids(OP, segment_ids, b, t)
    chunk_size, leaf_size = resolve_chunking(chunk_size, leaf_size)
    return DplrCall(b, t, h, dk, dv, jnp.dtype(q.dtype), chunk_size, leaf_size, dispatch.target_backend())


# ---------------------------------------------------------------------------------------------------------
# implementations: run(q, k, v, alpha, beta, log_decay, state, document_BT, *, chunk_size, leaf_size); q, k, v,
# alpha, beta in the caller's dtype, log_decay and state in the compute dtype (float32, or float64 for float64
# inputs), which every implementation computes in.


def _run_reference(q, k, v, alpha, beta, log_decay, state, document_BT, **unused_tuning):
    q, k, v, alpha, beta = (x.astype(log_decay.dtype) for x in (q, k, v, alpha, beta))
    return reference.dplr_reference(q, k, v, alpha, beta, log_decay, state, document_BT)


def _run_xla(q, k, v, alpha, beta, log_decay, state, document_BT, *, chunk_size, leaf_size):
    t = q.shape[1]
    # zero tokens with λ = 0 are identity transitions; padded tokens stay in the last document. The operands stay
    # in the caller's dtype here (chunked_dplr casts them a chunk group at a time: no float32 copy is kept)
    chunked = [xla.to_chunks(common.pad_time(x, chunk_size), chunk_size) for x in (q, k, v, alpha, beta, log_decay)]
    document_BNC, carried_BN = common.chunk_documents(common.pad_time(document_BT, chunk_size, mode="edge"),
                                                      chunk_size)
    out, final = xla.chunked_dplr(*chunked, state, document_BNC[:, None], carried_BN[:, None], leaf_size)
    return xla.from_chunks(out)[:, :t], final


TABLE = dispatch.OpTable(OP, fallback="xla")
TABLE.register(dispatch.Implementation("reference", _run_reference))
TABLE.register(dispatch.Implementation("xla", _run_xla))
# Not tried by "auto": it rescales α by e^{−λ}, finite only for λ > −80, which "auto" cannot check at trace time.
# Callers whose λ is bounded by construction (RWKV-7: λ > −0.61) ask for it by name.
TABLE.register(dispatch.Implementation("delta_pairs", delta_pairs.run))


def dplr_delta_rule(q, k, v, *, alpha, beta, log_decay=None, initial_state=None, segment_ids=None,
                    chunk_size: Optional[int] = None, leaf_size: Optional[int] = None, implementation: str = "auto"):
    """Diagonal-plus-low-rank delta rule S_t = (Diag(e^{λ_t}) + β_tᵀ α_t) S_{t−1} + k_tᵀ v_t, o_t = q_t S_t.

    Args:
      q: [B, T, H, Dk] readout (any scale already applied).
      k: [B, T, H, Dk] write key.   v: [B, T, H, Dv] write value.
      alpha: [B, T, H, Dk] read vector of the low-rank term (r_t = α_t S_{t−1}).
      beta: [B, T, H, Dk] the direction r_t is written back along. q, k, v, alpha, beta share a dtype.
      log_decay: λ ≤ 0, [B, T, H, Dk] (channel-wise) or [B, T, H] (per head); None = no decay.
      initial_state: [B, H, Dk, Dv] state before token 0 (any float dtype); None = zeros.
      segment_ids: [B, T] int; the state resets to zero at every t with seg[t] != seg[t−1] (an id reused after
        another document is a new document). The initial state belongs to each row's first document; the
        final state is that of each row's last document.
      chunk_size (default 64), leaf_size (default 16): chunkwise tiling; ignored by "reference". For
        "delta_pairs" they tile the 2T delta-rule tokens (default: the delta-rule op's defaults per backend).
      implementation: "auto" | "reference" | "xla" | "delta_pairs". "auto" runs "xla", the chunked form in
        pure JAX, differentiated by JAX autodiff. "delta_pairs" runs each token as two delta-rule tokens on that
        op's kernels (Pallas on TPU and GPU, custom VJPs); it rescales α by e^{−λ}, so it needs λ > −80
        (float32 / bfloat16 range), which RWKV-7's λ ∈ (−0.61, 0) meets — see delta_pairs.py.

    Returns:
      (o [B, T, H, Dv] in v's dtype, final_state [B, H, Dk, Dv] float32, or float64 for float64 inputs).
    """
    call = validate(q, k, v, alpha, beta, log_decay, initial_state, segment_ids, chunk_size, leaf_size)
    violation = common.check_nonpositive(OP, "log_decay", log_decay)
    impl = TABLE.choose(implementation, call)
    dtype = common.compute_dtype(q.dtype)
    b, t, h, dk = q.shape
    lam = _channelwise(log_decay, (b, t, h, dk), dtype)
    state = (jnp.zeros((b, h, dk, v.shape[-1]), dtype) if initial_state is None else initial_state.astype(dtype))
    tiling = dict(chunk_size=call.chunk_size, leaf_size=call.leaf_size)
    if impl.name == "delta_pairs":  # the delta-rule op tiles (and defaults) its own 2T tokens
        tiling = dict(chunk_size=chunk_size, leaf_size=leaf_size)
    out, final = impl.run(q, k, v, alpha, beta, lam, state, common.document_index(segment_ids, b, t), **tiling)
    return common.poison(violation, out.astype(v.dtype), final)


def dplr_delta_rule_step(q, k, v, *, alpha, beta, log_decay=None, state):
    """One decode token: q, k, alpha, beta [B, H, Dk]; v [B, H, Dv]; log_decay [B, H, Dk], [B, H] or None;
    state [B, H, Dk, Dv]. Returns (o [B, H, Dv] in v's dtype, new_state float32 / float64).
    Packed-document resets are the caller's job (pass a zero state)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("alpha", alpha), ("beta", beta)):
        common.check_float(STEP, name, x)
        if x.ndim != 3:
            raise common.bad_argument(STEP, name, x, "rank 3 [B, H, D]")
    b, h, dk = q.shape
    for name, x in (("k", k), ("alpha", alpha), ("beta", beta)):
        common.check_shape(STEP, name, x, (b, h, dk), "BHK")
    if tuple(v.shape[:2]) != (b, h):
        raise common.bad_argument(STEP, "v", v, f"shape [B={b}, H={h}, Dv]")
    for name, x in (("k", k), ("v", v), ("alpha", alpha), ("beta", beta)):
        common.check_same_dtype(STEP, name, x, "q", q)
    dv = v.shape[2]
    common.check_shape(STEP, "state", state, (b, h, dk, dv), "BHKV")
    violation = None
    if log_decay is not None:
        _check_decay(STEP, log_decay, (b, h, dk), ("B", "H", "Dk"))
        violation = common.check_nonpositive(STEP, "log_decay", log_decay, under_jit=False)
    dtype = common.compute_dtype(q.dtype)
    lam = _channelwise(log_decay, (b, h, dk), dtype)
    cast = [x.astype(dtype) for x in (q, k, v, alpha, beta)]
    out, new_state = decode.fused_step(*cast, lam, state.astype(dtype))
    return common.poison(violation, out.astype(v.dtype), new_state)
