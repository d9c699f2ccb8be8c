"""Chunkwise DPLR delta rule in pure JAX (docs/math/dplr_delta_rule.md, 'Chunk form'); differentiated by JAX
autodiff (it is plain jnp code, not a kernel).

Layout: chunked arrays ``x_BHNCD`` (batch, head, chunk, position in chunk, channel); a chunk of C tokens is
split into nb = C / n0 blocks of n0 tokens (``leaf_size``). Inside a chunk, with the read r_i = α_i S_{i−1}:

    R = (I − A_αβ)⁻¹ [ (α⊙Γ⁻) S₀ + A_αk V ]                  (A_αβ strictly lower: a unit-triangular solve)
    O = (q⊙Γ) S₀ + A_qβ R + A_qk V
    S_C = Diag(Γ_C) S₀ + (β⊙E)ᵀ R + (k⊙E)ᵀ V

with Γ_i = exp Σ_{s≤i} λ_s, Γ⁻_i = exp Σ_{s<i} λ_s, E_j = exp Σ_{s>j} λ_s and the pair decays
A_xy[i, j] = Σ_c x_ic y_jc exp Σ_{j<s≤i'} λ_sc (i' = i − 1 for the α rows, i for the q rows).

Every exponent is a sum of λ ≤ 0 over a token range, never a difference of prefix sums:
  * a block pair (rows in block R, columns in an earlier block L) factors through the blocks in between:
    exp(Σ_{start(R)≤s≤i'} λ) · exp(Σ_{L<m<R} total_m) · exp(Σ_{j<s≤end(L)} λ), every factor ≤ 1;
  * a diagonal block uses the exact [n0, n0, K] tensor of range sums.
Segments: pairs of different documents are masked; the S₀ rows apply to the carried-in document only, the E
rows to the chunk's last document only, and Diag(Γ_C) only to a chunk without a boundary. The chunk is then an
affine map S_C = F S₀ + G of its initial state; the only sequential work is that K×K by K×V scan. The
pieces are built for about 8 chunks at a time, in a scan over those groups whose step is rematerialised in the
backward pass (:func:`chunked_dplr`): autodiff keeps the inputs and one state per group.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def einsum(spec, *operands):
    return jnp.einsum(spec, *operands, precision=_HIGHEST)


def to_chunks(x_BTHD, chunk_size):
    """[B, T, H, D] -> [B, H, N, C, D] (T a multiple of C)."""
    b, t, h, d = x_BTHD.shape
    return x_BTHD.reshape(b, t // chunk_size, chunk_size, h, d).transpose(0, 3, 1, 2, 4)


def from_chunks(x_BHNCD):
    b, h, n, c, d = x_BHNCD.shape
    return x_BHNCD.transpose(0, 2, 3, 1, 4).reshape(b, n * c, h, d)


def range_sum(x, keep_ts, axis=-2):
    """Σ_s keep[t, s] x_s along ``axis``, as a 0/1 matmul (sums over ranges only)."""
    moved = jnp.moveaxis(x, axis, -1)
    return jnp.moveaxis(einsum("...s,ts->...t", moved, keep_ts.astype(x.dtype)), -1, axis)


def unit_lower_inverse(strict_lower):
    """(I − N)⁻¹ for strictly lower-triangular N [..., C, C] by doubling: Π_k (I + N^(2^k)), ⌈log2 C⌉ steps of
    matmuls (N is nilpotent, so the product is exact); no LAPACK call (see pallas_kernels/vla/small_linalg.py)."""
    c = strict_lower.shape[-1]
    inverse = jnp.eye(c, dtype=strict_lower.dtype) + strict_lower
    power, span = strict_lower, 2
    while span < c:
        power = einsum("...ij,...jk->...ik", power, power)
        inverse = inverse + einsum("...ij,...jk->...ik", inverse, power)
        span *= 2
    return inverse


def _blocks(x, n0):
    """[..., C, D] -> [..., nb, n0, D]."""
    return x.reshape(*x.shape[:-2], x.shape[-2] // n0, n0, x.shape[-1])


def _assemble(cross_RLij, diagonal_Rij):
    """Block pieces -> [..., C, C]: cross blocks below the diagonal (R > L), the diagonal blocks on it."""
    nb, n0 = diagonal_Rij.shape[-3], diagonal_Rij.shape[-1]
    below = jnp.tril(jnp.ones((nb, nb), bool), -1)[:, :, None, None]
    eye = jnp.eye(nb, dtype=bool)[:, :, None, None]
    full = jnp.where(below, cross_RLij, 0) + jnp.where(eye, diagonal_Rij[..., :, None, :, :], 0)
    full = jnp.swapaxes(full, -3, -2)  # [..., R, i, L, j]
    return full.reshape(*full.shape[:-4], nb * n0, nb * n0)


def pair_matrices(q, k, alpha, beta, lam, n0):
    """A_αβ, A_αk (pairs j < i, decay over (j, i−1]) and A_qβ, A_qk (pairs j ≤ i, decay over (j, i]) of every
    chunk, [..., C, C], documents not yet masked."""
    lam_b = _blocks(lam, n0)  # [..., nb, n0, K]
    i = jnp.arange(n0)
    before = i[:, None] > i[None, :]  # [t, s]: s < t
    prefix_excl = range_sum(lam_b, before)  # Σ_{start ≤ s < i}
    prefix_incl = range_sum(lam_b, before | jnp.eye(n0, dtype=bool))  # Σ_{start ≤ s ≤ i}
    suffix_excl = range_sum(lam_b, before.T)  # Σ_{j < s ≤ end}
    total = jnp.sum(lam_b, axis=-2)  # [..., nb, K]
    m = jnp.arange(lam_b.shape[-3])
    between = (m[None, None, :] > m[None, :, None]) & (m[None, None, :] < m[:, None, None])  # [R, L, m]: L<m<R
    gap_RLK = einsum("...mk,rlm->...rlk", total, between.astype(lam.dtype))  # Σ of block totals strictly between
    gap_RLK = jnp.exp(gap_RLK)

    def cross(rows, cols):
        # rows [..., nb, n0, K] already times exp(prefix); cols times exp(suffix)
        return einsum("...Rik,...RLk,...Ljk->...RLij", rows, gap_RLK, cols)

    alpha_b, q_b = _blocks(alpha, n0), _blocks(q, n0)
    beta_b, k_b = _blocks(beta, n0), _blocks(k, n0)
    alpha_rows, q_rows = alpha_b * jnp.exp(prefix_excl), q_b * jnp.exp(prefix_incl)
    beta_cols, k_cols = beta_b * jnp.exp(suffix_excl), k_b * jnp.exp(suffix_excl)

    # diagonal blocks: exact range sums Σ_{j<s<i} (strict) and Σ_{j<s≤i} (inclusive) per channel
    t_, j_, s_ = i[:, None, None], i[None, :, None], i[None, None, :]
    strict = ((s_ > j_) & (s_ < t_)).astype(lam.dtype)
    inclusive = ((s_ > j_) & (s_ <= t_)).astype(lam.dtype)
    decay_strict = jnp.exp(einsum("...sk,ijs->...ijk", lam_b, strict))  # exponent 0 (value 1) off the triangle
    decay_incl = jnp.exp(einsum("...sk,ijs->...ijk", lam_b, inclusive))
    strict_lower, lower = before, before | jnp.eye(n0, dtype=bool)

    def diagonal(rows, cols, decay, keep):
        return jnp.where(keep, einsum("...ik,...ijk,...jk->...ij", rows, decay, cols), 0)

    a_ab = _assemble(cross(alpha_rows, beta_cols), diagonal(alpha_b, beta_b, decay_strict, strict_lower))
    a_ak = _assemble(cross(alpha_rows, k_cols), diagonal(alpha_b, k_b, decay_strict, strict_lower))
    a_qb = _assemble(cross(q_rows, beta_cols), diagonal(q_b, beta_b, decay_incl, lower))
    a_qk = _assemble(cross(q_rows, k_cols), diagonal(q_b, k_b, decay_incl, lower))
    return a_ab, a_ak, a_qb, a_qk


def chunk_pieces(q, k, v, alpha, beta, lam, document_B1NC, carry_B1N, n0):
    """Per chunk: (Q_eff, O_intra, F, G) with O = Q_eff S₀ + O_intra and S_C = F S₀ + G."""
    c = lam.shape[-2]
    same_doc = document_B1NC[..., :, None] == document_B1NC[..., None, :]  # [B,1,N,C,C]
    start = (document_B1NC == carry_B1N[..., None])[..., None]  # tokens of the carried-in document
    end = (document_B1NC == document_B1NC[..., -1:])[..., None]  # tokens of the chunk's last document
    unbroken = (document_B1NC[..., -1] == carry_B1N)[..., None, None]  # no boundary inside the chunk

    a_ab, a_ak, a_qb, a_qk = (jnp.where(same_doc, a, 0) for a in pair_matrices(q, k, alpha, beta, lam, n0))
    i = jnp.arange(c)
    before = i[:, None] > i[None, :]
    cum_excl = range_sum(lam, before)
    cum_incl = range_sum(lam, before | jnp.eye(c, dtype=bool))
    after = range_sum(lam, before.T)
    total = jnp.sum(lam, axis=-2)  # [..., K]

    solve = unit_lower_inverse(a_ab)
    w = einsum("...ij,...jk->...ik", solve, jnp.where(start, alpha * jnp.exp(cum_excl), 0))  # R = W S₀ + U
    u = einsum("...ij,...jv->...iv", solve, einsum("...ij,...jv->...iv", a_ak, v))
    q_eff = jnp.where(start, q * jnp.exp(cum_incl), 0) + einsum("...ij,...jk->...ik", a_qb, w)
    o_intra = einsum("...ij,...jv->...iv", a_qb, u) + einsum("...ij,...jv->...iv", a_qk, v)
    beta_end = jnp.where(end, beta * jnp.exp(after), 0)
    k_end = jnp.where(end, k * jnp.exp(after), 0)
    carry_diag = jnp.where(unbroken[..., 0], jnp.exp(total), 0)  # [..., K]
    f = carry_diag[..., :, None] * jnp.eye(lam.shape[-1], dtype=lam.dtype) + einsum("...ck,...cj->...kj",
                                                                                   beta_end, w)
    g = einsum("...ck,...cv->...kv", beta_end, u) + einsum("...ck,...cv->...kv", k_end, v)
    return q_eff, o_intra, f, g


def _pad_chunks(x, n_pad, edge=False):
    """Pads the chunk axis (2) of ``x`` with ``n_pad`` chunks: zeros (identity transitions that write nothing), or
    the last entry repeated (documents: the padding stays in the last document, so it carries the state)."""
    if n_pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[2] = (0, n_pad)
    return jnp.pad(x, widths, mode="edge" if edge else "constant")


def chunked_dplr(q, k, v, alpha, beta, lam, state_BHKV, document_B1NC, carry_B1N, n0, group=8):
    """Chunked inputs [B,H,N,C,·] -> (o [B,H,N,C,V] in λ's dtype, final state [B,H,K,V]); q, k, v, alpha, beta
    may be in a narrower dtype than λ (the compute dtype): they are cast chunk group by chunk group.

    A scan over groups of about ``group`` chunks (the chunk count padded to whole groups with identity chunks):
    a group's pieces are built at once (:func:`chunk_pieces`, vectorised over its chunks), then its chunks are
    stepped in order. The group step is rematerialised in the backward pass, so autodiff keeps only the inputs
    and the state entering each group; the pieces' temporaries (the leaves' [n0, n0, K] decay tensors, the pair
    matrices, the inverse: tens of times the chunk's inputs) exist for one group at a time."""
    n = q.shape[2]
    n_groups = -(-n // group)
    size = -(-n // n_groups)  # chunks per group: as even as the count allows, so padding stays < one group
    n_pad = n_groups * size - n
    xs = [_pad_chunks(x, n_pad) for x in (q, k, v, alpha, beta, lam)]
    docs = (_pad_chunks(document_B1NC, n_pad, edge=True), _pad_chunks(carry_B1N[..., None], n_pad, edge=True)[..., 0])
    # [B, H, G·size, ...] -> [G, B, H, size, ...]: the scan walks the groups
    grouped = [jnp.moveaxis(x.reshape(*x.shape[:2], n_groups, size, *x.shape[3:]), 2, 0) for x in (*xs, *docs)]
    dtype = lam.dtype

    @jax.checkpoint
    def group_step(state, pieces_in):
        *inputs, lam_g, document_g, carry_g = pieces_in
        inputs = [x.astype(dtype) for x in inputs]
        q_eff, o_intra, f, g = chunk_pieces(*inputs, lam_g, document_g, carry_g, n0)

        def step(state, chunk):
            q_eff_n, o_intra_n, f_n, g_n = chunk
            # the output of the chunk is read here, from the state entering it (reading it after the scan from a
            # stacked, transposed state tripped XLA:CPU's algebraic simplifier at some shapes)
            out_n = einsum("...ck,...kv->...cv", q_eff_n, state) + o_intra_n
            return einsum("...kj,...jv->...kv", f_n, state) + g_n, out_n

        chunk_major = tuple(jnp.moveaxis(x, 2, 0) for x in (q_eff, o_intra, f, g))
        state, out_nBHCV = jax.lax.scan(step, state, chunk_major)
        return state, jnp.moveaxis(out_nBHCV, 0, 2)  # [B, H, size, C, V]

    final, out_GBHSCV = jax.lax.scan(group_step, state_BHKV, grouped)
    out = jnp.moveaxis(out_GBHSCV, 0, 2)  # [B, H, G, size, C, V]
    out = out.reshape(*out.shape[:2], n_groups * size, *out.shape[4:])
    return out[:, :, :n], final
