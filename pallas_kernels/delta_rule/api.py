"""Public entry points of the delta-rule op (docs/math/delta_rule.md): validation, defaults, dispatch.

Recurrence (row vectors, state key-major [Dk, Dv]):
    S_t = (I − k_tᵀ k̂_t) Diag(exp λ_t) S_{t−1} + k_tᵀ v̂_t,     o_t = q̂_t S_t
with q̂ = ``q``, k = ``k``, k̂ = ``erase_key``, v̂ = ``v``, λ = ``log_decay``. Gates are applied by the caller.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax.numpy as jnp

from mixerlab.pallas_kernels import common, dispatch
from mixerlab.pallas_kernels.delta_rule import (
    decode, decode_pallas_triton, pallas_tpu, pallas_triton, reference, vjp, xla)

DEFAULT_CHUNK_SIZE = {"tpu": 256}  # every other backend: 64
DEFAULT_CHUNK_SIZE_OTHER = 64
# Default leaf: halve the chunk while it stays even and above the target (TPU 256 -> 8, CPU 64 -> 8, GPU
# 64 -> 16). GPU 16: the configuration the H200 benchmarks measured; leaf 8 times the same within run-to-run
# noise there (docs/benchmarks/delta_rule_h200.md).
DEFAULT_LEAF_TARGET = {"gpu": 16}
DEFAULT_LEAF_TARGET_OTHER = 8
DEFAULT_NORMALIZER_EPS = 1e-6
STEP, NLA = "delta_rule_step", "normalized_linear_attention"  # op names in error messages


@dataclasses.dataclass(frozen=True)
class DeltaRuleCall:
    """What an implementation's ``supports()`` may look at."""

    batch: int
    length: int
    heads: int
    key_dim: int
    value_dim: int
    dtype: jnp.dtype
    has_erase: bool
    decay: str  # "none" | "head" | "channel"
    has_initial_state: bool
    has_segments: bool
    chunk_size: int
    leaf_size: int
    backend: str


# ---------------------------------------------------------------------------------------------------------
# validation

OP = "delta_rule"


def _fail(name: str, x, expected: str, op: str = OP) -> ValueError:
    return common.bad_argument(op, name, x, expected)


def resolve_chunking(chunk_size, leaf_size, backend):
    """Rule: chunk_size any positive int; leaf_size any positive int with chunk_size / leaf_size a power of
    two (1, 2, 4, ...), i.e. the chunk is a perfect binary tree of leaves. Defaults: chunk 256 on TPU and
    64 elsewhere; leaf = the chunk halved while it is even and larger than the backend's target (16 on GPU,
    8 elsewhere: e.g. 8 for every power-of-two chunk >= 8 on TPU, the chunk itself when it is <= 8)."""
    if chunk_size is None:
        chunk_size = DEFAULT_CHUNK_SIZE.get(backend, DEFAULT_CHUNK_SIZE_OTHER)
    if not common.is_int(chunk_size) or chunk_size < 1:
        raise ValueError(f"delta_rule: chunk_size={chunk_size!r}; expected a positive int")
    chunk_size = int(chunk_size)
    if leaf_size is None:
        leaf_size = chunk_size
        target = DEFAULT_LEAF_TARGET.get(backend, DEFAULT_LEAF_TARGET_OTHER)
        while leaf_size % 2 == 0 and leaf_size > target:
            leaf_size //= 2
    if not common.is_int(leaf_size) or leaf_size < 1:
        raise ValueError(f"delta_rule: leaf_size={leaf_size!r}; expected a positive int")
    leaf_size = int(leaf_size)
    ratio = chunk_size // leaf_size
    if chunk_size % leaf_size or ratio & (ratio - 1):
        raise ValueError(
            f"delta_rule: leaf_size={leaf_size} does not fit chunk_size={chunk_size}; expected chunk_size = "
            f"leaf_size × a power of two (e.g. leaf 4, 8 or 16 with chunk 64, or leaf_size == chunk_size)")
    return chunk_size, leaf_size


