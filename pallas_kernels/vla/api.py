"""Public entry points of the Variational Linear Attention op (docs/math/vla.md): validation, defaults, dispatch.

Per head, row vectors, key-major state S [Dk, Dv] (``o = q S``) and penalty inverse A [Dk, Dk]:

    k̂ = k / max(‖k‖, ε)            u = p / max(‖p‖, ε)   (p = ``penalty_key``; None: u = k̂)
    A ← A − (Au)(Au)ᵀ / max(1 + uᵀAu, ε)                 Sherman–Morrison, A_t = (A_{t−1}⁻¹ + uᵀu)⁻¹
    α̂ = k̂A / max(‖k̂A‖, ε)                                 post-update A
    S ← S + α̂ᵀ (v − k̂ S)                                  residual write
    A ← A + ρ I   after token t when (pos_t + 1 + refresh_offset) mod P == 0   (identity refresh)
    o = q S

Ablations of the VLA paper (Tables 2 and 4), all off by default (= the paper's full method):
* ``normalize_key=False``: write and read with the raw key k instead of k̂ (u stays unit);
* ``normalize_write_direction=False``: write along α = k̂A itself (the classical RLS gain direction when u = k̂);
* ``penalty_update="fixed"``: no Sherman–Morrison update and no refresh, so A stays at its start value (I/λ₀ or
  the caller's A₀). It runs as u = 0 with no refresh, which every implementation then honours unchanged.

The layer applies the feature maps: it passes ``q = φ(q)`` (or a normalised query), ``k = φ(k)`` (or the raw
key) and ``penalty_key = f_θ(k)``; the op applies the unit normalisations with the ε floor. ``pos_t`` is the
token's position inside its document (restarting at every segment boundary; the first segment starts at
``initial_position``). Names (docs/math/vla.md, 'Names in the code'): ``lambda0`` = λ₀ (A₀ = I/λ₀), ``refresh_period`` =
P,
``refresh_magnitude`` = ρ, ``eps`` = ε.
"""
from __future__ import annotations

import functools

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from mixerlab.pallas_kernels import common, dispatch
from mixerlab.pallas_kernels.delta_rule import pallas_tpu as delta_rule_pallas_tpu
from mixerlab.pallas_kernels.delta_rule.api import delta_rule
from mixerlab.pallas_kernels.vla import decode, pallas_tpu, pallas_triton, reference, xla
from mixerlab.pallas_kernels.vla.reference import floored_norm

DEFAULT_LAMBDA0 = 0.1          # A₀ = I/λ₀ = 10 I              (VLA paper, Tables 3 and 6)
DEFAULT_REFRESH_PERIOD = 20    # P                              (VLA paper, Tables 3 and 6)
DEFAULT_REFRESH_MAGNITUDE = 1e-3  # ρ                           (VLA paper, Tables 3 and 6)
DEFAULT_EPS = 1e-4             # every denominator floor        (VLA paper, Tables 3 and 6)
PENALTY_UPDATES = ("sherman_morrison", "fixed")
MAX_DEFAULT_CHUNK = 64


@dataclasses.dataclass(frozen=True)
class VLACall:
    """What an implementation's ``supports()`` may look at."""

    batch: int
    length: int
    heads: int
    key_dim: int
    value_dim: int
    dtype: jnp.dtype
    has_penalty_key: bool
    has_initial_state: bool
    has_segments: bool
    chunk_size: int
    refresh_period: int
    backend: str


OP = "vla"


def _fail(name, x, expected) -> ValueError:
    return common.bad_argument(OP, name, x, expected)


def _check_float(name, x):
    common.check_float(OP, name, x)


_is_int, _is_real, compute_dtype = common.is_int, common.is_real, common.compute_dtype


