"""The pallas_call launches of the Pallas-Triton delta-rule kernels (``pallas_triton_kernels.py``): block specs,
grids, cost estimates, compiler parameters and output shapes, one function per pass (inputs already padded to a
multiple of the chunk). ``pallas_triton.py`` chains them into the forward and the custom-VJP backward."""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mixerlab.pallas_kernels.triton_common import compiler_params
from mixerlab.pallas_kernels.delta_rule.pallas_triton_config import F32
from mixerlab.pallas_kernels.delta_rule.pallas_triton_kernels import (
    _cotangents_kernel, _intra_alone_body, _intra_body, _intra_plain_body, _key_grads_body, _output_kernel, _passes,
    _readout_grad_kernel, _rhs_kernel, _scan_bwd_kernel, _scan_kernel, _scan_output_kernel)


# ---------------------------------------------------------------------------------------------------------
# pallas_call wrappers (inputs already padded to a multiple of the chunk)


def _cost(cfg, kernel, batch_heads, n_chunks, save_matrices=True):
    """pl.CostEstimate of one pallas_call: the executed FLOPs (full masked tiles), exps and HBM bytes that
    pallas_kernels/delta_rule/flops_gpu.py counts per chunk and head (tests/pallas_kernels/test_flops_gpu.py checks the
    FLOP and exp counts against the kernels' own jaxprs). The Triton lowering of JAX 0.10/0.11 drops it;
    interpret mode and tooling read it."""
    # imported here, not at the top: the package import must not load the FLOP CLIs, or
    # `python -m mixerlab.pallas_kernels.delta_rule.flops_gpu` warns that the module was imported before it ran
    from mixerlab.pallas_kernels.delta_rule import flops_gpu
    operand_bytes = jnp.dtype(cfg.operand_dtype).itemsize
    sum_passes = 2 if cfg.resolved_decay_sums == "tf32x2" and not cfg.interpret else 1  # as _split
    bounded = cfg.bounded_span is not None
    counts = flops_gpu.kernel_counts(cfg.chunk, cfg.leaf, cfg.key_dim, cfg.value_dim, cfg.block_k, sum_passes,
                                     save_matrices, operand_bytes, bounded, cfg.save_rhs, cfg.fuse_output,
                                     end_difference=cfg.end_decays == "difference", fold_solve=cfg.fold_solve,
                                     two_pass=cfg.two_pass and cfg.two_pass_key_grads, has_erase=cfg.has_erase)
    exps = flops_gpu.kernel_exps(cfg.chunk, cfg.key_dim, save_matrices, bounded, cfg.save_rhs, cfg.fuse_output,
                                 has_erase=cfg.has_erase)
    bf, tf, nbytes = counts[kernel]
    chunks = batch_heads * n_chunks
    return pl.CostEstimate(flops=int(chunks * (bf + tf)), transcendentals=int(chunks * exps[kernel]),
                           bytes_accessed=int(chunks * nbytes))


def _with_flags(cost, programs):
    """``cost`` plus one int32 flag read or written per program (the two-pass kernels)."""
    return pl.CostEstimate(flops=cost.flops, transcendentals=cost.transcendentals,
                           bytes_accessed=cost.bytes_accessed + 4 * programs)


def _params(cfg, warps, stages=None):
    return compiler_params(cfg.interpret, warps, stages)


def _token_spec(cfg, width):
    """[B, T, H, width] read per chunk: block [C, width] at (b, n, h)."""
    return pl.BlockSpec((None, cfg.chunk, None, width), lambda b, h, n: (b, n, h, 0))


def _chunk_spec(*tail):
    """[B, H, N, *tail] per chunk."""
    return pl.BlockSpec((None, None, None, *tail), lambda b, h, n: (b, h, n, *([0] * len(tail))))


def _per_head(*tail):
    """[B, H, *tail] read whole by each program of a (B, H, Dv/BV) grid (the sequential kernels)."""
    return pl.BlockSpec((None, None, *tail), lambda b, h, j: (b, h, *([0] * len(tail))))


def _per_head_v_block(*tail):
    """[B, H, ..., Dv] in blocks of BV along the last axis, one per program of a (B, H, Dv/BV) grid."""
    return pl.BlockSpec((None, None, *tail), lambda b, h, j: (b, h, *([0] * (len(tail) - 1)), j))


