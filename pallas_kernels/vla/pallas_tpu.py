"""VLA A-pass on TPU (Pallas / Mosaic): every write direction α̂_t and the final penalty inverse, forward here,
backward kernel in ``pallas_tpu_bwd.py``, wired through ``jax.custom_vjp`` (docs/math/vla.md, 'Recurrence' and
'Gradients'; design and VMEM: docs/kernels.md, 'TPU: the VLA A-pass').

The algorithm is the GPU kernel's (``pallas_triton.py``): token-level Sherman–Morrison with the d×d f32
penalty inverse A on chip for the whole sequence,

    A ← I/λ₀ at a document start;   w = A u;   δ = 1 + u·w;   ŵ = w / √δ;   A ← A − ŵ ŵᵀ
    g = A k̂;   A ← A + ρ I after a refresh token;      then in XLA: α̂ = g / max(‖g‖, ε)

Layout: k̂, u [B·H, Tp, d] f32 (T padded to a multiple of the chunk C with u = k̂ = 0: identity tokens), the
per-token flags [B, Tp, 1] int32 (RESET: a document starts at t > 0; REFRESH: A += ρI after t). Grid
(B·H "parallel", Tp/C "arbitrary"); A lives in a VMEM f32 scratch across the chunk axis. A grid step walks its
C tokens serially (``fori_loop``, dynamic sublane row loads and stores of the (C, d) blocks).

On the VPU, without transposes: a matrix-vector product is a broadcast multiply and a lane (or sublane)
reduction, and a vector changes orientation (row (1, d) ↔ column (d, 1)) by an identity mask and a reduction,
which is exact (one non-zero term). So ŵ's column is bitwise ŵ's row and A − ŵ_col ŵ_row stays exactly
symmetric, as in the reference's explicit symmetrisation. The MXU is not used: the products are d×1 and the
chain is serial, so a matmul pass per token would only add latency.

Outputs: g_t and ŵ_t per token ([B·H, Tp, d] f32), A at the start of every chunk ("anchors",
[B·H, N, d, d] f32, the backward's replay points) and the final A. The backward kernel replays each chunk
from its anchor with the stored ŵ (so it sees the forward's A bitwise) and walks the tokens in reverse.
Both directions are Pallas kernels; nothing is autodiffed through a kernel.

Inputs arrive unit-normalised and float32 (the op normalises in XLA); all state and accumulation is float32.
A₀ must be symmetric positive definite (the op checks it), so δ ≥ 1 and the ε floor of δ never binds.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mixerlab.pallas_kernels import common
from mixerlab.pallas_kernels.vla import penalty_vjp
from mixerlab.pallas_kernels.vla.penalty_vjp import REFRESH, RESET, token_flags
from mixerlab.pallas_kernels.vla.reference import floored_norm

F32 = jnp.float32
SUPPORTED_DIMS = (16, 32, 64, 128, 256)
DEFAULT_CHUNK = 64
# The backward keeps A at every token of its chunk in VMEM (C·d²·4 bytes): at most this much, so that the
# kernel stays inside the default 16 MiB scoped VMEM of v5e / v5p with its blocks and Mosaic's own scratch.
MAX_REPLAY_BYTES = 4 * 1024 * 1024

_SQ = pl.Squeezed() if hasattr(pl, "Squeezed") else None
_CompilerParams = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")


# ---------------------------------------------------------------------------------------------------------
# configuration


@dataclasses.dataclass(frozen=True)
class Config:
    key_dim: int
    heads: int
    chunk: int
    lambda0: float
    refresh_magnitude: float
    interpret: Any = False  # False | True | pltpu.InterpretParams(...)
    vmem_limit_bytes: Optional[int] = None  # None: the generation's default scoped VMEM limit (enough here)


def default_chunk(key_dim: int) -> int:
    """64 tokens per grid step, fewer where the backward's per-token A copies would pass MAX_REPLAY_BYTES."""
    chunk = DEFAULT_CHUNK
    while chunk > 8 and chunk * key_dim * key_dim * 4 > MAX_REPLAY_BYTES:
        chunk //= 2
    return chunk