def validate_hyper(lambda0, refresh_period, refresh_magnitude, refresh_offset, eps):
    if not _is_real(lambda0) or not lambda0 > 0:
        raise ValueError(f"vla: lambda0={lambda0!r}; expected a positive number (A₀ = I/lambda0)")
    if not _is_int(refresh_period) or refresh_period < 0:
        raise ValueError(f"vla: refresh_period={refresh_period!r}; expected an int >= 0 (0 = no refresh)")
    if not _is_real(refresh_magnitude) or refresh_magnitude < 0:
        raise ValueError(f"vla: refresh_magnitude={refresh_magnitude!r}; expected a number >= 0")
    if not _is_int(refresh_offset) or refresh_offset < 0 or (refresh_period and refresh_offset >= refresh_period):
        raise ValueError(f"vla: refresh_offset={refresh_offset!r}; expected an int in [0, refresh_period)"
                         f" (refresh_period={refresh_period})")
    if not _is_real(eps) or not eps > 0:
        raise ValueError(f"vla: eps={eps!r}; expected a positive number")


def validate_ablation(normalize_key, normalize_write_direction, penalty_update):
    for name, value in (("normalize_key", normalize_key), ("normalize_write_direction", normalize_write_direction)):
        if not isinstance(value, bool):
            raise ValueError(f"vla: {name}={value!r}; expected True (the paper's method) or False (ablation)")
    if penalty_update not in PENALTY_UPDATES:
        raise ValueError(f"vla: penalty_update={penalty_update!r}; expected one of {PENALTY_UPDATES} "
                         "('sherman_morrison' = the paper's method, 'fixed' = A stays at its start value)")


def resolve_chunk_size(chunk_size, refresh_period, refresh_offset):
    """Default: min(64, refresh_period − refresh_offset), or 64 without refresh. An explicit chunk_size must
    be a positive int ≤ refresh_period − refresh_offset, so that a chunk holds at most one refresh and only
    of the document it starts in (the chunked A-pass relies on it; docs/vla.md)."""
    limit = refresh_period - refresh_offset if refresh_period else None
    if chunk_size is None:
        return MAX_DEFAULT_CHUNK if limit is None else min(MAX_DEFAULT_CHUNK, limit)
    if not _is_int(chunk_size) or chunk_size < 1:
        raise ValueError(f"vla: chunk_size={chunk_size!r}; expected a positive int")
    if limit is not None and chunk_size > limit:
        raise ValueError(f"vla: chunk_size={chunk_size} exceeds refresh_period - refresh_offset = {limit}; "
                         f"the chunked A-pass needs chunk_size <= {limit}")
    return chunk_size


def validate(q, k, v, penalty_key, initial_state, segment_ids, initial_position, chunk_size,
             refresh_period, refresh_offset) -> VLACall:
    b, t, h, dk, dv = common.check_qkv(OP, q, k, v)
    if penalty_key is not None:
        _check_float("penalty_key", penalty_key)
        if tuple(penalty_key.shape) != (b, t, h, dk) or penalty_key.dtype != q.dtype:
            raise _fail("penalty_key", penalty_key, f"shape [B={b}, T={t}, H={h}, Dk={dk}] and q's dtype")
    if initial_state is not None:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
            raise ValueError(f"vla: argument 'initial_state' must be a pair (S [B,H,Dk,Dv], A [B,H,Dk,Dk]), "
                             f"got {type(initial_state).__name__}")
        s0, a0 = initial_state
        _check_float("initial_state[0] (S)", s0)
        _check_float("initial_state[1] (A)", a0)
        if tuple(s0.shape) != (b, h, dk, dv):
            raise _fail("initial_state[0] (S)", s0, f"shape [B={b}, H={h}, Dk={dk}, Dv={dv}]")
        if tuple(a0.shape) != (b, h, dk, dk):
            raise _fail("initial_state[1] (A)", a0, f"shape [B={b}, H={h}, Dk={dk}, Dk={dk}]")
        common.check_positive_definite(OP, "initial_state[1] (A)", a0)
    common.check_segment_ids(OP, segment_ids, b, t)
    if not _is_int(initial_position):
        if not hasattr(initial_position, "shape") or not jnp.issubdtype(initial_position.dtype, jnp.integer) \
                or tuple(initial_position.shape) not in ((), (b,)):
            raise _fail("initial_position", initial_position, f"an int or an integer array of shape [B={b}]")
    chunk_size = resolve_chunk_size(chunk_size, refresh_period, refresh_offset)
    return VLACall(b, t, h, dk, dv, jnp.dtype(q.dtype), penalty_key is not None, initial_state is not None,
                   segment_ids is not None, chunk_size, refresh_period, dispatch.target_backend())


