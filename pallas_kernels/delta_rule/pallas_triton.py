"""Boundary-pivoted chunkwise delta rule on GPU through Pallas' Triton backend (docs/math/delta_rule.md; forward and
custom-VJP backward).

Recurrence (row vectors, state key-major [Dk, Dv]):  S_t = (I − k_tᵀ k̂_t) Diag(e^{λ_t}) S_{t−1} + k_tᵀ v̂_t,
o_t = q̂_t S_t.  Entry point: :func:`run` with the op's ``impl.run`` contract, and :func:`supports`.

Modules: this one holds the entry, the forward chain and the custom VJP; ``pallas_triton_config`` the
:class:`Config` and its checks; ``pallas_triton_tiles`` the in-kernel helpers (pivot tree, cut, chunk matrices,
inverse); ``pallas_triton_kernels`` the kernel bodies; ``pallas_triton_calls`` the pallas_call launches. Every
name of those modules is re-exported here.

Structure (FLA-like: the state-independent work runs for every chunk in parallel, only the small
S-dependent products are sequential):

  forward   K1 ``intra``      grid (B, H, N)       per chunk: A, M (factored pairs, pivot tree), P = (I + A)⁻¹ (Neumann
                                                   leaves + 2×2 merges), U = P V̂, Y = P (K̂⊙π), Q̂⊙π, K⊙E, π_C
                                                   (and M, P for the backward)
            K2 ``scan``       grid (B, H, Dv/BV)   sequential over chunks: S₀ saved, Ũ = U − Y S₀,
                                                   S ← Diag(π_C) S + (K⊙E)ᵀ Ũ
            K3 ``output``     grid (B, H, N)       O = (Q̂⊙π) S₀ + M Ũ
            (a forward without backward, ``fuse_output``: K2 ``scan_output`` does both in its loop and writes
            neither S₀ nor Ũ)
  backward  B0 ``rhs``        grid (B, H, N)       U, Y, Q̂⊙π, K⊙E, π_C from the saved P — only with
                                                   ``save_rhs=False`` (by default the forward's are kept);
                                                   without ``save_matrices`` K1 runs again
            B1 ``scan_bwd``   grid (B, H, Dv/BV)   reverse over chunks: dŨ = Mᵀ dO + (K⊙E) dS,
                                                   dS ← (Q̂⊙π)ᵀ dO + Diag(π_C) dS − Yᵀ dŨ   (dS_C saved)
            B2a ``cotangents`` grid (B, H, N)      Ũ, dM, dV̂ = Pᵀ dŨ, dA (the transposed solve of the backward pass)
            B2b ``key_grads`` grid (B, H, N·Dk/BK) per chunk and key block: dq̂, dk, dk̂, dλ
  ``two_pass`` (default, with ``bounded_span``): K1 and B2b each run as a kernel specialised to the whole chunk's
  cut (no cut search, no exact level compiled in; K1 flags the chunks where that cut does not hold) and a
  ``*_search`` kernel that redoes only the flagged chunks with the search (:func:`_passes`).
  Saved for the backward: the (padded) inputs, the chunk-start states S₀, M and P (C × C per chunk), and
  U, Y, Q̂⊙π, K⊙E (C × D per chunk) — all in the operand dtype (every consumer is a matmul operand in that
  dtype); π_C, the carried state and the final state are f32.

Everything inside a kernel is a 2-D tile ([C, C], [C, BK], [C, Dv]) so that Triton never reshapes or
converts layouts; K1, B0 and B2b walk the key channels in blocks of BK (``block_k``) to bound registers.

Numerics (every exponent ≤ 0, docs/math/delta_rule.md, 'Boundary pivots'; or, per key block where the gates
allow it, factors within e^{±bounded_span}: :func:`_bounded_cut`, docs/kernels_gpu.md, 'Factored pairs'):
  * A and M by the pivot tree all the way down to single tokens. A pair (i > j) belongs to exactly one
    level: the node of size 2h whose left half holds j and right half holds i, pivot p = the left half's
    last token. Its decay e^{Σ_{j<s≤i} λ} = ρ_i κ_j with ρ_i = e^{Σ_{p<s≤i} λ} and κ_j = e^{Σ_{j<s≤p} λ},
    both ≤ 1. Per level the two sums are one matmul W_h λ with a 0/1 matrix (rows in a right half: the
    half's prefix up to i; rows in a left half: the half's suffix after j) on TF32 tensor cores (see
    :func:`_split` for the accuracy), so every exponent is a sum of λ ≤ 0 over one half-node — no
    differences, no cancellation (a finer tree than xla.py's exact n0×n0 leaves, same matrices). Then
    A_level = (K̂⊙F)(K⊙F)ᵀ masked to the level's (right, left) block, M likewise with Q̂; M's diagonal is
    q̂_i·k_i (decay e^0);
  * π (chunk start, e^{Σ_{0≤s≤i}}) and E (chunk end, e^{Σ_{j<s<C}}) the same way with the whole chunk;
  * P = (I + A)⁻¹: leaves (``leaf`` × ``leaf``) by the Neumann product (I − N)(I + N²)…, then per level
    P ← P − P A_ℓ P (= −P_RR A_RL P_LL in the (R, L) blocks; f32 operands, ``inverse_precision``);
  * state, accumulation, decay factors and the inverse in f32; matmul operands in the input dtype
    (bf16 inputs: bf16 tensor-core matmuls with f32 accumulation).
Segments: ``document_BT`` (running count of boundaries); A and M keep same-document pairs, the S₀ rows
(Q̂⊙π, K̂⊙π) only the carried-in document, K⊙E only the chunk's last document, π_C is zero in a chunk with
a boundary — the same rules as ``xla.py``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mixerlab.pallas_kernels import common

# The kernels live in four modules of one job each; every name stays importable from here (tools and tests
# read ``pallas_triton.X``): configuration, in-kernel helpers, kernel bodies, pallas_call launches.
from mixerlab.pallas_kernels.delta_rule.pallas_triton_config import (  # noqa: F401
    Config, F32, MAX_HEAD_DIM, SUPPORTED_CHUNKS, SUPPORTED_LEAVES, _MIN_DIM, default_block_v,
    make_config, supports)
from mixerlab.pallas_kernels.delta_rule.pallas_triton_tiles import (  # noqa: F401
    _ChunkMasks, _bounded_cut, _chunk_masks, _chunk_matrices, _cut_sums, _decay, _decay_sums, _dot, _edge_decays,
    _end_sums, _inverse, _key_block, _level, _matmul, _pivot_factors, _split, _start_sums)
from mixerlab.pallas_kernels.delta_rule.pallas_triton_kernels import (  # noqa: F401
    _cotangents_kernel, _d_rhs, _intra_alone_body, _intra_body, _intra_plain_body, _key_grads_body, _output_kernel,
    _passes, _readout_grad_kernel, _rhs_kernel, _scan_bwd_kernel, _scan_kernel, _scan_output_kernel)
from mixerlab.pallas_kernels.delta_rule.pallas_triton_calls import (  # noqa: F401
    _chunk_spec, _cost, _cotangents, _document_specs, _grads, _grads_plain, _intra, _intra_alone, _intra_plain, _k1,
    _key_grads, _output, _params, _per_head, _per_head_v_block, _rhs, _rhs_blocks, _scan, _scan_bwd, _scan_bwd_plain,
    _scan_output, _scan_plain, _token_spec, _with_flags)


# ---------------------------------------------------------------------------------------------------------
# custom VJP (padded inputs, documents and the carried-in document per chunk)


def _forward(cfg, q, k, erase, v, log_decay, state, document, carried, for_backward=False):
    """o, S_T, and what the backward keeps: S₀, plus M and P when ``cfg.save_matrices``, plus U, Y, Q̂⊙π, K⊙E,
    π_C when ``cfg.save_rhs`` as well, plus K1's flags (``two_pass``: B2b takes the whole chunk's cut where K1
    did)."""
    keep = for_backward and cfg.save_matrices
    if not cfg.has_erase:
        return _forward_plain(cfg, q, k, v, log_decay, state, document, carried, for_backward)
    if cfg.fuse_output and cfg.fold_solve and not for_backward:  # P folded into M P and Pᵀ(K⊙E); V̂ read by the scan
        readout_p, key_start, query_start, key_eff_p, chunk_decay = _intra_alone(cfg, q, k, erase, log_decay,
                                                                                  document, carried)
        out, final = _scan_output(cfg, key_start, v, key_eff_p, chunk_decay, query_start, readout_p, state,
                                  v.dtype)
        return out, final, None
    (readout, pseudo_values, state_reads, query_start, key_eff, chunk_decay, *inverse), flags = _intra(
        cfg, q, k, erase, v, log_decay, document, carried, with_inverse=keep, with_flags=True)
    if cfg.fuse_output and not for_backward:  # S₀ is not needed: one sequential kernel writes the output
        out, final = _scan_output(cfg, state_reads, pseudo_values, key_eff, chunk_decay, query_start, readout, state,
                                  v.dtype)
        return out, final, None
    starts, true_pseudo, final = _scan(cfg, state_reads, pseudo_values, key_eff, chunk_decay, state)
    out = _output(cfg, query_start, starts, readout, true_pseudo, v.dtype)
    if not keep:
        return out, final, (starts, None, None, None, None)
    rhs = (pseudo_values, state_reads, query_start, key_eff, chunk_decay) if cfg.save_rhs else None
    return out, final, (starts, readout, inverse[0], rhs, flags if cfg.two_pass_key_grads else None)


def _forward_plain(cfg, q, k, v, log_decay, state, document, carried, for_backward):
    """:func:`_forward` without an erase: K1 writes M, Q̂⊙π, K⊙E, π_C only (no A, no solve) and the scan and the
    output read V̂ by token. Kept for the backward (``save_matrices``): S₀, M, (Q̂⊙π, K⊙E, π_C), K1's flags —
    ``save_rhs`` has nothing to choose here (those tiles are all K1 writes besides M)."""
    keep = for_backward and cfg.save_matrices
    (readout, query_start, key_eff, chunk_decay), flags = _intra_plain(cfg, q, k, log_decay, document, carried,
                                                                       keep or not for_backward, with_flags=True)
    if cfg.fuse_output and not for_backward:
        out, final = _scan_output(cfg, None, v, key_eff, chunk_decay, query_start, readout, state, v.dtype)
        return out, final, None
    starts, final = _scan_plain(cfg, v, key_eff, chunk_decay, state)
    out = _output(cfg, query_start, starts, readout, v, v.dtype)
    if not keep:
        return out, final, (starts, None, None, None, None)
    return out, final, (starts, readout, None, (query_start, key_eff, chunk_decay),
                        flags if cfg.two_pass_key_grads else None)


def _backward_plain(cfg, residuals, cotangents):
    """:func:`_delta_rule_bwd` without an erase: B1 gives dV̂ directly, B2 dq̂, dk, dλ from dM (no dA, no solve)."""
    q, k, _, v, log_decay, state, document, carried, starts, readout, _, rhs, flags = residuals
    d_out, d_final = cotangents
    if rhs is None:  # save_matrices=False: K1 once more
        (readout, query_start, key_eff, chunk_decay), flags = _intra_plain(cfg, q, k, log_decay, document, carried,
                                                                           True, with_flags=True)
        flags = flags if cfg.two_pass_key_grads else None
    else:
        query_start, key_eff, chunk_decay = rhs
    d_out = d_out.astype(v.dtype)
    d_ends, dv, d_state = _scan_bwd_plain(cfg, readout, d_out, key_eff, query_start, chunk_decay,
                                          d_final.astype(F32), v.dtype)
    dq, dk, d_log_decay = _grads_plain(cfg, q, k, v, log_decay, document, carried, starts, d_ends, d_out,
                                       (q.dtype, k.dtype, log_decay.dtype), flags)
    return dq, dk, None, dv, d_log_decay, d_state.astype(state.dtype), None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _delta_rule(cfg, q, k, erase, v, log_decay, state, document, carried):
    out, final, _ = _forward(cfg, q, k, erase, v, log_decay, state, document, carried)
    return out, final


def _delta_rule_fwd(cfg, q, k, erase, v, log_decay, state, document, carried):
    out, final, saved = _forward(cfg, q, k, erase, v, log_decay, state, document, carried, for_backward=True)
    out, final, saved = common.keep_for_backward((out, final, saved))
    return (out, final), (q, k, erase, v, log_decay, state, document, carried, *saved)


def _delta_rule_bwd(cfg, residuals, cotangents):
    if not cfg.has_erase:
        return _backward_plain(cfg, residuals, cotangents)
    q, k, erase, v, log_decay, state, document, carried, starts, readout, inverse, rhs, flags = residuals
    d_out, d_final = cotangents
    if rhs is not None:  # save_rhs: the forward's own U, Y, Q̂⊙π, K⊙E, π_C
        pseudo_values, state_reads, query_start, key_eff, chunk_decay = rhs
    elif inverse is None:  # recompute the chunk matrices (save_matrices=False: less memory, one more K1)
        (readout, pseudo_values, state_reads, query_start, key_eff, chunk_decay, inverse), flags = _intra(
            cfg, q, k, erase, v, log_decay, document, carried, with_inverse=True, with_flags=True)
        flags = flags if cfg.two_pass_key_grads else None
    else:
        pseudo_values, state_reads, query_start, key_eff, chunk_decay = _rhs(cfg, q, k, erase, v, log_decay, document,
                                                                             carried, inverse)
    d_ends, d_true_pseudo, d_state = _scan_bwd(cfg, readout, d_out.astype(v.dtype), key_eff, query_start, state_reads,
                                               chunk_decay, d_final.astype(F32))
    dq, dk, d_erase, dv, d_log_decay = _grads(cfg, q, k, erase, log_decay, document, carried, inverse, pseudo_values,
                                              state_reads, starts, d_ends, d_out.astype(v.dtype), d_true_pseudo,
                                              (q.dtype, k.dtype, erase.dtype, v.dtype, log_decay.dtype), flags)
    return dq, dk, d_erase, dv, d_log_decay, d_state.astype(state.dtype), None, None


_delta_rule.defvjp(_delta_rule_fwd, _delta_rule_bwd)


# ---------------------------------------------------------------------------------------------------------
# public entry (the op's impl.run contract)


def run(q, k, erase, v, log_decay, state, document_BT, *, chunk_size, leaf_size, interpret=False, **overrides):
    """q, k, erase [B, T, H, Dk]; v [B, T, H, Dv] (one float dtype: bf16 runs bf16 matmul operands);
    log_decay [B, T, H, Dk] log-decay ≤ 0 (f32 recommended); state [B, H, Dk, Dv]; document_BT [B, T] int32.
    ``erase`` None: no erase (linear attention, gated linear attention): kernels specialised with
    ``Config.has_erase=False`` (no A, no inverse, no solve, forward or backward).
    Returns (o [B, T, H, Dv] in v's dtype, final_state [B, H, Dk, Dv] f32). Differentiable (custom VJP).
    ``overrides``: :class:`Config` fields (scan_block_v, inverse_precision, warps_*, ...)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    cfg = make_config(chunk_size, leaf_size, dk, dv, v.dtype, batch_heads=b * h, interpret=interpret,
                      has_erase=erase is not None, **overrides)
    padded = [None if x is None else common.pad_time(x, chunk_size) for x in (q, k, erase, v, log_decay)]
    document = common.pad_time(document_BT.astype(jnp.int32), chunk_size, mode="edge")
    _, carried = common.chunk_documents(document, chunk_size)
    out, final = _delta_rule(cfg, *padded[:5], state.astype(F32), document, carried)
    return out[:, :t], final
