"""Muir's boundary-pivoted chunkwise delta rule as a Pallas (Mosaic TPU) kernel: forward here, backward in
``pallas_tpu_bwd.py``, wired through ``jax.custom_vjp`` (docs/math/delta_rule.md: 'Boundary pivots', 'Recursive block
inverse', 'Backward pass';
docs/kernels.md, TPU section).

One module (about 650 lines) on purpose: the in-kernel building blocks, the forward kernel, its cost model and
the custom VJP are one Mosaic program whose blocks ``pallas_tpu_bwd.py`` (the backward, already apart) imports
from here; the sections below keep them apart.

Contract (what ``api.delta_rule`` calls, see ``api.py``)::

    run(q, k, erase, v, log_decay, state, document_BT, *, chunk_size, leaf_size, interpret=False)
        -> (o [B, T, H, Dv] in v's dtype, final_state [B, H, Dk, Dv] float32)
    supports(call: api.DeltaRuleCall) -> None | reason

q, k, erase [B, T, H, Dk] and v [B, T, H, Dv] share one dtype; bfloat16 operands are fed to the MXU as
bfloat16 (f32 accumulation), float32 operands at Precision.HIGHEST. log_decay is the channel-wise log-decay λ ≤ 0,
state the initial state, document_BT the running count of segment boundaries (the state resets wherever it
changes; the initial state belongs to each row's first document).

Layout: inputs are moved to [B·H, T, D] and padded to a multiple of C (zeros, λ = 0, last document id), so a
grid step sees (C, D) blocks. Grid (B·H "parallel", N_c "arbitrary"); the state S lives in a VMEM f32
scratch across the chunk axis; S₀ of every chunk is written out ([B·H, N_c, Dk, Dv] f32), the only residual of
the backward. Per chunk (every exponent is a range sum Σ_{a<s≤b} λ_s ≤ 0, never a difference of two prefix
sums (docs/math/delta_rule.md, 'Boundary pivots') — and is clamped ≤ 0 before its exp; see docs/kernels.md):

  1. Decay sums: leaf-local running sums pre_i = Σ_{leaf start≤s≤i} λ_s, suf_i = Σ_{i<s≤leaf end} λ_s (VPU
     rolls + adds); leaf totals and "whole leaves before / after" sums on the MXU as 0/1 matmuls at f32
     HIGHEST (the MXU cumulative log-decay, at leaf granularity: cumsum does not lower in Mosaic);
     Λ_i = pre_i + Σ_{leaves before}, π = e^Λ, E_i = e^{suf_i + Σ_{leaves after}}.
  2. Leaves (n0 × n0, exact): for every diagonal offset d < n0 the exponent Σ_{i−d<s≤i} λ_s (a running sum
     of rolled λ; masked rows set to 0 BEFORE the exp), a_d = Σ_c k̂_ic k_{i−d,c} e^{…},
     m_d = Σ_c q̂_ic k_{i−d,c} e^{…} (VPU/XLU, lane reductions), placed on the d-th subdiagonal of the
     [C/n0, n0, n0] leaf blocks; P's leaves by the Neumann product (I − N)(I + N²)(I + N⁴)…, batched.
  3. Tree levels h = n0 … C/2, every block at its exact size: pivot p = last token of each node's left
     half, ρ_i = e^{Σ_{p<s≤i} λ_s} on right halves and κ_j = e^{Σ_{j<s≤p} λ_s} on left halves (both ≤ 1; range
     sums = whole leaves of the half + pre/suf), zero off the pivot's document; per node
     [K̂_R⊙ρ; Q̂_R⊙ρ](K_L⊙κ)ᵀ = [A[R,L]; M[R,L]], one batched matmul over the level's C/(2h) nodes.
  4. 2×2 merges P[R,L] = −P[R,R] A[R,L] P[L,L], batched per level, the diagonal blocks read back from the
     (C, C) VMEM scratch where P and M are assembled block by block.
  5. [U Y] = P [V̂ ‖ K̂⊙π] (one C × (Dv+Dk) matmul), Ũ = U − Y S₀, O = (Q̂⊙π) S₀ + M Ũ,
     S_C = Diag(π_C) S₀ + (K⊙E)ᵀ Ũ.
Segments: A, M keep same-document pairs; the S₀ terms (Q̂⊙π, K̂⊙π) only rows of the chunk-start document;
E only rows of the chunk's last document; Diag(π_C) S₀ only when the chunk holds no boundary.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mixerlab.pallas_kernels import common

F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST
SUPPORTED_CHUNKS = (64, 128, 256)
SUPPORTED_DIMS = (64, 128, 256)
# Raised scoped-VMEM limit (bytes). The default scoped limit is 16 MiB on v5e/v5p and 32 MiB on v6e; the
# backward at C=256, d=256 needs more (docs/benchmarks/tpu_compile.md has the measured numbers).
VMEM_LIMIT_BYTES = 32 * 1024 * 1024

_SQ = pl.Squeezed() if hasattr(pl, "Squeezed") else None
_CompilerParams = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")


# ---------------------------------------------------------------------------------------------------------
# static geometry


@dataclasses.dataclass(frozen=True)
class Geometry:
    chunk: int
    leaf: int
    dk: int
    dv: int

    @property
    def levels(self) -> tuple[int, ...]:
        """Half-sizes h = n0, 2n0, …, C/2 of the tree levels; level h has C/(2h) nodes of 2h tokens."""
        out, h = [], self.leaf
        while h < self.chunk:
            out.append(h)
            h *= 2
        return tuple(out)

    @property
    def n_leaves(self) -> int:
        return self.chunk // self.leaf


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    geometry: Geometry
    heads: int
    operand_dtype: str  # "bfloat16" | "float32"
    interpret: Any = False  # False | True | pltpu.InterpretParams(...)
    vmem_limit_bytes: Optional[int] = VMEM_LIMIT_BYTES
    has_erase: bool = True  # False: the no-erase kernels (no k̂ input, no A, no P scratch, no solve)

    @property
    def cdt(self):
        return jnp.dtype(self.operand_dtype)


# ---------------------------------------------------------------------------------------------------------
# in-kernel building blocks (values, not refs)


def _precision(dtype):
    return _HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _dot(a, b, dims, cdt):
    return jax.lax.dot_general(a.astype(cdt), b.astype(cdt), dims, precision=_precision(cdt),
                               preferred_element_type=F32)


def mm(a, b, cdt):
    """a @ b with operands in ``cdt`` and f32 accumulation."""
    return _dot(a, b, (((1,), (0,)), ((), ())), cdt)


def mm_nt(a, b, cdt):
    """a @ bᵀ."""
    return _dot(a, b, (((1,), (1,)), ((), ())), cdt)


def mm_tn(a, b, cdt):
    """aᵀ @ b."""
    return _dot(a, b, (((0,), (0,)), ((), ())), cdt)


def bmm(a, b, cdt):
    """Per node: a[n] @ b[n] ([n, i, k] x [n, k, j] -> [n, i, j]); the tree's exact-size block products."""
    return _dot(a, b, (((2,), (1,)), ((0,), (0,))), cdt)