def normalize(x, eps):
    """x / max(‖x‖₂, ε) along the last axis (the ε floor)."""
    return x / floored_norm(x, eps)


document_index = common.document_index


def document_positions(document_BT, initial_position=0):
    """Position of each token inside its document; the first document starts at ``initial_position``."""
    b, t = document_BT.shape
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    boundary = jnp.concatenate([jnp.ones((b, 1), bool), document_BT[:, 1:] != document_BT[:, :-1]], axis=1)
    start = jax.lax.cummax(jnp.where(boundary, idx, 0), axis=1)
    offset = jnp.broadcast_to(jnp.asarray(initial_position, jnp.int32).reshape(-1, 1), (b, 1))
    return idx - start + jnp.where(document_BT == 0, offset, 0)


def refresh_mask(positions, refresh_period, refresh_offset):
    """Refresh after the token at document position p iff (p + 1 + offset) mod P == 0 (P = 0: never)."""
    if refresh_period == 0:
        return jnp.zeros(positions.shape, bool)
    return (positions + 1 + refresh_offset) % refresh_period == 0


def initial_state(batch, heads, key_dim, value_dim, *, lambda0=DEFAULT_LAMBDA0, dtype=jnp.float32):
    """(S = 0 [B,H,Dk,Dv], A = I/λ₀ [B,H,Dk,Dk]): the state every document starts from."""
    S = jnp.zeros((batch, heads, key_dim, value_dim), dtype)
    A = jnp.broadcast_to(jnp.eye(key_dim, dtype=dtype) / lambda0, (batch, heads, key_dim, key_dim))
    return S, A


# ---------------------------------------------------------------------------------------------------------
# implementations. Contract: run(q, k_hat, u, v, S0, A0, document_BT, refresh_BT, *, chunk_size, lambda0,
# refresh_magnitude, eps, operand_dtype) -> (o, (S, A)); every array in the compute dtype, k_hat and u
# unit-normalised; operand_dtype = the caller's dtype (a kernel may feed its matmuls operands in it).


def _run_reference(q, k_hat, u, v, S0, A0, document_BT, refresh_BT, *, chunk_size, lambda0, refresh_magnitude,
                   eps, normalize_write_direction=True, operand_dtype=None):
    del chunk_size, operand_dtype
    return reference.vla_reference(q, k_hat, u, v, S0, A0, document_BT, refresh_BT, lambda0=lambda0,
                                   refresh_magnitude=refresh_magnitude, eps=eps,
                                   normalize_write_direction=normalize_write_direction)


def _run_xla(q, k_hat, u, v, S0, A0, document_BT, refresh_BT, *, chunk_size, lambda0, refresh_magnitude, eps,
             normalize_write_direction=True, operand_dtype=None):
    del operand_dtype
    alpha, A = xla.penalty_pass(k_hat, u, A0, document_BT, refresh_BT, chunk_size=chunk_size, lambda0=lambda0,
                                refresh_magnitude=refresh_magnitude, eps=eps,
                                normalize_write_direction=normalize_write_direction)
    o, S = delta_rule(q, alpha, v, erase_key=k_hat, initial_state=S0, segment_ids=document_BT,
                      implementation="xla")
    return o, (S, A)


def per_shard_a_pass(penalty_pass, heads):
    """A kernel backend's ``penalty_pass`` (``pallas_triton`` or ``pallas_tpu``), per shard under a device mesh
    (batch over data/fsdp, heads over tensor)."""
    return common.per_shard(penalty_pass, heads, ("tokens", "tokens", "state", "rows", "rows"), ("tokens", "state"))


