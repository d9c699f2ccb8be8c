"""Public entry points of the interdomain op (docs/math/interdomain.md): validation, defaults, dispatch, parameter maps.

Per head h (all complex quantities carried as real (Re, Im) pairs; states stacked ``[Re X; Im X]``):

    X^k_t = Λ_t ⊙ X^k_{t−1} + b k̃_tᵀ,   X^v_t = Λ_t ⊙ X^v_{t−1} + b ṽ_tᵀ        Λ_{t,m} = exp(r_{t,m} + iθ_m)
    â_t   = X̂^k_t ξq_t,   o_t = (Ĝ â_t)ᵀ X̂^v_t

with ``q`` = ξ(q), ``k`` = k̃, ``v`` = ṽ, ``log_modulus`` = r (≤ 0; static [H, M] or selective [B, T, H, M]),
``phase`` = θ (static [H, M]), ``input_gain`` = b stacked [Re b; Im b] ([H, 2M]) and ``readout`` = Ĝ
([H, 2M, 2M], real). ``readout_matrix(C_re, C_im)`` builds Ĝ = ĈᵀĈ, which makes o_t the Hermitian
denominator-free readout Re(ξ(q)ᵀ U_tᴴ Γ_t) with U = C X^k, Γ = C X^v (IA1 Eq. 13, our conjugation,
docs/math/interdomain.md, 'What the paper leaves open'); ``conjugate=False`` gives the bilinear Re(ξ(q)ᵀ U_tᵀ Γ_t).

``s4d`` is the S4D-only baseline's core (docs/math/interdomain.md, 'S4D-only baseline'): X_t = Λ ⊙ X_{t−1} + b z_tᵀ, o_t
= ωᵀ X̂_t with a fixed real
2M vector ω per head (``readout_vector`` builds it from C and c_out: o_t = Re(c_outᵀ C X_t)).
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from mixerlab.pallas_kernels import common, dispatch
from mixerlab.pallas_kernels.interdomain import decode, pallas_tpu, pallas_triton, reference, toeplitz, xla

DEFAULT_CHUNK_SIZE = 64
# the Toeplitz form's default: its per-token work grows with the chunk, its chunk-state work shrinks; 128 was the
# fastest forward+backward at 8 x 4096 on the H200 (docs/kernels_gpu.md)
DEFAULT_TOEPLITZ_CHUNK_SIZE = 128
DEFAULT_SUB_CHUNK_SIZE = 8
# docs/math/interdomain.md 'Chunked form': exact pairwise decays inside 8 tokens, factors across; 8 ≈ √64
# balances the two (K·sub·M pairwise against (K/sub)·K·M cross-sub-chunk factors per chunk)


class InterdomainState(NamedTuple):
    """Recurrent state of the interdomain op: stacked [Re; Im] complex rows (float32, float64 for float64)."""

    key: jax.Array  # [B, H, 2M, R]
    value: jax.Array  # [B, H, 2M, Dv]


@dataclasses.dataclass(frozen=True)
class InterdomainCall:
    """What an implementation's ``supports()`` may look at."""

    op: str  # "interdomain" | "s4d"
    batch: int
    length: int
    heads: int
    key_dim: int  # R (0 for s4d)
    value_dim: int
    modes: int
    dtype: jnp.dtype
    selective: bool
    has_initial_state: bool
    has_segments: bool
    chunk_size: int
    sub_chunk_size: int
    backend: str


# ---------------------------------------------------------------------------------------------------------
# validation


_fail = common.bad_argument
_check_float = common.check_float
_check_shape = common.check_shape
compute_dtype = common.compute_dtype


def resolve_chunk_size(op, chunk_size):
    if chunk_size is None:
        return DEFAULT_CHUNK_SIZE
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"{op}: chunk_size={chunk_size!r}; expected a positive int (default {DEFAULT_CHUNK_SIZE})")
    return chunk_size


def _chunk_for(impl, requested, resolved):
    """The chunk the chosen implementation runs: the caller's, else its own default."""
    return DEFAULT_TOEPLITZ_CHUNK_SIZE if requested is None and impl.name in STATIC_DECAY_ONLY else resolved