def check_config(key_dim: int, chunk: int) -> Optional[str]:
    if key_dim not in SUPPORTED_DIMS:
        return f"key_dim={key_dim} not in {SUPPORTED_DIMS}"
    if chunk < 8 or chunk % 8:
        return f"chunk={chunk}: needs a positive multiple of 8 (the f32 sublane tile)"
    if chunk * key_dim * key_dim * 4 > MAX_REPLAY_BYTES:
        return (f"chunk={chunk} with key_dim={key_dim}: the backward's per-token A copies need "
                f"{chunk * key_dim * key_dim * 4} bytes of VMEM > {MAX_REPLAY_BYTES}; use chunk <= "
                f"{default_chunk(key_dim)}")
    return None


def supports(call) -> Optional[str]:
    """``None`` when the TPU A-pass (and the delta rule through "auto" for the S-pass) serves ``call`` (an
    ``api.VLACall``), else the reason."""
    if call.backend != "tpu":
        return f"needs a TPU backend (got {call.backend!r}); on CPU use pallas_tpu.penalty_pass(..., interpret=True)"
    if jnp.dtype(call.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"dtype {jnp.dtype(call.dtype).name} (TPU kernel: bfloat16 or float32)"
    return check_config(call.key_dim, default_chunk(call.key_dim))


# ---------------------------------------------------------------------------------------------------------
# in-kernel building blocks (values, not refs; VPU and XLU only)


def eye_mask(d):
    return jax.lax.broadcasted_iota(jnp.int32, (d, d), 0) == jax.lax.broadcasted_iota(jnp.int32, (d, d), 1)


def to_col(row, eye):
    """(1, d) -> (d, 1), exact: row i of the masked tile holds only element i."""
    return jnp.sum(jnp.where(eye, row, 0.0), axis=1, keepdims=True)


def to_row(col, eye):
    """(d, 1) -> (1, d), exact."""
    return jnp.sum(jnp.where(eye, col, 0.0), axis=0, keepdims=True)


def matvec_col(a, row):
    """A x as a column for x given as a row (lane reduction)."""
    return jnp.sum(a * row, axis=1, keepdims=True)


def matvec_row(a, col):
    """xᵀ A as a row for x given as a column (sublane reduction); = (A x)ᵀ for a symmetric A."""
    return jnp.sum(a * col, axis=0, keepdims=True)


def dot_rows(x, y):
    """x · y of two (1, d) rows -> (1, 1)."""
    return jnp.sum(x * y, axis=1, keepdims=True)


def flag(flags, bit):
    """(1, 1) bool from a (1, 1) int32 flags value."""
    return jnp.bitwise_and(flags, bit) != 0


def document_start(eye, cfg):
    """I/λ₀, built once per grid step (outside the token loops)."""
    return jnp.where(eye, 1.0 / cfg.lambda0, 0.0)


def start_of_token(a, flags, a_reset):
    """A before the token's update: I/λ₀ (``a_reset``) at a document start."""
    return jnp.where(flag(flags, RESET), a_reset, a)


def refresh(a, flags, eye, cfg):
    """A + ρI after a refresh token (+0, an exact no-op, elsewhere)."""
    rho = jnp.where(flag(flags, REFRESH), cfg.refresh_magnitude, 0.0)  # (1, 1)
    return a + jnp.where(eye, rho, 0.0)


def row(ref, j):
    return ref[pl.ds(j, 1), :]


# ---------------------------------------------------------------------------------------------------------
# forward kernel


def _forward_kernel(k_ref, u_ref, flags_ref, a0_ref, g_ref, factor_ref, anchor_ref, a_final_ref, a_scr, *,
                    cfg: Config):
    n = pl.program_id(1)
    eye = eye_mask(cfg.key_dim)
    a_reset = document_start(eye, cfg)

    @pl.when(n == 0)
    def _():
        a_scr[...] = a0_ref[...]

    a_in = a_scr[...]
    anchor_ref[...] = a_in

    def token(j, a):
        u, k_hat, flags = row(u_ref, j), row(k_ref, j), row(flags_ref, j)
        a = start_of_token(a, flags, a_reset)
        w_col = matvec_col(a, u)
        w_row = to_row(w_col, eye)
        root = jnp.sqrt(1.0 + dot_rows(u, w_row))  # √δ ≥ 1 (A SPD)
        f_col, f_row = w_col / root, w_row / root  # the same divisions: f_col is bitwise f_row's column
        a = a - f_col * f_row
        factor_ref[pl.ds(j, 1), :] = f_row
        g_ref[pl.ds(j, 1), :] = to_row(matvec_col(a, k_hat), eye)
        return refresh(a, flags, eye, cfg)

    a_out = jax.lax.fori_loop(0, cfg.chunk, token, a_in)
    a_scr[...] = a_out

    @pl.when(n == pl.num_programs(1) - 1)
    def _():
        a_final_ref[...] = a_out


# ---------------------------------------------------------------------------------------------------------
# cost model: the element operations the kernels issue (VPU multiplies/adds/selects, XLU reduction adds)


def forward_ops_per_token(d: int) -> int:
    """Per token and head, counting d×d work element by element: reset select 1, A u (mul + reduce) 2,
    w to a row (select + reduce) 2, the rank-1 update (mul + sub) 2, A k̂ (mul + reduce) 2, g to a row 2,
    the refresh (select + add) 2: 13 d², plus the O(d) vector work (u·w, the divisions by √δ)."""
    return 13 * d * d + 4 * d


def backward_ops_per_token(d: int) -> int:
    """Per token and head: the replay of the chunk from its anchor (reset select 1, ŵ to a column 2, rank-1
    update 2, refresh 2: 7 d²) and the adjoint (dg, k̂, u, dw to columns and y to a row: 5 × 2; A_post dg,
    Ā ŵ, A_post y: 3 × 2; the symmetric rank-4 cotangent update: 5 mul + 4 add; the reset select 1: 26 d²):
    33 d², plus the O(d) vector work (the dots, y, dw, du)."""
    return 33 * d * d + 20 * d


def cost(kernel: str, d: int, bh: int, n_tokens: int, chunk: int) -> pl.CostEstimate:
    """What a kernel issues over bh heads and n_tokens (padded) tokens: element operations as "flops", one
    square root per token ("transcendentals"), the HBM traffic of its blocks (per-token rows, flags, one
    anchor A per chunk, A₀ / dA_T in and A_T / dA₀ out)."""
    per_token = {"forward": forward_ops_per_token, "backward": backward_ops_per_token}[kernel](d)
    vectors = {"forward": 4, "backward": 6}[kernel]  # [d] f32 rows read + written per token
    anchors = (n_tokens // chunk) * d * d * 4
    return pl.CostEstimate(flops=int(bh * n_tokens * per_token), transcendentals=int(bh * n_tokens),
                           bytes_accessed=int(bh * (n_tokens * (vectors * d * 4 + 4) + anchors + 2 * d * d * 4)))


# ---------------------------------------------------------------------------------------------------------
# pallas_call builders


def specs(cfg: Config, n_chunks: int, reverse: bool):
    """(token rows, flags, per-head square, per-chunk square) BlockSpecs; ``reverse`` maps grid step c to
    chunk N − 1 − c."""
    c, d, heads = cfg.chunk, cfg.key_dim, cfg.heads
    ch = (lambda n: n_chunks - 1 - n) if reverse else (lambda n: n)
    tokens = pl.BlockSpec((_SQ, c, d), lambda bh, n: (bh, ch(n), 0))
    flags = pl.BlockSpec((_SQ, c, 1), lambda bh, n: (jax.lax.div(bh, heads), ch(n), 0))
    square = pl.BlockSpec((_SQ, d, d), lambda bh, n: (bh, 0, 0))
    per_chunk = pl.BlockSpec((_SQ, _SQ, d, d), lambda bh, n: (bh, ch(n), 0, 0))
    return tokens, flags, square, per_chunk


def compiler_params(cfg: Config):
    kw = dict(dimension_semantics=("parallel", "arbitrary"))
    if cfg.vmem_limit_bytes:
        kw["vmem_limit_bytes"] = cfg.vmem_limit_bytes
    return _CompilerParams(**kw)


def forward_call(cfg: Config, k_hat, u, flags, a0):
    """[B·H, Tp, d] f32 k̂, u; flags [B, Tp, 1] int32; A₀ [B·H, d, d] f32 -> (g, ŵ [B·H, Tp, d],
    anchors [B·H, N, d, d], final A [B·H, d, d]), all f32."""
    bh, tp, d = k_hat.shape
    n_chunks = tp // cfg.chunk
    tokens, flag_spec, square, per_chunk = specs(cfg, n_chunks, reverse=False)
    return pl.pallas_call(
        functools.partial(_forward_kernel, cfg=cfg),
        out_shape=(jax.ShapeDtypeStruct((bh, tp, d), F32), jax.ShapeDtypeStruct((bh, tp, d), F32),
                   jax.ShapeDtypeStruct((bh, n_chunks, d, d), F32), jax.ShapeDtypeStruct((bh, d, d), F32)),
        grid=(bh, n_chunks),
        in_specs=[tokens, tokens, flag_spec, square],
        out_specs=(tokens, tokens, per_chunk, square),
        scratch_shapes=[pltpu.VMEM((d, d), F32)],
        compiler_params=compiler_params(cfg),
        cost_estimate=cost("forward", d, bh, tp, cfg.chunk),
        interpret=cfg.interpret,
        name="vla_penalty_fwd",
    )(k_hat, u, flags, a0)


# ---------------------------------------------------------------------------------------------------------
# custom VJP (over k̂, u, A₀; the flags are integers)


def _backward(cfg, *args):
    from mixerlab.pallas_kernels.vla import pallas_tpu_bwd  # it imports this module's in-kernel helpers

    return pallas_tpu_bwd.backward_call(cfg, *args)


def _forward(cfg, k_hat, u, a0, flags):
    return forward_call(cfg, k_hat, u, flags, a0)


_penalty_pass = penalty_vjp.penalty_pass_with_vjp(_forward, _backward)


# ---------------------------------------------------------------------------------------------------------
# public entry


def _to_bh(x, tp):
    b, t, h, d = x.shape
    x = x.transpose(0, 2, 1, 3).reshape(b * h, t, d)
    return jnp.pad(x, ((0, 0), (0, tp - t), (0, 0))) if tp != t else x


def penalty_pass(k_hat_BTHK, u_BTHK, penalty_BHKK, document_BT, refresh_BT, *, lambda0, refresh_magnitude, eps,
                 normalize_write_direction=True, chunk: Optional[int] = None, interpret=False):
    """All α̂_t [B, T, H, K] float32 and the final A [B, H, K, K] float32, as ``xla.penalty_pass`` (k̂ and u
    unit-normalised; ``document_BT`` the running count of boundaries; ``refresh_BT`` refresh after token t).
    Differentiable w.r.t. k̂, u and A₀ (custom VJP; both directions are Pallas kernels). ``chunk``: tokens per
    grid step (default ``default_chunk(K)``)."""
    b, t, h, d = k_hat_BTHK.shape
    chunk = default_chunk(d) if chunk is None else chunk
    reason = check_config(d, chunk)
    if reason:
        raise ValueError(f"vla pallas_tpu: {reason}")
    cfg = Config(d, h, chunk, float(lambda0), float(refresh_magnitude), interpret)
    tp = -(-t // chunk) * chunk
    # padded tokens: u = k̂ = 0 (no update, g = 0), no reset, no refresh, so A_T is the last real token's
    flags = common.pad_time(token_flags(document_BT, refresh_BT), chunk)[..., None]
    k_hat, u = (_to_bh(x.astype(F32), tp) for x in (k_hat_BTHK, u_BTHK))
    g, a_final = _penalty_pass(cfg, k_hat, u, penalty_BHKK.astype(F32).reshape(b * h, d, d), flags)
    g = g[:, :t].reshape(b, h, t, d).transpose(0, 2, 1, 3)
    # the normalisation in XLA (autodiff): no reductions for it on the kernels' serial path
    return (g / floored_norm(g, eps) if normalize_write_direction else g), a_final.reshape(b, h, d, d)
