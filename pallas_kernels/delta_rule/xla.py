"""Boundary-pivoted chunkwise delta rule in pure JAX: the forward math of docs/math/delta_rule.md.

Layout inside this module: chunked arrays ``x_BHNCD`` (batch, head, chunk, position-in-chunk, channel);
``...`` in shapes below means (B, H, N). Documents arrive as ``document_B1NC`` (a running count of segment
boundaries, so two tokens share a document iff their counts are equal) and ``carry_document_B1N`` (the
document the state entering the chunk belongs to).

Every exponent is a sum of log-decays λ ≤ 0 over a contiguous token range ('Boundary pivots'): no
Λ_i − Λ_j differences are ever formed, so nothing cancels, nothing overflows and no gate is clamped.
  * leaves (n0×n0): the exact 3-D decay tensor exp Σ_{j<s≤i} λ_s per channel, walked one sub-diagonal
    d = i − j at a time (a window sum that grows by one λ per step), masked outside the leaf/document;
  * cross blocks of the binary tree: node [a, a+2h) splits into L = [a, a+h), R = [a+h, a+2h) with pivot
    p = a+h−1;  ρ_i = exp Σ_{p<s≤i} λ_s (i ∈ R),  κ_j = exp Σ_{j<s≤p} λ_s (j ∈ L),  both ≤ 1, and
    A[R, L] = (K̂_R⊙ρ)(K_L⊙κ)ᵀ,  M[R, L] = (Q̂_R⊙ρ)(K_L⊙κ)ᵀ;
  * chunk boundaries: π_i = exp Σ_{s≤i} λ_s,  E_j = exp Σ_{s>j} λ_s.

Segments inside a chunk (derived from the recurrence with S reset to 0 at a boundary):
  * A and M keep only same-document pairs (the reset kills every path that crosses a boundary);
  * the S₀ rows (Q̂⊙π, K̂⊙π) apply only to tokens in the carried-in document (``start`` mask);
  * the E rows apply only to tokens of the chunk's last document (``end`` mask);
  * Diag(π_C) S₀ survives only if the chunk holds no boundary.

The chunk is an affine map of its initial state ('The chunk as an affine map of its initial state'), computed for all
chunks in parallel:
  Y = P (K̂⊙π),  U = P V̂,  Q_eff = Q̂⊙π − M Y,  K_eff = K⊙E,
  S_C = F S₀ + G,  F = Diag(π_C) − K_effᵀ Y,  G = K_effᵀ U,  O = Q_eff S₀ + M U,
so the only sequential work is the scan S₀ ← F S₀ + G (a d_k×d_k by d_k×d_v product per chunk).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

# Full-precision matmuls: TPU/GPU would otherwise run f32 dots as bf16 passes / TF32.
_HIGHEST = jax.lax.Precision.HIGHEST


def matmul(a, b):
    return jnp.matmul(a, b, precision=_HIGHEST)


def einsum(spec, *operands):
    return jnp.einsum(spec, *operands, precision=_HIGHEST)


def transpose(x):
    return jnp.swapaxes(x, -1, -2)


# ---------------------------------------------------------------------------------------------------------
# segment sums of log-decay (sums of non-positive terms only)


def _range_sum(x, keep_ts, axis):
    """Σ_s keep[t, s] x_s along ``axis`` as a 0/1 matmul: XLA:CPU lowers cumsum to an associative scan
    that is slow to compile, and a triangular-ones matmul is the MXU form anyway."""
    moved = jnp.moveaxis(x, axis, -1)
    summed = einsum("...s,ts->...t", moved, keep_ts.astype(x.dtype))
    return jnp.moveaxis(summed, -1, axis)


def inclusive_cumsum(x, axis=-2):
    """Σ_{s ≤ i} x_s along ``axis``."""
    n = x.shape[axis]
    return _range_sum(x, jnp.tril(jnp.ones((n, n), dtype=bool)), axis)


def exclusive_reverse_cumsum(x, axis=-2):
    """Σ_{s > i} x_s along ``axis`` (a sum over the range, never a difference of prefix sums)."""
    n = x.shape[axis]
    return _range_sum(x, jnp.triu(jnp.ones((n, n), dtype=bool), 1), axis)


def reverse_inclusive_cumsum(x, axis=-2):
    """Σ_{s ≥ i} x_s along ``axis`` (used by the backward: dλ from dΛ)."""
    n = x.shape[axis]
    return _range_sum(x, jnp.triu(jnp.ones((n, n), dtype=bool)), axis)


def split_blocks(x, size):
    """[..., C, D] -> [..., C/size, size, D]."""
    return x.reshape(*x.shape[:-2], x.shape[-2] // size, size, x.shape[-1])


def split_halves(x, half):
    """[..., C, D] -> (left [..., nodes, half, D], right [..., nodes, half, D]) for nodes of 2·half tokens."""
    pairs = x.reshape(*x.shape[:-2], x.shape[-2] // (2 * half), 2, half, x.shape[-1])
    return pairs[..., 0, :, :], pairs[..., 1, :, :]


def join_halves(left, right):
    """Inverse of :func:`split_halves`."""
    pairs = jnp.stack([left, right], axis=-3)
    return pairs.reshape(*pairs.shape[:-4], pairs.shape[-4] * pairs.shape[-2] * 2, pairs.shape[-1])


def diagonal_blocks(x_CC, size):
    """[..., C, C] -> [..., C/size, size, size]: the diagonal blocks of a square matrix."""
    n = x_CC.shape[-1] // size
    blocks = x_CC.reshape(*x_CC.shape[:-2], n, size, n, size)
    return jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)


def tree_half_sizes(chunk_size, leaf_size):
    """Half-sizes h = n0, 2n0, …, C/2 of the tree levels above the leaves."""
    sizes, h = [], leaf_size
    while h < chunk_size:
        sizes.append(h)
        h *= 2
    return sizes


# ---------------------------------------------------------------------------------------------------------
# pivoted pieces of A and M


class PivotLevel(NamedTuple):
    half: int
    rho_right: jax.Array  # [..., nodes, h, K]  exp Σ_{p<s≤i} λ_s  (≤ 1)
    kappa_left: jax.Array  # [..., nodes, h, K]  exp Σ_{j<s≤p} λ_s  (≤ 1)
    same_doc: jax.Array  # [B, 1, N, nodes, h, h] bool, rows in R, columns in L


def shift_rows(x, offset, axis=-2):
    """Row i of the result is row i − offset of ``x`` along ``axis`` (offset > 0: down, < 0: up), zero-filled."""
    axis = axis % x.ndim
    n = x.shape[axis]
    if offset == 0:
        return x
    zeros = jnp.zeros_like(jax.lax.slice_in_dim(x, 0, abs(offset), axis=axis))
    if offset > 0:
        return jnp.concatenate([zeros, jax.lax.slice_in_dim(x, 0, n - offset, axis=axis)], axis=axis)
    return jnp.concatenate([jax.lax.slice_in_dim(x, -offset, n, axis=axis), zeros], axis=axis)


class LeafDiagonals(NamedTuple):
    """The leaves' exact decay tensor exp Σ_{j<s≤i} λ_s, one sub-diagonal d = i − j at a time: entry d − 1 of
    ``decays`` is [..., C, K] (row i pairs with key row i − d); ``keep[d − 1]`` [B, 1, N, C] marks rows whose
    partner lies in the same leaf and document. Rows not kept hold finite junk (exponent ≤ 0) and are masked."""

    decays: tuple
    keep: tuple


def leaf_diagonals(log_decay_BHNCK, document_B1NC, leaf_size) -> LeafDiagonals:
    position = jnp.arange(log_decay_BHNCK.shape[-2]) % leaf_size
    window = jnp.zeros_like(log_decay_BHNCK)
    decays, keep = [], []
    for offset in range(1, leaf_size):
        window = window + shift_rows(log_decay_BHNCK, offset - 1)  # Σ_{i−d<s≤i} λ_s: sums of λ ≤ 0 only
        decays.append(jnp.exp(window))
        keep.append((position >= offset) & (document_B1NC == shift_rows(document_B1NC, offset, axis=-1)))
    return LeafDiagonals(tuple(decays), tuple(keep))


def _skew(leaf_size, dtype):
    """one_hot[i, j, d] = [i − j == d]."""
    pos = jnp.arange(leaf_size)
    return (pos[:, None, None] - pos[None, :, None] == pos[None, None, :]).astype(dtype)


def diagonals_to_leaves(diagonals_BHNCD, leaf_size):
    """[..., C, n0] (entry d of row i = pair (i, i − d)) -> the leaf blocks [..., C/n0, n0, n0]."""
    x = split_blocks(diagonals_BHNCD, leaf_size)  # [..., L, i, d]
    return jnp.sum(x[..., :, None, :] * _skew(leaf_size, x.dtype), axis=-1)


def leaves_to_diagonals(leaves_BHNLNN):
    """Inverse of :func:`diagonals_to_leaves` (upper-triangle entries are dropped): [..., C, n0]."""
    n0 = leaves_BHNLNN.shape[-1]
    x = jnp.sum(leaves_BHNLNN[..., None] * _skew(n0, leaves_BHNLNN.dtype), axis=-2)  # [..., L, i, d]
    return x.reshape(*x.shape[:-3], -1, n0)


def leaf_blocks(q, k, erase, diagonals: LeafDiagonals, leaf_size):
    """A_leaf (strictly lower) and M_leaf (lower incl. diagonal), [..., C/n0, n0, n0], from the exact decays
    with mask-before-exp (no exponent > 0, nothing pivoted inside a leaf). ``erase`` None: A_leaf is None."""
    a_diag = [jnp.zeros(q.shape[:-1], q.dtype)]
    m_diag = [jnp.sum(q * k, axis=-1)]
    for offset, (decay, keep) in enumerate(zip(diagonals.decays, diagonals.keep), start=1):
        key = shift_rows(k, offset) * decay
        if erase is not None:
            a_diag.append(jnp.where(keep, jnp.sum(erase * key, axis=-1), 0.0))
        m_diag.append(jnp.where(keep, jnp.sum(q * key, axis=-1), 0.0))
    a_leaf = None if erase is None else diagonals_to_leaves(jnp.stack(a_diag, axis=-1), leaf_size)
    return a_leaf, diagonals_to_leaves(jnp.stack(m_diag, axis=-1), leaf_size)


def pivot_level(log_decay_BHNCK, document_B1NC, half):
    lam_left, lam_right = split_halves(log_decay_BHNCK, half)
    rho = jnp.exp(inclusive_cumsum(lam_right))
    kappa = jnp.exp(exclusive_reverse_cumsum(lam_left))
    doc_left, doc_right = split_halves(document_B1NC[..., None], half)
    same = doc_right[..., :, None, 0] == doc_left[..., None, :, 0]
    return PivotLevel(half, rho, kappa, same)


def cross_blocks(erase, q, k, level):
    """A[R, L] = (K̂_R⊙ρ)(K_L⊙κ)ᵀ and M[R, L] = (Q̂_R⊙ρ)(K_L⊙κ)ᵀ on same-document pairs, as one
    (2h × K)(K × h) matmul: ([..., nodes, h, h], [..., nodes, h, h]). ``erase`` None: (None, M[R, L]), one
    (h × K)(K × h) matmul."""
    h = level.half
    _, query_right = split_halves(q, h)
    key_left, _ = split_halves(k, h)
    if erase is None:
        return None, jnp.where(level.same_doc, matmul(query_right * level.rho_right,
                                                      transpose(key_left * level.kappa_left)), 0.0)
    _, erase_right = split_halves(erase, h)
    _, query_right = split_halves(q, h)
    key_left, _ = split_halves(k, h)
    rows = jnp.concatenate([erase_right, query_right], axis=-2) * jnp.concatenate([level.rho_right] * 2, axis=-2)
    both = jnp.where(jnp.concatenate([level.same_doc] * 2, axis=-2),
                     matmul(rows, transpose(key_left * level.kappa_left)), 0.0)
    return both[..., :h, :], both[..., h:, :]


# ---------------------------------------------------------------------------------------------------------
# recursive inverse of T = I + A (docs/math/delta_rule.md, 'Recursive block inverse')


def neumann_leaf_inverse(strict_lower_LNN):
    """(I + N)⁻¹ = (I − N)(I + N²)(I + N⁴)… for strictly lower N (nilpotent: the product is exact)."""
    n = strict_lower_LNN.shape[-1]
    eye = jnp.eye(n, dtype=strict_lower_LNN.dtype)
    inverse = eye - strict_lower_LNN
    power = strict_lower_LNN
    for _ in range(max(math.ceil(math.log2(n)) - 1, 0)):  # ⌈log₂ n0⌉ factors in all
        power = matmul(power, power)
        inverse = matmul(inverse, eye + power)
    return inverse


def assemble_lower(top_left, bottom_left, bottom_right):
    """[[TL, 0], [BL, BR]] for stacks of square blocks."""
    top = jnp.concatenate([top_left, jnp.zeros_like(top_left)], axis=-1)
    bottom = jnp.concatenate([bottom_left, bottom_right], axis=-1)
    return jnp.concatenate([top, bottom], axis=-2)


def merge_pairs(blocks, bottom_left_of):
    """Merge consecutive diagonal blocks [..., 2n, h, h] into [..., n, 2h, 2h]; ``bottom_left_of(L, R)``."""
    pairs = blocks.reshape(*blocks.shape[:-3], blocks.shape[-3] // 2, 2, *blocks.shape[-2:])
    left, right = pairs[..., 0, :, :], pairs[..., 1, :, :]
    return assemble_lower(left, bottom_left_of(left, right), right)


def recursive_inverse(leaf_blocks, cross_blocks):
    """Inverse of the unit lower-triangular T whose diagonal leaves are I + ``leaf_blocks`` [..., L, n0, n0]
    and whose level-ℓ off-diagonal blocks are ``cross_blocks[ℓ]`` [..., nodes, h, h]; eq. (11):
    inv([[T_a, 0], [B, T_b]]) = [[T_a⁻¹, 0], [−T_b⁻¹ B T_a⁻¹, T_b⁻¹]].  Returns [..., C, C]."""
    inverse = neumann_leaf_inverse(leaf_blocks)
    for block in cross_blocks:
        inverse = merge_pairs(inverse, lambda left, right, b=block: -matmul(matmul(right, b), left))
    return inverse[..., 0, :, :]


def assemble_tree(leaf_blocks, cross_blocks):
    """Lower block-triangular [..., C, C] from its diagonal leaves and per-level off-diagonal blocks."""
    matrix = leaf_blocks
    for block in cross_blocks:
        matrix = merge_pairs(matrix, lambda left, right, b=block: b)
    return matrix[..., 0, :, :]


# ---------------------------------------------------------------------------------------------------------
# everything per chunk that does not depend on the carried state


class ChunkTensors(NamedTuple):
    leaf_diagonals: LeafDiagonals
    levels: tuple  # PivotLevel per tree level
    start_decay: jax.Array  # π masked to the carried-in document   [..., C, K]
    end_decay: jax.Array  # E masked to the chunk's last document    [..., C, K]
    chunk_decay: jax.Array  # π_C, zero if the chunk holds a boundary  [..., K]
    same_doc: jax.Array  # [B, 1, N, C, C] bool
    inverse: Optional[jax.Array]  # P = (I + A)⁻¹   [..., C, C]; None without an erase (P = I)
    readout: jax.Array  # M (lower incl. diagonal)  [..., C, C]
    pseudo_values: jax.Array  # U = P V̂   [..., C, V]  (V̂ itself without an erase)
    state_reads: Optional[jax.Array]  # Y = P (K̂⊙π)   [..., C, K]; None without an erase (Y = 0)
    query_eff: jax.Array  # Q̂⊙π − M Y   [..., C, K]
    key_eff: jax.Array  # K⊙E   [..., C, K]
    transition: Optional[jax.Array]  # F = Diag(π_C) − K_effᵀ Y   [..., K, K]; None without an erase (F = Diag(π_C))
    write: jax.Array  # G = K_effᵀ U   [..., K, V]


def chunk_tensors(q, k, erase, v, log_decay, document_B1NC, carry_document_B1N, leaf_size) -> ChunkTensors:
    """All chunks in parallel. Inputs [B, H, N, C, D] in the compute dtype. ``erase`` None (no erase): no A, no
    inverse, no solve: U = V̂, Y = 0, Q_eff = Q̂⊙π, F = Diag(π_C) (kept as π_C), G = K_effᵀ V̂."""
    chunk = q.shape[-2]
    diagonals = leaf_diagonals(log_decay, document_B1NC, leaf_size)
    a_leaf, m_leaf = leaf_blocks(q, k, erase, diagonals, leaf_size)

    levels = tuple(pivot_level(log_decay, document_B1NC, h) for h in tree_half_sizes(chunk, leaf_size))
    a_cross, m_cross = zip(*[cross_blocks(erase, q, k, level) for level in levels]) if levels else ((), ())
    readout = assemble_tree(m_leaf, m_cross)

    carried = (document_B1NC == carry_document_B1N[..., None])[..., None]
    in_last = (document_B1NC == document_B1NC[..., -1:])[..., None]
    no_boundary = (document_B1NC[..., -1] == carry_document_B1N)[..., None]
    start_decay = jnp.where(carried, jnp.exp(inclusive_cumsum(log_decay)), 0.0)
    end_decay = jnp.where(in_last, jnp.exp(exclusive_reverse_cumsum(log_decay)), 0.0)
    chunk_decay = jnp.where(no_boundary, jnp.exp(jnp.sum(log_decay, axis=-2)), 0.0)
    same_doc = document_B1NC[..., :, None] == document_B1NC[..., None, :]
    key_eff = k * end_decay
    if erase is None:
        return ChunkTensors(diagonals, levels, start_decay, end_decay, chunk_decay, same_doc, None, readout, v, None,
                            q * start_decay, key_eff, None, matmul(transpose(key_eff), v))
    inverse = recursive_inverse(a_leaf, a_cross)

    # fused solve [U Y] = P [V̂ ‖ K̂⊙π]
    value_width = v.shape[-1]
    solved = matmul(inverse, jnp.concatenate([v, erase * start_decay], axis=-1))
    pseudo_values, state_reads = solved[..., :value_width], solved[..., value_width:]
    query_eff = q * start_decay - matmul(readout, state_reads)
    transition = _diag_embed(chunk_decay) - matmul(transpose(key_eff), state_reads)
    write = matmul(transpose(key_eff), pseudo_values)
    return ChunkTensors(diagonals, levels, start_decay, end_decay, chunk_decay, same_doc, inverse, readout,
                        pseudo_values, state_reads, query_eff, key_eff, transition, write)


def _diag_embed(x_K):
    return x_K[..., :, None] * jnp.eye(x_K.shape[-1], dtype=x_K.dtype)


def apply_transition(transition, state):
    """F S: a [K, K] matmul, or a row scaling when F = Diag(π_C) is given as π_C [K] (no erase)."""
    return transition[..., :, None] * state if transition.ndim == state.ndim - 1 else matmul(transition, state)


def scan_chunk_states(transition_BHNKK, write_BHNKV, initial_BHKV):
    """S₀⁽ⁿ⁺¹⁾ = F⁽ⁿ⁾ S₀⁽ⁿ⁾ + G⁽ⁿ⁾. Returns (every chunk-start state [B,H,N,K,V], final state [B,H,K,V]).
    F may be π_C [B,H,N,K] (F diagonal: no erase)."""

    def step(state, chunk):
        transition, write = chunk
        return apply_transition(transition, state) + write, state

    final, starts = jax.lax.scan(step, initial_BHKV,
                                 (jnp.moveaxis(transition_BHNKK, 2, 0), jnp.moveaxis(write_BHNKV, 2, 0)))
    return jnp.moveaxis(starts, 0, 2), final


def chunked_forward(q, k, erase, v, log_decay, initial_BHKV, document_B1NC, carry_document_B1N, leaf_size):
    """Returns (o [B,H,N,C,V], final state [B,H,K,V], chunk-start states [B,H,N,K,V])."""
    t = chunk_tensors(q, k, erase, v, log_decay, document_B1NC, carry_document_B1N, leaf_size)
    starts, final = scan_chunk_states(t.chunk_decay if t.transition is None else t.transition, t.write, initial_BHKV)
    out = matmul(t.query_eff, starts) + matmul(t.readout, t.pseudo_values)
    return out, final, starts


# ---------------------------------------------------------------------------------------------------------
# layout helpers used by the public wrapper


def to_chunks(x_BTHD, chunk_size):
    """[B, T, H, D] -> [B, H, N, C, D] (T a multiple of C)."""
    b, t, h, d = x_BTHD.shape
    return x_BTHD.reshape(b, t // chunk_size, chunk_size, h, d).transpose(0, 3, 1, 2, 4)


def from_chunks(x_BHNCD):
    b, h, n, c, d = x_BHNCD.shape
    return x_BHNCD.transpose(0, 2, 3, 1, 4).reshape(b, n * c, h, d)