def resolve_sub_chunk_size(op, sub_chunk_size, chunk):
    """None -> min(8, chunk): a chunk shorter than 8 is a single sub-chunk (exact pairwise decays)."""
    if sub_chunk_size is None:
        return min(DEFAULT_SUB_CHUNK_SIZE, chunk)
    if (not isinstance(sub_chunk_size, int) or isinstance(sub_chunk_size, bool) or sub_chunk_size < 1
            or sub_chunk_size > chunk):
        raise ValueError(f"{op}: sub_chunk_size={sub_chunk_size!r}; expected a positive int <= chunk_size={chunk} "
                         f"(default min({DEFAULT_SUB_CHUNK_SIZE}, chunk_size))")
    return sub_chunk_size


def _check_dynamics(op, b, t, h, log_modulus, phase, input_gain):
    _check_float(op, "phase", phase)
    if phase.ndim != 2 or phase.shape[0] != h:
        raise _fail(op, "phase", phase, f"shape [H={h}, M]")
    m = phase.shape[1]
    _check_float(op, "log_modulus", log_modulus)
    if tuple(log_modulus.shape) == (h, m):
        selective = False
    elif tuple(log_modulus.shape) == (b, t, h, m):
        selective = True
    else:
        raise _fail(op, "log_modulus", log_modulus, f"[H={h}, M={m}] (static) or [B={b}, T={t}, H={h}, M={m}]")
    _check_shape(op, "input_gain", input_gain, (h, 2 * m), ("H", "2M"))
    return m, selective


def check_log_modulus(op, log_modulus, *, under_jit=True):
    """r = log|Λ| must be ≤ 0 and finite (a positive r grows the state without bound; a non-finite one is
    not a decay). Concrete: raise a ValueError naming the argument, its shape and the first offending entry.
    Traced: the violation flag for ``common.poison`` (with MIXERLAB_CHECK_DOMAINS=1 also a run-time error;
    a non-finite entry is reported there as nan)."""
    if isinstance(log_modulus, jax.core.Tracer):
        finite_or_nan = jnp.where(jnp.isfinite(log_modulus), log_modulus, jnp.nan)
        return common.check_nonpositive(op, "log_modulus", finite_or_nan, under_jit=under_jit)
    r = np.asarray(log_modulus)
    bad = ~(np.isfinite(r) & (r <= 0))
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{op}: argument 'log_modulus' is outside its domain: expected every entry <= 0 and "
                         f"finite; found {r[index].item()!r} at index {index} of shape {tuple(r.shape)} "
                         f"({int(bad.sum())} of {r.size} entries outside)")
    return None


# ---------------------------------------------------------------------------------------------------------
# implementations. Contract (interdomain): run(q, k, v, log_modulus [B,T,H,M], phase, gain, readout,
# key_state, value_state, document_BT, *, chunk_size, sub_chunk_size) -> (o, key, value); q, k, v (s4d: z) in
# the caller's dtype, everything else in the compute dtype: each implementation decides how the data enter its
# arithmetic (the kernels use them as GEMM operands, the XLA forms upcast them and pick the matmul precision
# from the caller's dtype). (s4d): run(z, log_modulus, phase, gain, readout_vector, state, document_BT, *,
# chunk_size, sub_chunk_size) -> (o, state).


def _upcast(*data):
    dt = compute_dtype(data[0].dtype)
    return tuple(x.astype(dt) for x in data)


def _ref_ia(q, k, v, *rest, chunk_size, sub_chunk_size):
    del chunk_size, sub_chunk_size
    return _ia_ref(*_upcast(q, k, v), *rest)


def _ref_s4d(z, *rest, chunk_size, sub_chunk_size):
    del chunk_size, sub_chunk_size
    return _s4d_ref(*_upcast(z), *rest)


def _ia_xla(q, k, v, *rest, chunk_size, sub_chunk_size):
    return _ia_xla_jit(*_upcast(q, k, v), *rest, chunk_size=chunk_size, sub_chunk_size=sub_chunk_size,
                       precision=xla.data_precision(q.dtype))


def _s4d_xla(z, *rest, chunk_size, sub_chunk_size):
    return _s4d_xla_jit(*_upcast(z), *rest, chunk_size=chunk_size, sub_chunk_size=sub_chunk_size,
                        precision=xla.data_precision(z.dtype))


