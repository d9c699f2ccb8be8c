"""Interdomain attention on GPU through Pallas' Triton backend: pass (iii) of the chunked form (the outputs of
every chunk from its chunk-start states) as per-chunk kernels, forward and custom-VJP backward
(docs/math/interdomain.md, 'Chunked form', 'Gradients'; docs/kernels_gpu.md, 'Interdomain attention').

Passes (i) and (ii) (chunk-local end states, the serial scan over the chunk boundaries) stay in XLA
(``xla.chunk_start_states``): O(T·M·(R + Dv)) work with one small matmul per chunk. Pass (iii) is where the
pure-JAX form spends its time and memory (it materialises b ⊙ F and b ⊙ D per chunk); here everything of a
chunk stays on chip. Split at the readout, all grids (B, H, N), one chunk of one head per program:

  ``query``       â [K, 2M]  (saves Sc)        ``query_bwd``   dq, dk, dr, dX̂ᵏ₀, partial dθ, db from dâ
  XLA             ω = Ĝ â per token (autodiffed: dĜ, dâ)
  ``output``      o [K, Dv]  (saves P)         ``output_bwd``  dω, dv, dr, dX̂ᵛ₀, partial dθ, db from dO

The per-head partial sums (over chunks and batch) are reduced by XLA. Each kernel walks the M modes in blocks
of BM (everything but Sc, P and their cotangents is per mode), so per-mode tiles are [K, BM]; complex tiles
are separate Re / Im tiles, everything 2-D. Per chunk (K tokens, M complex modes):

    e^{ℓ_s} = exp(r(−1, s]) e^{iθ(s+1)}        (carried-in document rows only)
    a_s     = e^{ℓ_s} ⊙ (X̂ᵏ₀ q_s) + b ⊙ Σ_{j≤s} Sc[s, j] D[s, j],     Sc = q kᵀ ⊙ 1[same document]
    ω_s     = Ĝ â_s
    o_s     = Re(conj(ω_s) ⊙ e^{ℓ_s}) X̂ᵛ₀ + Σ_j P[s, j] v_j,     P[s, j] = Re Σ_m conj(ω_sm) b_m D[s, j, m]

D[s, j] = exp(r(j, s]) e^{iθ(s−j)} (K×K×M) is never formed. Like the delta rule's boundary pivots
(docs/math/delta_rule.md), every strictly lower pair (s > j) belongs to one level of a binary pivot tree:
the node of size 2h whose right half holds s and left half holds j, pivot p = the left half's last token, and

    D[s, j] = f_ℓ[s] · f_ℓ[j],   f_ℓ[s] = exp(r(p, s]) e^{iθ(s−p)} (right half),  exp(r(s, p]) e^{iθ(p−s)} (left)

with both factors decays (every exponent a sum of r ≤ 0 over a half-node: no overflow, no cancellation, a
factor underflows only where the true decay is below the float range). Per level ℓ = 0 … log2 K − 1 the
pair sums are two real GEMMs:  Σ_j Sc D b = f_ℓ ⊙ ((Sc ⊙ pairs_ℓ) · (b ⊙ f_ℓ))  and
P_ℓ = Re((conj(ω) ⊙ f_ℓ) · (b ⊙ f_ℓ)ᵀ) ⊙ pairs_ℓ; the diagonal (D = 1) is added directly. The range sums
r(·, ·] are 0/1 matmuls (exact weights, f32 at float32 accuracy); phases are integer offsets (the row sums of
those 0/1 matrices) times θ, never a cumsum of θ.

Numerics: state, accumulation, decays and range sums in f32; the matmul operands in the caller's dtype
(bf16 inputs: bf16 tensor-core GEMMs with f32 accumulation; f32 inputs: ``Config.precision``, "tf32" one
tensor-core pass by default on the GPU, "highest" float32-accurate as three TF32 passes).

``sub_chunk_size`` of the op does not apply (the pivot tree replaces the sub-chunks; accuracy does not depend
on it either way).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mixerlab.pallas_kernels import common
from mixerlab.pallas_kernels.interdomain import xla

# The kernels live in four modules of one job each; every name stays importable from here (tools and tests
# read ``pallas_triton.X``): configuration, tile math, kernel bodies, pallas_call launches.
from mixerlab.pallas_kernels.interdomain.pallas_triton_config import (  # noqa: F401
    Config, F32, MAX_HEAD_DIM, MAX_MODES, SUPPORTED_CHUNKS, _DTYPES, _MIN_DIM, make_config, supports)
from mixerlab.pallas_kernels.interdomain.pallas_triton_tiles import (  # noqa: F401
    _Masks, _Modes, _carry_in, _cmul, _conj_mul, _dot, _factor_grads, _gain_grads, _level, _level_factor, _matmul,
    _n_blocks, _polar, _range_sums, _scores, _to_tf32)
from mixerlab.pallas_kernels.interdomain.pallas_triton_kernels import (  # noqa: F401
    _output_bwd_kernel, _output_kernel, _query_bwd_kernel, _query_kernel)
from mixerlab.pallas_kernels.interdomain.pallas_triton_calls import (  # noqa: F401
    _call, _chunk_spec, _common_specs, _grid, _head_spec, _output_bwd_call, _output_call, _params, _query_bwd_call,
    _query_call, _token_spec, flop_counts)


def _param_grads(dr, dth, db, r, phase, gain):
    """Per-chunk partial sums of dθ and db reduced over batch and chunks; dr in r's dtype."""
    return (dr.astype(r.dtype), jnp.sum(dth, axis=(0, 2)).astype(phase.dtype),
            jnp.sum(db, axis=(0, 2)).astype(gain.dtype))


