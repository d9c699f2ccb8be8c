"""Custom VJP of the chunkwise delta rule (docs/math/delta_rule.md, 'Backward pass'), written for the two-phase forward
of ``xla.py``.

Saved for the backward: the inputs and the chunk-start states S₀⁽ⁿ⁾ only. The backward recomputes every
state-independent chunk tensor (leaf decays, pivots, P, M, U, Y, ...) for all chunks in parallel, runs one
reverse scan for dS (dS₀ = Q_effᵀ dO + Fᵀ dS_C), then finishes every chunk in parallel:

  dQ_eff = dO S₀ᵀ              dU = Mᵀ dO + K_eff dS_C         dM = tril(dO Uᵀ − dQ_eff Yᵀ)
  dY = −Mᵀ dQ_eff − K_eff dS_C S₀ᵀ                          dK_eff = (U − Y S₀) dS_Cᵀ
  [dV̂ ‖ dR] = Pᵀ [dU ‖ dY]   (transposed fused solve)       dA = −tril_s([dV̂ ‖ dR][U ‖ Y]ᵀ)
  dπ_C = rowsum(S₀ ⊙ dS_C)

dA and dM go back to vectors through the same leaves / pivot factors as the forward (no exponent > 0), and
the log-decay gradient uses the "q⊙dq − k⊙dk" identity: every exponent is Σ_{j<s≤i} λ_s, so a pair term g
adds +g to dΛ_i and −g to dΛ_j, and dλ = reverse-cumsum(dΛ) within the chunk. Nothing differentiates
through the Neumann / merge recursion.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mixerlab.pallas_kernels import common
from mixerlab.pallas_kernels.delta_rule import xla
from mixerlab.pallas_kernels.delta_rule.xla import matmul, transpose


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def chunked_delta_rule(q, k, erase, v, log_decay, initial_BHKV, document_B1NC, carry_document_B1N, leaf_size):
    """Chunked inputs [B,H,N,C,D] (compute dtype) -> (o [B,H,N,C,V], final state [B,H,K,V])."""
    out, final, _ = xla.chunked_forward(q, k, erase, v, log_decay, initial_BHKV, document_B1NC,
                                        carry_document_B1N, leaf_size)
    return out, final


def _forward(q, k, erase, v, log_decay, initial_BHKV, document_B1NC, carry_document_B1N, leaf_size):
    out, final, starts = xla.chunked_forward(q, k, erase, v, log_decay, initial_BHKV, document_B1NC,
                                             carry_document_B1N, leaf_size)
    out, final, starts = common.keep_for_backward((out, final, starts))
    return (out, final), (q, k, erase, v, log_decay, document_B1NC, carry_document_B1N, starts)


def _reverse_state_scan(transition_BHNKK, out_to_state_BHNKV, d_final_BHKV):
    """dS₀⁽ⁿ⁾ = Q_effᵀ dO⁽ⁿ⁾ + F⁽ⁿ⁾ᵀ dS_C⁽ⁿ⁾ with dS_C⁽ⁿ⁾ = dS₀⁽ⁿ⁺¹⁾. Returns (dS_C per chunk, dS₀⁽⁰⁾)."""

    def step(d_end, chunk):
        transition, out_to_state = chunk
        if transition.ndim == d_end.ndim - 1:  # F = Diag(π_C), given as π_C (no erase)
            return out_to_state + transition[..., :, None] * d_end, d_end
        return out_to_state + matmul(transpose(transition), d_end), d_end

    d_initial, d_ends = jax.lax.scan(
        step, d_final_BHKV,
        (jnp.moveaxis(transition_BHNKK, 2, 0), jnp.moveaxis(out_to_state_BHNKV, 2, 0)), reverse=True)
    return jnp.moveaxis(d_ends, 0, 2), d_initial


def _backward(leaf_size, residuals, cotangents):
    q, k, erase, v, log_decay, document_B1NC, carry_document_B1N, starts = residuals
    d_out, d_final = cotangents
    t = xla.chunk_tensors(q, k, erase, v, log_decay, document_B1NC, carry_document_B1N, leaf_size)
    if erase is None:
        return _backward_without_erase(t, q, k, v, starts, d_out, d_final, leaf_size)
    chunk = q.shape[-2]

    d_ends, d_initial = _reverse_state_scan(t.transition, matmul(transpose(t.query_eff), d_out), d_final)

    readout_t = transpose(t.readout)
    d_query_eff = matmul(d_out, transpose(starts))
    d_pseudo = matmul(readout_t, d_out) + matmul(t.key_eff, d_ends)
    d_state_reads = -matmul(readout_t, d_query_eff) - matmul(t.key_eff, matmul(d_ends, transpose(starts)))
    true_pseudo = t.pseudo_values - matmul(t.state_reads, starts)
    d_key_eff = matmul(true_pseudo, transpose(d_ends))
    d_chunk_decay = jnp.sum(starts * d_ends, axis=-1)

    causal = jnp.tril(jnp.ones((chunk, chunk), dtype=bool))
    strict = jnp.tril(causal, -1)
    d_readout = jnp.where(causal & t.same_doc,
                          matmul(d_out, transpose(t.pseudo_values)) - matmul(d_query_eff, transpose(t.state_reads)),
                          0.0)

    value_width = v.shape[-1]
    d_rhs = matmul(transpose(t.inverse), jnp.concatenate([d_pseudo, d_state_reads], axis=-1))
    d_v, d_erase_start = d_rhs[..., :value_width], d_rhs[..., value_width:]
    solved = jnp.concatenate([t.pseudo_values, t.state_reads], axis=-1)
    d_strict = jnp.where(strict & t.same_doc, -matmul(d_rhs, transpose(solved)), 0.0)

    d_erase_pairs, d_key_a, d_query_pairs, d_key_m = _contract_pairs(t, q, k, erase, d_strict, d_readout,
                                                                     leaf_size)

    d_q = d_query_eff * t.start_decay + d_query_pairs
    d_erase = d_erase_start * t.start_decay + d_erase_pairs
    d_k = d_key_eff * t.end_decay + d_key_a + d_key_m

    end_terms = t.end_decay * d_key_eff * k
    d_cum_log_decay = (erase * d_erase_pairs - k * d_key_a + q * d_query_pairs - k * d_key_m
                       + t.start_decay * (d_query_eff * q + d_erase_start * erase) - end_terms)
    d_log_decay = _log_decay_grad(t, d_cum_log_decay, end_terms, d_chunk_decay)
    return d_q, d_k, d_erase, d_v, d_log_decay, d_initial, None, None


def _log_decay_grad(t, d_cum_log_decay, end_terms, d_chunk_decay):
    """dλ from dΛ: the chunk-end terms (Σ_i of K⊙E⊙H and π_C ⊙ rowsum(S₀⊙dS_C)) join the last token, then
    the reverse cumsum within the chunk."""
    chunk_end = jnp.sum(end_terms, axis=-2) + d_chunk_decay * t.chunk_decay
    d_cum_log_decay = d_cum_log_decay.at[..., -1, :].add(chunk_end)
    return xla.reverse_inclusive_cumsum(d_cum_log_decay)


def _backward_without_erase(t, q, k, v, starts, d_out, d_final, leaf_size):
    """:func:`_backward` with k̂ = 0: P = I, Y = 0, F = Diag(π_C), so dV̂ = dU = Mᵀ dO + K_eff dS_C (no transposed
    solve), dM = tril(dO V̂ᵀ), no dA, and dq̂, dk, dλ from dM and the chunk edges alone."""
    chunk = q.shape[-2]
    d_ends, d_initial = _reverse_state_scan(t.chunk_decay, matmul(transpose(t.query_eff), d_out), d_final)
    d_query_eff = matmul(d_out, transpose(starts))
    d_v = matmul(transpose(t.readout), d_out) + matmul(t.key_eff, d_ends)
    d_key_eff = matmul(v, transpose(d_ends))
    d_chunk_decay = jnp.sum(starts * d_ends, axis=-1)
    causal = jnp.tril(jnp.ones((chunk, chunk), dtype=bool))
    d_readout = jnp.where(causal & t.same_doc, matmul(d_out, transpose(v)), 0.0)
    _, _, d_query_pairs, d_key_m = _contract_pairs(t, q, k, None, None, d_readout, leaf_size)

    d_q = d_query_eff * t.start_decay + d_query_pairs
    d_k = d_key_eff * t.end_decay + d_key_m
    end_terms = t.end_decay * d_key_eff * k
    d_cum_log_decay = q * d_query_pairs - k * d_key_m + t.start_decay * d_query_eff * q - end_terms
    return d_q, d_k, None, d_v, _log_decay_grad(t, d_cum_log_decay, end_terms, d_chunk_decay), d_initial, None, None


def _contract_pairs(t, q, k, erase, d_strict_CC, d_readout_CC, leaf_size):
    """Gradients of A = [k̂ᵢ·kⱼ decay] and M = [q̂ᵢ·kⱼ decay] w.r.t. the row vectors (k̂, q̂) and the column
    key (k, once through A and once through M), contracted with the forward's leaves and pivots. ``erase`` None
    (no A): the A terms are None and not computed."""
    with_a = erase is not None
    # leaves, one sub-diagonal d at a time (the forward's exact decays): pair (i, i − d)
    d_a = xla.leaves_to_diagonals(xla.diagonal_blocks(d_strict_CC, leaf_size)) if with_a else None  # [..., C, n0]
    d_m = xla.leaves_to_diagonals(xla.diagonal_blocks(d_readout_CC, leaf_size))
    d_erase = jnp.zeros_like(erase) if with_a else None
    d_query = d_m[..., :1] * k
    d_key_a = jnp.zeros_like(k) if with_a else None
    d_key_m = d_m[..., :1] * q
    for offset, decay in enumerate(t.leaf_diagonals.decays, start=1):
        key = xla.shift_rows(k, offset) * decay
        if with_a:
            d_erase += d_a[..., offset:offset + 1] * key
            d_key_a += xla.shift_rows(d_a[..., offset:offset + 1] * erase * decay, -offset)
        d_query += d_m[..., offset:offset + 1] * key
        d_key_m += xla.shift_rows(d_m[..., offset:offset + 1] * q * decay, -offset)

    for level in t.levels:
        h = level.half
        d_m = xla.diagonal_blocks(d_readout_CC, 2 * h)[..., h:, :h]  # rows R, columns L
        key_left, _ = xla.split_halves(k, h)
        _, query_right = xla.split_halves(q, h)
        key_left_pivoted = key_left * level.kappa_left
        zeros = jnp.zeros_like(key_left)
        if with_a:
            d_a = xla.diagonal_blocks(d_strict_CC, 2 * h)[..., h:, :h]
            _, erase_right = xla.split_halves(erase, h)
            d_erase += xla.join_halves(zeros, matmul(d_a, key_left_pivoted) * level.rho_right)
            d_key_a += xla.join_halves(matmul(transpose(d_a), erase_right * level.rho_right) * level.kappa_left,
                                       zeros)
        d_query += xla.join_halves(zeros, matmul(d_m, key_left_pivoted) * level.rho_right)
        d_key_m += xla.join_halves(matmul(transpose(d_m), query_right * level.rho_right) * level.kappa_left, zeros)
    return d_erase, d_key_a, d_query, d_key_m


chunked_delta_rule.defvjp(_forward, _backward)