def _ia_toeplitz(q, k, v, *rest, chunk_size, sub_chunk_size):
    del sub_chunk_size  # no sub-chunks: the decays come from one table per head
    return _ia_toeplitz_jit(*_upcast(q, k, v), *rest, chunk_size=chunk_size, precision=xla.data_precision(q.dtype))


def _s4d_toeplitz(z, *rest, chunk_size, sub_chunk_size):
    del sub_chunk_size
    return _s4d_toeplitz_jit(*_upcast(z), *rest, chunk_size=chunk_size, precision=xla.data_precision(z.dtype))


def _narrow(dtype):
    """The GEMM operand dtype of "toeplitz_16bit": a 16-bit input dtype itself; None (the "toeplitz" path) else."""
    return jnp.dtype(dtype) if jnp.dtype(dtype).itemsize <= 2 else None


def _ia_toeplitz_16bit(q, k, v, *rest, chunk_size, sub_chunk_size):
    del sub_chunk_size
    narrow = _narrow(q.dtype)
    if narrow is None:
        return _ia_toeplitz(q, k, v, *rest, chunk_size=chunk_size, sub_chunk_size=None)
    return _ia_toeplitz_jit(q, k, v, *rest, chunk_size=chunk_size, precision=xla.data_precision(q.dtype),
                            operand_dtype=narrow)


def _s4d_toeplitz_16bit(z, *rest, chunk_size, sub_chunk_size):
    del sub_chunk_size
    narrow = _narrow(z.dtype)
    if narrow is None:
        return _s4d_toeplitz(z, *rest, chunk_size=chunk_size, sub_chunk_size=None)
    return _s4d_toeplitz_jit(z, *rest, chunk_size=chunk_size, precision=xla.data_precision(z.dtype),
                             operand_dtype=narrow)


_ia_ref = jax.jit(reference.interdomain_reference)
_s4d_ref = jax.jit(reference.s4d_reference)
_ia_xla_jit = jax.jit(xla.interdomain_chunked, static_argnames=("chunk_size", "sub_chunk_size", "precision"))
_s4d_xla_jit = jax.jit(xla.s4d_chunked, static_argnames=("chunk_size", "sub_chunk_size", "precision"))
_ia_toeplitz_jit = jax.jit(toeplitz.interdomain_toeplitz, static_argnames=("chunk_size", "precision", "operand_dtype"))
_s4d_toeplitz_jit = jax.jit(toeplitz.s4d_toeplitz, static_argnames=("chunk_size", "precision", "operand_dtype"))
_ia_step = jax.jit(decode.interdomain_step)
_s4d_step = jax.jit(decode.s4d_step)

# implementations that take log_modulus as the static [H, M] (the others get it per token, [B, T, H, M])
STATIC_DECAY_ONLY = ("toeplitz", "toeplitz_16bit")

TABLE = dispatch.OpTable("interdomain", fallback="xla")
TABLE.register(dispatch.Implementation("reference", _ref_ia))
TABLE.register(dispatch.Implementation("xla", _ia_xla))
# A static decay (no selective decay: the paper's LM runs) takes the Toeplitz form first on every backend: plain
# XLA GEMMs against one decay table per head, no per-token decay tensors (toeplitz.py, docs/kernels_gpu.md).
TABLE.register(dispatch.Implementation("toeplitz", _ia_toeplitz, toeplitz.supports, fast=True))
# The same with 16-bit inputs kept as every data GEMM's operands (float32 results; toeplitz.py): opt-in until it is
# timed against "toeplitz" on a GPU.
TABLE.register(dispatch.Implementation("toeplitz_16bit", _ia_toeplitz_16bit, toeplitz.supports))
# The TPU kernels: "auto" takes them on a TPU backend when ``supports`` accepts the call (docs/kernels.md).
TABLE.register(dispatch.Implementation("pallas_tpu", pallas_tpu.run, pallas_tpu.supports, fast=True))
# The GPU kernel is opt-in (implementation="pallas_triton"), not "auto": correct on the H200 but slower than
# "xla" there (8x4096, H12, M64, bf16: 19.8 / 49.3 ms fwd / fwd+bwd vs 8.5 / 27.0 ms; docs/kernels_gpu.md).
# It takes q, k, v in the caller's dtype (bf16 GEMM operands).
TABLE.register(dispatch.Implementation("pallas_triton", pallas_triton.run, pallas_triton.supports))