def _run_pallas_triton(q, k_hat, u, v, S0, A0, document_BT, refresh_BT, *, chunk_size, lambda0, refresh_magnitude,
                       eps, operand_dtype, normalize_write_direction=True, interpret=False, **kernel_config):
    """A-pass: the token-level Sherman–Morrison kernel (``pallas_triton.py``, its own custom VJP;
    ``kernel_config``: its ``Config`` fields); S-pass: the delta rule with operands in the caller's dtype, so that
    "auto" picks its Pallas-Triton kernel on GPU (bf16 tensor-core matmuls for bf16 inputs; α̂ and k̂ rounded to
    that dtype there, state f32)."""
    del chunk_size  # the kernel is serial over tokens; anchor_every sets its backward checkpoints
    alpha, A = per_shard_a_pass(pallas_triton.penalty_pass, k_hat.shape[2])(
        k_hat, u, A0, document_BT, refresh_BT, lambda0=lambda0, refresh_magnitude=refresh_magnitude, eps=eps,
        normalize_write_direction=normalize_write_direction, interpret=interpret, **kernel_config)
    od = operand_dtype
    o, S = delta_rule(q.astype(od), alpha.astype(od), v.astype(od), erase_key=k_hat.astype(od), initial_state=S0,
                      segment_ids=document_BT, implementation="auto")
    return o, (S, A)


def _tpu_s_pass(q, alpha, v, k_hat, S0, document_BT, interpret):
    """The delta rule with write key α̂ and erase key k̂, operands in the caller's dtype. On a TPU "auto" picks
    its Pallas TPU kernel (head dims 64/128/256) or falls back to its xla form. ``interpret``: the delta
    rule's TPU kernel in interpret mode (CPU tests), where its tiling serves the head dims."""
    b, t, h, dk = q.shape
    chunk, leaf = 64, 8
    if interpret and delta_rule_pallas_tpu.check_config(chunk, leaf, dk, v.shape[-1]) is None:
        return delta_rule_pallas_tpu.run(q, alpha, k_hat, v, jnp.zeros((b, t, h, dk), jnp.float32), S0, document_BT,
                                         chunk_size=chunk, leaf_size=leaf, interpret=interpret)
    return delta_rule(q, alpha, v, erase_key=k_hat, initial_state=S0, segment_ids=document_BT,
                      implementation="auto")


def _run_pallas_tpu(q, k_hat, u, v, S0, A0, document_BT, refresh_BT, *, chunk_size, lambda0, refresh_magnitude,
                    eps, operand_dtype, normalize_write_direction=True, interpret=False):
    """A-pass: the token-level Sherman–Morrison Mosaic kernels (``pallas_tpu.py``, ``pallas_tpu_bwd.py``, their
    own custom VJP); S-pass: the delta rule with operands in the caller's dtype (bf16 MXU operands for bf16
    inputs: α̂ and k̂ rounded to bf16 there; state f32)."""
    del chunk_size  # the xla form's A-pass chunk; the kernel is serial over tokens (its own grid chunk)
    alpha, A = per_shard_a_pass(pallas_tpu.penalty_pass, k_hat.shape[2])(
        k_hat, u, A0, document_BT, refresh_BT, lambda0=lambda0, refresh_magnitude=refresh_magnitude, eps=eps,
        normalize_write_direction=normalize_write_direction, interpret=interpret)
    od = operand_dtype
    o, S = _tpu_s_pass(q.astype(od), alpha.astype(od), v.astype(od), k_hat.astype(od), S0, document_BT, interpret)
    return o, (S, A)


TABLE = dispatch.OpTable("vla", fallback="xla")
TABLE.register(dispatch.Implementation("reference", _run_reference))
TABLE.register(dispatch.Implementation("xla", _run_xla))
# "auto" picks the TPU kernel on a TPU (supports() refuses every other backend, so auto moves on there)
TABLE.register(dispatch.Implementation("pallas_tpu", _run_pallas_tpu, pallas_tpu.supports, fast=True))
# "auto" picks the GPU kernel on a GPU: on the H200 the op runs 13 ms fwd+bwd at 8·4096, H 12, d 64 against
# ~110 ms for the xla form (docs/kernels_gpu.md, 'VLA A-pass through Pallas' Triton backend')
TABLE.register(dispatch.Implementation("pallas_triton", _run_pallas_triton, pallas_triton.supports, fast=True))
# The same A-pass with its serial kernels cut to their chains (pallas_triton.py): the forward's g and the backward's
# A products formed per anchor block by replays. Opt-in until it is timed against "pallas_triton" on a GPU.
TABLE.register(dispatch.Implementation(
    "pallas_triton_split", functools.partial(_run_pallas_triton, forward="split", backward="split"),
    pallas_triton.supports))


