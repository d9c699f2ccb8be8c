"""In-kernel helpers of the Pallas-Triton delta-rule kernels (``pallas_triton.py``), traced inside the kernel
bodies (only ops with Triton lowerings): matmuls, the pivot tree's decay sums and factors, the bounded-span
cut, the chunk's document masks, the chunk matrices A, M, π, E and the inverse P = (I + A)⁻¹
(docs/math/delta_rule.md, 'Boundary pivots'; docs/kernels_gpu.md, 'Factored pairs')."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mixerlab.pallas_kernels.triton_common import iota
from mixerlab.pallas_kernels.delta_rule.pallas_triton_config import F32


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
    way (K̂⊙π in the operand dtype: the rounding the matmul Y = P (K̂⊙π) applies to it). Without an erase
    (``erase_ref`` None, ``cfg.has_erase`` False) A is None and nothing of it is computed: no K̂ products, no K̂⊙π.

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
        q, k = q_ref[:, cols], k_ref[:, cols]  # operand dtype; products promote to f32
        e = erase_ref[:, cols] if cfg.has_erase else None
        start, end, chunk_decay = _edge_decays(log_decay, log_decay_split, masks, cfg)
        query_start_out[:, cols] = (q * start).astype(query_start_out.dtype)
        key_eff_out[:, cols] = (k * end).astype(key_eff_out.dtype)
        chunk_decay_out[cols] = chunk_decay
        if cfg.has_erase:
            key_start_out[:, cols] = (e * start).astype(key_start_out.dtype)

        def add_pair_products(a, m, left, kr, pairs=None):
            """(A, M) plus one pivot product each (A only with an erase), masked to ``pairs``; A first, in the
            order the delta kernel always issued them."""
            keep = (lambda x: x) if pairs is None else (lambda x: jnp.where(pairs, x, 0.0))
            if cfg.has_erase:
                a = a + keep(_dot(e * left, kr, cfg, trans_b=True))
            return a, m + keep(_dot(q * left, kr, cfg, trans_b=True))

        def level(l, acc):
            pairs, sums = _level(cfg, l)
            f = _decay(sums, log_decay_split, cfg)
            return add_pair_products(*acc, f, k * f, pairs)

        diag = diag + jnp.sum(q.astype(F32) * k.astype(F32), axis=1)
        if whole_chunk:  # pairs above the diagonal (e^{positive}, possibly inf) are dropped by the final select
            sums = _cut_sums(cfg.levels, log_decay_split, cfg)
            low = jnp.minimum(low, jnp.min(sums, axis=1))  # per row (within a warp); across rows after the loop
            _, left, right = _pivot_factors(cfg.levels, sums, log_decay_split, cfg)
            return (*add_pair_products(a, m, left, k * right), diag, low)
        cut = 0  # the exact tree for every pair
        if cfg.bounded_span is not None:
            cut, sums = _bounded_cut(log_decay_split, cfg, keep_sums=True)
            pairs, left, right = _pivot_factors(cut, sums, log_decay_split, cfg)
            a, m = add_pair_products(a, m, left, k * right, pairs)
        a, m = jax.lax.fori_loop(cut, cfg.levels, level, (a, m))
        return a, m, diag, low

    zeros = jnp.zeros((c, c), F32)
    # no erase: A's accumulator is a scalar zero that no matmul ever feeds
    a, m, diag, low = jax.lax.fori_loop(0, cfg.key_dim // cfg.block_k, key_block,
                                        (zeros if cfg.has_erase else jnp.zeros((), F32), zeros,
                                         jnp.zeros((c,), F32), jnp.zeros((c,), F32)))
    flag = (jnp.min(low) < -cfg.bounded_span).astype(jnp.int32) if whole_chunk else 0
    a = jnp.where(masks.strict & masks.same_doc, a, 0.0) if cfg.has_erase else None
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