S4D_TABLE = dispatch.OpTable("s4d", fallback="xla")
S4D_TABLE.register(dispatch.Implementation("reference", _ref_s4d))
S4D_TABLE.register(dispatch.Implementation("xla", _s4d_xla))
S4D_TABLE.register(dispatch.Implementation("toeplitz", _s4d_toeplitz, toeplitz.supports, fast=True))
S4D_TABLE.register(dispatch.Implementation("toeplitz_16bit", _s4d_toeplitz_16bit, toeplitz.supports))
S4D_TABLE.register(dispatch.Implementation("pallas_tpu", pallas_tpu.run_s4d, pallas_tpu.supports, fast=True))
S4D_TABLE.register(dispatch.Implementation("pallas_triton", pallas_triton.run_s4d, pallas_triton.supports))


def interdomain(q, k, v, *, log_modulus, phase, input_gain, readout, initial_state=None, segment_ids=None,
                chunk_size: Optional[int] = None, implementation: str = "auto",
                sub_chunk_size: Optional[int] = None):
    """Interdomain attention core (complex diagonal S4D memory over [k̃, ṽ] with a query readout).

    Args:
      q: [B, T, H, R] query features ξ(q).  k: [B, T, H, R] key write k̃.  v: [B, T, H, Dv] value write ṽ.
        q, k, v share a floating dtype (bf16 / f32 inputs compute in float32; float64 stays float64).
      log_modulus: r = Re log Λ ≤ 0, [H, M] (static) or [B, T, H, M] (selective decay).
      phase: θ = Im log Λ, [H, M] (static; phases are taken from integer offsets times θ).
      input_gain: b, [H, 2M] stacked [Re b; Im b].
      readout: Ĝ, [H, 2M, 2M] real (see ``readout_matrix``).
      initial_state: ``InterdomainState`` (key [B, H, 2M, R], value [B, H, 2M, Dv]) or None (zeros). It
        belongs to the first segment of each row.
      segment_ids: [B, T] int; both states reset to zero at every t with seg[t] != seg[t−1] (an id reused after
        another document is a new document, docs/architecture.md 'Packing'); the final states are those of each
        row's last document.
      chunk_size: chunk length (default 128 for "toeplitz", 64 otherwise; any positive int, T need not be a
        multiple).
      sub_chunk_size: sub-chunk length of "xla" inside a chunk (docs/math/interdomain.md 'Chunked form': exact
        pairwise decays within a sub-chunk, relative factors across). Default min(8, chunk_size); any int in
        [1, chunk_size], it need not divide chunk_size. Accuracy does not depend on it.
      implementation: "auto" | "reference" | "xla" | "toeplitz" (static log_modulus only) | "toeplitz_16bit" (the
        same with 16-bit q, k, v as the GEMM operands, float32 results; opt-in) | "pallas_tpu" (TPU) |
        "pallas_triton" (GPU, opt-in); the kernels run bf16 inputs as bf16 GEMM operands with float32
        accumulation and state. "auto" takes "toeplitz" for a static log_modulus (any backend), else
        "pallas_tpu" on a TPU where it accepts the call, else "xla".

    Returns:
      (o [B, T, H, Dv] in v's dtype, ``InterdomainState`` float32 / float64).
    """
    op = "interdomain"
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_float(op, name, x)
        if x.ndim != 4:
            raise _fail(op, name, x, "rank 4 [B, T, H, D]")
    b, t, h, r = q.shape
    if t < 1 or r < 1:
        raise _fail(op, "q", q, "non-empty T and R")
    if tuple(k.shape) != (b, t, h, r):
        raise _fail(op, "k", k, f"shape [B={b}, T={t}, H={h}, R={r}] (as q)")
    if tuple(v.shape[:3]) != (b, t, h) or v.shape[3] < 1:
        raise _fail(op, "v", v, f"shape [B={b}, T={t}, H={h}, Dv]")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise _fail(op, name, x, f"dtype {jnp.dtype(q.dtype).name} (the dtype of q)")
    dv = v.shape[3]
    m, selective = _check_dynamics(op, b, t, h, log_modulus, phase, input_gain)
    _check_shape(op, "readout", readout, (h, 2 * m, 2 * m), ("H", "2M", "2M"))
    if initial_state is not None:
        if not isinstance(initial_state, tuple) or len(initial_state) != 2:
            raise ValueError(f"{op}: argument 'initial_state' must be an InterdomainState(key, value) or None, "
                             f"got {type(initial_state).__name__}")
        _check_shape(op, "initial_state.key", initial_state[0], (b, h, 2 * m, r), ("B", "H", "2M", "R"))
        _check_shape(op, "initial_state.value", initial_state[1], (b, h, 2 * m, dv), ("B", "H", "2M", "Dv"))
    common.check_segment_ids(op, segment_ids, b, t)
    chunk = resolve_chunk_size(op, chunk_size)
    sub = resolve_sub_chunk_size(op, sub_chunk_size, chunk)
    call = InterdomainCall(op, b, t, h, r, dv, m, jnp.dtype(q.dtype), selective, initial_state is not None,
                           segment_ids is not None, chunk, sub, dispatch.target_backend())
    violation = check_log_modulus(op, log_modulus)
    impl = TABLE.choose(implementation, call)
    chunk = _chunk_for(impl, chunk_size, chunk)
    dt = compute_dtype(q.dtype)
    lm = log_modulus.astype(dt)
    if not selective and impl.name not in STATIC_DECAY_ONLY:
        lm = jnp.broadcast_to(lm, (b, t, h, m))
    if initial_state is None:
        key0, value0 = jnp.zeros((b, h, 2 * m, r), dt), jnp.zeros((b, h, 2 * m, dv), dt)
    else:
        key0, value0 = initial_state[0].astype(dt), initial_state[1].astype(dt)
    run, out_dtype = impl.run, v.dtype
    if impl.name.startswith("pallas_"):  # the kernels run per shard under a mesh
        run = common.per_shard(run, h, ("tokens",) * 4 + ("heads",) * 3 + ("state", "state", "rows"),
                               ("tokens", "state", "state"))
    o, key, value = run(q, k, v, lm, phase.astype(dt), input_gain.astype(dt), readout.astype(dt), key0, value0,
                        common.document_index(segment_ids, b, t), chunk_size=chunk, sub_chunk_size=sub)
    o, key, value = common.poison(violation, o.astype(out_dtype), key, value)
    return o, InterdomainState(key, value)