def bmm_nt(a, b, cdt):
    """Per node: a[n] @ b[n]ᵀ."""
    return _dot(a, b, (((2,), (2,)), ((0,), (0,))), cdt)


def bmm_tn(a, b, cdt):
    """Per node: a[n]ᵀ @ b[n]."""
    return _dot(a, b, (((1,), (1,)), ((0,), (0,))), cdt)


def mm_f32(a, b):
    """Exact-as-f32 matmul (Precision.HIGHEST): the cumulative sums and tiny bookkeeping products."""
    return mm(a, b, F32)


def iota2(shape):
    return (jax.lax.broadcasted_iota(jnp.int32, shape, 0), jax.lax.broadcasted_iota(jnp.int32, shape, 1))


def upper_ones(n):
    i, j = iota2((n, n))
    return (j >= i).astype(F32)


def neg_exp(x):
    """e^{min(x, 0)}: every exponent in this kernel is ≤ 0 in exact arithmetic; the clamp only removes the
    rounding of an f32 sum of non-positive terms, so nothing can overflow."""
    return jnp.exp(jnp.minimum(x, 0.0))


def concat_cols(parts):
    """Lane-axis concatenation when every part is 128-lane aligned; None otherwise (caller splits)."""
    if all(p.shape[1] % 128 == 0 for p in parts):
        return jnp.concatenate(parts, axis=1)
    return None


def fused_mm(lhs, rhs_parts, cdt, transpose_lhs=False):
    """lhs @ [R1 ‖ R2 ‖ …] as ONE matmul when the parts are lane-aligned, else one per part."""
    op = mm_tn if transpose_lhs else mm
    fused = concat_cols(rhs_parts)
    if fused is not None:
        out = op(lhs, fused, cdt)
        outs, start = [], 0
        for p in rhs_parts:
            outs.append(out[:, start:start + p.shape[1]])
            start += p.shape[1]
        return outs
    return [op(lhs, p, cdt) for p in rhs_parts]


def leaf_diagonals(log_decay_t, key_t, leaf):
    """The leaf decay tensor one diagonal at a time, exact: yields (d, w_d, e_d) for d = 0 … n0−1 where, on
    rows i with i mod n0 ≥ d, e_d = e^{Σ_{i−d<s≤i} λ_s} and w_d = k_{i−d} ⊙ e_d (d = 0: w = k, e = None).
    The exponent is a running sum of rolled λ (a range sum of non-positive terms, never a difference of
    prefix sums, so it does not cancel); rows with i mod n0 < d are set to 0 BEFORE the exp and masked by
    the caller. ``log_decay_t`` is the raw per-token λ of the rows."""
    rows = log_decay_t.shape[0]
    r = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    yield 0, key_t, None
    expo = log_decay_t
    for d in range(1, leaf):
        if d > 1:
            expo = expo + pltpu.roll(log_decay_t, d - 1, 0)
        e = neg_exp(jnp.where((r & (leaf - 1)) >= d, expo, 0.0))  # mask BEFORE the exp
        yield d, pltpu.roll(key_t, d, 0) * e, e