def _document_specs(cfg):
    """Documents [B, T] per chunk [C] and the carried-in document [B, N] per chunk (a scalar), on a (B, H, N)
    grid."""
    return [pl.BlockSpec((None, cfg.chunk), lambda b, h, n: (b, n)), pl.BlockSpec((None, None), lambda b, h, n: (b, n))]


def _rhs_blocks(cfg, q, v):
    """Out shapes and specs of U, Y, Q̂⊙π, K⊙E (operand dtype) and π_C (f32), and the in specs of
    q, k, k̂, v̂, λ, documents, carried document — shared by K1 and its backward twin."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    c, n, od = cfg.chunk, t // cfg.chunk, cfg.operand_dtype
    shapes = [jax.ShapeDtypeStruct((b, h, n, c, dv), od),  # U
              jax.ShapeDtypeStruct((b, h, n, c, dk), od),  # Y
              jax.ShapeDtypeStruct((b, h, n, c, dk), od),  # Q̂⊙π
              jax.ShapeDtypeStruct((b, h, n, c, dk), od),  # K⊙E
              jax.ShapeDtypeStruct((b, h, n, dk), F32)]  # π_C
    specs = [_chunk_spec(c, dv), _chunk_spec(c, dk), _chunk_spec(c, dk), _chunk_spec(c, dk), _chunk_spec(dk)]
    in_specs = [_token_spec(cfg, dk)] * 3 + [_token_spec(cfg, dv), _token_spec(cfg, dk), *_document_specs(cfg)]
    return shapes, specs, in_specs, (b, h, n)


def _intra(cfg, q, k, erase, v, log_decay, document, carried, with_inverse, with_flags=False):
    """K1: (M, U, Y, Q̂⊙π, K⊙E, π_C[, P]); ``with_flags``: (that, the first pass's flags or None)."""
    shapes, specs, in_specs, grid = _rhs_blocks(cfg, q, v)
    c = cfg.chunk
    shapes = [jax.ShapeDtypeStruct((*grid, c, c), cfg.operand_dtype)] + shapes  # M
    specs = [_chunk_spec(c, c)] + specs
    if with_inverse:  # P in the operand dtype: every consumer is a matmul with operands in that dtype
        shapes.append(jax.ShapeDtypeStruct((*grid, c, c), cfg.operand_dtype))
        specs.append(_chunk_spec(c, c))
    return _k1(cfg, _intra_body(cfg, with_inverse), "delta_rule_intra", shapes, specs, in_specs, grid,
               _cost(cfg, "K1_intra", grid[0] * grid[1], grid[2], with_inverse),
               (q, k, erase, v, log_decay, document, carried), with_flags)


def _intra_plain(cfg, q, k, log_decay, document, carried, with_inverse, with_flags=False):
    """K1 without an erase: (M, Q̂⊙π, K⊙E, π_C); ``with_flags`` as :func:`_intra`. ``with_inverse`` only selects
    the cost entry (the training forward's K1 or the forward alone's: the same kernel, no P either way)."""
    b, t, h, dk = q.shape
    c, n, od = cfg.chunk, t // cfg.chunk, cfg.operand_dtype
    shapes = [jax.ShapeDtypeStruct((b, h, n, c, c), od)] + [jax.ShapeDtypeStruct((b, h, n, c, dk), od)] * 2 + [
        jax.ShapeDtypeStruct((b, h, n, dk), F32)]
    specs = [_chunk_spec(c, c)] + [_chunk_spec(c, dk)] * 2 + [_chunk_spec(dk)]
    in_specs = [_token_spec(cfg, dk)] * 3 + _document_specs(cfg)
    return _k1(cfg, _intra_plain_body(cfg), "delta_rule_intra", shapes, specs, in_specs, (b, h, n),
               _cost(cfg, "K1_intra", b * h, n, with_inverse), (q, k, log_decay, document, carried), with_flags)


def _intra_alone(cfg, q, k, erase, log_decay, document, carried):
    """K1 of a forward without backward (``fold_solve``): (M P, K̂⊙π, Q̂⊙π, Pᵀ(K⊙E), π_C)."""
    b, t, h, dk = q.shape
    c, n, od = cfg.chunk, t // cfg.chunk, cfg.operand_dtype
    shapes = [jax.ShapeDtypeStruct((b, h, n, c, c), od)] + [jax.ShapeDtypeStruct((b, h, n, c, dk), od)] * 3 + [
        jax.ShapeDtypeStruct((b, h, n, dk), F32)]
    specs = [_chunk_spec(c, c)] + [_chunk_spec(c, dk)] * 3 + [_chunk_spec(dk)]
    in_specs = [_token_spec(cfg, dk)] * 4 + _document_specs(cfg)
    return _k1(cfg, _intra_alone_body(cfg), "delta_rule_intra_alone", shapes, specs, in_specs, (b, h, n),
               _cost(cfg, "K1_intra_alone", b * h, n), (q, k, erase, log_decay, document, carried))


def _k1(cfg, body, name, shapes, specs, in_specs, grid, cost, args, with_flags=False):
    """K1 as one pass, or (``two_pass`` with ``bounded_span``) as the whole-chunk pass and the search pass of the
    chunks it flagged (:func:`_passes`). The second pass declares only its flag reads: with ordinary gates no
    chunk is flagged and its programs return at once (a flagged chunk costs one more K1 program).
    ``with_flags``: (outputs, the flags [B, H, N] int32, None for one pass)."""
    n_in, n_out = len(args), len(shapes)
    call = functools.partial(pl.pallas_call, grid=grid, interpret=cfg.interpret,
                             compiler_params=_params(cfg, cfg.warps_intra))
    if cfg.bounded_span is None or not cfg.two_pass:
        out = call(_passes(body, n_in, n_out, "single"), out_shape=tuple(shapes), in_specs=in_specs,
                   out_specs=tuple(specs), cost_estimate=cost, name=name)(*args)
        return (out, None) if with_flags else out
    flag_shape = jax.ShapeDtypeStruct(grid, jnp.int32)
    flag_spec = pl.BlockSpec((None, None, None), lambda b, h, n: (b, h, n))
    *first, flag = call(_passes(body, n_in, n_out, "first"), out_shape=(*shapes, flag_shape), in_specs=in_specs,
                        out_specs=(*specs, flag_spec), cost_estimate=_with_flags(cost, math.prod(grid)),
                        name=name)(*args)
    out = call(_passes(body, n_in, n_out, "second"), out_shape=tuple(shapes),
               in_specs=[*in_specs, flag_spec, *specs], out_specs=tuple(specs),
               input_output_aliases={n_in + 1 + i: i for i in range(n_out)},
               cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=4 * math.prod(grid)),
               name=name + "_search")(*args, flag, *first)
    return (out, flag) if with_flags else out