def interdomain_step(q, k, v, *, log_modulus, phase, input_gain, readout, state):
    """One decode token: q, k [B, H, R]; v [B, H, Dv]; log_modulus [H, M] or [B, H, M]; state an
    ``InterdomainState``. Cost O(M(R + Dv) + M²) per head. Packed-document resets are the caller's job (pass
    a zero state). Returns (o [B, H, Dv] in v's dtype, new state float32 / float64)."""
    op = "interdomain_step"
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_float(op, name, x)
        if x.ndim != 3:
            raise _fail(op, name, x, "rank 3 [B, H, D]")
    b, h, r = q.shape
    if tuple(k.shape) != (b, h, r):
        raise _fail(op, "k", k, f"shape [B={b}, H={h}, R={r}]")
    if tuple(v.shape[:2]) != (b, h):
        raise _fail(op, "v", v, f"shape [B={b}, H={h}, Dv]")
    dv = v.shape[2]
    _check_float(op, "phase", phase)
    if phase.ndim != 2 or phase.shape[0] != h:
        raise _fail(op, "phase", phase, f"shape [H={h}, M]")
    m = phase.shape[1]
    _check_float(op, "log_modulus", log_modulus)
    if tuple(log_modulus.shape) not in ((h, m), (b, h, m)):
        raise _fail(op, "log_modulus", log_modulus, f"[H={h}, M={m}] or [B={b}, H={h}, M={m}]")
    violation = check_log_modulus(op, log_modulus, under_jit=False)
    _check_shape(op, "input_gain", input_gain, (h, 2 * m), ("H", "2M"))
    _check_shape(op, "readout", readout, (h, 2 * m, 2 * m), ("H", "2M", "2M"))
    _check_shape(op, "state.key", state[0], (b, h, 2 * m, r), ("B", "H", "2M", "R"))
    _check_shape(op, "state.value", state[1], (b, h, 2 * m, dv), ("B", "H", "2M", "Dv"))
    dt = compute_dtype(q.dtype)
    lm = jnp.broadcast_to(log_modulus.astype(dt), (b, h, m))
    ph = phase.astype(dt)
    o, key, value = _ia_step(q.astype(dt), k.astype(dt), v.astype(dt), lm, jnp.cos(ph), jnp.sin(ph),
                                            input_gain.astype(dt), readout.astype(dt), state[0].astype(dt),
                                            state[1].astype(dt))
    o, key, value = common.poison(violation, o.astype(v.dtype), key, value)
    return o, InterdomainState(key, value)


