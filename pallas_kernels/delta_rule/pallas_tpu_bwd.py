"""Backward kernel of the Pallas TPU delta rule (docs/math/delta_rule.md, 'Backward pass'): one kernel walking the
chunks in reverse (grid
step c handles chunk N_c − 1 − c through the index maps), recomputing every chunk from its saved S₀ with the
forward's own ``chunk_core`` and carrying dS in a VMEM f32 scratch. Per chunk:

  dŨ = Mᵀ dO + (K⊙E) dS                     dM = tril(dO Ũᵀ)            (same-document pairs)
  dS_prev = (Q̂⊙π)ᵀ dO + Diag(π_C) dS − Yᵀ dŨ  dY = −dŨ S₀ᵀ
  [dV̂ ‖ dR] = Pᵀ [dŨ ‖ dY]   (one transposed C × (Dv+Dk) matmul)
  dA = −tril_s([dV̂ ‖ dR][U ‖ Y]ᵀ)            (same-document pairs)
  dA, dM → dK̂, dQ̂, dK through the SAME leaves / pivot factors as the forward (no exponent > 0):
      leaves: per offset d, lane-free row gathers of the d-th subdiagonal and rolls back to column rows;
      levels inside a tile: [dA_h; dM_h](K⊙F) ⊙ F and [dA_h; dM_h]ᵀ[K̂⊙F; Q̂⊙F] ⊙ F (masked full-tile);
      top blocks: the same with ρ, κ on aligned blocks.
  G = dO S₀ᵀ, H = Ũ dSᵀ;  dQ̂ = dQ̂ᵖ + G⊙π,  dK̂ = dK̂ᵖ + dR⊙π,  dK = dKᵖ + H⊙E,  dV̂ from the solve
  dΛ = K̂⊙dK̂ᵖ + Q̂⊙dQ̂ᵖ − K⊙dKᵖ + π⊙(dR⊙K̂ + G⊙Q̂) − K⊙E⊙H;  dΛ_C += Σ_i (K⊙E⊙H)_i + π_C ⊙ rowsum(S₀⊙dS)
  dλ = U_C dΛ (upper-triangular ones, MXU f32 HIGHEST);  dS ← dS_prev;  d(initial state) = dS after chunk 0.
The pair identity dΛ_i += g, dΛ_j −= g for a pair term g makes the pivot cancel (the log-decay gradient of the backward
pass).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mixerlab.pallas_kernels.delta_rule.pallas_tpu import (
    F32, Geometry, KernelConfig, _specs, chunk_core, compiler_params, concat_cols, core_counts, cross_mask, fused_mm,
    iota2, leaf_diagonals, mm, mm_f32, mm_nt, mm_tn, offset_place, scratch, upper_ones)


def _contract_tile(da_t, dm_t, q_t, k_t, e_t, log_decay_t, factors_t, g: Geometry, cdt):
    """Pair gradients of one tile's leaves and intra-tile levels: (dQ̂ᵖ, dK̂ᵖ, dKᵖ) [Tt, Dk] f32 of the pairs
    that carry a decay, and (dQ̂ᵈ, dKᵈ) of M's diagonal (exponent identically 0: no dΛ term, kept apart so that
    q⊙dq − k⊙dk does not leave a rounding residual in dΛ where every real term is tiny)."""
    rows, dk = q_t.shape
    dq = jnp.zeros((rows, dk), F32)
    de = jnp.zeros((rows, dk), F32)
    dkk = jnp.zeros((rows, dk), F32)
    dq_diag = dk_diag = None
    for d, w, ex in leaf_diagonals(log_decay_t, k_t, g.leaf):
        place = offset_place(rows, g.leaf, d)
        dm_d = jnp.sum(jnp.where(place, dm_t, 0.0), axis=1, keepdims=True)  # dM[i, i−d]
        if d == 0:
            dq_diag, dk_diag = dm_d * k_t, dm_d * q_t
            continue
        da_d = jnp.sum(jnp.where(place, da_t, 0.0), axis=1, keepdims=True)
        dq = dq + dm_d * w
        de = de + da_d * w
        z = (dm_d * q_t + da_d * e_t) * ex
        dkk = dkk + pltpu.roll(z, rows - d, 0)  # row i's term belongs to key row i − d
    for h, f in zip(g.tile_levels, factors_t):
        cross = cross_mask(rows, h)
        stacked = jnp.concatenate([jnp.where(cross, da_t, 0.0), jnp.where(cross, dm_t, 0.0)], axis=0)
        x = mm(stacked, k_t * f, cdt)  # [2Tt, Dk]
        de = de + x[:rows] * f
        dq = dq + x[rows:] * f
        z = mm_tn(stacked, jnp.concatenate([e_t * f, q_t * f], axis=0), cdt)  # [Tt, Dk]
        dkk = dkk + z * f
    return [dq, de, dkk, dq_diag, dk_diag]


def _backward_kernel(q_ref, k_ref, e_ref, v_ref, log_decay_ref, doc_col_ref, doc_row_ref, starts_ref, do_ref,
                     dfinal_ref,
                     dq_ref, dk_ref, de_ref, dv_ref, d_log_decay_ref, dinit_ref, ds_scr, inverse_scr, readout_scr,
                     *, cfg: KernelConfig):
    g, cdt = cfg.geometry, cfg.cdt
    c_, t = g.chunk, g.tile
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
    dm = jnp.where(same & (j <= i), mm_nt(d_out, ch.true_pseudo, cdt), 0.0)
    ds_prev = mm_tn(ch.qf * ch.start_decay, d_out, cdt) + ch.chunk_decay_col * ds - mm_tn(ch.state_reads, du, cdt)
    dy = -mm_nt(du, start_state, cdt)
    dvh, dr = fused_mm(inverse_scr[...], [du, dy], cdt, transpose_lhs=True)  # [dV̂ ‖ dR] = Pᵀ [dŨ ‖ dY]
    sol, dsol = concat_cols([ch.pseudo_values, ch.state_reads]), concat_cols([dvh, dr])
    outer = mm_nt(dsol, sol, cdt) if sol is not None else mm_nt(dvh, ch.pseudo_values, cdt) + mm_nt(dr, ch.state_reads,
                  cdt)
    da = jnp.where(same & (j < i), -outer, 0.0)

    # pair gradients, tile by tile, then the aligned top blocks
    parts = []
    for ti in range(g.n_tiles):
        s = slice(ti * t, (ti + 1) * t)
        parts.append(_contract_tile(da[s, s], dm[s, s], ch.qf[s], ch.kf[s], ch.ef[s], ch.log_decay[s],
                     ch.tile_factors[ti], g,
                                    cdt))
    for b in ch.blocks:
        h = b.rows.stop - b.rows.start
        stacked = jnp.concatenate([da[b.rows, b.cols], dm[b.rows, b.cols]], axis=0)  # [2h, h]
        x = mm(stacked, ch.kf[b.cols] * b.kappa, cdt)  # [2h, Dk]
        z = mm_tn(stacked, jnp.concatenate([ch.ef[b.rows] * b.rho, ch.qf[b.rows] * b.rho], axis=0), cdt)
        d_e, d_q, d_k = x[:h] * b.rho, x[h:] * b.rho, z * b.kappa
        for ti in range(b.rows.start // t, b.rows.stop // t):
            o = ti * t - b.rows.start
            parts[ti][0] = parts[ti][0] + d_q[o:o + t]
            parts[ti][1] = parts[ti][1] + d_e[o:o + t]
        for ti in range(b.cols.start // t, b.cols.stop // t):
            o = ti * t - b.cols.start
            parts[ti][2] = parts[ti][2] + d_k[o:o + t]
    join = lambda n: parts[0][n] if len(parts) == 1 else jnp.concatenate([p[n] for p in parts], axis=0)  # noqa: E731
    dq_p, de_p, dk_p, dq_diag, dk_diag = (join(n) for n in range(5))

    g_mat = mm_nt(d_out, start_state, cdt)  # G = dO S₀ᵀ
    h_mat = mm_nt(ch.true_pseudo, ds, cdt)  # H = Ũ dSᵀ
    dq_ref[...] = (dq_p + dq_diag + g_mat * ch.start_decay).astype(dq_ref.dtype)
    de_ref[...] = (de_p + dr * ch.start_decay).astype(de_ref.dtype)
    dk_ref[...] = (dk_p + dk_diag + h_mat * ch.end_decay).astype(dk_ref.dtype)
    dv_ref[...] = dvh.astype(dv_ref.dtype)

    # E_C = e^0 exactly: its +/− terms at row C cancel identically, so leave the last row out of both
    r = jax.lax.broadcasted_iota(jnp.int32, (c_, 1), 0)
    end_terms = jnp.where(r == c_ - 1, 0.0, ch.kf * ch.end_decay * h_mat)
    d_cum_log_decay = (ch.ef * de_p + ch.qf * dq_p - ch.kf * dk_p + ch.start_decay * (dr * ch.ef + g_mat * ch.qf)
                       - end_terms)
    state_term = mm_nt(jnp.ones((8, g.dv), F32), start_state * ds, F32)[0:1]  # rowsum(S₀ ⊙ dS) as a row [1, Dk]
    chunk_end = jnp.sum(end_terms, axis=0, keepdims=True) + ch.chunk_decay_row * state_term
    d_cum_log_decay = jnp.where(r == c_ - 1, d_cum_log_decay + chunk_end, d_cum_log_decay)
    d_log_decay_ref[...] = mm_f32(upper_ones(c_), d_cum_log_decay)  # dλ_s = Σ_{i ≥ s} dΛ_i

    ds_scr[...] = ds_prev

    @pl.when(c == pl.num_programs(1) - 1)
    def _():
        dinit_ref[...] = ds_prev


def backward_cost(g: Geometry, bh: int, n_chunks: int, io_bytes: int) -> pl.CostEstimate:
    flops, _, exps = core_counts(g)  # recompute
    c, t, n0, dk, dv = g.chunk, g.tile, g.leaf, g.dk, g.dv
    flops += 2 * c * c * dv + 2 * c * dk * dv  # dŨ
    flops += 2 * c * c * dv  # dM
    flops += 2 * 2 * c * dk * dv  # dS_prev
    flops += 2 * c * dk * dv  # dY
    flops += 2 * c * c * (dk + dv)  # Pᵀ solve
    flops += 2 * c * c * (dk + dv)  # dA outer product
    n_tl = len(g.tile_levels)
    flops += g.n_tiles * n_tl * 2 * (2 * 2 * t * t * dk)  # two [2Tt]-stacked contractions per level
    exps += c * dk * (n0 - 1)  # leaf exps recomputed in the contraction
    for h in g.top_levels:
        nodes = c // (2 * h)
        flops += nodes * 2 * (2 * 2 * h * h * dk)
    flops += 2 * 2 * c * dk * dv  # G, H
    flops += 2 * c * c * dk + 2 * 8 * dk * dv  # dλ = U_C dΛ, rowsum
    per_chunk_bytes = (2 * (io_bytes * c * (3 * dk + dv) + 4 * c * dk)  # inputs read, gradients written
                       + io_bytes * c * dv + 4 * dk * dv + 4 * 2 * c)  # dO, S₀, documents
    total = bh * n_chunks
    return pl.CostEstimate(flops=int(total * flops), transcendentals=int(total * exps),
                           bytes_accessed=int(total * per_chunk_bytes + bh * 2 * 4 * dk * dv))


def backward_call(cfg: KernelConfig, q, k, e, v, log_decay, doc_col, doc_row, starts, d_out, d_final):
    g = cfg.geometry
    bh, tp, _ = q.shape
    n_chunks = tp // g.chunk
    seq, doc_col_spec, doc_row_spec, state, per_chunk_state = _specs(cfg, n_chunks, reverse=True)
    return pl.pallas_call(
        functools.partial(_backward_kernel, cfg=cfg),
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                   jax.ShapeDtypeStruct(e.shape, e.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype),
                   jax.ShapeDtypeStruct(log_decay.shape, F32), jax.ShapeDtypeStruct((bh, g.dk, g.dv), F32)),
        grid=(bh, n_chunks),
        in_specs=[seq(g.dk), seq(g.dk), seq(g.dk), seq(g.dv), seq(g.dk), doc_col_spec, doc_row_spec, per_chunk_state,
                  seq(g.dv), state],
        out_specs=(seq(g.dk), seq(g.dk), seq(g.dk), seq(g.dv), seq(g.dk), state),
        scratch_shapes=scratch(g),
        compiler_params=compiler_params(cfg),
        cost_estimate=backward_cost(g, bh, n_chunks, jnp.dtype(cfg.cdt).itemsize),
        interpret=cfg.interpret,
        name="delta_rule_bwd",
    )(q, k, e, v, log_decay, doc_col, doc_row, starts, d_out, d_final)