def _prepare(q, k, v, penalty_key, initial_state_, segment_ids, initial_position, lambda0, refresh_period,
             refresh_offset, eps, normalize_key=True, penalty_update="sherman_morrison"):
    dtype = compute_dtype(q.dtype)
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    k_hat, u = _key_and_penalty_direction(k, penalty_key, dtype, eps, normalize_key, penalty_update)
    if initial_state_ is None:
        S0, A0 = initial_state(b, h, dk, dv, lambda0=lambda0, dtype=dtype)
    else:
        S0, A0 = initial_state_[0].astype(dtype), initial_state_[1].astype(dtype)
        A0 = 0.5 * (A0 + jnp.swapaxes(A0, -1, -2))  # A is symmetric: every implementation sees (and
        # differentiates) the same symmetric part, so the gradient w.r.t. A₀ is symmetric
    document = document_index(segment_ids, b, t)
    refresh = refresh_mask(document_positions(document, initial_position), refresh_period, refresh_offset)
    if penalty_update == "fixed":  # no refresh either: A stays exactly at its start value
        refresh = jnp.zeros_like(refresh)
    return q.astype(dtype), k_hat, u, v.astype(dtype), S0, A0, document, refresh


def _key_and_penalty_direction(k, penalty_key, dtype, eps, normalize_key, penalty_update):
    """(write/read key, penalty direction u) in the compute dtype. u is always unit (or 0 for a fixed penalty:
    the Sherman–Morrison update with u = 0 leaves A unchanged); the key is unit unless ``normalize_key=False``."""
    k = k.astype(dtype)
    u = normalize(k if penalty_key is None else penalty_key.astype(dtype), eps)
    if penalty_update == "fixed":
        u = jnp.zeros_like(u)
    return (normalize(k, eps) if normalize_key else k), u


def vla(q, k, v, *, penalty_key=None, initial_state=None, segment_ids=None, initial_position=0,
        lambda0: float = DEFAULT_LAMBDA0, refresh_period: int = DEFAULT_REFRESH_PERIOD,
        refresh_magnitude: float = DEFAULT_REFRESH_MAGNITUDE, refresh_offset: int = 0,
        eps: float = DEFAULT_EPS, chunk_size: Optional[int] = None, implementation: str = "auto",
        normalize_key: bool = True, normalize_write_direction: bool = True, penalty_update: str = "sherman_morrison"):
    """Variational Linear Attention core (see the module docstring for the recurrence).

    Args:
      q: [B, T, H, Dk] readout query (feature map / normalisation already applied by the caller): o = q S.
      k: [B, T, H, Dk] write/read key before normalisation (the layer passes φ(k)); the op uses k̂ = k/max(‖k‖, ε).
      v: [B, T, H, Dv] value. q, k, v (and penalty_key) share a dtype.
      penalty_key: [B, T, H, Dk] f_θ(k) before normalisation; u = p/max(‖p‖, ε). None: u = k̂.
      initial_state: (S [B,H,Dk,Dv], A [B,H,Dk,Dk]) before token 0 (any float dtype); None: (0, I/λ₀). A must
        be symmetric positive definite; its symmetric part (A + Aᵀ)/2 is used.
        It belongs to the first segment of each row; every later segment starts from (0, I/λ₀).
      segment_ids: [B, T] int; a document starts at every t with seg[t] != seg[t−1] (an id reused after another
        document is a new document, docs/architecture.md 'Packing'); the final state is that of each row's
        last document.
      initial_position: int or [B] int: document position of token 0 (tokens already consumed by the first
        segment, e.g. after a prefill); sets the refresh phase only.
      lambda0: λ₀ > 0 (A₀ = I/λ₀). refresh_period: P ≥ 0 (0 = never). refresh_magnitude: ρ ≥ 0.
      refresh_offset: 0 ≤ r < P; refresh after document position p iff (p + 1 + r) mod P == 0 (0: after the
        write of tokens P, 2P, … counted from 1 (docs/math/vla.md, 'What the paper leaves open'); 1: before the update
        of those tokens).
      eps: ε floor of every denominator (‖k‖, ‖p‖, 1 + uᵀAu, ‖k̂A‖).
      chunk_size: A-pass chunk length of "xla"; ≤ refresh_period − refresh_offset (default min(64, that)).
      implementation: "auto" | "reference" | "xla" | "pallas_tpu" | "pallas_triton" (token-level A-pass
        kernels, then the delta rule's kernel) | "pallas_triton_split" (the same with the A-pass kernels cut to
        their serial chains and replays per anchor block; opt-in). "auto" picks "pallas_tpu" on a TPU for
        Dk in {16, 32, 64, 128, 256} and float32/bfloat16 inputs, "pallas_triton" on a GPU for Dk a power of two
        in [16, 128] and float32/bfloat16/float16 inputs; everything else gets "xla".
      normalize_key, normalize_write_direction, penalty_update: the ablations of the module docstring
        (defaults = the paper's method); every implementation honours them.

    Returns:
      (o [B, T, H, Dv] in v's dtype, (S [B,H,Dk,Dv], A [B,H,Dk,Dk]) float32, or float64 for float64 inputs).
    """
    validate_hyper(lambda0, refresh_period, refresh_magnitude, refresh_offset, eps)
    validate_ablation(normalize_key, normalize_write_direction, penalty_update)
    call = validate(q, k, v, penalty_key, initial_state, segment_ids, initial_position, chunk_size,
                    refresh_period, refresh_offset)
    impl = TABLE.choose(implementation, call)
    args = _prepare(q, k, v, penalty_key, initial_state, segment_ids, initial_position, lambda0,
                    refresh_period, refresh_offset, eps, normalize_key, penalty_update)
    o, (S, A) = impl.run(*args, chunk_size=call.chunk_size, lambda0=lambda0,
                         refresh_magnitude=refresh_magnitude, eps=eps, operand_dtype=q.dtype,
                         normalize_write_direction=normalize_write_direction)
    return o.astype(v.dtype), (S, A)