def leaf_iota(g: Geometry):
    """(row, column) int32 iotas [C/n0, n0, n0] of the per-leaf blocks."""
    shape = (g.n_leaves, g.leaf, g.leaf)
    return jax.lax.broadcasted_iota(jnp.int32, shape, 1), jax.lax.broadcasted_iota(jnp.int32, shape, 2)


def same_document_offset(doc_col, d):
    """Bool [C, 1]: token i and token i − d are in the same document (rows i mod n0 < d are the caller's)."""
    docf = doc_col.astype(F32)
    return docf == pltpu.roll(docf, d, 0)


def leaf_blocks(qf, kf, ef, log_decay, doc_col, g: Geometry):
    """The leaves of A (strictly lower) and M (lower) as per-leaf blocks [C/n0, n0, n0] f32, same-document
    pairs only: per diagonal offset d the exact pairwise exponents and lane reductions (VPU/XLU), placed on
    the d-th sub-diagonal of every leaf block. ``ef`` None (no erase): A is None."""
    ii, jj = leaf_iota(g)
    shape = (g.n_leaves, g.leaf, 1)
    a = None if ef is None else jnp.zeros(ii.shape, F32)
    m = jnp.zeros(ii.shape, F32)
    for d, w, _ in leaf_diagonals(log_decay, kf, g.leaf):
        place = jj == ii - d
        m_d = jnp.sum(qf * w, axis=1, keepdims=True)
        if d:
            same = same_document_offset(doc_col, d)
            m_d = jnp.where(same, m_d, 0.0)
            if ef is not None:
                a_d = jnp.where(same, jnp.sum(ef * w, axis=1, keepdims=True), 0.0)
                a = a + jnp.where(place, a_d.reshape(shape), 0.0)
        m = m + jnp.where(place, m_d.reshape(shape), 0.0)
    return a, m


def leaf_inverse(a_leaves, g: Geometry, cdt):
    """(I + N)⁻¹ of every leaf at its exact n0 × n0 size: the Neumann product (I − N)(I + N²)(I + N⁴)…
    (N is strictly lower, so N^{n0} = 0), batched over the C/n0 leaves."""
    ii, jj = leaf_iota(g)
    eye = (ii == jj).astype(F32)
    inv = eye - a_leaves
    power = a_leaves
    for _ in range(max(int(math.log2(g.leaf)) - 1, 0)):
        power = bmm(power, power, cdt)
        inv = bmm(inv, eye + power, cdt)
    return inv


def leaf_range_sums(log_decay, leaf):
    """(pre, suf) [C, Dk]: pre_i = Σ_{leaf start ≤ s ≤ i} λ_s and suf_i = Σ_{i < s ≤ leaf end} λ_s, as running
    sums of rolled λ (range sums of non-positive terms: no cancellation, VPU/XLU)."""
    rows = log_decay.shape[0]
    pos = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) & (leaf - 1)
    pre, run = log_decay, log_decay
    for d in range(1, leaf):
        run = run + pltpu.roll(log_decay, d, 0)  # Σ_{i−d ≤ s ≤ i}
        pre = jnp.where(pos == d, run, pre)
    suf, run = jnp.zeros_like(log_decay), jnp.zeros_like(log_decay)
    for d in range(1, leaf):
        run = run + pltpu.roll(log_decay, rows - d, 0)  # Σ_{i < s ≤ i+d}
        suf = jnp.where(pos == leaf - 1 - d, run, suf)
    return pre, suf