def validate(q, k, v, erase_key, log_decay, initial_state, segment_ids, chunk_size, leaf_size) -> DeltaRuleCall:
    b, t, h, dk, dv = common.check_qkv(OP, q, k, v)
    if erase_key is not None:
        common.check_shape(OP, "erase_key", erase_key, (b, t, h, dk), "BTHK")
        common.check_same_dtype(OP, "erase_key", erase_key, "q", q)
    decay = "none"
    if log_decay is not None:
        common.check_float(OP, "log_decay", log_decay)
        if tuple(log_decay.shape) == (b, t, h, dk):
            decay = "channel"
        elif tuple(log_decay.shape) == (b, t, h):
            decay = "head"
        else:
            raise _fail("log_decay", log_decay,
                        f"[B={b}, T={t}, H={h}, Dk={dk}] (channel-wise) or [B={b}, T={t}, H={h}] (per head)")
    if initial_state is not None:
        common.check_shape(OP, "initial_state", initial_state, (b, h, dk, dv), "BHKV")
    common.check_segment_ids(OP, segment_ids, b, t)
    backend = dispatch.target_backend()
    chunk_size, leaf_size = resolve_chunking(chunk_size, leaf_size, backend)
    return DeltaRuleCall(b, t, h, dk, dv, jnp.dtype(q.dtype), erase_key is not None, decay,
                         initial_state is not None, segment_ids is not None, chunk_size, leaf_size, backend)


compute_dtype = common.compute_dtype


# ---------------------------------------------------------------------------------------------------------
# implementations
#
# Contract: run(q, k, erase, v, log_decay, state, document_BT, *, chunk_size, leaf_size) -> (o, final_state).
# q, k, erase [B,T,H,Dk] and v [B,T,H,Dv] arrive in the caller's dtype (a kernel may feed bf16 operands to
# its matmuls); log_decay [B,T,H,Dk] and state [B,H,Dk,Dv] in the compute dtype; document_BT int32 is the
# running count of segment boundaries (equal counts = same document). erase is None when the caller gave no
# erase key (linear attention, the gated no-erase mixers): then k̂ = 0, (I + A)⁻¹ = I, and an implementation
# skips A, the inverse P, Y = P (K̂⊙π) and the M·Y correction (and their backward): the chunk is
# O = (Q̂⊙π) S₀ + M V̂, S_C = Diag(π_C) S₀ + (K⊙E)ᵀ V̂. Pallas kernels register here with
# ``TABLE.register(dispatch.Implementation("pallas_tpu", run, supports, fast=True))``.


def _upcast(dtype, *arrays):
    return [x.astype(dtype) for x in arrays]


def _run_reference(q, k, erase, v, log_decay, state, document_BT, **unused_tuning):
    erase = jnp.zeros_like(k) if erase is None else erase  # the oracle runs the general recurrence
    q, k, erase, v = _upcast(log_decay.dtype, q, k, erase, v)
    return reference.delta_rule_reference(q, k, erase, v, log_decay, state, document_BT)


def _run_xla(q, k, erase, v, log_decay, state, document_BT, *, chunk_size, leaf_size):
    t = q.shape[1]
    # xla computes in float32 (float64 for float64 inputs) whatever the operand dtype; erase None: no erase
    q, k, v = _upcast(log_decay.dtype, q, k, v)
    erase = None if erase is None else erase.astype(log_decay.dtype)
    # zero tokens with λ = 0 are identity transitions; padded tokens stay in the last document
    chunked = [None if x is None else xla.to_chunks(common.pad_time(x, chunk_size), chunk_size)
               for x in (q, k, erase, v, log_decay)]
    document_BNC, carried_BN = common.chunk_documents(common.pad_time(document_BT, chunk_size, mode="edge"),
                                                      chunk_size)
    document_B1NC, carry_B1N = document_BNC[:, None], carried_BN[:, None]
    out_BHNCV, final_BHKV = vjp.chunked_delta_rule(*chunked, state, document_B1NC, carry_B1N, leaf_size)
    return xla.from_chunks(out_BHNCV)[:, :t], final_BHKV


def _without_erase(run, q, k, v, log_decay, state, document_BT, **tiling):
    return run(q, k, None, v, log_decay, state, document_BT, **tiling)


TABLE = dispatch.OpTable("delta_rule", fallback="xla", planned=("pallas_tpu", "pallas_triton"))
TABLE.register(dispatch.Implementation("reference", _run_reference))
TABLE.register(dispatch.Implementation("xla", _run_xla))
# The Pallas kernels: "auto" tries them first; each refuses calls (backend, dtype, chunk, head dim) it cannot
# serve, with the reason logged, and "auto" falls back to "xla".
TABLE.register(dispatch.Implementation("pallas_tpu", pallas_tpu.run, pallas_tpu.supports, fast=True))
TABLE.register(dispatch.Implementation("pallas_triton", pallas_triton.run, pallas_triton.supports, fast=True))