def vla_diagnostics(q, k, v, *, penalty_key=None, initial_state=None, segment_ids=None, initial_position=0,
                    lambda0: float = DEFAULT_LAMBDA0, refresh_period: int = DEFAULT_REFRESH_PERIOD,
                    refresh_magnitude: float = DEFAULT_REFRESH_MAGNITUDE, refresh_offset: int = 0,
                    eps: float = DEFAULT_EPS, normalize_key: bool = True, normalize_write_direction: bool = True,
                    penalty_update: str = "sherman_morrison"):
    """Per-token diagnostics from the reference scan (docs/math/vla.md, 'Jacobian norm'), each [B, T, H]:
    ``state_norm`` ‖S_t‖_F, ``penalty_norm`` ‖A_t‖_F (after any refresh at t), ``alignment`` c_t = α̂_t·k̂_t,
    ``jacobian_norm`` ‖J_t‖₂ = ‖I − α̂_t k̂_tᵀ‖₂ from the closed form sqrt((3 − 2c + sqrt(5 − 4c))/2); plus
    ``alpha`` [B, T, H, Dk] (α̂_t). Products of J over windows (‖∏_{25} J‖₂) need α̂ and k̂: see
    ``jacobian_window_norm``."""
    validate_hyper(lambda0, refresh_period, refresh_magnitude, refresh_offset, eps)
    validate_ablation(normalize_key, normalize_write_direction, penalty_update)
    validate(q, k, v, penalty_key, initial_state, segment_ids, initial_position, None, refresh_period,
             refresh_offset)
    args = _prepare(q, k, v, penalty_key, initial_state, segment_ids, initial_position, lambda0,
                    refresh_period, refresh_offset, eps, normalize_key, penalty_update)
    _, _, diag = reference.vla_reference(*args, lambda0=lambda0, refresh_magnitude=refresh_magnitude, eps=eps,
                                         normalize_write_direction=normalize_write_direction, diagnostics=True)
    return diag