def _rhs(cfg, q, k, erase, v, log_decay, document, carried, inverse):
    """K1's backward twin with P given: (U, Y, Q̂⊙π, K⊙E, π_C)."""
    shapes, specs, in_specs, grid = _rhs_blocks(cfg, q, v)
    return pl.pallas_call(_rhs_kernel(cfg), out_shape=tuple(shapes), grid=grid,
                          in_specs=in_specs + [_chunk_spec(cfg.chunk, cfg.chunk)], out_specs=tuple(specs),
                          interpret=cfg.interpret, compiler_params=_params(cfg, cfg.warps_rhs),
                          cost_estimate=_cost(dataclasses.replace(cfg, save_rhs=False), "B0_rhs", grid[0] * grid[1],
                                              grid[2]),  # B0 runs when the forward's tiles are not kept
                          name="delta_rule_rhs")(q, k, erase, v, log_decay, document, carried, inverse)


def _scan_plain(cfg, v, key_eff, chunk_decay, state):
    """K2 without an erase: (S₀ per chunk, S_T) from V̂ read by token (Ũ = V̂, nothing else to write)."""
    b, h, n, c, dk = key_eff.shape
    dv = v.shape[-1]
    bv = cfg.scan_block_v
    by_token = pl.BlockSpec((None, n * c, None, bv), lambda b_, h_, j: (b_, 0, h_, j))
    return pl.pallas_call(
        _scan_kernel(cfg, n),
        out_shape=(jax.ShapeDtypeStruct((b, h, n, dk, dv), cfg.operand_dtype),
                   jax.ShapeDtypeStruct((b, h, dk, dv), F32)),
        grid=(b, h, dv // bv),
        in_specs=[by_token, _per_head(n, c, dk), _per_head(n, dk), _per_head_v_block(dk, bv)],
        out_specs=(_per_head_v_block(n, dk, bv), _per_head_v_block(dk, bv)),
        interpret=cfg.interpret, compiler_params=_params(cfg, cfg.warps_scan, cfg.stages_scan),
        cost_estimate=_cost(cfg, "K2_scan", b * h, n),
        name="delta_rule_scan")(v, key_eff, chunk_decay, state)


def _scan(cfg, state_reads, pseudo_values, key_eff, chunk_decay, state):
    b, h, n, c, dk = state_reads.shape
    dv = pseudo_values.shape[-1]
    bv = cfg.scan_block_v
    return pl.pallas_call(
        _scan_kernel(cfg, n),
        out_shape=(jax.ShapeDtypeStruct((b, h, n, dk, dv), cfg.operand_dtype),
                   jax.ShapeDtypeStruct((b, h, n, c, dv), pseudo_values.dtype), jax.ShapeDtypeStruct((b, h, dk, dv),
                                        F32)),
        grid=(b, h, dv // bv),
        in_specs=[_per_head(n, c, dk), _per_head_v_block(n, c, bv), _per_head(n, c, dk), _per_head(n, dk),
                  _per_head_v_block(dk, bv)],
        out_specs=(_per_head_v_block(n, dk, bv), _per_head_v_block(n, c, bv), _per_head_v_block(dk, bv)),
        interpret=cfg.interpret, compiler_params=_params(cfg, cfg.warps_scan, cfg.stages_scan),
        cost_estimate=_cost(cfg, "K2_scan", b * h, n),
        name="delta_rule_scan")(state_reads, pseudo_values, key_eff, chunk_decay, state)


def _scan_output(cfg, state_reads, pseudo_values, key_eff, chunk_decay, query_start, readout, state, out_dtype):
    """K2 with K3 folded in (``fuse_output``, a forward without backward): (o [B, T, H, Dv], S_T). With
    ``fold_solve``, ``pseudo_values`` is V̂ itself [B, T, H, Dv] (and the other operands those of
    :func:`_intra_alone`)."""
    b, h, n, c, dk = key_eff.shape
    dv = pseudo_values.shape[-1]
    bv = cfg.scan_block_v
    by_token = pl.BlockSpec((None, n * c, None, bv), lambda b_, h_, j: (b_, 0, h_, j))
    # without an erase (``state_reads`` None) V̂ is Ũ itself, read by token
    in_specs = [by_token if cfg.fold_solve or not cfg.has_erase else _per_head_v_block(n, c, bv),
                _per_head(n, c, dk), _per_head(n, dk), _per_head(n, c, dk), _per_head(n, c, c),
                _per_head_v_block(dk, bv)]
    args = (pseudo_values, key_eff, chunk_decay, query_start, readout, state)
    if cfg.has_erase:
        in_specs, args = [_per_head(n, c, dk), *in_specs], (state_reads, *args)
    return pl.pallas_call(
        _scan_output_kernel(cfg, n), grid=(b, h, dv // bv),
        out_shape=(jax.ShapeDtypeStruct((b, n * c, h, dv), out_dtype), jax.ShapeDtypeStruct((b, h, dk, dv), F32)),
        in_specs=in_specs,
        out_specs=(by_token, _per_head_v_block(dk, bv)),
        interpret=cfg.interpret, compiler_params=_params(cfg, cfg.warps_scan, cfg.stages_scan_output),
        cost_estimate=_cost(cfg, "K2_scan_output", b * h, n), name="delta_rule_scan_output")(*args)


def _output(cfg, query_start, starts, readout, true_pseudo, out_dtype):
    b, h, n, c, dk = query_start.shape
    dv = true_pseudo.shape[-1]
    # without an erase Ũ is V̂ [B, T, H, Dv], read by token
    true_pseudo_spec = _chunk_spec(c, dv) if cfg.has_erase else _token_spec(cfg, dv)
    return pl.pallas_call(
        _output_kernel(cfg), out_shape=jax.ShapeDtypeStruct((b, n * c, h, dv), out_dtype), grid=(b, h, n),
        in_specs=[_chunk_spec(c, dk), _chunk_spec(dk, dv), _chunk_spec(c, c), true_pseudo_spec],
        out_specs=_token_spec(cfg, dv), interpret=cfg.interpret,
        cost_estimate=_cost(cfg, "K3_output", b * h, n),
        compiler_params=_params(cfg, cfg.warps_output), name="delta_rule_output")(query_start, starts, readout,
                                true_pseudo)


def _scan_bwd_plain(cfg, readout, d_out, key_eff, query_start, chunk_decay, d_final, dv_dtype):
    """B1 without an erase: (dS_C per chunk, dV̂ [B, T, H, Dv] in ``dv_dtype``, dS₀): dŨ is dV̂ itself (no
    transposed solve), written by token."""
    b, h, n, c, dk = key_eff.shape
    dv = d_out.shape[-1]
    bv = cfg.scan_block_v
    by_token = pl.BlockSpec((None, n * c, None, bv), lambda b_, h_, j: (b_, 0, h_, j))
    return pl.pallas_call(
        _scan_bwd_kernel(cfg, n),
        out_shape=(jax.ShapeDtypeStruct((b, h, n, dk, dv), cfg.operand_dtype),
                   jax.ShapeDtypeStruct((b, n * c, h, dv), dv_dtype), jax.ShapeDtypeStruct((b, h, dk, dv), F32)),
        grid=(b, h, dv // bv),
        in_specs=[_per_head(n, c, c), by_token, _per_head(n, c, dk), _per_head(n, c, dk), _per_head(n, dk),
                  _per_head_v_block(dk, bv)],
        out_specs=(_per_head_v_block(n, dk, bv), by_token, _per_head_v_block(dk, bv)),
        interpret=cfg.interpret, compiler_params=_params(cfg, cfg.warps_scan, cfg.stages_scan),
        cost_estimate=_cost(cfg, "B1_scan_bwd", b * h, n),
        name="delta_rule_scan_bwd")(readout, d_out, key_eff, query_start, chunk_decay, d_final)


def _scan_bwd(cfg, readout, d_out, key_eff, query_start, state_reads, chunk_decay, d_final):
    b, h, n, c, dk = state_reads.shape
    dv = d_out.shape[-1]
    bv = cfg.scan_block_v
    do_spec = pl.BlockSpec((None, n * c, None, bv), lambda b_, h_, j: (b_, 0, h_, j))
    return pl.pallas_call(
        _scan_bwd_kernel(cfg, n),
        out_shape=(jax.ShapeDtypeStruct((b, h, n, dk, dv), cfg.operand_dtype),
                   jax.ShapeDtypeStruct((b, h, n, c, dv), state_reads.dtype), jax.ShapeDtypeStruct((b, h, dk, dv),
                                        F32)),
        grid=(b, h, dv // bv),
        in_specs=[_per_head(n, c, c), do_spec, _per_head(n, c, dk), _per_head(n, c, dk), _per_head(n, c, dk),
                  _per_head(n, dk), _per_head_v_block(dk, bv)],
        out_specs=(_per_head_v_block(n, dk, bv), _per_head_v_block(n, c, bv), _per_head_v_block(dk, bv)),
        interpret=cfg.interpret, compiler_params=_params(cfg, cfg.warps_scan, cfg.stages_scan),
        cost_estimate=_cost(cfg, "B1_scan_bwd", b * h, n),
        name="delta_rule_scan_bwd")(readout, d_out, key_eff, query_start, state_reads, chunk_decay, d_final)


def _cotangents(cfg, document, carried, inverse, pseudo_values, state_reads, starts, d_out, d_true_pseudo, dv_dtype):
    b, h, n, c, dv = pseudo_values.shape
    dk = state_reads.shape[-1]
    od = cfg.operand_dtype
    out_shape = (jax.ShapeDtypeStruct((b, h, n, c, dv), od),  # Ũ
                 jax.ShapeDtypeStruct((b, h, n, c, c), od),  # dM
                 jax.ShapeDtypeStruct((b, h, n, c, c), od),  # dA
                 jax.ShapeDtypeStruct((b, n * c, h, dv), dv_dtype))  # dV̂
    in_specs = [*_document_specs(cfg), _chunk_spec(c, c), _chunk_spec(c, dv), _chunk_spec(c, dk), _chunk_spec(dk, dv),
                _token_spec(cfg, dv), _chunk_spec(c, dv)]
    out_specs = (_chunk_spec(c, dv), _chunk_spec(c, c), _chunk_spec(c, c), _token_spec(cfg, dv))
    return pl.pallas_call(_cotangents_kernel(cfg), out_shape=out_shape, grid=(b, h, n), in_specs=in_specs,
                          out_specs=out_specs, interpret=cfg.interpret,
                          cost_estimate=_cost(cfg, "B2a_cotangents", b * h, n),
                          compiler_params=_params(cfg, cfg.warps_cotangents), name="delta_rule_cotangents")(
        document, carried, inverse, pseudo_values, state_reads, starts, d_out, d_true_pseudo)


def _key_grads(cfg, q, k, erase, log_decay, document, carried, inverse, starts, d_ends, d_out, d_true_pseudo,
               true_pseudo, d_readout, d_strict, dtypes, flags=None):
    """B2b; with ``flags`` (the forward's K1 ran two passes) as two kernels like K1: every program with the
    whole chunk's cut, then the search for the programs of flagged chunks (outputs aliased)."""
    b, t, h, dk = q.shape
    dv = true_pseudo.shape[-1]
    c, bk = cfg.chunk, cfg.block_k
    n = t // c
    # grid (B, H, N·key blocks): chunk j // nkb, key block j % nkb
    nkb = dk // bk
    token = pl.BlockSpec((None, c, None, bk), lambda b_, h_, j: (b_, j // nkb, h_, j % nkb))
    chunk = lambda *tail: pl.BlockSpec((None, None, None, *tail),  # noqa: E731
                                       lambda b_, h_, j: (b_, h_, j // nkb, *([0] * len(tail))))
    # noqa
    state_rows = pl.BlockSpec((None, None, None, bk, dv), lambda b_, h_, j: (b_, h_, j // nkb, j % nkb, 0))
    in_specs = [token] * 4 + [
        pl.BlockSpec((None, c), lambda b_, h_, j: (b_, j // nkb)),
        pl.BlockSpec((None, None), lambda b_, h_, j: (b_, j // nkb)),
        chunk(c, c), state_rows, state_rows, pl.BlockSpec((None, c, None, dv), lambda b_, h_, j: (b_, j // nkb, h_, 0)),
        chunk(c, dv), chunk(c, dv), chunk(c, c), chunk(c, c)]
    out_shape = (jax.ShapeDtypeStruct(q.shape, dtypes[0]), jax.ShapeDtypeStruct(k.shape, dtypes[1]),
                 jax.ShapeDtypeStruct(erase.shape, dtypes[2]), jax.ShapeDtypeStruct(log_decay.shape, dtypes[3]))
    args = (q, k, erase, log_decay, document, carried, inverse, starts, d_ends, d_out, d_true_pseudo, true_pseudo,
            d_readout, d_strict)
    call = functools.partial(pl.pallas_call, out_shape=out_shape, grid=(b, h, n * nkb), out_specs=(token,) * 4,
                             interpret=cfg.interpret, compiler_params=_params(cfg, cfg.warps_key_grads))
    body = _key_grads_body(cfg)
    cost = _cost(cfg, "B2b_key_grads", b * h, n)
    if flags is None:
        return call(_passes(body, len(args), 4, "single"), in_specs=in_specs, cost_estimate=cost,
                    name="delta_rule_key_grads")(*args)
    flag_spec = pl.BlockSpec((None, None, None), lambda b_, h_, j: (b_, h_, j // nkb))
    whole = call(_passes(body, len(args), 4, "whole"), in_specs=in_specs, cost_estimate=cost,
                 name="delta_rule_key_grads")(*args)
    return call(_passes(body, len(args), 4, "second"), in_specs=[*in_specs, flag_spec, *(token,) * 4],
                input_output_aliases={len(args) + 1 + i: i for i in range(4)},
                cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=4 * b * h * n * nkb),
                name="delta_rule_key_grads_search")(*args, flags, *whole)


def _grads(cfg, q, k, erase, log_decay, document, carried, inverse, pseudo_values, state_reads, starts, d_ends, d_out,
           d_true_pseudo, dtypes, flags=None):
    """B2: dq̂, dk, dk̂, dV̂, dλ (B2a per chunk, then B2b per chunk and key block)."""
    true_pseudo, d_readout, d_strict, dv = _cotangents(cfg, document, carried, inverse, pseudo_values, state_reads,
                                                       starts, d_out, d_true_pseudo, dtypes[3])
    dq, dk, d_erase, d_log_decay = _key_grads(cfg, q, k, erase, log_decay, document, carried, inverse, starts, d_ends,
                                              d_out, d_true_pseudo, true_pseudo, d_readout, d_strict,
                                              (dtypes[0], dtypes[1], dtypes[2], dtypes[4]), flags)
    return dq, dk, d_erase, dv, d_log_decay


def _grads_plain(cfg, q, k, v, log_decay, document, carried, starts, d_ends, d_out, dtypes, flags=None):
    """B2 without an erase: dM = dO V̂ᵀ (B2a), then dq̂, dk, dλ per chunk and key block (B2b); dV̂ came from B1."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    c, bk = cfg.chunk, cfg.block_k
    n = t // c
    d_readout = pl.pallas_call(
        _readout_grad_kernel(cfg), out_shape=jax.ShapeDtypeStruct((b, h, n, c, c), cfg.operand_dtype),
        grid=(b, h, n), in_specs=[*_document_specs(cfg), _token_spec(cfg, dv), _token_spec(cfg, dv)],
        out_specs=_chunk_spec(c, c), interpret=cfg.interpret, cost_estimate=_cost(cfg, "B2a_cotangents", b * h, n),
        compiler_params=_params(cfg, cfg.warps_cotangents), name="delta_rule_cotangents")(document, carried, v, d_out)
    nkb = dk // bk
    token = pl.BlockSpec((None, c, None, bk), lambda b_, h_, j: (b_, j // nkb, h_, j % nkb))
    by_token = pl.BlockSpec((None, c, None, dv), lambda b_, h_, j: (b_, j // nkb, h_, 0))
    chunk = pl.BlockSpec((None, None, None, c, c), lambda b_, h_, j: (b_, h_, j // nkb, 0, 0))
    state_rows = pl.BlockSpec((None, None, None, bk, dv), lambda b_, h_, j: (b_, h_, j // nkb, j % nkb, 0))
    in_specs = [token] * 3 + [pl.BlockSpec((None, c), lambda b_, h_, j: (b_, j // nkb)),
                              pl.BlockSpec((None, None), lambda b_, h_, j: (b_, j // nkb)),
                              state_rows, state_rows, by_token, by_token, chunk]
    out_shape = tuple(jax.ShapeDtypeStruct(x.shape, dt) for x, dt in zip((q, k, log_decay), dtypes))
    args = (q, k, log_decay, document, carried, starts, d_ends, d_out, v, d_readout)
    call = functools.partial(pl.pallas_call, out_shape=out_shape, grid=(b, h, n * nkb), out_specs=(token,) * 3,
                             interpret=cfg.interpret, compiler_params=_params(cfg, cfg.warps_key_grads))
    body = _key_grads_body(cfg)
    cost = _cost(cfg, "B2b_key_grads", b * h, n)
    if flags is None:
        return call(_passes(body, len(args), 3, "single"), in_specs=in_specs, cost_estimate=cost,
                    name="delta_rule_key_grads")(*args)
    flag_spec = pl.BlockSpec((None, None, None), lambda b_, h_, j: (b_, h_, j // nkb))
    whole = call(_passes(body, len(args), 3, "whole"), in_specs=in_specs, cost_estimate=cost,
                 name="delta_rule_key_grads")(*args)
    return call(_passes(body, len(args), 3, "second"), in_specs=[*in_specs, flag_spec, *(token,) * 3],
                input_output_aliases={len(args) + 1 + i: i for i in range(3)},
                cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=4 * b * h * n * nkb),
                name="delta_rule_key_grads_search")(*args, flags, *whole)