def delta_rule(q, k, v, *, erase_key=None, log_decay=None, initial_state=None, segment_ids=None,
               chunk_size: Optional[int] = None, leaf_size: Optional[int] = None, implementation: str = "auto"):
    """Delta-family token mixer core.

    Args:
      q: [B, T, H, Dk] readout query q̂ (scale and readout gain already applied).
      k: [B, T, H, Dk] write key.
      v: [B, T, H, Dv] write value v̂ (write gate already applied). q, k, v (and erase_key) share a dtype.
      erase_key: [B, T, H, Dk] erase/read key k̂ (e.g. β·k or b⊙k); None = no erase (linear attention).
      log_decay: λ ≤ 0, [B, T, H, Dk] (channel-wise) or [B, T, H] (per head); None = no decay.
      initial_state: [B, H, Dk, Dv] state before token 0 (any float dtype); None = zeros.
      segment_ids: [B, T] int; the state resets to zero at every t with seg[t] != seg[t−1] (an id reused after
        another document is a new document, docs/architecture.md 'Packing'). The initial state belongs to the
        first segment of each row; the final state is that of each row's last document.
      chunk_size, leaf_size: chunkwise tiling (see ``resolve_chunking``); ignored by "reference".
      implementation: "auto" | "reference" | "xla" (Pallas kernels will register in the same table).

    Returns:
      (o [B, T, H, Dv] in v's dtype, final_state [B, H, Dk, Dv] float32, or float64 for float64 inputs).
    """
    call = validate(q, k, v, erase_key, log_decay, initial_state, segment_ids, chunk_size, leaf_size)
    violation = common.check_nonpositive(OP, "log_decay", log_decay)
    impl = TABLE.choose(implementation, call)
    dtype = compute_dtype(q.dtype)
    b, t, h, dk = q.shape
    if log_decay is None:
        lam = jnp.zeros((b, t, h, dk), dtype)
    elif log_decay.ndim == 3:
        lam = jnp.broadcast_to(log_decay.astype(dtype)[..., None], (b, t, h, dk))  # grad sums over channels
    else:
        lam = log_decay.astype(dtype)
    state = (jnp.zeros((b, h, dk, v.shape[-1]), dtype) if initial_state is None
             else initial_state.astype(dtype))
    document = common.document_index(segment_ids, b, t)
    tiling = dict(chunk_size=call.chunk_size, leaf_size=call.leaf_size)
    if erase_key is None:  # the no-erase specialisation (see the contract above)
        run = functools.partial(_without_erase, impl.run)
        tokens = ("tokens",) * 4
        args = (q, k, v, lam, state, document)
    else:
        run, tokens, args = impl.run, ("tokens",) * 5, (q, k, erase_key, v, lam, state, document)
    if impl.name.startswith("pallas_"):
        run = common.per_shard(run, h, tokens + ("state", "rows"), ("tokens", "state"))
    out, final = run(*args, **tiling)
    return common.poison(violation, out.astype(v.dtype), final)


@dataclasses.dataclass(frozen=True)
class StepCall:
    """What the decode-step implementations are chosen on."""
    backend: str
    key_dim: int
    value_dim: int
    dtype: jnp.dtype
    state_dtype: jnp.dtype


def _step_xla(q, k, erase, v, log_decay, state):
    dtype = compute_dtype(q.dtype)
    return decode.fused_step(*_upcast(dtype, q, k, erase, v), log_decay, state.astype(dtype))


def _step_triton(q, k, erase, v, log_decay, state):
    return decode_pallas_triton.step(q, k, erase, v, log_decay, state.astype(jnp.float32))


def _step_triton_supports(call: StepCall):
    return decode_pallas_triton.supports(call.backend, call.key_dim, call.value_dim, call.dtype, call.state_dtype)


STEP_TABLE = dispatch.OpTable(STEP, fallback="xla")
STEP_TABLE.register(dispatch.Implementation("xla", _step_xla))
STEP_TABLE.register(dispatch.Implementation("pallas_triton", _step_triton, _step_triton_supports, fast=True))