def jacobian_window_norm(k_hat_BTHK, alpha_BTHK, window: int, *, log10: bool = False):
    """‖J_t J_{t−1} ⋯ J_{t−w+1}‖₂ for every t ≥ w−1 (J_t = I − α̂_t k̂_tᵀ, acting on the key side of S),
    [B, T−w+1, H]. O(T w d³): for diagnostics on short sequences. ``log10``: log10 of the same norms without
    overflow (the running product is divided by its Frobenius norm after every factor and the logs of those
    norms summed), for products past the float range."""
    dk = k_hat_BTHK.shape[-1]
    J = jnp.eye(dk, dtype=k_hat_BTHK.dtype) - alpha_BTHK[..., :, None] * k_hat_BTHK[..., None, :]
    t = J.shape[1]
    prod = J[:, window - 1:]
    log_scale = jnp.zeros(prod.shape[:-2], prod.dtype)
    for i in range(1, window):
        prod = jnp.matmul(prod, J[:, window - 1 - i:t - i], precision=jax.lax.Precision.HIGHEST)
        if log10:
            fro = jnp.linalg.norm(prod, axis=(-2, -1))
            prod = prod / fro[..., None, None]
            log_scale = log_scale + jnp.log10(fro)
    norm = jnp.linalg.norm(prod, ord=2, axis=(-2, -1))
    return log_scale + jnp.log10(norm) if log10 else norm


def vla_step(q, k, v, *, penalty_key=None, state, position, refresh_period: int = DEFAULT_REFRESH_PERIOD,
             refresh_magnitude: float = DEFAULT_REFRESH_MAGNITUDE, refresh_offset: int = 0,
             eps: float = DEFAULT_EPS, normalize_key: bool = True, normalize_write_direction: bool = True,
             penalty_update: str = "sherman_morrison"):
    """One decode token: q, k, penalty_key [B, H, Dk]; v [B, H, Dv]; state = (S [B,H,Dk,Dv], A [B,H,Dk,Dk]);
    position [B] int = the token's position in its document (sets the refresh). Returns (o [B,H,Dv] in v's
    dtype, (S, A) float32 / float64). Document resets are the caller's job: pass ``initial_state(...)``."""
    validate_hyper(DEFAULT_LAMBDA0, refresh_period, refresh_magnitude, refresh_offset, eps)
    validate_ablation(normalize_key, normalize_write_direction, penalty_update)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_float(name, x)
        if x.ndim != 3:
            raise _fail(name, x, "rank 3 [B, H, D]")
    b, h, dk = q.shape
    if tuple(k.shape) != (b, h, dk):
        raise _fail("k", k, f"shape [B={b}, H={h}, Dk={dk}]")
    if penalty_key is not None and tuple(penalty_key.shape) != (b, h, dk):
        raise _fail("penalty_key", penalty_key, f"shape [B={b}, H={h}, Dk={dk}]")
    if tuple(v.shape[:2]) != (b, h):
        raise _fail("v", v, f"shape [B={b}, H={h}, Dv]")
    dv = v.shape[2]
    if not isinstance(state, (tuple, list)) or len(state) != 2:
        raise ValueError("vla_step: argument 'state' must be a pair (S [B,H,Dk,Dv], A [B,H,Dk,Dk])")
    S, A = state
    if tuple(S.shape) != (b, h, dk, dv):
        raise _fail("state[0] (S)", S, f"shape [B={b}, H={h}, Dk={dk}, Dv={dv}]")
    if tuple(A.shape) != (b, h, dk, dk):
        raise _fail("state[1] (A)", A, f"shape [B={b}, H={h}, Dk={dk}, Dk={dk}]")
    if not hasattr(position, "shape") or tuple(position.shape) != (b,):
        raise _fail("position", position, f"an integer array of shape [B={b}]")
    dtype = compute_dtype(q.dtype)
    k_hat, u = _key_and_penalty_direction(k, penalty_key, dtype, eps, normalize_key, penalty_update)
    refresh = refresh_mask(position, refresh_period, refresh_offset) & (penalty_update != "fixed")
    o, (S, A) = decode.step(q.astype(dtype), k_hat, u, v.astype(dtype), S.astype(dtype), A.astype(dtype), refresh,
                            refresh_magnitude=refresh_magnitude, eps=eps,
                            normalize_write_direction=normalize_write_direction)
    return o.astype(v.dtype), (S, A)
