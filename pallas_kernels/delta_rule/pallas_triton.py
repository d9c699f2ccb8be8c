"""Boundary-pivoted chunkwise delta rule on GPU through Pallas' Triton backend (docs/math/delta_rule.md; forward and
custom-VJP backward).

Recurrence (row vectors, state key-major [Dk, Dv]):  S_t = (I − k_tᵀ k̂_t) Diag(e^{λ_t}) S_{t−1} + k_tᵀ v̂_t,
o_t = q̂_t S_t.  Entry point: :func:`run` with the op's ``impl.run`` contract, and :func:`supports`.

Structure (FLA-like: the state-independent work runs for every chunk in parallel, only the small
S-dependent products are sequential):

  forward   K1 ``intra``      grid (B, H, N)       per chunk: A, M (factored pairs, pivot tree), P = (I + A)⁻¹ (Neumann
                                                   leaves + 2×2 merges), U = P V̂, Y = P (K̂⊙π), Q̂⊙π, K⊙E, π_C
                                                   (and M, P for the backward)
            K2 ``scan``       grid (B, H, Dv/BV)   sequential over chunks: S₀ saved, Ũ = U − Y S₀,
                                                   S ← Diag(π_C) S + (K⊙E)ᵀ Ũ
            K3 ``output``     grid (B, H, N)       O = (Q̂⊙π) S₀ + M Ũ
            (a forward without backward, ``fuse_output``: K2 ``scan_output`` does both in its loop and writes
            neither S₀ nor Ũ)
  backward  B0 ``rhs``        grid (B, H, N)       U, Y, Q̂⊙π, K⊙E, π_C from the saved P — only with
                                                   ``save_rhs=False`` (by default the forward's are kept);
                                                   without ``save_matrices`` K1 runs again
            B1 ``scan_bwd``   grid (B, H, Dv/BV)   reverse over chunks: dŨ = Mᵀ dO + (K⊙E) dS,
                                                   dS ← (Q̂⊙π)ᵀ dO + Diag(π_C) dS − Yᵀ dŨ   (dS_C saved)
            B2a ``cotangents`` grid (B, H, N)      Ũ, dM, dV̂ = Pᵀ dŨ, dA (the transposed solve of the backward pass)
            B2b ``key_grads`` grid (B, H, N·Dk/BK) per chunk and key block: dq̂, dk, dk̂, dλ
  ``two_pass`` (default, with ``bounded_span``): K1 and B2b each run as a kernel specialised to the whole chunk's
  cut (no cut search, no exact level compiled in; K1 flags the chunks where that cut does not hold) and a
  ``*_search`` kernel that redoes only the flagged chunks with the search (:func:`_passes`).
  Saved for the backward: the (padded) inputs, the chunk-start states S₀, M and P (C × C per chunk), and
  U, Y, Q̂⊙π, K⊙E (C × D per chunk) — all in the operand dtype (every consumer is a matmul operand in that
  dtype); π_C, the carried state and the final state are f32.

Everything inside a kernel is a 2-D tile ([C, C], [C, BK], [C, Dv]) so that Triton never reshapes or
converts layouts; K1, B0 and B2b walk the key channels in blocks of BK (``block_k``) to bound registers.

Numerics (every exponent ≤ 0, docs/math/delta_rule.md, 'Boundary pivots'; or, per key block where the gates
allow it, factors within e^{±bounded_span}: :func:`_bounded_cut`, docs/kernels_gpu.md, 'Factored pairs'):
  * A and M by the pivot tree all the way down to single tokens. A pair (i > j) belongs to exactly one
    level: the node of size 2h whose left half holds j and right half holds i, pivot p = the left half's
    last token. Its decay e^{Σ_{j<s≤i} λ} = ρ_i κ_j with ρ_i = e^{Σ_{p<s≤i} λ} and κ_j = e^{Σ_{j<s≤p} λ},
    both ≤ 1. Per level the two sums are one matmul W_h λ with a 0/1 matrix (rows in a right half: the
    half's prefix up to i; rows in a left half: the half's suffix after j) on TF32 tensor cores (see
    :func:`_split` for the accuracy), so every exponent is a sum of λ ≤ 0 over one half-node — no
    differences, no cancellation (a finer tree than xla.py's exact n0×n0 leaves, same matrices). Then
    A_level = (K̂⊙F)(K⊙F)ᵀ masked to the level's (right, left) block, M likewise with Q̂; M's diagonal is
    q̂_i·k_i (decay e^0);
  * π (chunk start, e^{Σ_{0≤s≤i}}) and E (chunk end, e^{Σ_{j<s<C}}) the same way with the whole chunk;
  * P = (I + A)⁻¹: leaves (``leaf`` × ``leaf``) by the Neumann product (I − N)(I + N²)…, then per level
    P ← P − P A_ℓ P (= −P_RR A_RL P_LL in the (R, L) blocks; f32 operands, ``inverse_precision``);
  * state, accumulation, decay factors and the inverse in f32; matmul operands in the input dtype
    (bf16 inputs: bf16 tensor-core matmuls with f32 accumulation).
Segments: ``document_BT`` (running count of boundaries); A and M keep same-document pairs, the S₀ rows
(Q̂⊙π, K̂⊙π) only the carried-in document, K⊙E only the chunk's last document, π_C is zero in a chunk with
a boundary — the same rules as ``xla.py``.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mixerlab.pallas_kernels import common
from mixerlab.pallas_kernels.triton_common import compiler_params, iota, pow2, unavailable


F32 = jnp.float32
SUPPORTED_CHUNKS = (32, 64, 128)
SUPPORTED_LEAVES = (8, 16)
MAX_HEAD_DIM = 256
_MIN_DIM = 16  # tl.dot needs every matmul dimension ≥ 16


# ---------------------------------------------------------------------------------------------------------
# configuration


@dataclasses.dataclass(frozen=True)
class Config:
    chunk: int
    leaf: int  # diagonal blocks of the inverse (Neumann product), then 2×2 merges up to the chunk
    key_dim: int
    value_dim: int
    operand_dtype: jnp.dtype  # matmul operands of the big products (bf16 or f32)
    inverse_precision: str = "highest"  # f32 matmuls (P = (I + A)⁻¹, f32 operands): "tf32" | "highest" | "ieee"
    scan_block_v: int = 64  # Dv block of the sequential kernels (more CTAs when B·H is small)
    block_k: int = 64  # key channels per pass of K1 and B2
    warps_intra: int = 4
    warps_rhs: int = 4
    warps_scan: int = 4
    warps_output: int = 4
    warps_cotangents: int = 4
    warps_key_grads: int = 4
    stages_scan: int = 2
    stages_scan_output: int = 2  # make_config: 1 for ≥ 256 programs (242 registers and 32 KB instead of 136 KB:
    #                              two per SM), else 2 (the loads of the next chunk in flight)
    decay_sums: str = "auto"  # log-decay sums on the tensor cores: "tf32x2" | "tf32" | "auto" (see _split)
    end_decays: str = "sums"  # E's exponent: "sums" (its own 0/1 matmul) or "difference" (the chunk total minus
    #                           π's: one decay-sum matmul fewer per key block in K1, B0 and B2b; off by
    #                           ≈ 2⁻²³·|Λ_C|, 1.5e-4 relative in E for a chunk total of −1280; passes the GPU
    #                           tests; on the H200 no faster: forward 1.931 against 1.917 ms at 8·4096)
    two_pass: bool = True  # with bounded_span: K1 runs a first pass specialised to the whole chunk's cut (every pair
    #                        through the middle pivot, no cut search, no exact level) that flags the chunks where
    #                        some key block's half-chunk sums leave [−span, 0]; a second pass recomputes only those
    #                        with the search (H200, 8·4096·16·128 bf16: the forward's K1 1.43 → 1.19 ms with the
    #                        search removed; see _chunk_matrices)
    two_pass_key_grads: bool = True  # with two_pass in training: B2b as two kernels too (every program on the whole
    #                                  chunk's cut where K1 flagged nothing, then the search for the flagged chunks)
    fold_solve: bool = True  # a forward without backward: K1 writes M P, K̂⊙π and Pᵀ(K⊙E) instead of M, U = P V̂,
    #                          Y and K⊙E, and scan_output reads V̂ itself (Ũ = P (V̂ − (K̂⊙π) S₀) is never formed:
    #                          O = (Q̂⊙π) S₀ + (M P) W, S ← π_C S₀ + (Pᵀ(K⊙E))ᵀ W with W = V̂ − (K̂⊙π) S₀;
    #                          H200, 8·4096·16·128 bf16: forward 2.08 → 1.99 ms, K1 1.71 → 1.60 ms)
    pair_grads_f32: bool = False  # B2b's pivot-level matmuls with f32 operands (TF32 on the GPU): bf16 dλ error
    #                               6.3e-3 -> 2.5e-3 in interpret mode, +3.1 ms in B2b on the H200 (of 5.1)
    bounded_span: Optional[float] = 60.0  # per key block, pairs inside the largest nodes whose half-node decay
    #                                        sums all lie in [−span, 0] take one product through the node's pivot
    #                                        (factors e^{±x}, x ≤ span) instead of one per pivot level; None:
    #                                        always the exact tree (every exponent ≤ 0; the default for float16
    #                                        operands, whose range ends at e^11). See _bounded_cut.
    save_rhs: bool = True  # keep the forward's U, Y, Q̂⊙π, K⊙E, π_C for the backward instead of running B0
    #                        (with save_matrices; 3·Dk + Dv operand-dtype numbers more per token and head)
    fuse_output: bool = True  # a forward without backward (inference, evaluation) runs K2 and K3 as one kernel
    #                           that writes no S₀ or Ũ (the training forward keeps S₀ and runs them apart)
    save_matrices: bool = True  # keep M and P (C×C per chunk, operand dtype) for the backward instead of
    #                             running K1 again (≈ 17 % more residual bytes at C 64, D 128, bf16, f32 λ)
    interpret: bool = False

    @property
    def levels(self):
        """Levels of the pivot tree, half sizes 1, 2, …, C/2 (every strictly lower pair is in one level);
        the inverse merges the levels with half ≥ leaf."""
        return int(math.log2(self.chunk))

    @property
    def resolved_decay_sums(self):
        """"auto": "tf32" with 16-bit operands (the sums' error stays under the operands' rounding), else
        "tf32x2" (f32-accurate)."""
        if self.decay_sums != "auto":
            return self.decay_sums
        return "tf32" if self.operand_dtype.itemsize == 2 else "tf32x2"

    @property
    def precision(self):
        """"tf32": one TF32 tensor-core pass; "highest": float32-accurate, as three TF32 passes on the GPU
        (Triton's tf32x3; a true IEEE f32 tl.dot is an FMA loop that compiles for minutes) and plain f32 in
        interpret mode; "ieee": Triton's FMA-based IEEE f32 dot (slow to compile and run; debugging only)."""
        return _precision(self.inverse_precision, self.interpret)


def _precision(name, interpret):
    if name == "tf32":
        return jax.lax.Precision.DEFAULT
    if name == "highest" and not interpret:
        return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return jax.lax.Precision.HIGHEST


def default_block_v(batch_heads: int, value_dim: int) -> int:
    """Dv block of the sequential kernels: the largest of 64/32/16 that still gives ≥ 128 CTAs."""
    for bv in (64, 32):
        if bv <= value_dim and batch_heads * (value_dim // bv) >= 128:
            return bv
    return min(16, value_dim) if value_dim >= 16 else value_dim


def make_config(chunk, leaf, key_dim, value_dim, operand_dtype, *, batch_heads=128, interpret=False, **overrides):
    operand_dtype = jnp.dtype(operand_dtype)
    base = dict(chunk=chunk, leaf=leaf, key_dim=key_dim, value_dim=value_dim, operand_dtype=operand_dtype,
                inverse_precision="highest" if interpret else "tf32",
                scan_block_v=default_block_v(batch_heads, value_dim), block_k=min(32, key_dim),
                bounded_span=None if operand_dtype == jnp.dtype(jnp.float16) else 60.0, interpret=interpret)
    base.update(overrides)
    if "stages_scan_output" not in overrides:  # one buffer lets two programs share an SM; worth it with more
        # programs than SMs (8·4096, 16 heads: 256 programs, forward 0.05 ms faster on the H200); with one
        # program per SM the second buffer hides the loads (1·32768: with one stage the forward went 3.10 →
        # 3.70 ms although K1 got faster)
        programs = batch_heads * (value_dim // base["scan_block_v"])
        base["stages_scan_output"] = 1 if programs >= 256 else 2
    cfg = Config(**base)
    if cfg.decay_sums not in ("auto", "tf32", "tf32x2"):
        raise ValueError(f"pallas_triton: decay_sums={cfg.decay_sums!r}; expected 'auto', 'tf32' or 'tf32x2'")
    if cfg.end_decays not in ("sums", "difference"):
        raise ValueError(f"pallas_triton: end_decays={cfg.end_decays!r}; expected 'sums' or 'difference'")
    if cfg.bounded_span is not None and operand_dtype == jnp.dtype(jnp.float16):
        raise ValueError(f"pallas_triton: bounded_span={cfg.bounded_span!r} with float16 operands; the factors "
                         "e^{±span} need an 8-bit exponent (float32, bfloat16): float16 overflows above e^11. "
                         "Use bounded_span=None (the default for float16)")
    if cfg.bounded_span is not None and not 0 < cfg.bounded_span <= 80:
        raise ValueError(f"pallas_triton: bounded_span={cfg.bounded_span!r}; expected None (the exact pivot tree) "
                         "or a number in (0, 80] (factors e^{±span} stay normal f32 / bf16 numbers)")
    if cfg.key_dim % cfg.block_k or cfg.block_k < _MIN_DIM or not pow2(cfg.block_k):
        raise ValueError(f"pallas_triton: block_k={cfg.block_k} must be a power of two ≥ {_MIN_DIM} dividing "
                         f"key_dim={cfg.key_dim}")
    return cfg


def supports(call) -> Optional[str]:
    """``None`` when this kernel can serve ``call`` (an ``api.DeltaRuleCall``), else the reason."""
    reason = unavailable(getattr(call, "backend", None))
    if reason:
        return reason
    if call.chunk_size not in SUPPORTED_CHUNKS:
        return f"chunk_size={call.chunk_size} not in {SUPPORTED_CHUNKS}"
    if call.leaf_size not in SUPPORTED_LEAVES or call.leaf_size * 2 > call.chunk_size:
        return f"leaf_size={call.leaf_size} not in {SUPPORTED_LEAVES} (with chunk_size ≥ 2·leaf_size)"
    for name, d in (("key_dim", call.key_dim), ("value_dim", call.value_dim)):
        if not pow2(d) or d < _MIN_DIM or d > MAX_HEAD_DIM:
            return f"{name}={d}: needs a power of two in [{_MIN_DIM}, {MAX_HEAD_DIM}]"
    if jnp.dtype(call.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(call.dtype).name} not supported (float32, bfloat16, float16)"
    return None


# ---------------------------------------------------------------------------------------------------------
# in-kernel helpers (traced inside the Pallas kernels; only ops with Triton lowerings)


def _matmul(a, b, trans_a, trans_b, precision):
    """a @ b (optionally transposed) with f32 accumulation, as a plain dot_general (pl.dot is gone in
    JAX 0.11.2; the Triton lowering turns a contraction over dim 0 / dim 1 into a transpose + tl.dot)."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


def _dot(a, b, cfg, *, trans_a=False, trans_b=False, f32=False):
    """Matmul with f32 accumulation. ``f32``: both operands f32 at ``cfg.inverse_precision``; otherwise
    both operands cast to the operand dtype (bf16 tensor cores for bf16 inputs)."""
    if f32 or cfg.operand_dtype == jnp.dtype(F32):
        return _matmul(a.astype(F32), b.astype(F32), trans_a, trans_b, cfg.precision)
    return _matmul(a.astype(cfg.operand_dtype), b.astype(cfg.operand_dtype), trans_a, trans_b, None)


def _level(cfg, level):
    """Level ``level`` of the pivot tree (half size h = 2^level; ``level`` may be traced, so a loop over the
    levels keeps only one level's [C, C] constants alive). Returns
      pairs [C, C] bool: (i, j) with i in the right and j in the left half of the same node of size 2h;
      sums  [C, C] 0/1 f32: (W λ)_i = Σ_{p<s≤i} λ for rows in a right half (p: the pivot, last token of the
            left half) and Σ_{i<s≤p} λ for rows in a left half."""
    c = cfg.chunk
    i = iota((c, c), 0)
    j = iota((c, c), 1)
    node_i = jax.lax.shift_right_logical(i, level)
    node_j = jax.lax.shift_right_logical(j, level)
    right = (node_i & 1) == 1
    pairs = ((node_i >> 1) == (node_j >> 1)) & right & ((node_j & 1) == 0)
    sums = jnp.where((node_i == node_j) & jnp.where(right, j <= i, j > i), 1.0, 0.0).astype(F32)
    return pairs, sums


def _start_sums(cfg):
    """0/1 [C, C] with (W λ)_i = Σ_{0≤s≤i} λ (decay from the chunk start to token i)."""
    c = cfg.chunk
    return jnp.where(iota((c, c), 1) <= iota((c, c), 0), 1.0, 0.0).astype(F32)


def _end_sums(cfg):
    """0/1 [C, C] with (W λ)_j = Σ_{j<s<C} λ (decay from token j to the chunk end)."""
    c = cfg.chunk
    return jnp.where(iota((c, c), 1) > iota((c, c), 0), 1.0, 0.0).astype(F32)


def _split(log_decay, cfg):
    """λ [C, BK] f32 as TF32-exact parts whose sum is λ, so that W λ (W a 0/1 matrix, exact in TF32) is a
    sum of one-pass TF32 matmuls:
      "tf32x2": (hi, lo), hi = λ with the low 13 mantissa bits cleared, lo = λ − hi (|lo| < 2⁻¹⁰|λ|, itself
                kept to 2⁻¹⁰ by the tensor core): f32-accurate sums (~2⁻²⁰ relative per term);
      "tf32":   (λ rounded to the nearest TF32,): 2⁻¹¹ relative per term — the largest error this adds to a
                decay e^{Σλ} is |Σλ|·2⁻¹¹·e^{Σλ} ≤ 2⁻¹¹/e ≈ 1.8e-4, well under a bf16 operand's 2⁻⁹;
    interpret mode: (λ,) with an f32 matmul."""
    if cfg.interpret:
        return (log_decay,)
    bits = jax.lax.bitcast_convert_type(log_decay, jnp.int32)
    if cfg.resolved_decay_sums == "tf32":
        return (jax.lax.bitcast_convert_type((bits + 4096) & jnp.int32(-8192), F32),)
    hi = jax.lax.bitcast_convert_type(bits & jnp.int32(-8192), F32)
    return hi, log_decay - hi


def _decay_sums(weights, log_decay_parts, cfg):
    """W λ (W a 0/1 [C, C] matrix, λ as parts from :func:`_split`): sums of λ ≤ 0. [C, BK] f32."""
    precision = jax.lax.Precision.HIGHEST if cfg.interpret else jax.lax.Precision.DEFAULT
    sums = _matmul(weights, log_decay_parts[0], False, False, precision)
    for part in log_decay_parts[1:]:
        sums += _matmul(weights, part, False, False, precision)
    return sums


def _decay(weights, log_decay_parts, cfg):
    """e^{W λ}: every entry is e^{a sum of λ ≤ 0} ≤ 1. [C, BK] f32."""
    return jnp.exp(_decay_sums(weights, log_decay_parts, cfg))


def _bounded_cut(log_decay_parts, cfg, keep_sums):
    """(cut, sums): the pivot levels below which this key block factors every pair through one pivot per
    node (int32), and the decay sums of that cut (:func:`_level`'s W λ at half size 2^(cut − 1)) when
    ``keep_sums``, else None (:func:`_pivot_factors` computes them again: on the H200 that is faster in the
    key-gradient kernel, 3.47 against 3.95 ms, and slower in K1, 1.99 against 1.80 ms, two H200 calls).

    With cut = c, a node of 2^c tokens has its pivot p at the left half's last token, and every pair
    i > j inside it has e^{Λ_i − Λ_j} = e^{Λ_i − Λ_p} · e^{Λ_p − Λ_j} (Λ the inclusive cumsum of λ): one
    masked product per node instead of one per level 0 … c − 1. Each factor is e^{±(a sum of λ over part
    of one half-node)}, so it is a normal f32 / bf16 number when every half-node sum lies in [−span, 0]
    (span = ``bounded_span`` ≤ 80 < log(f32 max) = 88.7); that is what selects c: the largest c ≤ levels
    for which it holds — the whole chunk for gates of ordinary size (one check), fewer levels for strong
    decays, 0 (the exact tree) when single tokens decay by more than e^{−span}. The entries are as accurate
    as the tree's: both factors read the same rounded λ, so their exponents add up to Σ_{j<s≤i} λ up to the
    f32 rounding of the two sums (≈ 2⁻²⁴·span each; the tree has none of it). Pairs above the diagonal
    (e^{positive}, possibly inf in f32) are masked by a select, never multiplied."""
    def too_wide(cut, sums):
        return (cut > 0) & (jnp.min(jnp.min(sums, axis=1), axis=0) < -cfg.bounded_span)

    top = jnp.int32(cfg.levels)
    if not keep_sums:
        cut = jax.lax.while_loop(lambda cut: too_wide(cut, _cut_sums(cut, log_decay_parts, cfg)), lambda cut: cut - 1,
                                 top)
        return cut, None
    return jax.lax.while_loop(lambda carry: too_wide(*carry),
                              lambda carry: (carry[0] - 1, _cut_sums(carry[0] - 1, log_decay_parts, cfg)),
                              (top, _cut_sums(top, log_decay_parts, cfg)))


def _cut_sums(cut, log_decay_parts, cfg):
    return _decay_sums(_level(cfg, jnp.maximum(cut - 1, 0))[1], log_decay_parts, cfg)


def _pivot_factors(cut, sums, log_decay_parts, cfg):
    """For (cut, sums) from :func:`_bounded_cut`: (pairs [C, C] bool: i > j inside one node of 2^cut
    tokens, left = e^{Λ_i − Λ_p}, right = e^{Λ_p − Λ_i} [C, BK] f32). The exponents are clipped to ±span,
    which changes nothing when the cut holds and keeps the factors finite when cut = 0 (no pair selected)."""
    c = cfg.chunk
    if sums is None:
        sums = _cut_sums(cut, log_decay_parts, cfg)
    right_half = (jax.lax.shift_right_logical(iota((c, cfg.block_k), 0), jnp.maximum(cut - 1, 0)) & 1) == 1
    span = cfg.bounded_span
    exponent = jnp.clip(jnp.where(right_half, sums, -sums), -span, span)  # Λ_i − Λ_p
    i, j = iota((c, c), 0), iota((c, c), 1)
    pairs = (jax.lax.shift_right_logical(i, cut) == jax.lax.shift_right_logical(j, cut)) & (i > j)
    return pairs, jnp.exp(exponent), jnp.exp(-exponent)


def _key_block(b, cfg):
    return pl.ds(pl.multiple_of(b * cfg.block_k, cfg.block_k), cfg.block_k)


class _ChunkMasks:
    """Document and causal masks of one chunk, built where they are used (properties, not stored), so that
    no [C, C] mask stays live in registers across the key-block loops."""

    def __init__(self, doc, carry, last, cfg):
        self.doc, self.carry, self.last, self.c = doc, carry, last, cfg.chunk

    def _rows_cols(self):
        return iota((self.c, self.c), 0), iota((self.c, self.c), 1)

    @property
    def same_doc(self):
        return self.doc[:, None] == self.doc[None, :]

    @property
    def eye(self):
        i, j = self._rows_cols()
        return i == j

    @property
    def causal(self):
        i, j = self._rows_cols()
        return i >= j

    @property
    def strict(self):
        i, j = self._rows_cols()
        return i > j

    @property
    def carried(self):
        return (self.doc == self.carry)[:, None]  # rows whose document is the carried-in one

    @property
    def in_last(self):
        return (self.doc == self.last)[:, None]  # rows in the chunk's last document

    @property
    def no_boundary(self):
        return self.last == self.carry


def _chunk_masks(document_ref, carried_document_ref, cfg):
    return _ChunkMasks(document_ref[...], carried_document_ref[...], document_ref[cfg.chunk - 1], cfg)


def _edge_decays(log_decay, log_decay_split, masks, cfg):
    """The chunk-edge decays of one key block: π = e^{Σ_{0≤s≤i} λ} on the rows of the carried-in document and
    E = e^{Σ_{j<s<C} λ} on the rows of the chunk's last document (0 elsewhere) [C, BK]; π_C (0 across a
    boundary) [BK]. With ``end_decays="difference"`` the exponent of E is the chunk total minus π's
    (Λ_C − Λ_j, both sums of the same rounded λ parts, clipped at 0) instead of a second 0/1 matmul."""
    starts = _decay_sums(_start_sums(cfg), log_decay_split, cfg)
    if cfg.end_decays == "difference":
        total = sum(jnp.sum(part, axis=0) for part in log_decay_split)
        ends = jnp.minimum(total[None, :] - starts, 0.0)
    else:
        ends = _decay_sums(_end_sums(cfg), log_decay_split, cfg)
    start = jnp.where(masks.carried, jnp.exp(starts), 0.0)
    end = jnp.where(masks.in_last, jnp.exp(ends), 0.0)
    return start, end, jnp.where(masks.no_boundary, jnp.exp(jnp.sum(log_decay, axis=0)), 0.0)


def _chunk_matrices(q_ref, k_ref, erase_ref, log_decay_ref, masks, cfg, query_start_out, key_eff_out, chunk_decay_out,
                    key_start_out, whole_chunk=False):
    """(M (lower incl. diagonal), A (strictly lower), both [C, C] f32, flag); writes Q̂⊙π, K⊙E, π_C and K̂⊙π on the
    way (K̂⊙π in the operand dtype: the rounding the matmul Y = P (K̂⊙π) applies to it).

    ``whole_chunk`` (the first of ``two_pass``'s passes): every key block takes the cut of the whole chunk, with
    no search and no exact level compiled in, and the flag (int32) is 1 when some block's half-chunk sums leave
    [−span, 0] — then A and M are wrong (clipped factors) and the second pass must redo the chunk. On the H200
    the search (a while loop on a block-wide minimum) and the exact levels it may enter cost 0.23 of K1's
    1.43 ms at 8·4096 even when no block leaves the whole-chunk cut; the check alone feeds no branch. Otherwise
    the flag is 0 and the cut is searched per key block (:func:`_bounded_cut`)."""
    c = cfg.chunk

    def key_block(b, acc):
        a, m, diag, low = acc
        cols = _key_block(b, cfg)
        log_decay = log_decay_ref[:, cols].astype(F32)
        log_decay_split = _split(log_decay, cfg)
        q, k, e = q_ref[:, cols], k_ref[:, cols], erase_ref[:, cols]  # operand dtype; products promote to f32
        start, end, chunk_decay = _edge_decays(log_decay, log_decay_split, masks, cfg)
        query_start_out[:, cols] = (q * start).astype(query_start_out.dtype)
        key_eff_out[:, cols] = (k * end).astype(key_eff_out.dtype)
        chunk_decay_out[cols] = chunk_decay
        key_start_out[:, cols] = (e * start).astype(key_start_out.dtype)

        def level(l, acc):
            pairs, sums = _level(cfg, l)
            f = _decay(sums, log_decay_split, cfg)
            kf = k * f
            return (acc[0] + jnp.where(pairs, _dot(e * f, kf, cfg, trans_b=True), 0.0),
                    acc[1] + jnp.where(pairs, _dot(q * f, kf, cfg, trans_b=True), 0.0))

        diag = diag + jnp.sum(q.astype(F32) * k.astype(F32), axis=1)
        if whole_chunk:  # pairs above the diagonal (e^{positive}, possibly inf) are dropped by the final select
            sums = _cut_sums(cfg.levels, log_decay_split, cfg)
            low = jnp.minimum(low, jnp.min(sums, axis=1))  # per row (within a warp); across rows after the loop
            _, left, right = _pivot_factors(cfg.levels, sums, log_decay_split, cfg)
            kr = k * right
            return a + _dot(e * left, kr, cfg, trans_b=True), m + _dot(q * left, kr, cfg, trans_b=True), diag, low
        cut = 0  # the exact tree for every pair
        if cfg.bounded_span is not None:
            cut, sums = _bounded_cut(log_decay_split, cfg, keep_sums=True)
            pairs, left, right = _pivot_factors(cut, sums, log_decay_split, cfg)
            kr = k * right
            a = a + jnp.where(pairs, _dot(e * left, kr, cfg, trans_b=True), 0.0)
            m = m + jnp.where(pairs, _dot(q * left, kr, cfg, trans_b=True), 0.0)
        a, m = jax.lax.fori_loop(cut, cfg.levels, level, (a, m))
        return a, m, diag, low

    zeros = jnp.zeros((c, c), F32)
    a, m, diag, low = jax.lax.fori_loop(0, cfg.key_dim // cfg.block_k, key_block,
                                        (zeros, zeros, jnp.zeros((c,), F32), jnp.zeros((c,), F32)))
    flag = (jnp.min(low) < -cfg.bounded_span).astype(jnp.int32) if whole_chunk else 0
    a = jnp.where(masks.strict & masks.same_doc, a, 0.0)
    m = jnp.where(masks.strict & masks.same_doc, m, 0.0) + jnp.where(masks.eye, diag[:, None], 0.0)
    return m, a, flag


def _inverse(a, cfg):
    """(I + A)⁻¹ for strictly lower A: Neumann product on the leaf blocks, then P ← P − P A_ℓ P per level."""
    c = cfg.chunk
    eye = jnp.where(iota((c, c), 0) == iota((c, c), 1), 1.0, 0.0).astype(F32)
    a_diag = jnp.where((iota((c, c), 0) // cfg.leaf) == (iota((c, c), 1) // cfg.leaf), a, 0.0)
    inverse = eye - a_diag
    power = a_diag
    for _ in range(int(math.log2(cfg.leaf)) - 1):
        power = _dot(power, power, cfg, f32=True)
        inverse = _dot(inverse, eye + power, cfg, f32=True)
    for level in range(int(math.log2(cfg.leaf)), cfg.levels):
        a_level = jnp.where(_level(cfg, level)[0], a, 0.0)
        inverse = inverse - _dot(_dot(inverse, a_level, cfg, f32=True), inverse, cfg, f32=True)
    return inverse


# ---------------------------------------------------------------------------------------------------------
# kernels


def _passes(body, n_inputs, n_outputs, stage):
    """The kernel of one pass of K1 or B2b from ``body(input refs, output refs, whole_chunk) -> flag``:
      "single": the cut searched per key block (``two_pass`` off, or the exact tree);
      "first":  the whole chunk's cut; one more output, the flag [B, H, N] int32;
      "whole":  the whole chunk's cut, no flag (B2b: the forward's K1 flagged the chunks already);
      "second": inputs, the flag, then the first pass's outputs (aliased to this pass's outputs, never read);
                only a flagged chunk runs the body (with the search) and overwrites its outputs.
    (The search as a branch after the whole-chunk body in one program spilled 1.9–2.9 KB per thread offline,
    against 128–260 bytes for the two kernels.)"""
    if stage == "first":
        def kernel(*refs):
            refs[-1][...] = body(refs[:n_inputs], refs[n_inputs:-1], True)
    elif stage == "whole":
        def kernel(*refs):
            body(refs[:n_inputs], refs[n_inputs:], True)
    elif stage == "second":
        def kernel(*refs):
            @pl.when(refs[n_inputs][...] != 0)
            def _():
                body(refs[:n_inputs], refs[-n_outputs:], False)
    else:
        def kernel(*refs):
            body(refs[:n_inputs], refs[n_inputs:], False)
    return kernel


def _intra_body(cfg, with_inverse):
    def body(inputs, outputs, whole_chunk):
        q_ref, k_ref, erase_ref, v_ref, log_decay_ref, document_ref, carried_document_ref = inputs
        (readout_out, pseudo_values_out, state_reads_out, query_start_out, key_eff_out, chunk_decay_out,
         *maybe_inverse_out) = outputs
        masks = _chunk_masks(document_ref, carried_document_ref, cfg)
        # K̂⊙π goes to Y's output block in the key-block loop (π is at hand there) and is read back for
        # Y = P (K̂⊙π) once P is known: computing π again cost 0.2 ms of K1's 1.9 at 8·4096 on the H200. The
        # read sees the writes: the same program made them, and the solve's block barriers (every matmul
        # operand passes through shared memory) lie between them.
        m, a, flag = _chunk_matrices(q_ref, k_ref, erase_ref, log_decay_ref, masks, cfg, query_start_out,
                                     key_eff_out, chunk_decay_out, key_start_out=state_reads_out,
                                     whole_chunk=whole_chunk)
        p = _inverse(a, cfg)
        od = cfg.operand_dtype
        readout_out[...] = m.astype(readout_out.dtype)
        pseudo_values_out[...] = _dot(p, v_ref[...], cfg).astype(od)
        state_reads_out[...] = _dot(p, state_reads_out[...], cfg).astype(od)  # one [C, Dk] product
        if with_inverse:
            maybe_inverse_out[0][...] = p.astype(maybe_inverse_out[0].dtype)
        return flag

    return body


def _intra_alone_body(cfg):
    """K1 for a forward without backward (``fold_solve``): M P, K̂⊙π, Q̂⊙π, Pᵀ(K⊙E), π_C. P is folded into the
    two matrices the scan multiplies Ũ by, so the scan reads V̂ and K̂⊙π in place of U = P V̂ and Y = P (K̂⊙π):
    here no V̂ read, no U written, and M P ([C, C] × [C, C]) in place of U = P V̂ ([C, C] × [C, Dv]); the same
    products in the scan."""
    def body(inputs, outputs, whole_chunk):
        q_ref, k_ref, erase_ref, log_decay_ref, document_ref, carried_document_ref = inputs
        readout_out, state_reads_out, query_start_out, key_eff_out, chunk_decay_out = outputs
        masks = _chunk_masks(document_ref, carried_document_ref, cfg)
        m, a, flag = _chunk_matrices(q_ref, k_ref, erase_ref, log_decay_ref, masks, cfg, query_start_out,
                                     key_eff_out, chunk_decay_out, key_start_out=state_reads_out,
                                     whole_chunk=whole_chunk)
        p = _inverse(a, cfg)
        od = cfg.operand_dtype
        readout_out[...] = _dot(m, p, cfg).astype(od)
        # K⊙E went to its output block in the key-block loop; read back after the solve (same program, block
        # barriers between, as for K̂⊙π in _intra_body) and replaced by Pᵀ(K⊙E)
        key_eff_out[...] = _dot(p, key_eff_out[...], cfg, trans_a=True).astype(od)
        return flag

    return body


def _rhs_kernel(cfg):
    """Backward with the forward's P saved: U = P V̂, Y = P (K̂⊙π), Q̂⊙π, K⊙E, π_C (no A, M or inverse)."""

    def kernel(q_ref, k_ref, erase_ref, v_ref, log_decay_ref, document_ref, carried_document_ref, inverse_ref,
               pseudo_values_out, state_reads_out, query_start_out, key_eff_out, chunk_decay_out):
        masks = _chunk_masks(document_ref, carried_document_ref, cfg)
        od = cfg.operand_dtype
        pseudo_values_out[...] = _dot(inverse_ref[...], v_ref[...], cfg).astype(od)

        def key_block(b, carry):
            cols = _key_block(b, cfg)
            log_decay = log_decay_ref[:, cols].astype(F32)
            log_decay_split = _split(log_decay, cfg)
            start, end, chunk_decay = _edge_decays(log_decay, log_decay_split, masks, cfg)
            query_start_out[:, cols] = (q_ref[:, cols] * start).astype(od)
            key_eff_out[:, cols] = (k_ref[:, cols] * end).astype(od)
            chunk_decay_out[cols] = chunk_decay
            state_reads_out[:, cols] = _dot(inverse_ref[...], erase_ref[:, cols] * start, cfg).astype(od)
            return carry

        jax.lax.fori_loop(0, cfg.key_dim // cfg.block_k, key_block, 0)

    return kernel


def _scan_kernel(cfg, n_chunks):
    def kernel(state_reads_ref, pseudo_values_ref, key_eff_ref, chunk_decay_ref, s_init_ref, starts_out,
               true_pseudo_out, s_final_out):
        def body(n, state):
            starts_out[n] = state.astype(starts_out.dtype)
            true_pseudo = pseudo_values_ref[n].astype(F32) - _dot(state_reads_ref[n], state, cfg)
            true_pseudo_out[n] = true_pseudo.astype(true_pseudo_out.dtype)
            return chunk_decay_ref[n][:, None] * state + _dot(key_eff_ref[n], true_pseudo, cfg, trans_a=True)

        s_final_out[...] = jax.lax.fori_loop(0, n_chunks, body, s_init_ref[...].astype(F32))

    return kernel


def _scan_output_kernel(cfg, n_chunks):
    """K2 with K3 folded in, for a forward without backward: each chunk's output O = (Q̂⊙π) S₀ + M Ũ while S₀
    and Ũ are at hand (the same products and roundings as K3's, which reads them back from HBM). With
    ``fold_solve`` the same body reads V̂ (by token), K̂⊙π, M P and Pᵀ(K⊙E) (:func:`_intra_alone_body`), and
    its "Ũ" is W = V̂ − (K̂⊙π) S₀."""
    c = cfg.chunk

    def kernel(state_reads_ref, pseudo_values_ref, key_eff_ref, chunk_decay_ref, query_start_ref, readout_ref,
               s_init_ref, o_out, s_final_out):
        def body(n, state):
            values = pseudo_values_ref[pl.ds(n * c, c), :] if cfg.fold_solve else pseudo_values_ref[n]
            true_pseudo = values.astype(F32) - _dot(state_reads_ref[n], state, cfg)
            o = _dot(query_start_ref[n], state, cfg) + _dot(readout_ref[n], true_pseudo, cfg)
            o_out[pl.ds(n * c, c), :] = o.astype(o_out.dtype)
            return chunk_decay_ref[n][:, None] * state + _dot(key_eff_ref[n], true_pseudo, cfg, trans_a=True)

        s_final_out[...] = jax.lax.fori_loop(0, n_chunks, body, s_init_ref[...].astype(F32))

    return kernel


def _output_kernel(cfg):
    def kernel(query_start_ref, starts_ref, readout_ref, true_pseudo_ref, o_ref):
        o = _dot(query_start_ref[...], starts_ref[...], cfg) + _dot(readout_ref[...], true_pseudo_ref[...], cfg)
        o_ref[...] = o.astype(o_ref.dtype)

    return kernel


def _scan_bwd_kernel(cfg, n_chunks):
    c = cfg.chunk

    def kernel(readout_ref, do_ref, key_eff_ref, query_start_ref, state_reads_ref, chunk_decay_ref, ds_final_ref,
               d_ends_out, d_true_pseudo_out, d_start_state_out):
        def body(i, d_state):
            n = n_chunks - 1 - i
            d_ends_out[n] = d_state.astype(d_ends_out.dtype)
            d_out = do_ref[pl.ds(n * c, c), :]
            d_true_pseudo = _dot(readout_ref[n], d_out, cfg, trans_a=True) + _dot(key_eff_ref[n], d_state, cfg)
            d_true_pseudo_out[n] = d_true_pseudo.astype(d_true_pseudo_out.dtype)
            return (_dot(query_start_ref[n], d_out, cfg, trans_a=True) + chunk_decay_ref[n][:, None] * d_state
                    - _dot(state_reads_ref[n], d_true_pseudo, cfg, trans_a=True))

        d_start_state_out[...] = jax.lax.fori_loop(0, n_chunks, body, ds_final_ref[...].astype(F32))

    return kernel


def _cotangents_kernel(cfg):
    """B2a, per chunk: Ũ = U − Y S₀, dM = dO Ũᵀ (causal), dV̂ = Pᵀ dŨ (the transposed solve, written out),
    dA = −(dV̂ Uᵀ + dR Yᵀ) (strictly lower) with dR = Pᵀ dY, dY = −dŨ S₀ᵀ."""
    nkb = cfg.key_dim // cfg.block_k

    def kernel(document_ref, carried_document_ref, inverse_ref, pseudo_values_ref, state_reads_ref, starts_ref, do_ref,
               d_true_pseudo_ref, true_pseudo_out, d_readout_out, d_strict_out, dv_out):
        masks = _chunk_masks(document_ref, carried_document_ref, cfg)
        true_pseudo = pseudo_values_ref[...].astype(F32) - _dot(state_reads_ref[...], starts_ref[...], cfg)
        true_pseudo_out[...] = true_pseudo.astype(true_pseudo_out.dtype)
        d_m = _dot(do_ref[...], true_pseudo, cfg, trans_b=True)
        d_readout_out[...] = jnp.where(masks.causal & masks.same_doc, d_m, 0.0).astype(d_readout_out.dtype)
        d_v = _dot(inverse_ref[...], d_true_pseudo_ref[...], cfg, trans_a=True)
        dv_out[...] = d_v.astype(dv_out.dtype)

        def key_block(b, acc):
            cols = _key_block(b, cfg)
            return acc + _dot(_d_rhs(inverse_ref, d_true_pseudo_ref, starts_ref, cols, cfg), state_reads_ref[:, cols],
                              cfg, trans_b=True)

        d_a = jax.lax.fori_loop(0, nkb, key_block, _dot(d_v, pseudo_values_ref[...], cfg, trans_b=True))
        d_strict_out[...] = jnp.where(masks.strict & masks.same_doc, -d_a, 0.0).astype(d_strict_out.dtype)

    return kernel


def _d_rhs(inverse_ref, d_true_pseudo_ref, starts_ref, cols, cfg):
    """dR = Pᵀ dY for the key block ``cols``: the cotangent of K̂⊙π (Y = P (K̂⊙π), dY = −dŨ S₀ᵀ). [C, BK]."""
    d_y = -_dot(d_true_pseudo_ref[...], starts_ref[cols, :], cfg, trans_b=True)
    return _dot(inverse_ref[...], d_y, cfg, trans_a=True)


def _key_grads_body(cfg):
    """B2b, per chunk and key block (all blocks in parallel): dq̂, dk, dk̂, dλ of the block's key channels
    from dA, dM, Ũ and the states. ``whole_chunk``: the key block takes the whole chunk's cut (the forward's K1
    did not flag its chunk), with no search and no exact level compiled in, as K1's first pass."""
    c = cfg.chunk

    def body(inputs, outputs, whole_chunk):
        (q_ref, k_ref, erase_ref, log_decay_ref, document_ref, carried_document_ref, inverse_ref, starts_ref,
         d_ends_ref, do_ref, d_true_pseudo_ref, true_pseudo_ref, d_readout_ref, d_strict_ref) = inputs
        dq_out, dk_out, d_erase_out, d_log_decay_out = outputs
        masks = _chunk_masks(document_ref, carried_document_ref, cfg)
        log_decay = log_decay_ref[...].astype(F32)
        log_decay_split = _split(log_decay, cfg)
        q, k, e = q_ref[...], k_ref[...], erase_ref[...]  # operand dtype; products promote to f32

        # pair gradients through the pivot tree (same factors as the forward; F is ρ on right-half rows and
        # κ on left-half rows)
        def level(l, acc):
            pairs, sums = _level(cfg, l)
            f = _decay(sums, log_decay_split, cfg)
            d_a = d_strict_ref[...]
            d_m = d_readout_ref[...]
            da_l = jnp.where(pairs, d_a, jnp.zeros_like(d_a))
            dm_l = jnp.where(pairs, d_m, jnp.zeros_like(d_m))
            kf = k * f
            wide = cfg.pair_grads_f32
            return (acc[0] + _dot(da_l, kf, cfg, f32=wide) * f, acc[1] + _dot(dm_l, kf, cfg, f32=wide) * f,
                    acc[2] + (_dot(da_l, e * f, cfg, trans_a=True, f32=wide)
                              + _dot(dm_l, q * f, cfg, trans_a=True, f32=wide)) * f)

        zeros = jnp.zeros((c, cfg.block_k), F32)
        pair_grads = (zeros, zeros, zeros)
        cut = 0
        if cfg.bounded_span is not None:  # the forward's one product per node, transposed
            if whole_chunk:
                cut, sums = cfg.levels, None
            else:
                cut, sums = _bounded_cut(log_decay_split, cfg, keep_sums=False)
            pairs, left, right = _pivot_factors(cut, sums, log_decay_split, cfg)
            if whole_chunk:
                pairs = masks.strict
            d_a = jnp.where(pairs, d_strict_ref[...], jnp.zeros_like(d_strict_ref[...]))
            d_m = jnp.where(pairs, d_readout_ref[...], jnp.zeros_like(d_readout_ref[...]))
            kr = k * right
            wide = cfg.pair_grads_f32
            pair_grads = (_dot(d_a, kr, cfg, f32=wide) * left, _dot(d_m, kr, cfg, f32=wide) * left,
                          (_dot(d_a, e * left, cfg, trans_a=True, f32=wide)
                           + _dot(d_m, q * left, cfg, trans_a=True, f32=wide)) * right)
        d_e_pair, d_q_pair, d_k_pair = pair_grads if whole_chunk else jax.lax.fori_loop(cut, cfg.levels, level,
                                                                                        pair_grads)
        # the state terms after the level loop: nothing [C, BK] extra stays live across it
        s0 = starts_ref[...]
        d_ends = d_ends_ref[...]
        d_qpi = _dot(do_ref[...], s0, cfg, trans_b=True)
        d_keff = _dot(true_pseudo_ref[...], d_ends, cfg, trans_b=True)
        d_pic = jnp.sum(s0.astype(F32) * d_ends.astype(F32), axis=1)
        d_r = _dot(inverse_ref[...], -_dot(d_true_pseudo_ref[...], s0, cfg, trans_b=True), cfg, trans_a=True)
        d_m_diag = jnp.sum(jnp.where(masks.eye, d_readout_ref[...].astype(F32), 0.0), axis=1)[:, None]
        start, end, chunk_decay = _edge_decays(log_decay, log_decay_split, masks, cfg)
        dq_out[...] = (d_qpi * start + d_q_pair + d_m_diag * k).astype(dq_out.dtype)
        d_erase_out[...] = (d_r * start + d_e_pair).astype(d_erase_out.dtype)
        dk_out[...] = (d_keff * end + d_k_pair + d_m_diag * q).astype(dk_out.dtype)
        # log-decay: every exponent is Λ_i − Λ_j (pairs, π, E, π_C; Λ the chunk's inclusive cumsum), so
        # dΛ_i collects +g, dΛ_j −g; dλ = reverse cumsum of dΛ within the chunk.
        end_terms = end * d_keff * k
        d_cum = (e * d_e_pair - k * d_k_pair + q * d_q_pair + start * (d_qpi * q + d_r * e) - end_terms)
        chunk_end = jnp.sum(end_terms, axis=0) + d_pic * chunk_decay
        total = jnp.sum(d_cum, axis=0)
        d_lam = total[None, :] - jnp.cumsum(d_cum, axis=0) + d_cum + chunk_end[None, :]
        d_log_decay_out[...] = d_lam.astype(d_log_decay_out.dtype)

    return body


# ---------------------------------------------------------------------------------------------------------
# pallas_call wrappers (inputs already padded to a multiple of the chunk)


def _cost(cfg, kernel, batch_heads, n_chunks, save_matrices=True):
    """pl.CostEstimate of one pallas_call: the executed FLOPs (full masked tiles), exps and HBM bytes that
    pallas_kernels/delta_rule/flops_gpu.py counts per chunk and head (tests/pallas_kernels/test_flops_gpu.py checks the
    FLOP and exp counts against the kernels' own jaxprs). The Triton lowering of JAX 0.10/0.11 drops it;
    interpret mode and tooling read it."""
    # imported here, not at the top: the package import must not load the FLOP CLIs, or
    # `python -m mixerlab.pallas_kernels.delta_rule.flops_gpu` warns that the module was imported before it ran
    from mixerlab.pallas_kernels.delta_rule import flops_gpu
    operand_bytes = jnp.dtype(cfg.operand_dtype).itemsize
    sum_passes = 2 if cfg.resolved_decay_sums == "tf32x2" and not cfg.interpret else 1  # as _split
    bounded = cfg.bounded_span is not None
    counts = flops_gpu.kernel_counts(cfg.chunk, cfg.leaf, cfg.key_dim, cfg.value_dim, cfg.block_k, sum_passes,
                                     save_matrices, operand_bytes, bounded, cfg.save_rhs, cfg.fuse_output,
                                     end_difference=cfg.end_decays == "difference", fold_solve=cfg.fold_solve,
                                     two_pass=cfg.two_pass and cfg.two_pass_key_grads)
    exps = flops_gpu.kernel_exps(cfg.chunk, cfg.key_dim, save_matrices, bounded, cfg.save_rhs, cfg.fuse_output)
    bf, tf, nbytes = counts[kernel]
    chunks = batch_heads * n_chunks
    return pl.CostEstimate(flops=int(chunks * (bf + tf)), transcendentals=int(chunks * exps[kernel]),
                           bytes_accessed=int(chunks * nbytes))


def _with_flags(cost, programs):
    """``cost`` plus one int32 flag read or written per program (the two-pass kernels)."""
    return pl.CostEstimate(flops=cost.flops, transcendentals=cost.transcendentals,
                           bytes_accessed=cost.bytes_accessed + 4 * programs)


def _params(cfg, warps, stages=None):
    return compiler_params(cfg.interpret, warps, stages)


def _token_spec(cfg, width):
    """[B, T, H, width] read per chunk: block [C, width] at (b, n, h)."""
    return pl.BlockSpec((None, cfg.chunk, None, width), lambda b, h, n: (b, n, h, 0))


def _chunk_spec(*tail):
    """[B, H, N, *tail] per chunk."""
    return pl.BlockSpec((None, None, None, *tail), lambda b, h, n: (b, h, n, *([0] * len(tail))))


def _per_head(*tail):
    """[B, H, *tail] read whole by each program of a (B, H, Dv/BV) grid (the sequential kernels)."""
    return pl.BlockSpec((None, None, *tail), lambda b, h, j: (b, h, *([0] * len(tail))))


def _per_head_v_block(*tail):
    """[B, H, ..., Dv] in blocks of BV along the last axis, one per program of a (B, H, Dv/BV) grid."""
    return pl.BlockSpec((None, None, *tail), lambda b, h, j: (b, h, *([0] * (len(tail) - 1)), j))


def _document_specs(cfg):
    """Documents [B, T] per chunk [C] and the carried-in document [B, N] per chunk (a scalar), on a (B, H, N)
    grid."""
    return [pl.BlockSpec((None, cfg.chunk), lambda b, h, n: (b, n)), pl.BlockSpec((None, None), lambda b, h, n: (b, n))]


def _rhs_blocks(cfg, q, v):
    """Out shapes and specs of U, Y, Q̂⊙π, K⊙E (operand dtype) and π_C (f32), and the in specs of
    q, k, k̂, v̂, λ, documents, carried document — shared by K1 and its backward twin."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    c, n, od = cfg.chunk, t // cfg.chunk, cfg.operand_dtype
    shapes = [jax.ShapeDtypeStruct((b, h, n, c, dv), od),  # U
              jax.ShapeDtypeStruct((b, h, n, c, dk), od),  # Y
              jax.ShapeDtypeStruct((b, h, n, c, dk), od),  # Q̂⊙π
              jax.ShapeDtypeStruct((b, h, n, c, dk), od),  # K⊙E
              jax.ShapeDtypeStruct((b, h, n, dk), F32)]  # π_C
    specs = [_chunk_spec(c, dv), _chunk_spec(c, dk), _chunk_spec(c, dk), _chunk_spec(c, dk), _chunk_spec(dk)]
    in_specs = [_token_spec(cfg, dk)] * 3 + [_token_spec(cfg, dv), _token_spec(cfg, dk), *_document_specs(cfg)]
    return shapes, specs, in_specs, (b, h, n)


def _intra(cfg, q, k, erase, v, log_decay, document, carried, with_inverse, with_flags=False):
    """K1: (M, U, Y, Q̂⊙π, K⊙E, π_C[, P]); ``with_flags``: (that, the first pass's flags or None)."""
    shapes, specs, in_specs, grid = _rhs_blocks(cfg, q, v)
    c = cfg.chunk
    shapes = [jax.ShapeDtypeStruct((*grid, c, c), cfg.operand_dtype)] + shapes  # M
    specs = [_chunk_spec(c, c)] + specs
    if with_inverse:  # P in the operand dtype: every consumer is a matmul with operands in that dtype
        shapes.append(jax.ShapeDtypeStruct((*grid, c, c), cfg.operand_dtype))
        specs.append(_chunk_spec(c, c))
    return _k1(cfg, _intra_body(cfg, with_inverse), "delta_rule_intra", shapes, specs, in_specs, grid,
               _cost(cfg, "K1_intra", grid[0] * grid[1], grid[2], with_inverse),
               (q, k, erase, v, log_decay, document, carried), with_flags)


def _intra_alone(cfg, q, k, erase, log_decay, document, carried):
    """K1 of a forward without backward (``fold_solve``): (M P, K̂⊙π, Q̂⊙π, Pᵀ(K⊙E), π_C)."""
    b, t, h, dk = q.shape
    c, n, od = cfg.chunk, t // cfg.chunk, cfg.operand_dtype
    shapes = [jax.ShapeDtypeStruct((b, h, n, c, c), od)] + [jax.ShapeDtypeStruct((b, h, n, c, dk), od)] * 3 + [
        jax.ShapeDtypeStruct((b, h, n, dk), F32)]
    specs = [_chunk_spec(c, c)] + [_chunk_spec(c, dk)] * 3 + [_chunk_spec(dk)]
    in_specs = [_token_spec(cfg, dk)] * 4 + _document_specs(cfg)
    return _k1(cfg, _intra_alone_body(cfg), "delta_rule_intra_alone", shapes, specs, in_specs, (b, h, n),
               _cost(cfg, "K1_intra_alone", b * h, n), (q, k, erase, log_decay, document, carried))


def _k1(cfg, body, name, shapes, specs, in_specs, grid, cost, args, with_flags=False):
    """K1 as one pass, or (``two_pass`` with ``bounded_span``) as the whole-chunk pass and the search pass of the
    chunks it flagged (:func:`_passes`). The second pass declares only its flag reads: with ordinary gates no
    chunk is flagged and its programs return at once (a flagged chunk costs one more K1 program).
    ``with_flags``: (outputs, the flags [B, H, N] int32, None for one pass)."""
    n_in, n_out = len(args), len(shapes)
    call = functools.partial(pl.pallas_call, grid=grid, interpret=cfg.interpret,
                             compiler_params=_params(cfg, cfg.warps_intra))
    if cfg.bounded_span is None or not cfg.two_pass:
        out = call(_passes(body, n_in, n_out, "single"), out_shape=tuple(shapes), in_specs=in_specs,
                   out_specs=tuple(specs), cost_estimate=cost, name=name)(*args)
        return (out, None) if with_flags else out
    flag_shape = jax.ShapeDtypeStruct(grid, jnp.int32)
    flag_spec = pl.BlockSpec((None, None, None), lambda b, h, n: (b, h, n))
    *first, flag = call(_passes(body, n_in, n_out, "first"), out_shape=(*shapes, flag_shape), in_specs=in_specs,
                        out_specs=(*specs, flag_spec), cost_estimate=_with_flags(cost, math.prod(grid)),
                        name=name)(*args)
    out = call(_passes(body, n_in, n_out, "second"), out_shape=tuple(shapes),
               in_specs=[*in_specs, flag_spec, *specs], out_specs=tuple(specs),
               input_output_aliases={n_in + 1 + i: i for i in range(n_out)},
               cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=4 * math.prod(grid)),
               name=name + "_search")(*args, flag, *first)
    return (out, flag) if with_flags else out


def _rhs(cfg, q, k, erase, v, log_decay, document, carried, inverse):
    """K1's backward twin with P given: (U, Y, Q̂⊙π, K⊙E, π_C)."""
    shapes, specs, in_specs, grid = _rhs_blocks(cfg, q, v)
    return pl.pallas_call(_rhs_kernel(cfg), out_shape=tuple(shapes), grid=grid,
                          in_specs=in_specs + [_chunk_spec(cfg.chunk, cfg.chunk)], out_specs=tuple(specs),
                          interpret=cfg.interpret, compiler_params=_params(cfg, cfg.warps_rhs),
                          cost_estimate=_cost(dataclasses.replace(cfg, save_rhs=False), "B0_rhs", grid[0] * grid[1],
                                              grid[2]),  # B0 runs when the forward's tiles are not kept
                          name="delta_rule_rhs")(q, k, erase, v, log_decay, document, carried, inverse)


def _scan(cfg, state_reads, pseudo_values, key_eff, chunk_decay, state):
    b, h, n, c, dk = state_reads.shape
    dv = pseudo_values.shape[-1]
    bv = cfg.scan_block_v
    return pl.pallas_call(
        _scan_kernel(cfg, n),
        out_shape=(jax.ShapeDtypeStruct((b, h, n, dk, dv), cfg.operand_dtype),
                   jax.ShapeDtypeStruct((b, h, n, c, dv), pseudo_values.dtype), jax.ShapeDtypeStruct((b, h, dk, dv),
                                        F32)),
        grid=(b, h, dv // bv),
        in_specs=[_per_head(n, c, dk), _per_head_v_block(n, c, bv), _per_head(n, c, dk), _per_head(n, dk),
                  _per_head_v_block(dk, bv)],
        out_specs=(_per_head_v_block(n, dk, bv), _per_head_v_block(n, c, bv), _per_head_v_block(dk, bv)),
        interpret=cfg.interpret, compiler_params=_params(cfg, cfg.warps_scan, cfg.stages_scan),
        cost_estimate=_cost(cfg, "K2_scan", b * h, n),
        name="delta_rule_scan")(state_reads, pseudo_values, key_eff, chunk_decay, state)


def _scan_output(cfg, state_reads, pseudo_values, key_eff, chunk_decay, query_start, readout, state, out_dtype):
    """K2 with K3 folded in (``fuse_output``, a forward without backward): (o [B, T, H, Dv], S_T). With
    ``fold_solve``, ``pseudo_values`` is V̂ itself [B, T, H, Dv] (and the other operands those of
    :func:`_intra_alone`)."""
    b, h, n, c, dk = state_reads.shape
    dv = pseudo_values.shape[-1]
    bv = cfg.scan_block_v
    by_token = pl.BlockSpec((None, n * c, None, bv), lambda b_, h_, j: (b_, 0, h_, j))
    return pl.pallas_call(
        _scan_output_kernel(cfg, n), grid=(b, h, dv // bv),
        out_shape=(jax.ShapeDtypeStruct((b, n * c, h, dv), out_dtype), jax.ShapeDtypeStruct((b, h, dk, dv), F32)),
        in_specs=[_per_head(n, c, dk), by_token if cfg.fold_solve else _per_head_v_block(n, c, bv),
                  _per_head(n, c, dk), _per_head(n, dk), _per_head(n, c, dk), _per_head(n, c, c),
                  _per_head_v_block(dk, bv)],
        out_specs=(by_token, _per_head_v_block(dk, bv)),
        interpret=cfg.interpret, compiler_params=_params(cfg, cfg.warps_scan, cfg.stages_scan_output),
        cost_estimate=_cost(cfg, "K2_scan_output", b * h, n), name="delta_rule_scan_output")(
        state_reads, pseudo_values, key_eff, chunk_decay, query_start, readout, state)


def _output(cfg, query_start, starts, readout, true_pseudo, out_dtype):
    b, h, n, c, dk = query_start.shape
    dv = true_pseudo.shape[-1]
    return pl.pallas_call(
        _output_kernel(cfg), out_shape=jax.ShapeDtypeStruct((b, n * c, h, dv), out_dtype), grid=(b, h, n),
        in_specs=[_chunk_spec(c, dk), _chunk_spec(dk, dv), _chunk_spec(c, c), _chunk_spec(c, dv)],
        out_specs=_token_spec(cfg, dv), interpret=cfg.interpret,
        cost_estimate=_cost(cfg, "K3_output", b * h, n),
        compiler_params=_params(cfg, cfg.warps_output), name="delta_rule_output")(query_start, starts, readout,
                                true_pseudo)


def _scan_bwd(cfg, readout, d_out, key_eff, query_start, state_reads, chunk_decay, d_final):
    b, h, n, c, dk = state_reads.shape
    dv = d_out.shape[-1]
    bv = cfg.scan_block_v
    do_spec = pl.BlockSpec((None, n * c, None, bv), lambda b_, h_, j: (b_, 0, h_, j))
    return pl.pallas_call(
        _scan_bwd_kernel(cfg, n),
        out_shape=(jax.ShapeDtypeStruct((b, h, n, dk, dv), cfg.operand_dtype),
                   jax.ShapeDtypeStruct((b, h, n, c, dv), state_reads.dtype), jax.ShapeDtypeStruct((b, h, dk, dv),
                                        F32)),
        grid=(b, h, dv // bv),
        in_specs=[_per_head(n, c, c), do_spec, _per_head(n, c, dk), _per_head(n, c, dk), _per_head(n, c, dk),
                  _per_head(n, dk), _per_head_v_block(dk, bv)],
        out_specs=(_per_head_v_block(n, dk, bv), _per_head_v_block(n, c, bv), _per_head_v_block(dk, bv)),
        interpret=cfg.interpret, compiler_params=_params(cfg, cfg.warps_scan, cfg.stages_scan),
        cost_estimate=_cost(cfg, "B1_scan_bwd", b * h, n),
        name="delta_rule_scan_bwd")(readout, d_out, key_eff, query_start, state_reads, chunk_decay, d_final)


def _cotangents(cfg, document, carried, inverse, pseudo_values, state_reads, starts, d_out, d_true_pseudo, dv_dtype):
    b, h, n, c, dv = pseudo_values.shape
    dk = state_reads.shape[-1]
    od = cfg.operand_dtype
    out_shape = (jax.ShapeDtypeStruct((b, h, n, c, dv), od),  # Ũ
                 jax.ShapeDtypeStruct((b, h, n, c, c), od),  # dM
                 jax.ShapeDtypeStruct((b, h, n, c, c), od),  # dA
                 jax.ShapeDtypeStruct((b, n * c, h, dv), dv_dtype))  # dV̂
    in_specs = [*_document_specs(cfg), _chunk_spec(c, c), _chunk_spec(c, dv), _chunk_spec(c, dk), _chunk_spec(dk, dv),
                _token_spec(cfg, dv), _chunk_spec(c, dv)]
    out_specs = (_chunk_spec(c, dv), _chunk_spec(c, c), _chunk_spec(c, c), _token_spec(cfg, dv))
    return pl.pallas_call(_cotangents_kernel(cfg), out_shape=out_shape, grid=(b, h, n), in_specs=in_specs,
                          out_specs=out_specs, interpret=cfg.interpret,
                          cost_estimate=_cost(cfg, "B2a_cotangents", b * h, n),
                          compiler_params=_params(cfg, cfg.warps_cotangents), name="delta_rule_cotangents")(
        document, carried, inverse, pseudo_values, state_reads, starts, d_out, d_true_pseudo)


def _key_grads(cfg, q, k, erase, log_decay, document, carried, inverse, starts, d_ends, d_out, d_true_pseudo,
               true_pseudo, d_readout, d_strict, dtypes, flags=None):
    """B2b; with ``flags`` (the forward's K1 ran two passes) as two kernels like K1: every program with the
    whole chunk's cut, then the search for the programs of flagged chunks (outputs aliased)."""
    b, t, h, dk = q.shape
    dv = true_pseudo.shape[-1]
    c, bk = cfg.chunk, cfg.block_k
    n = t // c
    # grid (B, H, N·key blocks): chunk j // nkb, key block j % nkb
    nkb = dk // bk
    token = pl.BlockSpec((None, c, None, bk), lambda b_, h_, j: (b_, j // nkb, h_, j % nkb))
    chunk = lambda *tail: pl.BlockSpec((None, None, None, *tail),  # noqa: E731
                                       lambda b_, h_, j: (b_, h_, j // nkb, *([0] * len(tail))))
    # noqa
    state_rows = pl.BlockSpec((None, None, None, bk, dv), lambda b_, h_, j: (b_, h_, j // nkb, j % nkb, 0))
    in_specs = [token] * 4 + [
        pl.BlockSpec((None, c), lambda b_, h_, j: (b_, j // nkb)),
        pl.BlockSpec((None, None), lambda b_, h_, j: (b_, j // nkb)),
        chunk(c, c), state_rows, state_rows, pl.BlockSpec((None, c, None, dv), lambda b_, h_, j: (b_, j // nkb, h_, 0)),
        chunk(c, dv), chunk(c, dv), chunk(c, c), chunk(c, c)]
    out_shape = (jax.ShapeDtypeStruct(q.shape, dtypes[0]), jax.ShapeDtypeStruct(k.shape, dtypes[1]),
                 jax.ShapeDtypeStruct(erase.shape, dtypes[2]), jax.ShapeDtypeStruct(log_decay.shape, dtypes[3]))
    args = (q, k, erase, log_decay, document, carried, inverse, starts, d_ends, d_out, d_true_pseudo, true_pseudo,
            d_readout, d_strict)
    call = functools.partial(pl.pallas_call, out_shape=out_shape, grid=(b, h, n * nkb), out_specs=(token,) * 4,
                             interpret=cfg.interpret, compiler_params=_params(cfg, cfg.warps_key_grads))
    body = _key_grads_body(cfg)
    cost = _cost(cfg, "B2b_key_grads", b * h, n)
    if flags is None:
        return call(_passes(body, len(args), 4, "single"), in_specs=in_specs, cost_estimate=cost,
                    name="delta_rule_key_grads")(*args)
    flag_spec = pl.BlockSpec((None, None, None), lambda b_, h_, j: (b_, h_, j // nkb))
    whole = call(_passes(body, len(args), 4, "whole"), in_specs=in_specs, cost_estimate=cost,
                 name="delta_rule_key_grads")(*args)
    return call(_passes(body, len(args), 4, "second"), in_specs=[*in_specs, flag_spec, *(token,) * 4],
                input_output_aliases={len(args) + 1 + i: i for i in range(4)},
                cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=4 * b * h * n * nkb),
                name="delta_rule_key_grads_search")(*args, flags, *whole)


def _grads(cfg, q, k, erase, log_decay, document, carried, inverse, pseudo_values, state_reads, starts, d_ends, d_out,
           d_true_pseudo, dtypes, flags=None):
    """B2: dq̂, dk, dk̂, dV̂, dλ (B2a per chunk, then B2b per chunk and key block)."""
    true_pseudo, d_readout, d_strict, dv = _cotangents(cfg, document, carried, inverse, pseudo_values, state_reads,
                                                       starts, d_out, d_true_pseudo, dtypes[3])
    dq, dk, d_erase, d_log_decay = _key_grads(cfg, q, k, erase, log_decay, document, carried, inverse, starts, d_ends,
                                              d_out, d_true_pseudo, true_pseudo, d_readout, d_strict,
                                              (dtypes[0], dtypes[1], dtypes[2], dtypes[4]), flags)
    return dq, dk, d_erase, dv, d_log_decay


# ---------------------------------------------------------------------------------------------------------
# custom VJP (padded inputs, documents and the carried-in document per chunk)


def _forward(cfg, q, k, erase, v, log_decay, state, document, carried, for_backward=False):
    """o, S_T, and what the backward keeps: S₀, plus M and P when ``cfg.save_matrices``, plus U, Y, Q̂⊙π, K⊙E,
    π_C when ``cfg.save_rhs`` as well, plus K1's flags (``two_pass``: B2b takes the whole chunk's cut where K1
    did)."""
    keep = for_backward and cfg.save_matrices
    if cfg.fuse_output and cfg.fold_solve and not for_backward:  # P folded into M P and Pᵀ(K⊙E); V̂ read by the scan
        readout_p, key_start, query_start, key_eff_p, chunk_decay = _intra_alone(cfg, q, k, erase, log_decay,
                                                                                  document, carried)
        out, final = _scan_output(cfg, key_start, v, key_eff_p, chunk_decay, query_start, readout_p, state,
                                  v.dtype)
        return out, final, None
    (readout, pseudo_values, state_reads, query_start, key_eff, chunk_decay, *inverse), flags = _intra(
        cfg, q, k, erase, v, log_decay, document, carried, with_inverse=keep, with_flags=True)
    if cfg.fuse_output and not for_backward:  # S₀ is not needed: one sequential kernel writes the output
        out, final = _scan_output(cfg, state_reads, pseudo_values, key_eff, chunk_decay, query_start, readout, state,
                                  v.dtype)
        return out, final, None
    starts, true_pseudo, final = _scan(cfg, state_reads, pseudo_values, key_eff, chunk_decay, state)
    out = _output(cfg, query_start, starts, readout, true_pseudo, v.dtype)
    if not keep:
        return out, final, (starts, None, None, None, None)
    rhs = (pseudo_values, state_reads, query_start, key_eff, chunk_decay) if cfg.save_rhs else None
    return out, final, (starts, readout, inverse[0], rhs, flags if cfg.two_pass_key_grads else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _delta_rule(cfg, q, k, erase, v, log_decay, state, document, carried):
    out, final, _ = _forward(cfg, q, k, erase, v, log_decay, state, document, carried)
    return out, final


def _delta_rule_fwd(cfg, q, k, erase, v, log_decay, state, document, carried):
    out, final, saved = _forward(cfg, q, k, erase, v, log_decay, state, document, carried, for_backward=True)
    out, final, saved = common.keep_for_backward((out, final, saved))
    return (out, final), (q, k, erase, v, log_decay, state, document, carried, *saved)


def _delta_rule_bwd(cfg, residuals, cotangents):
    q, k, erase, v, log_decay, state, document, carried, starts, readout, inverse, rhs, flags = residuals
    d_out, d_final = cotangents
    if rhs is not None:  # save_rhs: the forward's own U, Y, Q̂⊙π, K⊙E, π_C
        pseudo_values, state_reads, query_start, key_eff, chunk_decay = rhs
    elif inverse is None:  # recompute the chunk matrices (save_matrices=False: less memory, one more K1)
        (readout, pseudo_values, state_reads, query_start, key_eff, chunk_decay, inverse), flags = _intra(
            cfg, q, k, erase, v, log_decay, document, carried, with_inverse=True, with_flags=True)
        flags = flags if cfg.two_pass_key_grads else None
    else:
        pseudo_values, state_reads, query_start, key_eff, chunk_decay = _rhs(cfg, q, k, erase, v, log_decay, document,
                                                                             carried, inverse)
    d_ends, d_true_pseudo, d_state = _scan_bwd(cfg, readout, d_out.astype(v.dtype), key_eff, query_start, state_reads,
                                               chunk_decay, d_final.astype(F32))
    dq, dk, d_erase, dv, d_log_decay = _grads(cfg, q, k, erase, log_decay, document, carried, inverse, pseudo_values,
                                              state_reads, starts, d_ends, d_out.astype(v.dtype), d_true_pseudo,
                                              (q.dtype, k.dtype, erase.dtype, v.dtype, log_decay.dtype), flags)
    return dq, dk, d_erase, dv, d_log_decay, d_state.astype(state.dtype), None, None


_delta_rule.defvjp(_delta_rule_fwd, _delta_rule_bwd)


# ---------------------------------------------------------------------------------------------------------
# public entry (the op's impl.run contract)


def run(q, k, erase, v, log_decay, state, document_BT, *, chunk_size, leaf_size, interpret=False, **overrides):
    """q, k, erase [B, T, H, Dk]; v [B, T, H, Dv] (one float dtype: bf16 runs bf16 matmul operands);
    log_decay [B, T, H, Dk] log-decay ≤ 0 (f32 recommended); state [B, H, Dk, Dv]; document_BT [B, T] int32.
    Returns (o [B, T, H, Dv] in v's dtype, final_state [B, H, Dk, Dv] f32). Differentiable (custom VJP).
    ``overrides``: :class:`Config` fields (scan_block_v, inverse_precision, warps_*, ...)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    cfg = make_config(chunk_size, leaf_size, dk, dv, v.dtype, batch_heads=b * h, interpret=interpret, **overrides)
    padded = [common.pad_time(x, chunk_size) for x in (q, k, erase, v, log_decay)]
    document = common.pad_time(document_BT.astype(jnp.int32), chunk_size, mode="edge")
    _, carried = common.chunk_documents(document, chunk_size)
    out, final = _delta_rule(cfg, *padded[:5], state.astype(F32), document, carried)
    return out[:, :t], final