def delta_rule_step(q, k, v, *, erase_key=None, log_decay=None, state, implementation: str = "auto"):
    """One decode token: q, k, erase_key [B, H, Dk]; v [B, H, Dv]; log_decay [B, H, Dk] or [B, H] or None;
    state [B, H, Dk, Dv]. Returns (o [B, H, Dv] in v's dtype, new_state float32 / float64).
    Packed-document resets are the caller's job (pass a zero state).
    ``implementation``: "auto" (the Pallas-Triton kernel on GPU, else "xla"), "xla" or "pallas_triton"."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        common.check_float(STEP, name, x)
        if x.ndim != 3:
            raise _fail(name, x, "rank 3 [B, H, D]", STEP)
    b, h, dk = q.shape
    common.check_shape(STEP, "k", k, (b, h, dk), "BHK")
    if tuple(v.shape[:2]) != (b, h):
        raise _fail("v", v, f"shape [B={b}, H={h}, Dv]", STEP)
    dv = v.shape[2]
    for name, x in (("k", k), ("v", v), ("erase_key", erase_key)):
        if x is not None and x.dtype != q.dtype:
            raise _fail(name, x, f"dtype {jnp.dtype(q.dtype).name} (the dtype of q)", STEP)
    if erase_key is not None:
        common.check_shape(STEP, "erase_key", erase_key, (b, h, dk), "BHK")
    common.check_float(STEP, "state", state)
    common.check_shape(STEP, "state", state, (b, h, dk, dv), "BHKV")
    dtype = compute_dtype(q.dtype)
    if log_decay is None:
        lam = jnp.zeros((b, h, dk), dtype)
    else:
        common.check_float(STEP, "log_decay", log_decay)
        if tuple(log_decay.shape) == (b, h):
            lam = jnp.broadcast_to(log_decay.astype(dtype)[..., None], (b, h, dk))
        elif tuple(log_decay.shape) == (b, h, dk):
            lam = log_decay.astype(dtype)
        else:
            raise _fail("log_decay", log_decay, f"[B={b}, H={h}, Dk={dk}] or [B={b}, H={h}]", STEP)
        violation = common.check_nonpositive(STEP, "log_decay", log_decay, under_jit=False)
    erase = jnp.zeros((b, h, dk), q.dtype) if erase_key is None else erase_key
    call = StepCall(dispatch.target_backend(), dk, dv, jnp.dtype(q.dtype), jnp.dtype(dtype))
    out, new_state = STEP_TABLE.choose(implementation, call).run(q, k, erase, v, lam, state)
    return common.poison(violation if log_decay is not None else None, out.astype(v.dtype), new_state)


def normalized_linear_attention(q_feat, k_feat, v, *, initial_state=None, segment_ids=None,
                                eps: float = DEFAULT_NORMALIZER_EPS, chunk_size=None, leaf_size=None,
                                implementation: str = "auto"):
    """Normalised linear attention o_t = φ(q_t) S_t / (φ(q_t) z_tᵀ + eps) (docs/math/delta_rule.md, 'Normalised linear
    attention'), run through the core
    with the augmented value v̂ = [v, 1] (no erase, no decay): column Dv of the state is z.

    q_feat, k_feat: [B, T, H, Dk] feature maps φ(q), φ(k) ≥ 0 (e.g. ELU + 1), same dtype as v [B, T, H, Dv].
    eps (default 1e-6) only guards an all-zero feature row; with φ > 0 the denominator is already positive.
    Returns (o [B, T, H, Dv] in v's dtype, state [B, H, Dk, Dv + 1] float32/float64 = [S | zᵀ]).
    The ratio is taken in the compute dtype (float32 at least)."""
    for name, x in (("q_feat", q_feat), ("k_feat", k_feat), ("v", v)):
        common.check_float(NLA, name, x)
        if x.dtype != v.dtype:
            raise _fail(name, x, f"dtype {jnp.dtype(v.dtype).name} (the dtype of v)", NLA)
    dtype = compute_dtype(v.dtype)
    # the core sees [v, 1] in the compute dtype, so the ratio is formed from f32 (or f64) num and den
    augmented = jnp.concatenate([v.astype(dtype), jnp.ones((*v.shape[:-1], 1), dtype)], axis=-1)
    cast = lambda x: x.astype(dtype)  # noqa: E731
    out, state = delta_rule(cast(q_feat), cast(k_feat), augmented, initial_state=initial_state,
                            segment_ids=segment_ids, chunk_size=chunk_size, leaf_size=leaf_size,
                            implementation=implementation)
    numerator, denominator = out[..., :-1], out[..., -1:]
    return (numerator / (denominator + eps)).astype(v.dtype), state
