"""The pallas_call launches of the Pallas-Triton interdomain kernels (``pallas_triton_kernels.py``): block specs,
grids, cost estimates (``flop_counts``), compiler parameters and output shapes, one function per kernel (inputs
padded to a multiple of the chunk). ``pallas_triton.py`` chains them into the custom VJPs."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mixerlab.pallas_kernels.triton_common import compiler_params

from mixerlab.pallas_kernels.interdomain.pallas_triton_config import F32
from mixerlab.pallas_kernels.interdomain.pallas_triton_kernels import (
    _output_bwd_kernel, _output_kernel, _query_bwd_kernel, _query_kernel)


# ---------------------------------------------------------------------------------------------------------
# pallas_call wrappers (inputs padded to a multiple of the chunk)


def _token_spec(cfg, width):
    """[B, T, H, width] read per chunk: block [K, width] at (b, n, h)."""
    return pl.BlockSpec((None, cfg.chunk, None, width), lambda b, h, n: (b, n, h, 0))


def _chunk_spec(*tail):
    """[B, H, N, *tail] per chunk."""
    return pl.BlockSpec((None, None, None, *tail), lambda b, h, n: (b, h, n, *([0] * len(tail))))


def _head_spec(*tail):
    """[H, *tail] per head."""
    return pl.BlockSpec((None, *tail), lambda b, h, n: (h, *([0] * len(tail))))


def _common_specs(cfg, state_width):
    """r, θ, b, the chunk-start state block, documents, carried document."""
    m = cfg.modes
    return [_token_spec(cfg, m), _head_spec(m), _head_spec(2 * m), _chunk_spec(2 * m, state_width),
            pl.BlockSpec((None, cfg.chunk), lambda b, h, n: (b, n)), pl.BlockSpec((None, None), lambda b, h, n: (b, n))]


def _params(cfg, warps):
    return compiler_params(cfg.interpret, warps)


def flop_counts(cfg):
    """{kernel: (FLOPs, transcendentals, HBM bytes)} per chunk and head, as the kernels execute them (full
    masked tiles; a range sum counted once, though with "tf32x3" it runs as three TF32 passes). The readout
    ω = Ĝ â between the kernels is XLA's and not counted; the backward kernels read the K × K matrix (Sc or P)
    that the forward saves (``saved_bytes``), the forward writes it only under a gradient."""
    k, m, r, dv, lv = cfg.chunk, cfg.modes, cfg.key_dim, cfg.value_dim, cfg.levels
    kkm = 2 * k * k * m  # one [K, K] x [K, M] GEMM over all mode blocks
    od = jnp.dtype(cfg.operand_dtype).itemsize
    factor_exps = 3 * k * m  # exp, cos, sin of one [K, M] factor
    common = k * m * 4 + (3 * m) * 4  # r, θ, b
    per_token = 2 * m * 4  # â, ω, dâ or dω per token (f32)
    saved = k * k * od  # Sc or P
    # query: Sc, per level (range sum + 2 GEMMs), carry-in sum, X̂ᵏ₀ q
    query = (2 * k * k * r + lv * 3 * kkm + kkm + 2 * 2 * k * m * r, factor_exps * (lv + 1),
             common + 2 * k * r * od + 2 * m * r * 4 + k * per_token)
    # output: per level (range sum + 2 GEMMs), carry-in sum, carried value, P v
    output = (lv * 3 * kkm + kkm + 2 * 2 * k * m * dv + 2 * k * k * dv, factor_exps * (lv + 1),
              common + k * per_token + k * dv * od + 2 * m * dv * 4 + k * dv * od)
    # query_bwd: state read, dq, dX̂ᵏ₀, carry-in sum and its transpose, per level (range sum and its
    # transpose, u (2), dSc (2), dc (2)), dSc k, dScᵀ q (Sc is the forward's)
    query_bwd = (3 * 2 * 2 * k * m * r + 2 * kkm + lv * 8 * kkm + 2 * 2 * k * k * r,
                 factor_exps * (lv + 1),
                 common + 2 * k * r * od + 2 * m * r * 4 + k * per_token + 2 * k * r * od + 2 * k * m * 4 + 5 * m * 4
                 + 2 * m * r * 4 + saved)
    # output_bwd: dP, per level (range sum and its transpose, dh (2), dc (2)), the carried value part
    # (dX̂ᵛ₀, dg), carry-in sum and its transpose, Pᵀ dO (P is the forward's)
    output_bwd = (2 * k * k * dv + lv * 6 * kkm + 2 * 2 * 2 * k * m * dv + 2 * kkm + 2 * k * k * dv,
                  factor_exps * (lv + 1),
                  common + k * per_token + 2 * k * dv * od + 2 * m * dv * 4 + k * per_token + k * dv * od
                  + k * m * 4 + 4 * m * 4 + 2 * m * dv * 4 + saved)
    return dict(query=query, output=output, query_bwd=query_bwd, output_bwd=output_bwd)


def _call(cfg, kernel, name, grid, in_specs, out_shape, out_specs, warps, *args, saving=False):
    flops, exps, nbytes = flop_counts(cfg)[name]
    nbytes += cfg.chunk * cfg.chunk * jnp.dtype(cfg.operand_dtype).itemsize if saving else 0
    programs = grid[0] * grid[1] * grid[2]
    cost = pl.CostEstimate(flops=int(programs * flops), transcendentals=int(programs * exps),
                           bytes_accessed=int(programs * nbytes))
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
                          interpret=cfg.interpret, compiler_params=_params(cfg, warps), cost_estimate=cost,
                          name=f"interdomain_{name}")(*args)


def _grid(cfg, x):
    return x.shape[0], x.shape[2], x.shape[1] // cfg.chunk


def _query_call(cfg, q, k, r, phase, gain, xk, doc, carry, save_scores=False):
    """â [B, T, H, 2M] f32 (stacked Re | Im) [, Sc [B, H, N, K, K] in the operand dtype]."""
    b, t, h, _ = q.shape
    grid = _grid(cfg, q)
    specs = [_token_spec(cfg, cfg.key_dim)] * 2 + _common_specs(cfg, cfg.key_dim)
    out = [jax.ShapeDtypeStruct((b, t, h, 2 * cfg.modes), F32)]
    out_specs = [_token_spec(cfg, 2 * cfg.modes)]
    if save_scores:
        out.append(jax.ShapeDtypeStruct((*grid, cfg.chunk, cfg.chunk), cfg.operand_dtype))
        out_specs.append(_chunk_spec(cfg.chunk, cfg.chunk))
    return _call(cfg, _query_kernel(cfg, save_scores), "query", grid, specs, tuple(out), tuple(out_specs),
                 cfg.warps_forward, q, k, r, phase, gain, xk, doc, carry, saving=save_scores)


def _query_bwd_call(cfg, q, k, r, phase, gain, xk, doc, carry, scores, da):
    cfg = dataclasses.replace(cfg, block_m=cfg.block_m_backward)
    b, t, h, _ = q.shape
    n, m = t // cfg.chunk, cfg.modes
    specs = [_token_spec(cfg, cfg.key_dim)] * 2 + _common_specs(cfg, cfg.key_dim) + [
        _chunk_spec(cfg.chunk, cfg.chunk), _token_spec(cfg, 2 * m)]
    shape = jax.ShapeDtypeStruct
    out = (shape(q.shape, q.dtype), shape(k.shape, k.dtype), shape(r.shape, F32), shape((b, h, n, m), F32),
           shape((b, h, n, 2 * m), F32), shape(r.shape, F32), shape((b, h, n, m), F32), shape(xk.shape, F32))
    out_specs = (_token_spec(cfg, cfg.key_dim), _token_spec(cfg, cfg.key_dim), _token_spec(cfg, m), _chunk_spec(m),
                 _chunk_spec(2 * m), _token_spec(cfg, m), _chunk_spec(m), _chunk_spec(2 * m, cfg.key_dim))
    return _call(cfg, _query_bwd_kernel(cfg), "query_bwd", _grid(cfg, q), specs, out, out_specs, cfg.warps_backward,
                 q, k, r, phase, gain, xk, doc, carry, scores, da)


def _output_call(cfg, omega, v, r, phase, gain, xv, doc, carry, save_pairs=False):
    """o [B, T, H, Dv] in v's dtype [, P [B, H, N, K, K] in the operand dtype]."""
    grid = _grid(cfg, v)
    specs = [_token_spec(cfg, 2 * cfg.modes), _token_spec(cfg, cfg.value_dim)] + _common_specs(cfg, cfg.value_dim)
    out = [jax.ShapeDtypeStruct(v.shape, v.dtype)]
    out_specs = [_token_spec(cfg, cfg.value_dim)]
    if save_pairs:
        out.append(jax.ShapeDtypeStruct((*grid, cfg.chunk, cfg.chunk), cfg.operand_dtype))
        out_specs.append(_chunk_spec(cfg.chunk, cfg.chunk))
    return _call(cfg, _output_kernel(cfg, save_pairs), "output", grid, specs, tuple(out), tuple(out_specs),
                 cfg.warps_forward, omega, v, r, phase, gain, xv, doc, carry, saving=save_pairs)


def _output_bwd_call(cfg, omega, v, r, phase, gain, xv, doc, carry, pairs, d_out):
    cfg = dataclasses.replace(cfg, block_m=cfg.block_m_backward)
    b, t, h, dv = v.shape
    n, m = t // cfg.chunk, cfg.modes
    specs = ([_token_spec(cfg, 2 * m), _token_spec(cfg, dv)] + _common_specs(cfg, dv)
             + [_chunk_spec(cfg.chunk, cfg.chunk), _token_spec(cfg, dv)])
    shape = jax.ShapeDtypeStruct
    out = (shape(omega.shape, F32), shape(v.shape, v.dtype), shape(r.shape, F32), shape((b, h, n, m), F32),
           shape((b, h, n, 2 * m), F32), shape(xv.shape, F32))
    out_specs = (_token_spec(cfg, 2 * m), _token_spec(cfg, dv), _token_spec(cfg, m), _chunk_spec(m),
                 _chunk_spec(2 * m), _chunk_spec(2 * m, dv))
    return _call(cfg, _output_bwd_kernel(cfg), "output_bwd", _grid(cfg, v), specs, out, out_specs,
                 cfg.warps_backward, omega, v, r, phase, gain, xv, doc, carry, pairs, d_out)
