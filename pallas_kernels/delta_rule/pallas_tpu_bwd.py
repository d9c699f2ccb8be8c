"""Backward kernel of the Pallas TPU delta rule (docs/math/delta_rule.md, 'Backward pass'): one kernel walking the
chunks in reverse (grid
step c handles chunk N_c − 1 − c through the index maps), recomputing every chunk from its saved S₀ with the
forward's own ``chunk_core`` and carrying dS in a VMEM f32 scratch. Per chunk:

  dŨ = Mᵀ dO + (K⊙E) dS                     dM = tril(dO Ũᵀ)            (same-document pairs)
  dS_prev = (Q̂⊙π)ᵀ dO + Diag(π_C) dS − Yᵀ dŨ  dY = −dŨ S₀ᵀ
  [dV̂ ‖ dR] = Pᵀ [dŨ ‖ dY]   (one transposed C × (Dv+Dk) matmul)
  dA = −tril_s([dV̂ ‖ dR][U ‖ Y]ᵀ)            (same-document pairs)
  dA, dM → dK̂, dQ̂, dK through the SAME leaves / pivot factors as the forward (no exponent > 0):
      leaves: the [C/n0, n0, n0] blocks of dA, dM, one sub-diagonal at a time as a column, rolled back to
      the key rows;
      levels: per node, batched over the level's nodes at the exact block sizes, [dA; dM][R,L] (K_L⊙κ) ⊙ ρ
      and [dA; dM][R,L]ᵀ [K̂_R⊙ρ; Q̂_R⊙ρ] ⊙ κ.
  G = dO S₀ᵀ, H = Ũ dSᵀ;  dQ̂ = dQ̂ᵖ + G⊙π,  dK̂ = dK̂ᵖ + dR⊙π,  dK = dKᵖ + H⊙E,  dV̂ from the solve
  dΛ = K̂⊙dK̂ᵖ + Q̂⊙dQ̂ᵖ − K⊙dKᵖ + π⊙(dR⊙K̂ + G⊙Q̂) − K⊙E⊙H;  dΛ_C += Σ_i (K⊙E⊙H)_i + π_C ⊙ rowsum(S₀⊙dS)
  dλ = U_C dΛ (upper-triangular ones, MXU f32 HIGHEST);  dS ← dS_prev;  d(initial state) = dS after chunk 0.
The pair identity dΛ_i += g, dΛ_j −= g for a pair term g makes the pivot cancel (the log-decay gradient of the backward
pass).
Without an erase (``KernelConfig.has_erase`` False) P = I, Y = 0 and A = 0: dV̂ = dŨ, no dY, no transposed solve,
no dA (and no dK̂), dM = tril(dO V̂ᵀ), dS_prev = (Q̂⊙π)ᵀ dO + Diag(π_C) dS; the contractions carry dM alone.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mixerlab.pallas_kernels.delta_rule.pallas_tpu import (F32, Chunk, Geometry, KernelConfig, _specs, bmm, bmm_tn,
                                                  chunk_core, compiler_params, concat_cols, core_counts,
                                                  cross_blocks, cross_operands, fused_mm, iota2, leaf_diagonals,
                                                  leaf_iota, leaf_slices, mm, mm_f32, mm_nt, mm_tn, scratch,
                                                  upper_ones)


def _contract_leaves(da, dm, ch: Chunk, g: Geometry):
    """Pair gradients of the leaves: (dQ̂ᵖ, dK̂ᵖ, dKᵖ) [C, Dk] f32 of the pairs that carry a decay, and (dQ̂ᵈ, dKᵈ)
    of M's diagonal (exponent identically 0: no dΛ term, kept apart so that q⊙dq − k⊙dk does not leave a
    rounding residual in dΛ where every real term is tiny). ``da``/``dm`` are the (C, C) gradients of A and M;
    their leaf blocks are read as a [C/n0, n0, n0] stack and one sub-diagonal at a time comes out as a column."""
    c, dk = ch.qf.shape
    ii, jj = leaf_iota(g)
    with_a = ch.ef is not None
    da_leaves = jnp.stack([da[s, s] for s in leaf_slices(g)]) if with_a else None
    dm_leaves = jnp.stack([dm[s, s] for s in leaf_slices(g)])

    def diagonal(blocks, d):  # [C, 1]: entry (i, i − d) of i's leaf block, 0 where i mod n0 < d
        return jnp.sum(jnp.where(jj == ii - d, blocks, 0.0), axis=2, keepdims=True).reshape(c, 1)

    dq = jnp.zeros((c, dk), F32)
    de = jnp.zeros((c, dk), F32) if with_a else None
    dkk = jnp.zeros((c, dk), F32)
    dq_diag = dk_diag = None
    for d, w, ex in leaf_diagonals(ch.log_decay, ch.kf, g.leaf):
        dm_d = diagonal(dm_leaves, d)  # dM[i, i−d]
        if d == 0:
            dq_diag, dk_diag = dm_d * ch.kf, dm_d * ch.qf
            continue
        dq = dq + dm_d * w
        if with_a:
            da_d = diagonal(da_leaves, d)
            de = de + da_d * w
            z = (dm_d * ch.qf + da_d * ch.ef) * ex
        else:
            z = dm_d * ch.qf * ex
        dkk = dkk + pltpu.roll(z, c - d, 0)  # row i's term belongs to key row i − d
    return dq, de, dkk, dq_diag, dk_diag


def _contract_levels(da, dm, ch: Chunk, g: Geometry, cdt):
    """Pair gradients of the tree levels through the forward's own pivot factors, per node at the exact block
    sizes: [dA; dM][R,L] (K_L⊙κ) ⊙ ρ -> dK̂_R, dQ̂_R and [dA; dM][R,L]ᵀ [K̂_R⊙ρ; Q̂_R⊙ρ] ⊙ κ -> dK_L."""
    c, dk = ch.qf.shape
    dq = jnp.zeros((c, dk), F32)
    de = jnp.zeros((c, dk), F32) if ch.ef is not None else None
    dkk = jnp.zeros((c, dk), F32)
    for lv in ch.levels:
        h, f = lv.half, lv.factors
        rows, cols = cross_operands(ch.qf, ch.kf, ch.ef, lv)
        if ch.ef is None:  # dM[R,L] alone: [n, h, h] against K_L⊙κ and Q̂_R⊙ρ
            dm_blocks = cross_blocks(dm, g, h)
            zero = jnp.zeros((dm_blocks.shape[0], h, dk), F32)
            dq = dq + jnp.concatenate([zero, bmm(dm_blocks, cols, cdt) * f[:, h:]], axis=1).reshape(c, dk)
            dkk = dkk + jnp.concatenate([bmm_tn(dm_blocks, rows, cdt) * f[:, :h], zero], axis=1).reshape(c, dk)
            continue
        stacked = jnp.concatenate([cross_blocks(da, g, h), cross_blocks(dm, g, h)], axis=1)  # [n, 2h, h]
        x = bmm(stacked, cols, cdt)  # [n, 2h, Dk]
        z = bmm_tn(stacked, rows, cdt) * f[:, :h]  # [n, h, Dk]: dK of the left halves
        zero = jnp.zeros_like(z)
        de = de + jnp.concatenate([zero, x[:, :h] * f[:, h:]], axis=1).reshape(c, dk)
        dq = dq + jnp.concatenate([zero, x[:, h:] * f[:, h:]], axis=1).reshape(c, dk)
        dkk = dkk + jnp.concatenate([z, zero], axis=1).reshape(c, dk)
    return dq, de, dkk


def _readout_grad(d_out, ch: Chunk, doc_col, doc_row, g: Geometry, cdt):
    """dM = tril(dO Ũᵀ) on same-document pairs (the diagonal included)."""
    i, j = iota2((g.chunk, g.chunk))
    return jnp.where((doc_col == doc_row) & (j <= i), mm_nt(d_out, ch.true_pseudo, cdt), 0.0)


def _end_terms(ch: Chunk, h_mat, g: Geometry):
    """K⊙E⊙H with the last row left out: E_C = e^0 exactly, so its +/− terms at row C cancel identically."""
    r = jax.lax.broadcasted_iota(jnp.int32, (g.chunk, 1), 0)
    return jnp.where(r == g.chunk - 1, 0.0, ch.kf * ch.end_decay * h_mat)


def _log_decay_grad(d_cum_log_decay, end_terms, ch: Chunk, start_state, ds, g: Geometry):
    """dλ from dΛ: the chunk-end terms (Σ_i K⊙E⊙H and π_C ⊙ rowsum(S₀⊙dS)) join the last row, then
    dλ_s = Σ_{i ≥ s} dΛ_i on the MXU."""
    c_ = g.chunk
    r = jax.lax.broadcasted_iota(jnp.int32, (c_, 1), 0)
    state_term = mm_nt(jnp.ones((8, g.dv), F32), start_state * ds, F32)[0:1]  # rowsum(S₀ ⊙ dS) as a row [1, Dk]
    chunk_end = jnp.sum(end_terms, axis=0, keepdims=True) + ch.chunk_decay_row * state_term
    d_cum_log_decay = jnp.where(r == c_ - 1, d_cum_log_decay + chunk_end, d_cum_log_decay)
    return mm_f32(upper_ones(c_), d_cum_log_decay)


def _backward_kernel(*refs, cfg: KernelConfig):
    if not cfg.has_erase:
        return _backward_kernel_without_erase(*refs, cfg=cfg)
    (q_ref, k_ref, e_ref, v_ref, log_decay_ref, doc_col_ref, doc_row_ref, starts_ref, do_ref, dfinal_ref,
     dq_ref, dk_ref, de_ref, dv_ref, d_log_decay_ref, dinit_ref, ds_scr, inverse_scr, readout_scr) = refs
    g, cdt = cfg.geometry, cfg.cdt
    c_ = g.chunk
    c = pl.program_id(1)

    @pl.when(c == 0)
    def _():
        ds_scr[...] = dfinal_ref[...]

    ds = ds_scr[...]
    start_state = starts_ref[...]
    doc_col, doc_row = doc_col_ref[...], doc_row_ref[...]
    ch = chunk_core(q_ref[...], k_ref[...], e_ref[...], v_ref[...], log_decay_ref[...], doc_col, doc_row, start_state,
                    inverse_scr,
                    readout_scr, g, cdt)
    d_out = do_ref[...].astype(F32)
    i, j = iota2((c_, c_))
    same = doc_col == doc_row

    du = mm_tn(readout_scr[...], d_out, cdt) + mm(ch.kf * ch.end_decay, ds, cdt)
    dm = _readout_grad(d_out, ch, doc_col, doc_row, g, cdt)
    ds_prev = mm_tn(ch.qf * ch.start_decay, d_out, cdt) + ch.chunk_decay_col * ds - mm_tn(ch.state_reads, du, cdt)
    dy = -mm_nt(du, start_state, cdt)
    dvh, dr = fused_mm(inverse_scr[...], [du, dy], cdt, transpose_lhs=True)  # [dV̂ ‖ dR] = Pᵀ [dŨ ‖ dY]
    sol, dsol = concat_cols([ch.pseudo_values, ch.state_reads]), concat_cols([dvh, dr])
    outer = mm_nt(dsol, sol, cdt) if sol is not None else mm_nt(dvh, ch.pseudo_values, cdt) + mm_nt(dr, ch.state_reads,
                  cdt)
    da = jnp.where(same & (j < i), -outer, 0.0)

    # pair gradients: leaves (VPU, exact exponents), then the tree levels (MXU, pivot factors)
    dq_p, de_p, dk_p, dq_diag, dk_diag = _contract_leaves(da, dm, ch, g)
    dq_l, de_l, dk_l = _contract_levels(da, dm, ch, g, cdt)
    dq_p, de_p, dk_p = dq_p + dq_l, de_p + de_l, dk_p + dk_l

    g_mat = mm_nt(d_out, start_state, cdt)  # G = dO S₀ᵀ
    h_mat = mm_nt(ch.true_pseudo, ds, cdt)  # H = Ũ dSᵀ
    dq_ref[...] = (dq_p + dq_diag + g_mat * ch.start_decay).astype(dq_ref.dtype)
    de_ref[...] = (de_p + dr * ch.start_decay).astype(de_ref.dtype)
    dk_ref[...] = (dk_p + dk_diag + h_mat * ch.end_decay).astype(dk_ref.dtype)
    dv_ref[...] = dvh.astype(dv_ref.dtype)

    end_terms = _end_terms(ch, h_mat, g)
    d_cum_log_decay = (ch.ef * de_p + ch.qf * dq_p - ch.kf * dk_p + ch.start_decay * (dr * ch.ef + g_mat * ch.qf)
                       - end_terms)
    d_log_decay_ref[...] = _log_decay_grad(d_cum_log_decay, end_terms, ch, start_state, ds, g)

    ds_scr[...] = ds_prev

    @pl.when(c == pl.num_programs(1) - 1)
    def _():
        dinit_ref[...] = ds_prev


def _backward_kernel_without_erase(q_ref, k_ref, v_ref, log_decay_ref, doc_col_ref, doc_row_ref, starts_ref, do_ref,
                                   dfinal_ref, dq_ref, dk_ref, dv_ref, d_log_decay_ref, dinit_ref, ds_scr, readout_scr,
                                   *, cfg: KernelConfig):
    """:func:`_backward_kernel` with k̂ = 0 (module docstring): no P, no solve, no dA, no dK̂."""
    g, cdt = cfg.geometry, cfg.cdt
    c = pl.program_id(1)

    @pl.when(c == 0)
    def _():
        ds_scr[...] = dfinal_ref[...]

    ds = ds_scr[...]
    start_state = starts_ref[...]
    doc_col, doc_row = doc_col_ref[...], doc_row_ref[...]
    ch = chunk_core(q_ref[...], k_ref[...], None, v_ref[...], log_decay_ref[...], doc_col, doc_row, start_state, None,
                    readout_scr, g, cdt)
    d_out = do_ref[...].astype(F32)

    dvh = mm_tn(readout_scr[...], d_out, cdt) + mm(ch.kf * ch.end_decay, ds, cdt)  # dV̂ = dŨ
    dm = _readout_grad(d_out, ch, doc_col, doc_row, g, cdt)
    ds_prev = mm_tn(ch.qf * ch.start_decay, d_out, cdt) + ch.chunk_decay_col * ds

    dq_p, _, dk_p, dq_diag, dk_diag = _contract_leaves(None, dm, ch, g)
    dq_l, _, dk_l = _contract_levels(None, dm, ch, g, cdt)
    dq_p, dk_p = dq_p + dq_l, dk_p + dk_l

    g_mat = mm_nt(d_out, start_state, cdt)  # G = dO S₀ᵀ
    h_mat = mm_nt(ch.true_pseudo, ds, cdt)  # H = V̂ dSᵀ
    dq_ref[...] = (dq_p + dq_diag + g_mat * ch.start_decay).astype(dq_ref.dtype)
    dk_ref[...] = (dk_p + dk_diag + h_mat * ch.end_decay).astype(dk_ref.dtype)
    dv_ref[...] = dvh.astype(dv_ref.dtype)

    end_terms = _end_terms(ch, h_mat, g)
    d_cum_log_decay = ch.qf * dq_p - ch.kf * dk_p + ch.start_decay * (g_mat * ch.qf) - end_terms
    d_log_decay_ref[...] = _log_decay_grad(d_cum_log_decay, end_terms, ch, start_state, ds, g)

    ds_scr[...] = ds_prev

    @pl.when(c == pl.num_programs(1) - 1)
    def _():
        dinit_ref[...] = ds_prev


def backward_counts(g: Geometry, has_erase: bool = True):
    """(MXU FLOPs, exps) per chunk per head of the backward kernel: the recompute of steps 1–5 (the forward's
    ``core_counts``) plus the backward's own matmuls, every one at the shape the kernel issues."""
    flops, _, exps = core_counts(g, has_erase=has_erase)  # recompute
    c, n0, dk, dv = g.chunk, g.leaf, g.dk, g.dv
    if not has_erase:  # dV̂ = dŨ, dM, dS_prev (no Y term), dM's level contractions, G, H, dλ, rowsum
        flops += 2 * c * c * dv + 2 * c * dk * dv + 2 * c * c * dv + 2 * c * dk * dv
        flops += sum((c // (2 * h)) * 2 * (2 * h * h * dk) for h in g.levels)
        flops += 2 * 2 * c * dk * dv + 2 * c * c * dk + 2 * 8 * dk * dv
        return flops, exps + c * dk * (n0 - 1) + dk
    flops += 2 * c * c * dv + 2 * c * dk * dv  # dŨ
    flops += 2 * c * c * dv  # dM
    flops += 2 * 2 * c * dk * dv  # dS_prev
    flops += 2 * c * dk * dv  # dY
    flops += 2 * c * c * (dk + dv)  # Pᵀ solve
    flops += 2 * c * c * (dk + dv)  # dA outer product
    flops += sum((c // (2 * h)) * 2 * (2 * 2 * h * h * dk) for h in g.levels)  # two [2h, h]-stacked contractions
    exps += c * dk * (n0 - 1) + dk  # leaf exps recomputed in the contraction; π_C as a row (for dλ)
    flops += 2 * 2 * c * dk * dv  # G, H
    flops += 2 * c * c * dk + 2 * 8 * dk * dv  # dλ = U_C dΛ, rowsum
    return flops, exps


def backward_cost(g: Geometry, bh: int, n_chunks: int, io_bytes: int, has_erase: bool = True) -> pl.CostEstimate:
    flops, exps = backward_counts(g, has_erase)
    c, dk, dv = g.chunk, g.dk, g.dv
    keys = 3 if has_erase else 2
    per_chunk_bytes = (2 * (io_bytes * c * (keys * dk + dv) + 4 * c * dk)  # inputs read, gradients written
                       + io_bytes * c * dv + 4 * dk * dv + 4 * 2 * c)  # dO, S₀, documents
    total = bh * n_chunks
    return pl.CostEstimate(flops=int(total * flops), transcendentals=int(total * exps),
                           bytes_accessed=int(total * per_chunk_bytes + bh * 2 * 4 * dk * dv))


def backward_call(cfg: KernelConfig, q, k, e, v, log_decay, doc_col, doc_row, starts, d_out, d_final):
    g = cfg.geometry
    bh, tp, _ = q.shape
    n_chunks = tp // g.chunk
    seq, doc_col_spec, doc_row_spec, state, per_chunk_state = _specs(cfg, n_chunks, reverse=True)
    keys = (q, k, e) if cfg.has_erase else (q, k)  # no k̂ in or dk̂ out without an erase
    out = pl.pallas_call(
        functools.partial(_backward_kernel, cfg=cfg),
        out_shape=(*(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in keys), jax.ShapeDtypeStruct(v.shape, v.dtype),
                   jax.ShapeDtypeStruct(log_decay.shape, F32), jax.ShapeDtypeStruct((bh, g.dk, g.dv), F32)),
        grid=(bh, n_chunks),
        in_specs=[*[seq(g.dk)] * len(keys), seq(g.dv), seq(g.dk), doc_col_spec, doc_row_spec, per_chunk_state,
                  seq(g.dv), state],
        out_specs=(*[seq(g.dk)] * len(keys), seq(g.dv), seq(g.dk), state),
        scratch_shapes=scratch(g, has_erase=cfg.has_erase),
        compiler_params=compiler_params(cfg),
        cost_estimate=backward_cost(g, bh, n_chunks, jnp.dtype(cfg.cdt).itemsize, cfg.has_erase),
        interpret=cfg.interpret,
        name="delta_rule_bwd" if cfg.has_erase else "delta_rule_bwd_no_erase",
    )(*keys, v, log_decay, doc_col, doc_row, starts, d_out, d_final)
    if cfg.has_erase:
        return out
    dq, dk, dv, dlam, d_init = out
    return dq, dk, None, dv, dlam, d_init