# ---------------------------------------------------------------------------------------------------------
# custom VJPs (the readout ω = Ĝ â between them is plain JAX)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _query(cfg, q, k, r, phase, gain, xk, doc, carry):
    return _query_call(cfg, q, k, r, phase, gain, xk, doc, carry)[0]


def _query_fwd(cfg, *args):
    a, scores = common.keep_for_backward(_query_call(cfg, *args, save_scores=True))
    return a, (*common.keep_for_backward(args), scores)


def _query_bwd(cfg, residuals, da):
    q, k, r, phase, gain, xk, doc, carry, _ = residuals
    dq, dk, dr, dth, db, dr_carry, dth_carry, dxk = _query_bwd_call(cfg, *residuals, da.astype(F32))
    dr, dth = dr + dr_carry, dth + dth_carry
    return (dq, dk, *_param_grads(dr, dth, db, r, phase, gain), dxk.astype(xk.dtype), None, None)


_query.defvjp(_query_fwd, _query_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _output(cfg, omega, v, r, phase, gain, xv, doc, carry):
    return _output_call(cfg, omega, v, r, phase, gain, xv, doc, carry)[0]


def _output_fwd(cfg, *args):
    o, pairs = common.keep_for_backward(_output_call(cfg, *args, save_pairs=True))
    return o, (*common.keep_for_backward(args), pairs)


def _output_bwd(cfg, residuals, d_out):
    omega, v, r, phase, gain, xv, doc, carry, _ = residuals
    dw, dv, dr, dth, db, dxv = _output_bwd_call(cfg, *residuals, d_out.astype(v.dtype))
    return (dw.astype(omega.dtype), dv, *_param_grads(dr, dth, db, r, phase, gain), dxv.astype(xv.dtype), None, None)


_output.defvjp(_output_fwd, _output_bwd)


def _readout(cfg, a, readout):
    """ω = Ĝ â per token ([B, T, H, 2M] f32), an XLA GEMM with operands in the operand dtype."""
    od = cfg.operand_dtype
    precision = jax.lax.Precision.HIGHEST if (cfg.interpret or cfg.precision == "highest") else None
    return jnp.einsum("bthj,hij->bthi", a.astype(od), readout.astype(od), precision=precision,
                      preferred_element_type=F32)


# ---------------------------------------------------------------------------------------------------------
# public entry (the op's impl.run contract)


def run(q, k, v, log_modulus, phase, gain, readout, key_state, value_state, document_BT, *, chunk_size,
        sub_chunk_size=None, interpret=False, **overrides):
    """q, k [B, T, H, R], v [B, T, H, Dv] in the caller's dtype (bf16 runs bf16 GEMM operands); log_modulus
    [B, T, H, M], phase [H, M], gain [H, 2M], readout [H, 2M, 2M], states [B, H, 2M, R] / [B, H, 2M, Dv] in
    float32; document_BT [B, T] int. Returns (o [B, T, H, Dv] in v's dtype, key state, value state float32).
    Differentiable (custom VJPs). ``overrides``: :class:`Config` fields (precision, range_sums, block_m,
    warps_*)."""
    del sub_chunk_size  # the pivot tree replaces the sub-chunks
    b, t, h, r_dim = q.shape
    cfg = make_config(chunk_size, r_dim, v.shape[-1], phase.shape[-1], v.dtype, interpret=interpret, **overrides)
    ct = log_modulus.dtype
    (xk, xv), (key, value) = xla.chunk_start_states([k.astype(ct), v.astype(ct)], [key_state, value_state],
                                                    log_modulus, phase, gain, document_BT, chunk_size=chunk_size)
    qp, kp, vp, rp = [common.pad_time(x, chunk_size) for x in (q, k, v, log_modulus)]
    document, carried = _documents(document_BT, chunk_size)
    a = _query(cfg, qp, kp, rp, phase, gain, xk, document, carried)
    out = _output(cfg, _readout(cfg, a, readout), vp, rp, phase, gain, xv, document, carried)
    return out[:, :t], key, value


def run_s4d(z, log_modulus, phase, gain, readout, state, document_BT, *, chunk_size, sub_chunk_size=None,
            interpret=False, **overrides):
    """The S4D-only core (``s4d`` op contract; z [B, T, H, C] in the caller's dtype, readout ω [H, 2M]): the
    output kernel pair alone, with ω fixed per head (no query side). Returns (o in z's dtype, state f32)."""
    del sub_chunk_size
    b, t, h, c = z.shape
    cfg = make_config(chunk_size, c, c, phase.shape[-1], z.dtype, interpret=interpret, **overrides)
    (xs,), (final,) = xla.chunk_start_states([z.astype(log_modulus.dtype)], [state], log_modulus, phase, gain,
                                             document_BT, chunk_size=chunk_size)
    zp, rp = common.pad_time(z, chunk_size), common.pad_time(log_modulus, chunk_size)
    document, carried = _documents(document_BT, chunk_size)
    omega = jnp.broadcast_to(readout.astype(F32)[None, None], (b, zp.shape[1], h, readout.shape[-1]))
    out = _output(cfg, omega, zp, rp, phase, gain, xs, document, carried)
    return out[:, :t], final


def _documents(document_BT, chunk_size):
    """Padded document index [B, Tp] (edge: padding stays in the last document) and the carried-in
    document of every chunk [B, N]."""
    document = common.pad_time(document_BT.astype(jnp.int32), chunk_size, mode="edge")
    return document, common.chunk_documents(document, chunk_size)[1]
