"""Kernel bodies of the Pallas-Triton delta rule (``pallas_triton.py`` lists the passes): K1 ``intra`` and its
two-pass split, B0 ``rhs``, K2 ``scan`` / ``scan_output``, K3 ``output``, B1 ``scan_bwd``, B2a ``cotangents``
and B2b ``key_grads``. Each function returns the kernel (or the body :func:`_passes` turns into one) for a
:class:`~.pallas_triton_config.Config`; the launches are in ``pallas_triton_calls.py``."""
from __future__ import annotations


import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mixerlab.pallas_kernels.delta_rule.pallas_triton_config import F32
from mixerlab.pallas_kernels.delta_rule.pallas_triton_tiles import (
    _bounded_cut, _chunk_masks, _chunk_matrices, _decay, _dot, _edge_decays, _inverse, _key_block, _level,
    _pivot_factors, _split)


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


def _intra_plain_body(cfg):
    """K1 without an erase (``cfg.has_erase`` False): M, Q̂⊙π, K⊙E, π_C — no A, no inverse, no U or Y (U is V̂
    itself and Y is zero; the scan and the output read V̂ by token)."""
    def body(inputs, outputs, whole_chunk):
        q_ref, k_ref, log_decay_ref, document_ref, carried_document_ref = inputs
        readout_out, query_start_out, key_eff_out, chunk_decay_out = outputs
        masks = _chunk_masks(document_ref, carried_document_ref, cfg)
        m, _, flag = _chunk_matrices(q_ref, k_ref, None, log_decay_ref, masks, cfg, query_start_out, key_eff_out,
                                     chunk_decay_out, key_start_out=None, whole_chunk=whole_chunk)
        readout_out[...] = m.astype(readout_out.dtype)
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
    c = cfg.chunk
    if not cfg.has_erase:  # Ũ = V̂ (read by token): S ← Diag(π_C) S + (K⊙E)ᵀ V̂, no Ũ written
        def plain(values_ref, key_eff_ref, chunk_decay_ref, s_init_ref, starts_out, s_final_out):
            def body(n, state):
                starts_out[n] = state.astype(starts_out.dtype)
                values = values_ref[pl.ds(n * c, c), :]
                return chunk_decay_ref[n][:, None] * state + _dot(key_eff_ref[n], values, cfg, trans_a=True)

            s_final_out[...] = jax.lax.fori_loop(0, n_chunks, body, s_init_ref[...].astype(F32))

        return plain

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

    def kernel(*refs):
        if cfg.has_erase:
            (state_reads_ref, pseudo_values_ref, key_eff_ref, chunk_decay_ref, query_start_ref, readout_ref,
             s_init_ref, o_out, s_final_out) = refs
        else:  # V̂ by token is Ũ itself
            (pseudo_values_ref, key_eff_ref, chunk_decay_ref, query_start_ref, readout_ref, s_init_ref, o_out,
             s_final_out) = refs

        def body(n, state):
            by_token = cfg.fold_solve or not cfg.has_erase
            values = pseudo_values_ref[pl.ds(n * c, c), :] if by_token else pseudo_values_ref[n]
            if cfg.has_erase:
                true_pseudo = values.astype(F32) - _dot(state_reads_ref[n], state, cfg)
            else:
                true_pseudo = values
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
    if not cfg.has_erase:  # dV̂ = dŨ = Mᵀ dO + (K⊙E) dS (written by token), dS ← (Q̂⊙π)ᵀ dO + Diag(π_C) dS
        def plain(readout_ref, do_ref, key_eff_ref, query_start_ref, chunk_decay_ref, ds_final_ref, d_ends_out,
                  dv_out, d_start_state_out):
            def body(i, d_state):
                n = n_chunks - 1 - i
                d_ends_out[n] = d_state.astype(d_ends_out.dtype)
                d_out = do_ref[pl.ds(n * c, c), :]
                d_values = _dot(readout_ref[n], d_out, cfg, trans_a=True) + _dot(key_eff_ref[n], d_state, cfg)
                dv_out[pl.ds(n * c, c), :] = d_values.astype(dv_out.dtype)
                return _dot(query_start_ref[n], d_out, cfg, trans_a=True) + chunk_decay_ref[n][:, None] * d_state

            d_start_state_out[...] = jax.lax.fori_loop(0, n_chunks, body, ds_final_ref[...].astype(F32))

        return plain

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