def s4d(z, *, log_modulus, phase, input_gain, readout, initial_state=None, segment_ids=None,
        chunk_size: Optional[int] = None, implementation: str = "auto", sub_chunk_size: Optional[int] = None):
    """S4D-only core: z [B, T, H, C]; log_modulus [H, M] or [B, T, H, M]; phase [H, M]; input_gain [H, 2M];
    readout ω [H, 2M] (``readout_vector``); initial_state [B, H, 2M, C] or None; segment_ids, chunk_size,
    sub_chunk_size and implementation ("auto" | "reference" | "xla" | "pallas_tpu" | "pallas_triton") as
    ``interdomain``.
    Returns (o [B, T, H, C] in z's dtype, state [B, H, 2M, C] float32 /
    float64)."""
    op = "s4d"
    _check_float(op, "z", z)
    if z.ndim != 4 or z.shape[1] < 1:
        raise _fail(op, "z", z, "rank 4 [B, T, H, C] with T >= 1")
    b, t, h, c = z.shape
    m, selective = _check_dynamics(op, b, t, h, log_modulus, phase, input_gain)
    _check_shape(op, "readout", readout, (h, 2 * m), ("H", "2M"))
    if initial_state is not None:
        _check_shape(op, "initial_state", initial_state, (b, h, 2 * m, c), ("B", "H", "2M", "C"))
    common.check_segment_ids(op, segment_ids, b, t)
    chunk = resolve_chunk_size(op, chunk_size)
    sub = resolve_sub_chunk_size(op, sub_chunk_size, chunk)
    call = InterdomainCall(op, b, t, h, 0, c, m, jnp.dtype(z.dtype), selective, initial_state is not None,
                           segment_ids is not None, chunk, sub, dispatch.target_backend())
    violation = check_log_modulus(op, log_modulus)
    impl = S4D_TABLE.choose(implementation, call)
    chunk = _chunk_for(impl, chunk_size, chunk)
    dt = compute_dtype(z.dtype)
    lm = log_modulus.astype(dt)
    if not selective and impl.name not in STATIC_DECAY_ONLY:
        lm = jnp.broadcast_to(lm, (b, t, h, m))
    x0 = jnp.zeros((b, h, 2 * m, c), dt) if initial_state is None else initial_state.astype(dt)
    run, out_dtype = impl.run, z.dtype
    if impl.name.startswith("pallas_"):  # the kernels run per shard under a mesh
        run = common.per_shard(run, h, ("tokens", "tokens", "heads", "heads", "heads", "state", "rows"),
                               ("tokens", "state"))
    o, x = run(z, lm, phase.astype(dt), input_gain.astype(dt), readout.astype(dt), x0,
               common.document_index(segment_ids, b, t), chunk_size=chunk, sub_chunk_size=sub)
    return common.poison(violation, o.astype(out_dtype), x)


def s4d_step(z, *, log_modulus, phase, input_gain, readout, state):
    """One decode token of ``s4d``: z [B, H, C]; log_modulus [H, M] or [B, H, M]; state [B, H, 2M, C]."""
    op = "s4d_step"
    _check_float(op, "z", z)
    if z.ndim != 3:
        raise _fail(op, "z", z, "rank 3 [B, H, C]")
    b, h, c = z.shape
    _check_float(op, "phase", phase)
    if phase.ndim != 2 or phase.shape[0] != h:
        raise _fail(op, "phase", phase, f"shape [H={h}, M]")
    m = phase.shape[1]
    if tuple(log_modulus.shape) not in ((h, m), (b, h, m)):
        raise _fail(op, "log_modulus", log_modulus, f"[H={h}, M={m}] or [B={b}, H={h}, M={m}]")
    violation = check_log_modulus(op, log_modulus, under_jit=False)
    _check_shape(op, "input_gain", input_gain, (h, 2 * m), ("H", "2M"))
    _check_shape(op, "readout", readout, (h, 2 * m), ("H", "2M"))
    _check_shape(op, "state", state, (b, h, 2 * m, c), ("B", "H", "2M", "C"))
    dt = compute_dtype(z.dtype)
    ph = phase.astype(dt)
    o, x = _s4d_step(z.astype(dt), jnp.broadcast_to(log_modulus.astype(dt), (b, h, m)), jnp.cos(ph),
                           jnp.sin(ph), input_gain.astype(dt), readout.astype(dt), state.astype(dt))
    return common.poison(violation, o.astype(z.dtype), x)