def leaf_matrix(rows, leaf, rule):
    """0/1 f32 [rows, rows/n0] from (token i, leaf l) index arrays: ``rule(i, l, leaf_of_i, start_of_l)``."""
    i, l = iota2((rows, rows // leaf))
    shift = int(math.log2(leaf))
    return jnp.where(rule(i, l, i >> shift, l << shift), 1.0, 0.0).astype(F32)


def level_exponent(pre, suf, totals, h, leaf):
    """Exponent [C, Dk] of tree level h (pivot p = last token of each node's left half), as range sums:
    right half  i: Σ_{p < s ≤ i} λ_s = (whole leaves of the right half before i's leaf) + pre_i,
    left half   j: Σ_{j < s ≤ p} λ_s = (whole leaves of the left half after j's leaf) + suf_j.
    The whole-leaf part is a 0/1 matmul over the leaf totals on the MXU (f32 HIGHEST)."""
    rows = pre.shape[0]
    node = int(math.log2(2 * h))

    def rule(i, l, li, ls):
        same_node = (i >> node) == (ls >> node)
        ri, rl = (i & h) != 0, (ls & h) != 0
        return same_node & ((ri & rl & (l < li)) | (~ri & ~rl & (l > li)))

    r = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    return mm_f32(leaf_matrix(rows, leaf, rule), totals) + jnp.where((r & h) != 0, pre, suf)


def by_node(x, h):
    """[C, D] -> [C/(2h), 2h, D]: the rows of every level-h node (left half [:, :h], right half [:, h:])."""
    return x.reshape(x.shape[0] // (2 * h), 2 * h, x.shape[1])


def node_factors(factor, doc_col, h):
    """The pivot factor of level h per node [C/(2h), 2h, Dk] (ρ on right halves, κ on left halves), zero on
    tokens outside the pivot's document. Documents are non-decreasing along the chunk, so for j ≤ p < i
    doc_i = doc_j ⇔ doc_i = doc_p = doc_j: the same-document mask of a cross block factors into a row
    mask and a column mask, folded into the operands (no [h, h] masks)."""
    docs = by_node(doc_col, h)
    return jnp.where(docs == docs[:, h - 1:h, :], by_node(factor, h), 0.0)


class Level(NamedTuple):
    half: int  # h
    factors: Any  # [C/(2h), 2h, Dk]: ρ (right halves) and κ (left halves), document-masked


def cross_operands(qf, kf, ef, lv: Level):
    """Per node: [K̂_R⊙ρ; Q̂_R⊙ρ] [n, 2h, Dk] (Q̂_R⊙ρ [n, h, Dk] when ``ef`` is None: no erase) and
    K_L⊙κ [n, h, Dk]."""
    h, f = lv.half, lv.factors
    rho = f[:, h:]
    if ef is None:
        return by_node(qf, h)[:, h:] * rho, by_node(kf, h)[:, :h] * f[:, :h]
    rows = jnp.concatenate([by_node(ef, h)[:, h:] * rho, by_node(qf, h)[:, h:] * rho], axis=1)
    return rows, by_node(kf, h)[:, :h] * f[:, :h]


def node_slices(g: Geometry, h):
    """Static (R, L) row/column slices of every level-h node."""
    return [(slice(a0 + h, a0 + 2 * h), slice(a0, a0 + h)) for a0 in range(0, g.chunk, 2 * h)]


def diagonal_blocks(mat, g: Geometry, h):
    """(P[R,R], P[L,L]) of every level-h node as [n, h, h] stacks, read from a (C, C) ref or value."""
    nodes = node_slices(g, h)
    return (jnp.stack([mat[r, r] for r, _ in nodes]), jnp.stack([mat[lo, lo] for _, lo in nodes]))


def cross_blocks(mat, g: Geometry, h):
    """[n, h, h] stack of the (R, L) blocks of every level-h node of a (C, C) ref or value."""
    return jnp.stack([mat[r, lo] for r, lo in node_slices(g, h)])


def leaf_slices(g: Geometry):
    return [slice(s, s + g.leaf) for s in range(0, g.chunk, g.leaf)]


class Chunk(NamedTuple):
    qf: Any
    kf: Any
    ef: Any
    log_decay: Any  # λ
    cum_log_decay: Any  # Λ
    levels: list  # Level per tree level h = n0 … C/2
    start_decay: Any  # π on the chunk-start document's rows, else 0
    end_decay: Any  # E on the chunk's last document's rows, else 0
    chunk_decay_row: Any  # [1, Dk] π_C, 0 if the chunk holds a boundary
    chunk_decay_col: Any  # [Dk, 1] the same as a column
    pseudo_values: Any  # U = P V̂ (V̂ without an erase)
    state_reads: Any  # Y = P (K̂⊙π) (None without an erase)
    true_pseudo: Any  # Ũ = U − Y S₀ (V̂ without an erase)


def chunk_core(q, k, e, v, log_decay, doc_col, doc_row, start_state, inverse_scr, readout_scr, g: Geometry,
               cdt) -> Chunk:
    """Steps 1–5 up to Ũ for one chunk; P and M are left in the (C, C) scratch refs. ``e`` None (no erase):
    steps 2–4 build M alone and step 5 is skipped (P = I: U = Ũ = V̂, Y = 0); ``inverse_scr`` is then None."""
    c = g.chunk
    qf, kf, ef = q.astype(F32), k.astype(F32), None if e is None else e.astype(F32)
    # chunk-local decays as range sums: exact leaf-local running sums (VPU) + leaf totals combined on the MXU
    pre, suf = leaf_range_sums(log_decay, g.leaf)
    li, si = iota2((c // g.leaf, c))
    totals = mm_f32(jnp.where((si >> int(math.log2(g.leaf))) == li, 1.0, 0.0), log_decay)  # leaf totals [C/n0, Dk]
    before_after = jnp.concatenate([leaf_matrix(c, g.leaf, lambda i, l, li, ls: l < li),
                                    leaf_matrix(c, g.leaf, lambda i, l, li, ls: l > li)], axis=0)
    outer = mm_f32(before_after, totals)
    cum_log_decay = pre + outer[:c]  # Λ_i = Σ_{s ≤ i} λ_s
    to_end = suf + outer[c:]  # Σ_{s > i} λ_s
    levels = [Level(h, node_factors(neg_exp(level_exponent(pre, suf, totals, h, g.leaf)), doc_col, h))
              for h in g.levels]
    last = doc_row[:, c - 1:c]  # [1, 1] relative document of the last token (0 = the chunk-start document)
    start = doc_col == 0
    end = doc_col == last
    no_boundary = last == 0
    start_decay = jnp.where(start, neg_exp(cum_log_decay), 0.0)
    end_decay = jnp.where(end, neg_exp(to_end), 0.0)
    chunk_decay_row = jnp.where(no_boundary, neg_exp(cum_log_decay[c - 1:c, :]), 0.0)
    chunk_decay_col = jnp.where(no_boundary, neg_exp(jnp.transpose(cum_log_decay[c - 8:c, :]))[:, 7:8], 0.0)

    if ef is None:  # no erase: M alone, no inverse, no solve
        readout_scr[...] = jnp.zeros((c, c), F32)
        _, m_leaves = leaf_blocks(qf, kf, None, log_decay, doc_col, g)
        for n, s in enumerate(leaf_slices(g)):
            readout_scr[s, s] = m_leaves[n]
        for lv in levels:
            blk = bmm_nt(*cross_operands(qf, kf, None, lv), cdt)  # [n, h, h]: M[R,L] of every node
            for n, (r, lo) in enumerate(node_slices(g, lv.half)):
                readout_scr[r, lo] = blk[n]
        return Chunk(qf, kf, None, log_decay, cum_log_decay, levels, start_decay, end_decay, chunk_decay_row,
                     chunk_decay_col, v, None, v)

    # P = (I + A)⁻¹ and M, every block at its exact size: leaves, then one batch of node blocks per level
    inverse_scr[...] = jnp.zeros((c, c), F32)
    readout_scr[...] = jnp.zeros((c, c), F32)
    a_leaves, m_leaves = leaf_blocks(qf, kf, ef, log_decay, doc_col, g)
    p_leaves = leaf_inverse(a_leaves, g, cdt)
    for n, s in enumerate(leaf_slices(g)):
        inverse_scr[s, s] = p_leaves[n]
        readout_scr[s, s] = m_leaves[n]
    for lv in levels:  # h = n0 … C/2: P[R,R] and P[L,L] are complete from the level below
        h = lv.half
        rows, cols = cross_operands(qf, kf, ef, lv)
        blk = bmm_nt(rows, cols, cdt)  # [n, 2h, h]: A[R,L] over M[R,L] of every node
        p_rr, p_ll = diagonal_blocks(inverse_scr, g, h)
        p_rl = -bmm(bmm(p_rr, blk[:, :h], cdt), p_ll, cdt)  # P[R,L] = −P[R,R] A[R,L] P[L,L]
        for n, (r, lo) in enumerate(node_slices(g, h)):
            inverse_scr[r, lo] = p_rl[n]
            readout_scr[r, lo] = blk[n, h:]

    pseudo_values, state_reads = fused_mm(inverse_scr[...], [v, ef * start_decay], cdt)  # [U Y] = P [V̂ ‖ K̂⊙π]
    true_pseudo = pseudo_values - mm(state_reads, start_state, cdt)
    return Chunk(qf, kf, ef, log_decay, cum_log_decay, levels, start_decay, end_decay, chunk_decay_row,
                 chunk_decay_col, pseudo_values, state_reads, true_pseudo)


# ---------------------------------------------------------------------------------------------------------
# forward kernel


def _forward_kernel(*refs, cfg: KernelConfig):
    if cfg.has_erase:
        (q_ref, k_ref, e_ref, v_ref, log_decay_ref, doc_col_ref, doc_row_ref, s_init_ref,
         o_ref, starts_ref, s_final_ref, s_scr, inverse_scr, readout_scr) = refs
    else:  # no k̂ input, no P scratch
        (q_ref, k_ref, v_ref, log_decay_ref, doc_col_ref, doc_row_ref, s_init_ref,
         o_ref, starts_ref, s_final_ref, s_scr, readout_scr) = refs
        e_ref = inverse_scr = None
    g, cdt = cfg.geometry, cfg.cdt
    c = pl.program_id(1)

    @pl.when(c == 0)
    def _():
        s_scr[...] = s_init_ref[...]

    start_state = s_scr[...]
    starts_ref[...] = start_state
    ch = chunk_core(q_ref[...], k_ref[...], None if e_ref is None else e_ref[...], v_ref[...], log_decay_ref[...],
                    doc_col_ref[...], doc_row_ref[...], start_state, inverse_scr, readout_scr, g, cdt)
    out = mm(ch.qf * ch.start_decay, start_state, cdt) + mm(readout_scr[...], ch.true_pseudo, cdt)
    o_ref[...] = out.astype(o_ref.dtype)
    s_new = ch.chunk_decay_col * start_state + mm_tn(ch.kf * ch.end_decay, ch.true_pseudo, cdt)
    s_scr[...] = s_new

    @pl.when(c == pl.num_programs(1) - 1)
    def _():
        s_final_ref[...] = s_new


# ---------------------------------------------------------------------------------------------------------
# cost model (what the kernel actually issues; see docs/kernels.md for the comparison with Table 8)


def core_counts(g: Geometry, breakdown: bool = False, has_erase: bool = True):
    """(MXU FLOPs, VPU ops, exps) per chunk per head of steps 1–5 up to Ũ, as issued: every matmul at the
    shape the kernel gives it (tree blocks at their exact node sizes). ``breakdown=True`` returns
    {stage: (mxu, vpu, exp)} instead. VPU ops are leading terms (1 per element and elementwise op).
    ``has_erase=False``: the no-erase kernels (M's leaves and node blocks only; no inverse, merges or solve)."""
    c, n0, dk, dv = g.chunk, g.leaf, g.dk, g.dv
    n_lv = len(g.levels)
    n_sq = max(int(math.log2(n0)) - 1, 0)
    out = {
        # leaf-local running sums (roll, add, select; forward and reverse), leaf totals, Λ and Σ_{s>i}, π, E
        "decay sums Λ, π, E": (2 * (c // n0) * c * dk + 2 * (2 * c) * (c // n0) * dk,
                               2 * (n0 - 1) * 3 * c * dk + 4 * c * dk, 2 * c * dk + 8 * dk),  # π_C: a [Dk, 8] exp
        # per level: 0/1 [C, C/n0] matmul over the leaf totals + select, add, exp, document mask
        "pivot factors F_h (all levels)": (n_lv * 2 * c * (c // n0) * dk, n_lv * 4 * c * dk, n_lv * c * dk),
        # per offset: roll λ, add, select, exp, roll k, mul; 2 products + 2 lane reductions; 2 placements
        "leaves A, M (VPU, exact)": (0, c * n0 * (10 * dk + 4 * n0), c * (n0 - 1) * dk),
        # batched Neumann (I − N)(I + N²)…: 2 n0³-matmuls per squaring step and leaf
        "leaf inverse (Neumann, n0 × n0 blocks)": ((c // n0) * n_sq * 2 * 2 * n0 ** 3, 0, 0),
        # per node [2h, Dk] x [Dk, h] (+ 3 operand scalings, each on half the rows)
        "cross blocks (exact node blocks)": (sum((c // (2 * h)) * 2 * (2 * h) * h * dk for h in g.levels),
                                             n_lv * 3 * c * dk // 2, 0),
        # per node −P[R,R] A[R,L] P[L,L]: two h³ matmuls
        "2x2 merges (exact node blocks)": (sum((c // (2 * h)) * 2 * 2 * h ** 3 for h in g.levels), 0, 0),
        "fused solve P[V ‖ K̂⊙π]": (2 * c * c * (dv + dk), c * dk, 0),
        "Ũ = U − Y S₀": (2 * c * dk * dv, c * dv, 0),
    }
    if not has_erase:
        for stage in ("leaf inverse (Neumann, n0 × n0 blocks)", "2x2 merges (exact node blocks)",
                      "fused solve P[V ‖ K̂⊙π]", "Ũ = U − Y S₀"):
            del out[stage]
        # per offset: roll λ, add, select, exp, roll k, mul; 1 product + 1 lane reduction; 1 placement
        out["leaves M (VPU, exact)"] = (0, c * n0 * (8 * dk + 2 * n0), c * (n0 - 1) * dk)
        del out["leaves A, M (VPU, exact)"]
        # per node [h, Dk] x [Dk, h] (+ 2 operand scalings, each on half the rows)
        out["cross blocks (exact node blocks)"] = (sum((c // (2 * h)) * 2 * h * h * dk for h in g.levels),
                                                   n_lv * c * dk, 0)
    if breakdown:
        return out
    return tuple(sum(v[n] for v in out.values()) for n in range(3))


def forward_counts(g: Geometry, has_erase: bool = True):
    """(MXU FLOPs, exps) per chunk per head of the whole forward kernel."""
    flops, _, exps = core_counts(g, has_erase=has_erase)
    c, dk, dv = g.chunk, g.dk, g.dv
    flops += 2 * c * dk * dv + 2 * c * c * dv  # O
    flops += 2 * c * dk * dv  # S_C
    return flops, exps


def forward_cost(g: Geometry, bh: int, n_chunks: int, io_bytes: int, has_erase: bool = True) -> pl.CostEstimate:
    flops, exps = forward_counts(g, has_erase)
    c, dk, dv = g.chunk, g.dk, g.dv
    keys = 3 if has_erase else 2
    per_chunk_bytes = (io_bytes * c * (keys * dk + 2 * dv) + 4 * c * dk  # q, k, (k̂,) v, o; λ
                       + 4 * 2 * c + 4 * dk * dv)  # document ids (column and row); S₀ out
    total = bh * n_chunks
    return pl.CostEstimate(flops=int(total * flops), transcendentals=int(total * exps),
                           bytes_accessed=int(total * per_chunk_bytes + bh * 2 * 4 * dk * dv))


# ---------------------------------------------------------------------------------------------------------
# pallas_call builders


def _specs(cfg: KernelConfig, n_chunks: int, reverse: bool):
    """BlockSpecs of the per-chunk inputs. ``reverse`` maps grid step c to chunk N_c − 1 − c."""
    g, heads = cfg.geometry, cfg.heads
    c_, dk, dv = g.chunk, g.dk, g.dv
    ch = (lambda c: n_chunks - 1 - c) if reverse else (lambda c: c)
    seq = lambda d: pl.BlockSpec((_SQ, c_, d), lambda b, c: (b, ch(c), 0))  # noqa: E731
    doc_col = pl.BlockSpec((_SQ, c_, 1), lambda b, c: (jax.lax.div(b, heads), ch(c), 0))
    doc_row = pl.BlockSpec((_SQ, _SQ, 1, c_), lambda b, c: (jax.lax.div(b, heads), ch(c), 0, 0))
    state = pl.BlockSpec((_SQ, dk, dv), lambda b, c: (b, 0, 0))
    per_chunk_state = pl.BlockSpec((_SQ, _SQ, dk, dv), lambda b, c: (b, ch(c), 0, 0))
    return seq, doc_col, doc_row, state, per_chunk_state


def compiler_params(cfg: KernelConfig):
    kw = dict(dimension_semantics=("parallel", "arbitrary"))
    if cfg.vmem_limit_bytes:
        kw["vmem_limit_bytes"] = cfg.vmem_limit_bytes
    return _CompilerParams(**kw)


def scratch(g: Geometry, state_scratch: int = 1, has_erase: bool = True):
    """The state scratch(es), then P's (with an erase) and M's (C, C) f32 scratch."""
    return ([pltpu.VMEM((g.dk, g.dv), F32)] * state_scratch
            + [pltpu.VMEM((g.chunk, g.chunk), F32)] * (2 if has_erase else 1))


def forward_call(cfg: KernelConfig, q, k, e, v, log_decay, doc_col, doc_row, s_init):
    """[B·H, Tp, D] inputs -> (o [B·H, Tp, Dv], S₀ per chunk [B·H, N_c, Dk, Dv] f32, final [B·H, Dk, Dv] f32).
    ``e`` None with ``cfg.has_erase`` False."""
    g = cfg.geometry
    bh, tp, _ = q.shape
    n_chunks = tp // g.chunk
    seq, doc_col_spec, doc_row_spec, state, per_chunk_state = _specs(cfg, n_chunks, reverse=False)
    keys, key_specs = ((q, k, e), [seq(g.dk)] * 3) if cfg.has_erase else ((q, k), [seq(g.dk)] * 2)
    return pl.pallas_call(
        functools.partial(_forward_kernel, cfg=cfg),
        out_shape=(jax.ShapeDtypeStruct((bh, tp, g.dv), v.dtype),
                   jax.ShapeDtypeStruct((bh, n_chunks, g.dk, g.dv), F32),
                   jax.ShapeDtypeStruct((bh, g.dk, g.dv), F32)),
        grid=(bh, n_chunks),
        in_specs=[*key_specs, seq(g.dv), seq(g.dk), doc_col_spec, doc_row_spec, state],
        out_specs=(seq(g.dv), per_chunk_state, state),
        scratch_shapes=scratch(g, has_erase=cfg.has_erase),
        compiler_params=compiler_params(cfg),
        cost_estimate=forward_cost(g, bh, n_chunks, jnp.dtype(cfg.cdt).itemsize, cfg.has_erase),
        interpret=cfg.interpret,
        name="delta_rule_fwd" if cfg.has_erase else "delta_rule_fwd_no_erase",
    )(*keys, v, log_decay, doc_col, doc_row, s_init)


# ---------------------------------------------------------------------------------------------------------
# custom VJP


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def chunked(q, k, e, v, log_decay, s_init, doc_col, doc_row, cfg: KernelConfig):
    out, _, final = forward_call(cfg, q, k, e, v, log_decay, doc_col, doc_row, s_init)
    return out, final


def _chunked_fwd(q, k, e, v, log_decay, s_init, doc_col, doc_row, cfg):
    out, starts, final = forward_call(cfg, q, k, e, v, log_decay, doc_col, doc_row, s_init)
    out, starts, final = common.keep_for_backward((out, starts, final))
    return (out, final), (q, k, e, v, log_decay, doc_col, doc_row, starts)


def _chunked_bwd(cfg, residuals, cotangents):
    from mixerlab.pallas_kernels.delta_rule import pallas_tpu_bwd

    q, k, e, v, log_decay, doc_col, doc_row, starts = residuals
    d_out, d_final = cotangents
    dq, dk, de, dv, dlam, d_init = pallas_tpu_bwd.backward_call(cfg, q, k, e, v, log_decay, doc_col, doc_row, starts,
                                                                d_out.astype(v.dtype), d_final.astype(F32))
    return dq, dk, de, dv, dlam, d_init, None, None


chunked.defvjp(_chunked_fwd, _chunked_bwd)


# ---------------------------------------------------------------------------------------------------------
# public entry points


def _to_bh(x, tp):
    b, t, h, d = x.shape
    x = x.transpose(0, 2, 1, 3).reshape(b * h, t, d)
    return jnp.pad(x, ((0, 0), (0, tp - t), (0, 0))) if tp != t else x


def relative_documents(document_BT, chunk_size, tp):
    """Document index relative to each chunk's carried document (0 = the document the state entering the
    chunk belongs to), as a column [B, Tp, 1] and as rows [B, N_c, 1, C], int32. Padding stays in the last
    document."""
    b = document_BT.shape[0]
    chunks, carried = common.chunk_documents(common.pad_time(document_BT.astype(jnp.int32), chunk_size, mode="edge"),
                                             chunk_size)
    rel = chunks - carried[..., None]
    return rel.reshape(b, tp, 1), rel.reshape(b, tp // chunk_size, 1, chunk_size)


def operand_dtype(dtype) -> str:
    return "bfloat16" if jnp.dtype(dtype) == jnp.bfloat16 else "float32"


def run(q, k, erase, v, log_decay, state, document_BT, *, chunk_size, leaf_size, interpret=False,
        vmem_limit_bytes: Optional[int] = VMEM_LIMIT_BYTES):
    """The op's ``impl.run`` contract (see module docstring). Differentiable through ``jax.custom_vjp``
    (forward and backward are Pallas kernels; nothing is autodiffed through the kernels). ``erase`` None: no
    erase, the kernels specialised to it (``KernelConfig.has_erase=False``: no A, inverse or solve)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    cdt = operand_dtype(q.dtype)
    reason = check_config(chunk_size, leaf_size, dk, dv)
    if reason:
        raise ValueError(f"delta_rule pallas_tpu: {reason}")
    tp = -(-t // chunk_size) * chunk_size
    cfg = KernelConfig(Geometry(chunk_size, leaf_size, dk, dv), h, cdt, interpret, vmem_limit_bytes,
                       has_erase=erase is not None)
    ops = [None if x is None else _to_bh(x.astype(cdt), tp) for x in (q, k, erase, v)]
    log_decay_bh = _to_bh(log_decay.astype(F32), tp)
    doc_col, doc_row = relative_documents(document_BT, chunk_size, tp)
    s_init = state.astype(F32).reshape(b * h, dk, dv)
    out, final = chunked(*ops, log_decay_bh, s_init, doc_col, doc_row, cfg)
    out = out[:, :t].reshape(b, h, t, dv).transpose(0, 2, 1, 3).astype(v.dtype)
    return out, final.reshape(b, h, dk, dv)


def check_config(chunk_size, leaf_size, dk, dv) -> Optional[str]:
    if chunk_size not in SUPPORTED_CHUNKS:
        return f"chunk_size={chunk_size} not in {SUPPORTED_CHUNKS}"
    # leaves are n0 VPU passes of exact exponents: past 32 tokens the MXU tree levels are cheaper
    if leaf_size < 4 or leaf_size & (leaf_size - 1) or leaf_size > min(chunk_size // 2, 32):
        return (f"leaf_size={leaf_size}: the TPU kernel needs a power of two in [4, {min(chunk_size // 2, 32)}] "
                f"(default 8)")
    if dk not in SUPPORTED_DIMS or dv not in SUPPORTED_DIMS:
        return f"key/value dims ({dk}, {dv}) not in {SUPPORTED_DIMS}"
    return None


def supports(call) -> Optional[str]:
    """None if the Pallas TPU kernel serves ``call`` (an api.DeltaRuleCall), else the reason."""
    if call.backend != "tpu":
        return f"needs a TPU backend (got {call.backend!r}); on CPU use pallas_tpu.run(..., interpret=True)"
    if jnp.dtype(call.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"dtype {jnp.dtype(call.dtype).name} (TPU kernel: bfloat16 or float32)"
    return check_config(call.chunk_size, call.leaf_size, call.key_dim, call.value_dim)


# ---------------------------------------------------------------------------------------------------------
# CPU helper: the op's normalisation, then the kernel in interpret mode


def delta_rule_interpret(q, k, v, *, erase_key=None, log_decay=None, initial_state=None, segment_ids=None,
                         chunk_size=64, leaf_size=8, interpret=True):
    """``api.delta_rule`` semantics on the Pallas TPU kernel in interpret mode (runs on CPU). Unlike the op,
    bfloat16 q/k/v/erase_key stay bfloat16 (the kernel's bf16 MXU path); λ and the state go to float32."""
    b, t, h, dk = q.shape
    if log_decay is None:
        log_decay = jnp.zeros((b, t, h, dk), F32)
    elif log_decay.ndim == 3:
        log_decay = jnp.broadcast_to(log_decay.astype(F32)[..., None], (b, t, h, dk))
    else:
        log_decay = log_decay.astype(F32)
    state = (jnp.zeros((b, h, dk, v.shape[-1]), F32) if initial_state is None
             else initial_state.astype(F32))
    erase = None if erase_key is None else erase_key.astype(q.dtype)
    return run(q, k, erase, v, log_decay, state, common.document_index(segment_ids, b, t),
               chunk_size=chunk_size, leaf_size=leaf_size, interpret=interpret)
