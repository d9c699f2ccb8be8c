"""Backward kernels of the Pallas TPU interdomain op (docs/math/interdomain.md, 'Gradients'), one per forward
kernel, on the same grid (B·H, N) with both axes "parallel": every chunk's gradients depend only on that
chunk's inputs, its start state and the forward's saved [K, K] matrix (Sc or P). The decay factors are
recomputed through the forward's own ``Chunk`` and ``level`` (no exponent > 0); the per-head parameters (θ, b)
get per-chunk partial sums [B·H, N, 3, M] that XLA reduces.

``interdomain_tpu_output_bwd`` (from dO; P saved):
  dv = Pᵀ dO, dP = dO vᵀ; per level with dP_ℓ = pairs_ℓ ⊙ same-doc ⊙ dP:
  dh = (dP_ℓ c_re, −dP_ℓ c_im), dc = (dP_ℓᵀ h_re, −dP_ℓᵀ h_im) → dω, df (→ dr, dθ), db; the diagonal
  dω += dP_ss b, db += Σ_s dP_ss ω; the carried part dX̂ᵛ₀ = (Re gᵀ dO, −Im gᵀ dO), dg → dω and de^{ℓ} (→ dr, dθ).
``interdomain_tpu_query_bwd`` (from dâ; Sc saved):
  per level: du = conj(f) ⊙ dâ, dSc += pairs ⊙ (du_re c_reᵀ + du_im c_imᵀ), dc = (Sc ⊙ pairs)ᵀ du → df, db,
  df += conj(u) ⊙ dâ (→ dr, dθ); the diagonal d diag(Sc) = Re(conj(b)·dâ), db += Σ_s diag(Sc)_s dâ_s;
  dk = dScᵀ q + d diag ⊙ q, dq = dSc k + d diag ⊙ k; the carried part dy = conj(e^{ℓ}) ⊙ dâ → dq, dX̂ᵏ₀, and
  de^{ℓ} = conj(y) ⊙ dâ (→ dr, dθ).
A factor f = exp(W r) e^{iθ n} with cotangent df gives dr += Wᵀ Re(conj(f) df) (the transposed 0/1 range
sums) and dθ += Σ_s n_s Im(conj(f) df).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mixerlab.pallas_kernels.interdomain.pallas_tpu import (F32, Chunk, KernelConfig, Specs, conj_mul,
                                                            factor_grads, mm, mm_nt, mm_tn, over_levels, pallas, upto)


def _gain_grads(ch: Chunk, dc_re, dc_im, f_re, f_im):
    """c = b ⊙ f: (df_re, df_im, db_re [1, M], db_im [1, M]) from dc."""
    df_re = dc_re * ch.b_re + dc_im * ch.b_im
    df_im = dc_im * ch.b_re - dc_re * ch.b_im
    return (df_re, df_im, jnp.sum(dc_re * f_re + dc_im * f_im, axis=0, keepdims=True),
            jnp.sum(dc_im * f_re - dc_re * f_im, axis=0, keepdims=True))


def _carry_in_grads(ch: Chunk, e_re, e_im, de_re, de_im):
    """dr, dθ through e^{ℓ} = exp(r(−1, s]) e^{iθ(s+1)} (0 off the carried rows: so is its cotangent's effect)."""
    s = jax.lax.broadcasted_iota(jnp.int32, (ch.k, 1), 0)
    return factor_grads(upto(ch.k), (s + 1).astype(F32), e_re, e_im, de_re, de_im)


def _write_mode_grads(ref, dth, db_re, db_im):
    ref[0:1, :] = dth
    ref[1:2, :] = db_re
    ref[2:3, :] = db_im


def _query_bwd_kernel(q_ref, k_ref, r_ref, params_ref, xk_ref, doc_col_ref, doc_row_ref, scores_ref, da_re_ref,
                      da_im_ref, dq_ref, dk_ref, dr_ref, dparams_ref, dxk_ref, *, cfg: KernelConfig):
    cdt, m = cfg.cdt, cfg.modes
    ch = Chunk(r_ref[...], params_ref[...], doc_col_ref[...], doc_row_ref[...])
    q, k = q_ref[...], k_ref[...]
    qf, kf = q.astype(F32), k.astype(F32)
    da_re, da_im = da_re_ref[...], da_im_ref[...]
    scores = scores_ref[...].astype(F32)
    # the diagonal (D = 1): â += diag(Sc) b
    diag = jnp.sum(qf * kf, axis=1, keepdims=True)
    d_diag = jnp.sum(da_re * ch.b_re + da_im * ch.b_im, axis=1, keepdims=True)
    db_re = jnp.sum(diag * da_re, axis=0, keepdims=True)
    db_im = jnp.sum(diag * da_im, axis=0, keepdims=True)
    d_scores = jnp.zeros_like(scores)
    dr = jnp.zeros_like(ch.r)
    dth = jnp.zeros_like(ch.theta)

    def pair_grads(lv, acc):
        d_scores, dr, dth, db_re, db_im = acc
        f_re, f_im = ch.factor(lv)
        c_re, c_im = ch.gained(f_re, f_im)
        s_l = jnp.where(lv.pairs, scores, 0.0)
        u_re, u_im = mm(s_l, c_re, cdt), mm(s_l, c_im, cdt)
        du_re, du_im = conj_mul(f_re, f_im, da_re, da_im)
        d_scores = d_scores + jnp.where(lv.pairs, mm_nt(du_re, c_re, cdt) + mm_nt(du_im, c_im, cdt), 0.0)
        dc_re, dc_im = mm_tn(s_l, du_re, cdt), mm_tn(s_l, du_im, cdt)
        df_re, df_im, db_l_re, db_l_im = _gain_grads(ch, dc_re, dc_im, f_re, f_im)
        du_re, du_im = conj_mul(u_re, u_im, da_re, da_im)  # f's own cotangent conj(u) ⊙ dâ
        dr_l, dth_l = factor_grads(lv.sums, lv.offset, f_re, f_im, df_re + du_re, df_im + du_im)
        return d_scores, dr + dr_l, dth + dth_l, db_re + db_l_re, db_im + db_l_im

    d_scores, dr, dth, db_re, db_im = over_levels(cfg, pair_grads, (d_scores, dr, dth, db_re, db_im))
    d_scores = jnp.where(ch.strict, d_scores, 0.0)
    dk_ref[...] = (mm_tn(d_scores, q, cdt) + d_diag * qf).astype(dk_ref.dtype)
    dq = mm(d_scores, k, cdt) + d_diag * kf
    # the carried part â += e^{ℓ} ⊙ (X̂ᵏ₀ q)
    xk = xk_ref[...]
    xk_re, xk_im = xk[:m], xk[m:]
    y_re, y_im = mm_nt(q, xk_re, cdt), mm_nt(q, xk_im, cdt)
    e_re, e_im = ch.carry_in()
    dy_re, dy_im = conj_mul(e_re, e_im, da_re, da_im)
    de_re, de_im = conj_mul(y_re, y_im, da_re, da_im)
    dxk_ref[:m, :] = mm_tn(dy_re, q, cdt)
    dxk_ref[m:, :] = mm_tn(dy_im, q, cdt)
    dq_ref[...] = (dq + mm(dy_re, xk_re, cdt) + mm(dy_im, xk_im, cdt)).astype(dq_ref.dtype)
    dr_e, dth_e = _carry_in_grads(ch, e_re, e_im, de_re, de_im)
    dr_ref[...] = dr + dr_e
    _write_mode_grads(dparams_ref, dth + dth_e, db_re, db_im)


def _output_bwd_kernel(om_re_ref, om_im_ref, v_ref, r_ref, params_ref, xv_ref, doc_col_ref, doc_row_ref, pairs_ref,
                       do_ref, dom_re_ref, dom_im_ref, dv_ref, dr_ref, dparams_ref, dxv_ref, *, cfg: KernelConfig):
    cdt, m = cfg.cdt, cfg.modes
    ch = Chunk(r_ref[...], params_ref[...], doc_col_ref[...], doc_row_ref[...])
    om_re, om_im = om_re_ref[...], om_im_ref[...]
    d_out = do_ref[...]
    dv_ref[...] = mm_tn(pairs_ref[...], d_out, cdt).astype(dv_ref.dtype)  # the forward's P
    d_pairs = mm_nt(d_out, v_ref[...], cdt)  # dP [K, K]
    dp_diag = jnp.sum(jnp.where(ch.eye, d_pairs, 0.0), axis=1, keepdims=True)
    # P's diagonal Re(conj(ω)·b): dω += dP_ss b, db += Σ_s dP_ss ω
    dom_re, dom_im = dp_diag * ch.b_re, dp_diag * ch.b_im
    db_re = jnp.sum(dp_diag * om_re, axis=0, keepdims=True)
    db_im = jnp.sum(dp_diag * om_im, axis=0, keepdims=True)
    dr = jnp.zeros_like(ch.r)
    dth = jnp.zeros_like(ch.theta)
    same = ch.same_doc

    def pair_grads(lv, acc):
        dom_re, dom_im, dr, dth, db_re, db_im = acc
        f_re, f_im = ch.factor(lv)
        c_re, c_im = ch.gained(f_re, f_im)
        h_re, h_im = conj_mul(om_re, om_im, f_re, f_im)
        dp_l = jnp.where(lv.pairs & same, d_pairs, 0.0)
        dh_re, dh_im = mm(dp_l, c_re, cdt), -mm(dp_l, c_im, cdt)
        dc_re, dc_im = mm_tn(dp_l, h_re, cdt), -mm_tn(dp_l, h_im, cdt)
        dom_re = dom_re + dh_re * f_re + dh_im * f_im
        dom_im = dom_im + dh_re * f_im - dh_im * f_re
        df_re, df_im, db_l_re, db_l_im = _gain_grads(ch, dc_re, dc_im, f_re, f_im)
        df_re = df_re + dh_re * om_re - dh_im * om_im  # h = conj(ω) ⊙ f
        df_im = df_im + dh_re * om_im + dh_im * om_re
        dr_l, dth_l = factor_grads(lv.sums, lv.offset, f_re, f_im, df_re, df_im)
        return dom_re, dom_im, dr + dr_l, dth + dth_l, db_re + db_l_re, db_im + db_l_im

    dom_re, dom_im, dr, dth, db_re, db_im = over_levels(cfg, pair_grads, (dom_re, dom_im, dr, dth, db_re, db_im))
    # the carried part Re(conj(ω) ⊙ e^{ℓ}) X̂ᵛ₀
    e_re, e_im = ch.carry_in()
    g_re, g_im = conj_mul(om_re, om_im, e_re, e_im)
    xv = xv_ref[...]
    dxv_ref[:m, :] = mm_tn(g_re, d_out, cdt)
    dxv_ref[m:, :] = -mm_tn(g_im, d_out, cdt)
    dg_re, dg_im = mm_nt(d_out, xv[:m], cdt), -mm_nt(d_out, xv[m:], cdt)
    dom_re_ref[...] = dom_re + dg_re * e_re + dg_im * e_im
    dom_im_ref[...] = dom_im + dg_re * e_im - dg_im * e_re
    de_re = dg_re * om_re - dg_im * om_im
    de_im = dg_re * om_im + dg_im * om_re
    dr_e, dth_e = _carry_in_grads(ch, e_re, e_im, de_re, de_im)
    dr_ref[...] = dr + dr_e
    _write_mode_grads(dparams_ref, dth + dth_e, db_re, db_im)


def query_bwd_call(cfg: KernelConfig, q, k, r, params, xk, doc_col, doc_row, scores, da_re, da_im):
    """(dq, dk in q's dtype, dr [B·H, Tp, M] f32, per-chunk (dθ, db_re, db_im) [B·H, N, 3, M], dX̂ᵏ₀ per chunk)."""
    bh, tp, _ = q.shape
    grid = (bh, tp // cfg.chunk)
    sp = Specs(cfg)
    shape = jax.ShapeDtypeStruct
    in_specs = ([sp.tokens(cfg.key_dim)] * 2 + [sp.tokens(cfg.modes), sp.params, sp.state(cfg.key_dim), sp.doc_col,
                                                sp.doc_row, sp.pair_matrix] + [sp.tokens(cfg.modes)] * 2)
    out = (shape(q.shape, q.dtype), shape(k.shape, k.dtype), shape(r.shape, F32),
           shape((*grid, 3, cfg.modes), F32), shape(xk.shape, F32))
    out_specs = (sp.tokens(cfg.key_dim), sp.tokens(cfg.key_dim), sp.tokens(cfg.modes), sp.mode_grads,
                 sp.state(cfg.key_dim))
    return pallas(cfg, _query_bwd_kernel, "query_bwd", grid, in_specs, out, out_specs)(
        q, k, r, params, xk, doc_col, doc_row, scores, da_re, da_im)


def output_bwd_call(cfg: KernelConfig, om_re, om_im, v, r, params, xv, doc_col, doc_row, pairs, d_out):
    """(dω_re, dω_im [B·H, Tp, M] f32, dv in v's dtype, dr f32, per-chunk (dθ, db_re, db_im), dX̂ᵛ₀ per chunk)."""
    bh, tp, dv = v.shape
    grid = (bh, tp // cfg.chunk)
    sp = Specs(cfg)
    shape = jax.ShapeDtypeStruct
    in_specs = ([sp.tokens(cfg.modes)] * 2 + [sp.tokens(dv), sp.tokens(cfg.modes), sp.params, sp.state(dv),
                                              sp.doc_col, sp.doc_row, sp.pair_matrix, sp.tokens(dv)])
    out = (shape(om_re.shape, F32), shape(om_im.shape, F32), shape(v.shape, v.dtype), shape(r.shape, F32),
           shape((*grid, 3, cfg.modes), F32), shape(xv.shape, F32))
    out_specs = (sp.tokens(cfg.modes), sp.tokens(cfg.modes), sp.tokens(dv), sp.tokens(cfg.modes), sp.mode_grads,
                 sp.state(dv))
    return pallas(cfg, _output_bwd_kernel, "output_bwd", grid, in_specs, out, out_specs)(
        om_re, om_im, v, r, params, xv, doc_col, doc_row, pairs, d_out)