# ---------------------------------------------------------------------------------------------------------
# parameter maps (used by mixers/interdomain.py and mixers/s4d.py)


def s4d_inv_imag(num_modes: int, n: Optional[int] = None):
    """S4D-Inv imaginary parts a_im(j) = (N/π)(N/(2j+1) − 1), j = 0..M−1. ``n`` = N: M as printed in IA
    (32 of 64 frequencies negative, docs/math/interdomain.md, 'What the paper leaves open') or 2M as the S4 code
    (``dplr.py``, init='inv': all positive)."""
    n = num_modes if n is None else n
    j = jnp.arange(num_modes, dtype=jnp.float32)
    return (n / math.pi) * (n / (2.0 * j + 1.0) - 1.0)


def zoh_input_gain(a_re, a_im, delta):
    """b = (exp(Δ A) − 1) / A with A = a_re + i a_im (a_re < 0), B = 1; a_*: [H, M], delta [H].
    Returns [H, 2M] stacked [Re b; Im b]."""
    x, y = delta[:, None] * a_re, delta[:, None] * a_im
    n_re = jnp.expm1(x) * jnp.cos(y) - 2.0 * jnp.sin(0.5 * y) ** 2  # e^x cos y − 1 without cancellation
    n_im = jnp.exp(x) * jnp.sin(y)
    den = a_re * a_re + a_im * a_im
    return jnp.concatenate([(n_re * a_re + n_im * a_im) / den, (n_im * a_re - n_re * a_im) / den], axis=-1)


def _real_form(c_re, c_im):
    """[.., M, M] complex -> [.., 2M, 2M] real [[Re, −Im], [Im, Re]]."""
    top = jnp.concatenate([c_re, -c_im], axis=-1)
    bottom = jnp.concatenate([c_im, c_re], axis=-1)
    return jnp.concatenate([top, bottom], axis=-2)


def readout_matrix(c_re, c_im, *, conjugate: bool = True):
    """Ĝ [H, 2M, 2M] from C_h = c_re + i c_im [H, M, M].

    conjugate=True (Hermitian, default): Ĝ = ĈᵀĈ, the real form of CᴴC, so o = Re(aᴴ CᴴC X^v) =
    Re(ξqᵀ Uᴴ Γ). conjugate=False (bilinear): Ĝ = J · realform(CᵀC), J = diag(1, −1), so o = Re(ξqᵀ Uᵀ Γ)."""
    hi = jax.lax.Precision.HIGHEST
    if conjugate:
        c_hat = _real_form(c_re, c_im)
        return jnp.einsum("hki,hkj->hij", c_hat, c_hat, precision=hi)
    g_re = jnp.einsum("hki,hkj->hij", c_re, c_re, precision=hi) - jnp.einsum("hki,hkj->hij", c_im, c_im, precision=hi)
    g_im = jnp.einsum("hki,hkj->hij", c_re, c_im, precision=hi) + jnp.einsum("hki,hkj->hij", c_im, c_re, precision=hi)
    g = _real_form(g_re, g_im)
    m = c_re.shape[-1]
    sign = jnp.concatenate([jnp.ones((m,), g.dtype), -jnp.ones((m,), g.dtype)])
    return g * sign[:, None]


def readout_vector(c_re, c_im, c_out):
    """ω [H, 2M] with ωᵀ X̂ = Re(c_outᵀ C X): c̃ = Cᵀ c_out, ω = [Re c̃; −Im c̃]. c_out: [H, M] real."""
    hi = jax.lax.Precision.HIGHEST
    t_re = jnp.einsum("hmn,hm->hn", c_re, c_out, precision=hi)
    t_im = jnp.einsum("hmn,hm->hn", c_im, c_out, precision=hi)
    return jnp.concatenate([t_re, -t_im], axis=-1)