def _readout_grad_kernel(cfg):
    """B2a without an erase: dM = dO V̂ᵀ on the causal same-document pairs (no Ũ, no dA, no transposed solve:
    dV̂ came out of the reverse scan)."""
    def kernel(document_ref, carried_document_ref, v_ref, do_ref, d_readout_out):
        masks = _chunk_masks(document_ref, carried_document_ref, cfg)
        d_m = _dot(do_ref[...], v_ref[...], cfg, trans_b=True)
        d_readout_out[...] = jnp.where(masks.causal & masks.same_doc, d_m, 0.0).astype(d_readout_out.dtype)

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

    erase = cfg.has_erase

    def body(inputs, outputs, whole_chunk):
        if erase:
            (q_ref, k_ref, erase_ref, log_decay_ref, document_ref, carried_document_ref, inverse_ref, starts_ref,
             d_ends_ref, do_ref, d_true_pseudo_ref, true_pseudo_ref, d_readout_ref, d_strict_ref) = inputs
            dq_out, dk_out, d_erase_out, d_log_decay_out = outputs
        else:  # no A: no dk̂, no dA terms, no dR = Pᵀ dY; Ũ is V̂ (by token)
            (q_ref, k_ref, log_decay_ref, document_ref, carried_document_ref, starts_ref, d_ends_ref, do_ref,
             true_pseudo_ref, d_readout_ref) = inputs
            dq_out, dk_out, d_log_decay_out = outputs
        masks = _chunk_masks(document_ref, carried_document_ref, cfg)
        log_decay = log_decay_ref[...].astype(F32)
        log_decay_split = _split(log_decay, cfg)
        q, k = q_ref[...], k_ref[...]  # operand dtype; products promote to f32
        e = erase_ref[...] if erase else None
        wide = cfg.pair_grads_f32

        def pair_terms(d_a, d_m, left, right, acc=None):
            """(dk̂, dq̂, dk) pair terms of one pivot product (plus ``acc``), dA and dM already masked to its pairs;
            the delta kernel's products in its original order; without an erase the dk̂ term is a scalar 0 and
            no dA product runs."""
            add = (lambda i, x: x) if acc is None else (lambda i, x: acc[i] + x)
            kr = k * right
            if not erase:  # (the loop carries the scalar through: a fresh constant is no loop value for Triton)
                return (jnp.zeros((), F32) if acc is None else acc[0], add(1, _dot(d_m, kr, cfg, f32=wide) * left),
                        add(2, _dot(d_m, q * left, cfg, trans_a=True, f32=wide) * right))
            return (add(0, _dot(d_a, kr, cfg, f32=wide) * left), add(1, _dot(d_m, kr, cfg, f32=wide) * left),
                    add(2, (_dot(d_a, e * left, cfg, trans_a=True, f32=wide)
                            + _dot(d_m, q * left, cfg, trans_a=True, f32=wide)) * right))

        # pair gradients through the pivot tree (same factors as the forward; F is ρ on right-half rows and
        # κ on left-half rows)
        def level(l, acc):
            pairs, sums = _level(cfg, l)
            f = _decay(sums, log_decay_split, cfg)
            d_a = d_strict_ref[...] if erase else None
            d_m = d_readout_ref[...]
            da_l = jnp.where(pairs, d_a, jnp.zeros_like(d_a)) if erase else None
            dm_l = jnp.where(pairs, d_m, jnp.zeros_like(d_m))
            return pair_terms(da_l, dm_l, f, f, acc)

        zeros = jnp.zeros((c, cfg.block_k), F32)
        pair_grads = (zeros if erase else jnp.zeros((), F32), zeros, zeros)
        cut = 0
        if cfg.bounded_span is not None:  # the forward's one product per node, transposed
            if whole_chunk:
                cut, sums = cfg.levels, None
            else:
                cut, sums = _bounded_cut(log_decay_split, cfg, keep_sums=False)
            pairs, left, right = _pivot_factors(cut, sums, log_decay_split, cfg)
            if whole_chunk:
                pairs = masks.strict
            d_a = jnp.where(pairs, d_strict_ref[...], jnp.zeros_like(d_strict_ref[...])) if erase else None
            d_m = jnp.where(pairs, d_readout_ref[...], jnp.zeros_like(d_readout_ref[...]))
            pair_grads = pair_terms(d_a, d_m, left, right)
        d_e_pair, d_q_pair, d_k_pair = pair_grads if whole_chunk else jax.lax.fori_loop(cut, cfg.levels, level,
                                                                                        pair_grads)
        # the state terms after the level loop: nothing [C, BK] extra stays live across it
        s0 = starts_ref[...]
        d_ends = d_ends_ref[...]
        d_qpi = _dot(do_ref[...], s0, cfg, trans_b=True)
        d_keff = _dot(true_pseudo_ref[...], d_ends, cfg, trans_b=True)
        d_pic = jnp.sum(s0.astype(F32) * d_ends.astype(F32), axis=1)
        if erase:  # (in the delta kernel's original order)
            d_r = _dot(inverse_ref[...], -_dot(d_true_pseudo_ref[...], s0, cfg, trans_b=True), cfg, trans_a=True)
        d_m_diag = jnp.sum(jnp.where(masks.eye, d_readout_ref[...].astype(F32), 0.0), axis=1)[:, None]
        start, end, chunk_decay = _edge_decays(log_decay, log_decay_split, masks, cfg)
        dq_out[...] = (d_qpi * start + d_q_pair + d_m_diag * k).astype(dq_out.dtype)
        if erase:
            d_erase_out[...] = (d_r * start + d_e_pair).astype(d_erase_out.dtype)
        dk_out[...] = (d_keff * end + d_k_pair + d_m_diag * q).astype(dk_out.dtype)
        # log-decay: every exponent is Λ_i − Λ_j (pairs, π, E, π_C; Λ the chunk's inclusive cumsum), so
        # dΛ_i collects +g, dΛ_j −g; dλ = reverse cumsum of dΛ within the chunk.
        end_terms = end * d_keff * k
        if erase:
            d_cum = (e * d_e_pair - k * d_k_pair + q * d_q_pair + start * (d_qpi * q + d_r * e) - end_terms)
        else:
            d_cum = -k * d_k_pair + q * d_q_pair + start * (d_qpi * q) - end_terms
        chunk_end = jnp.sum(end_terms, axis=0) + d_pic * chunk_decay
        total = jnp.sum(d_cum, axis=0)
        d_lam = total[None, :] - jnp.cumsum(d_cum, axis=0) + d_cum + chunk_end[None, :]
        d_log_decay_out[...] = d_lam.astype(d_log_decay_out.dtype)

    return body
