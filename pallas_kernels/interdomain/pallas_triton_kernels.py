"""The kernel bodies of the Pallas-Triton interdomain op: query, output and their backward kernels (launched by
``pallas_triton_calls.py``)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mixerlab.pallas_kernels.interdomain.pallas_triton_config import F32
from mixerlab.pallas_kernels.interdomain.pallas_triton_tiles import (
    _Masks, _Modes, _carry_in, _cmul, _conj_mul, _dot, _factor_grads, _gain_grads, _level, _n_blocks, _scores)


# ---------------------------------------------------------------------------------------------------------
# kernels. Query side:  â = e^{ℓ} ⊙ (X̂ᵏ₀ q) + b ⊙ Σ_{j≤s} Sc[s, j] D[s, j]      (``query``, ``query_bwd``)
#          readout:     ω = Ĝ â                                                  (XLA, between the two)
#          value side:  o = P v + Re(conj(ω) ⊙ e^{ℓ}) X̂ᵛ₀                        (``output``, ``output_bwd``)
# Every kernel walks the modes in blocks of BM (everything but P, Sc and their cotangents is per mode), so
# the per-mode tiles are [K, BM].


def _query_kernel(cfg, save_scores):
    k_len = cfg.chunk

    def kernel(q_ref, k_ref, r_ref, theta_ref, gain_ref, xk_ref, doc_ref, carry_ref, a_ref, *maybe_scores_out):
        masks = _Masks(doc_ref[...], carry_ref[...], k_len)
        scores, diag = _scores(q_ref[...], k_ref[...], masks, cfg)
        if save_scores:
            maybe_scores_out[0][...] = scores.astype(maybe_scores_out[0].dtype)

        def block(mb, carry):
            md = _Modes(mb, cfg, r_ref, theta_ref, gain_ref)

            def level(lv, acc):
                pairs, sums = _level(k_len, lv)
                f_re, f_im = md.factor(sums, cfg)
                c_re, c_im = md.gained(f_re, f_im)
                s_l = jnp.where(pairs, scores, 0.0)
                d_re, d_im = _cmul(f_re, f_im, _dot(s_l, c_re, cfg), _dot(s_l, c_im, cfg))
                return acc[0] + d_re, acc[1] + d_im

            w_re, w_im = jax.lax.fori_loop(0, cfg.levels, level, (diag * md.b_re, diag * md.b_im))
            q = q_ref[...]
            y_re, y_im = _dot(q, xk_ref[md.re, :], cfg, trans_b=True), _dot(q, xk_ref[md.im, :], cfg, trans_b=True)
            a_re, a_im = _cmul(*_carry_in(md.r, md.theta, masks, cfg), y_re, y_im)
            a_ref[:, md.re] = a_re + w_re
            a_ref[:, md.im] = a_im + w_im
            return carry

        jax.lax.fori_loop(0, _n_blocks(cfg), block, 0)

    return kernel


def _query_bwd_kernel(cfg):
    """Two passes over the mode blocks: the in-chunk part (pivot levels; dSc, dr, dθ, db), then the carried
    part (dq's state term, dX̂ᵏ₀ and its own dr, dθ), so that dSc and dq are never live at the same time."""
    k_len = cfg.chunk

    def kernel(q_ref, k_ref, r_ref, theta_ref, gain_ref, xk_ref, doc_ref, carry_ref, scores_ref, da_ref,
               dq_ref, dk_ref, dr_ref, dth_ref, db_ref, dr_carry_ref, dth_carry_ref, dxk_ref):
        masks = _Masks(doc_ref[...], carry_ref[...], k_len)

        def in_chunk(mb, acc):
            d_scores, d_diag = acc
            md = _Modes(mb, cfg, r_ref, theta_ref, gain_ref)
            da_re, da_im = da_ref[:, md.re], da_ref[:, md.im]
            # the diagonal (D = 1): â += diag(Sc) b
            diag = jnp.sum(q_ref[...].astype(F32) * k_ref[...].astype(F32), axis=1)[:, None]
            d_diag = d_diag + jnp.sum(da_re * md.b_re + da_im * md.b_im, axis=1)[:, None]
            db_re, db_im = jnp.sum(diag * da_re, axis=0), jnp.sum(diag * da_im, axis=0)

            def level(lv, acc):
                d_scores, db_re, db_im, dr, dth = acc
                pairs, sums = _level(k_len, lv)
                f_re, f_im = md.factor(sums, cfg)
                c_re, c_im = md.gained(f_re, f_im)
                s_l = jnp.where(pairs, scores_ref[...], 0.0)  # the forward's Sc, read per level (not kept live)
                u_re, u_im = _dot(s_l, c_re, cfg), _dot(s_l, c_im, cfg)
                du_re, du_im = _conj_mul(f_re, f_im, da_re, da_im)
                d_scores = d_scores + jnp.where(pairs, _dot(du_re, c_re, cfg, trans_b=True)
                                                + _dot(du_im, c_im, cfg, trans_b=True), 0.0)
                dc_re, dc_im = _dot(s_l, du_re, cfg, trans_a=True), _dot(s_l, du_im, cfg, trans_a=True)
                df_re, df_im, db_l_re, db_l_im = _gain_grads(dc_re, dc_im, f_re, f_im, md)
                du_re, du_im = _conj_mul(u_re, u_im, da_re, da_im)  # f's own cotangent conj(u) ⊙ dâ
                dr_l, dth_l = _factor_grads(sums, f_re, f_im, df_re + du_re, df_im + du_im, cfg)
                return d_scores, db_re + db_l_re, db_im + db_l_im, dr + dr_l, dth + dth_l

            init = (d_scores, db_re, db_im, jnp.zeros_like(md.r), jnp.zeros_like(md.theta))
            d_scores, db_re, db_im, dr, dth = jax.lax.fori_loop(0, cfg.levels, level, init)
            dr_ref[:, md.re] = dr
            dth_ref[md.re] = dth
            db_ref[md.re] = db_re
            db_ref[md.im] = db_im
            return d_scores, d_diag

        init = (jnp.zeros((k_len, k_len), F32), jnp.zeros((k_len, 1), F32))
        d_scores, d_diag = jax.lax.fori_loop(0, _n_blocks(cfg), in_chunk, init)
        d_scores = jnp.where(masks.strict, d_scores, 0.0)
        q, k = q_ref[...], k_ref[...]
        dk_ref[...] = (_dot(d_scores, q, cfg, trans_a=True) + d_diag * q.astype(F32)).astype(dk_ref.dtype)
        dq = _dot(d_scores, k, cfg) + d_diag * k.astype(F32)

        def carried(mb, dq):
            # â += e^{ℓ} ⊙ (X̂ᵏ₀ q)
            md = _Modes(mb, cfg, r_ref, theta_ref, gain_ref)
            da_re, da_im = da_ref[:, md.re], da_ref[:, md.im]
            q = q_ref[...]
            xk_re, xk_im = xk_ref[md.re, :], xk_ref[md.im, :]
            y_re, y_im = _dot(q, xk_re, cfg, trans_b=True), _dot(q, xk_im, cfg, trans_b=True)
            e_re, e_im = _carry_in(md.r, md.theta, masks, cfg)
            dy_re, dy_im = _conj_mul(e_re, e_im, da_re, da_im)
            de_re, de_im = _conj_mul(y_re, y_im, da_re, da_im)
            dxk_ref[md.re, :] = _dot(dy_re, q, cfg, trans_a=True)
            dxk_ref[md.im, :] = _dot(dy_im, q, cfg, trans_a=True)
            dr, dth = _factor_grads(masks.upto, e_re, e_im, de_re, de_im, cfg)  # e = 0 off the carried rows
            dr_carry_ref[:, md.re] = dr
            dth_carry_ref[md.re] = dth
            return dq + _dot(dy_re, xk_re, cfg) + _dot(dy_im, xk_im, cfg)

        dq_ref[...] = jax.lax.fori_loop(0, _n_blocks(cfg), carried, dq).astype(dq_ref.dtype)

    return kernel


def _output_kernel(cfg, save_pairs):
    k_len = cfg.chunk

    def kernel(w_ref, v_ref, r_ref, theta_ref, gain_ref, xv_ref, doc_ref, carry_ref, o_ref, *maybe_pairs_out):
        masks = _Masks(doc_ref[...], carry_ref[...], k_len)

        def block(mb, acc):
            p, o = acc
            md = _Modes(mb, cfg, r_ref, theta_ref, gain_ref)
            om_re, om_im = w_ref[:, md.re], w_ref[:, md.im]

            def level(lv, p):
                pairs, sums = _level(k_len, lv)
                f_re, f_im = md.factor(sums, cfg)
                c_re, c_im = md.gained(f_re, f_im)
                h_re, h_im = _conj_mul(om_re, om_im, f_re, f_im)
                p_l = _dot(h_re, c_re, cfg, trans_b=True) - _dot(h_im, c_im, cfg, trans_b=True)
                return p + jnp.where(pairs & masks.same_doc, p_l, 0.0)

            diag = jnp.sum(om_re * md.b_re + om_im * md.b_im, axis=1)[:, None]
            p = jax.lax.fori_loop(0, cfg.levels, level, p + jnp.where(masks.eye, diag, 0.0))
            g_re, g_im = _conj_mul(om_re, om_im, *_carry_in(md.r, md.theta, masks, cfg))
            return p, o + _dot(g_re, xv_ref[md.re, :], cfg) - _dot(g_im, xv_ref[md.im, :], cfg)

        init = (jnp.zeros((k_len, k_len), F32), jnp.zeros((k_len, cfg.value_dim), F32))
        p, o = jax.lax.fori_loop(0, _n_blocks(cfg), block, init)
        o_ref[...] = (o + _dot(p, v_ref[...], cfg)).astype(o_ref.dtype)
        if save_pairs:
            maybe_pairs_out[0][...] = p.astype(maybe_pairs_out[0].dtype)

    return kernel


def _output_bwd_kernel(cfg):
    k_len = cfg.chunk

    def kernel(w_ref, v_ref, r_ref, theta_ref, gain_ref, xv_ref, doc_ref, carry_ref, pairs_ref, do_ref,
               dw_ref, dv_ref, dr_ref, dth_ref, db_ref, dxv_ref):
        masks = _Masks(doc_ref[...], carry_ref[...], k_len)
        dv_ref[...] = _dot(pairs_ref[...], do_ref[...], cfg, trans_a=True).astype(dv_ref.dtype)  # the forward's P
        d_pairs = _dot(do_ref[...], v_ref[...], cfg, trans_b=True)  # dP [K, K]
        dp_diag = jnp.sum(jnp.where(masks.eye, d_pairs, 0.0), axis=1)[:, None]

        def block(mb, carry):
            md = _Modes(mb, cfg, r_ref, theta_ref, gain_ref)
            om_re, om_im = w_ref[:, md.re], w_ref[:, md.im]
            # P's diagonal Re(conj(ω)·b) gives dω += dP_ss b, db += Σ_s dP_ss ω; then its pivot levels
            dom_re, dom_im = dp_diag * md.b_re, dp_diag * md.b_im
            db_re, db_im = jnp.sum(dp_diag * om_re, axis=0), jnp.sum(dp_diag * om_im, axis=0)

            def level(lv, acc):
                dom_re, dom_im, db_re, db_im, dr, dth = acc
                pairs, sums = _level(k_len, lv)
                f_re, f_im = md.factor(sums, cfg)
                c_re, c_im = md.gained(f_re, f_im)
                h_re, h_im = _conj_mul(om_re, om_im, f_re, f_im)
                dp_l = jnp.where(pairs & masks.same_doc, d_pairs, 0.0)
                dh_re, dh_im = _dot(dp_l, c_re, cfg), -_dot(dp_l, c_im, cfg)
                dc_re, dc_im = _dot(dp_l, h_re, cfg, trans_a=True), -_dot(dp_l, h_im, cfg, trans_a=True)
                dom_re = dom_re + dh_re * f_re + dh_im * f_im
                dom_im = dom_im + dh_re * f_im - dh_im * f_re
                df_re, df_im, db_l_re, db_l_im = _gain_grads(dc_re, dc_im, f_re, f_im, md)
                df_re = df_re + dh_re * om_re - dh_im * om_im
                df_im = df_im + dh_re * om_im + dh_im * om_re
                dr_l, dth_l = _factor_grads(sums, f_re, f_im, df_re, df_im, cfg)
                return dom_re, dom_im, db_re + db_l_re, db_im + db_l_im, dr + dr_l, dth + dth_l

            init = (dom_re, dom_im, db_re, db_im, jnp.zeros_like(md.r), jnp.zeros_like(md.theta))
            dom_re, dom_im, db_re, db_im, dr, dth = jax.lax.fori_loop(0, cfg.levels, level, init)
            # the carried part Re(conj(ω) ⊙ e^{ℓ}) X̂ᵛ₀
            d_out = do_ref[...]
            e_re, e_im = _carry_in(md.r, md.theta, masks, cfg)
            g_re, g_im = _conj_mul(om_re, om_im, e_re, e_im)
            xv_re, xv_im = xv_ref[md.re, :], xv_ref[md.im, :]
            dxv_ref[md.re, :] = _dot(g_re, d_out, cfg, trans_a=True)
            dxv_ref[md.im, :] = -_dot(g_im, d_out, cfg, trans_a=True)
            dg_re, dg_im = _dot(d_out, xv_re, cfg, trans_b=True), -_dot(d_out, xv_im, cfg, trans_b=True)
            dw_ref[:, md.re] = dom_re + dg_re * e_re + dg_im * e_im
            dw_ref[:, md.im] = dom_im + dg_re * e_im - dg_im * e_re
            de_re = dg_re * om_re - dg_im * om_im
            de_im = dg_re * om_im + dg_im * om_re
            dr_e, dth_e = _factor_grads(masks.upto, e_re, e_im, de_re, de_im, cfg)
            dr_ref[:, md.re] = dr + dr_e
            dth_ref[md.re] = dth + dth_e
            db_ref[md.re] = db_re
            db_ref[md.im] = db_im
            return carry

        jax.lax.fori_loop(0, _n_blocks(cfg), block, 0)

    return kernel
