"""Backward kernel of the TPU VLA A-pass (``pallas_tpu.py``): dk̂, du per token and dA₀ from dg (the cotangent
of the unnormalised g_t = A_t k̂_t) and dA_T (docs/math/vla.md, 'Gradients'; docs/kernels.md).

Grid (B·H "parallel", N chunks "arbitrary", walked in reverse: grid step c is chunk N − 1 − c); the symmetric
cotangent Ā of A is carried in a VMEM f32 scratch across chunks. Per chunk:

1. Replay: from the chunk's anchor (A before its first token, saved by the forward) the forward's updates
   again with the stored ŵ — A ← (reset? I/λ₀ : A) − ŵŵᵀ = A_post,j (+ ρI after a refresh) — storing every
   A_post,j in a [C, d, d] VMEM scratch. Same operations on the same values as the forward, so the backward
   sees the forward's A bitwise, including across document starts inside the chunk.
2. Reverse over the chunk's tokens, the adjoint of one token (that of the GPU kernel, two terms rearranged):
       dk̂ = A_post dg
       √δ = (u·ŵ + √((u·ŵ)² + 4)) / 2                   (u·ŵ = (δ − 1)/√δ)
       y = Ā ŵ + (dg (k̂·ŵ) + k̂ (dg·ŵ)) / 2,   dδ = ŵ·y / δ,   dw = −2 y / √δ + dδ u
       du = dδ √δ ŵ + A_start dw = −(2/√δ) A_post y       (A_start u = √δ ŵ; no cancelling terms)
       Ā ← Ā + sym(dg k̂ᵀ + dw uᵀ);   Ā ← 0 at a document start (A_start = I/λ₀ there)
   Ā after the chunk's first token is carried to the previous chunk; after chunk 0 it is dA₀.

Vectors change orientation exactly (identity mask + reduction, see ``pallas_tpu``), so Ā stays exactly
symmetric: entry (i, j) and (j, i) sum the same products in the same order.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mixerlab.pallas_kernels.vla.pallas_tpu import (
    F32, RESET, Config, compiler_params, cost, document_start, dot_rows, eye_mask, flag, matvec_col, matvec_row,
    refresh, row, specs, start_of_token, to_col, to_row)


def _backward_kernel(k_ref, u_ref, factor_ref, flags_ref, dg_ref, anchor_ref, d_final_ref, dk_ref, du_ref,
                     d_a0_ref, d_a_scr, a_post_scr, *, cfg: Config):
    n = pl.program_id(1)
    eye = eye_mask(cfg.key_dim)
    a_reset = document_start(eye, cfg)

    @pl.when(n == 0)
    def _():
        d_a_scr[...] = d_final_ref[...]

    def replay(j, a):
        flags = row(flags_ref, j)
        f = row(factor_ref, j)
        a = start_of_token(a, flags, a_reset) - to_col(f, eye) * f
        a_post_scr[j] = a
        return refresh(a, flags, eye, cfg)

    jax.lax.fori_loop(0, cfg.chunk, replay, anchor_ref[...])

    def token(i, d_a):
        j = cfg.chunk - 1 - i
        a_post = a_post_scr[j]
        k_hat, u, f, d_g, flags = (row(r, j) for r in (k_ref, u_ref, factor_ref, dg_ref, flags_ref))
        dg_col, k_col, u_col = (to_col(x, eye) for x in (d_g, k_hat, u))
        dk_ref[pl.ds(j, 1), :] = matvec_row(a_post, dg_col)
        cu = dot_rows(u, f)
        root = 0.5 * (cu + jnp.sqrt(cu * cu + 4.0))  # √δ
        y_col = matvec_col(d_a, f) + 0.5 * (dg_col * dot_rows(k_hat, f) + k_col * dot_rows(d_g, f))
        y = to_row(y_col, eye)
        d_delta = dot_rows(f, y) / (root * root)
        d_w = -2.0 * y / root + d_delta * u
        dw_col = to_col(d_w, eye)
        # du = dδ √δ ŵ + A_start dw = −(2/√δ) A_post y: the two terms of the first form cancel where A is large
        du_ref[pl.ds(j, 1), :] = matvec_row(a_post, y_col) * (-2.0 / root)
        # sym(dg k̂ᵀ + dw uᵀ) as written: the GPU kernel's regrouping (dw + dg) k̂ᵀ + dw (u − k̂)ᵀ adds and removes
        # dw k̂ᵀ, which costs float32 accuracy where dw ≫ dg
        d_a = d_a + 0.5 * ((dg_col * k_hat + k_col * d_g) + (dw_col * u + u_col * d_w))
        return jnp.where(flag(flags, RESET), 0.0, d_a)

    d_a = jax.lax.fori_loop(0, cfg.chunk, token, d_a_scr[...])
    d_a_scr[...] = d_a

    @pl.when(n == pl.num_programs(1) - 1)
    def _():
        d_a0_ref[...] = d_a


def backward_call(cfg: Config, k_hat, u, factors, flags, d_g, anchors, d_final):
    """[B·H, Tp, d] f32 k̂, u, ŵ, dg; flags [B, Tp, 1]; anchors [B·H, N, d, d]; symmetric dA_T [B·H, d, d]
    -> (dk̂, du [B·H, Tp, d], dA₀ [B·H, d, d]), all f32."""
    bh, tp, d = k_hat.shape
    n_chunks = tp // cfg.chunk
    tokens, flag_spec, square, per_chunk = specs(cfg, n_chunks, reverse=True)
    return pl.pallas_call(
        functools.partial(_backward_kernel, cfg=cfg),
        out_shape=(jax.ShapeDtypeStruct((bh, tp, d), F32), jax.ShapeDtypeStruct((bh, tp, d), F32),
                   jax.ShapeDtypeStruct((bh, d, d), F32)),
        grid=(bh, n_chunks),
        in_specs=[tokens, tokens, tokens, flag_spec, tokens, per_chunk, square],
        out_specs=(tokens, tokens, square),
        scratch_shapes=[pltpu.VMEM((d, d), F32), pltpu.VMEM((cfg.chunk, d, d), F32)],
        compiler_params=compiler_params(cfg),
        cost_estimate=cost("backward", d, bh, tp, cfg.chunk),
        interpret=cfg.interpret,
        name="vla_penalty_bwd",
    )(k_hat, u, factors, flags, d_g, anchors, d_final)
