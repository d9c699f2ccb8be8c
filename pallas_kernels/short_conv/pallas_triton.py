"""The short convolution on GPU through Pallas' Triton backend: one forward kernel, two backward kernels.

    y_t = act(a_t),   a_t = Σ_{i<K} W[K−1−i] · x_{t−i} · [seg_{t−i} = seg_t]

(seg: the document index the op's entry derives from the segment ids, so equal values = same document.)

Forward, grid (B, T/BT, C/BC): a program owns y[b, t0:t0+BT, c0:c0+BC]. For each tap i it loads the x block
shifted i tokens back (masked before the row's start and where seg_{t−i} ≠ seg_t), accumulates in float32,
applies SiLU and stores in the output dtype. The K shifted loads overlap, so HBM sees x about once.

Backward, with d_t = dy_t · act'(a_t):

    dx_t = Σ_i W[K−1−i] · d_{t+i} · [seg_t = seg_{t+i}],     dW[K−1−i] = Σ_t x_{t−i} · [seg_{t−i} = seg_t] · d_t

Pass 1 (the forward's grid and blocks) recomputes a from x (nothing from the forward is stored) and writes d
in float32; with no activation d is dy itself and pass 1 is skipped. Pass 2, grid (B, T/(BT·S), C/BC): a
program walks S blocks of BT tokens, reads d at t..t+K−1 and x at t−(K−1)..t (2K blocks live) for dx, and sums
the dW terms of its S blocks in float32 registers; the [B · T/(BT·S), K, C] float32 partial sums are added up
by XLA afterwards (deterministic, no atomics). A single backward kernel that recomputes a at the K positions
each dx_t needs (K² multiply-adds and K sigmoids per element, 3K − 1 blocks live) was 7 % slower on an H100 at
32 × 4096 × 1024 even against its best blocks: the extra float32 round trip of d costs less than the
recomputation and the register pressure.

Shifted loads are gathers with row indices clamped into the array plus a mask (the interpreter clamps a
negative ``pl.ds`` start, which would shift the block); stores use ``pl.ds`` with a mask, so T and C need not
be multiples of the blocks. Block shapes are powers of two (Triton).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from mixerlab.pallas_kernels.triton_common import pltriton, compiler_params, iota, pow2, unavailable


F32 = jnp.float32
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_KERNEL_SIZE = 8  # the backward's pass 2 keeps 2K blocks live


@dataclasses.dataclass(frozen=True)
class Config:
    """Blocks and warps. ptxas on sm_90a at 32×4096×1024 bf16, K 4, with segments
    (``tools/triton_ptx_report.py --op short_conv``): forward 32 × 128 uses 127 registers per thread (64 × 128:
    255, two CTAs per SM); backward pass 1 126 (4 warps), pass 2 at 16 × 128 on 8 warps 121 (8 × 64 on 4 warps:
    64; 32 × 128 on 8 warps: 174), no spills.
    The backward blocks were the fastest of six on an H100 (``tools/bench_short_conv.py --sweep`` times a few)."""

    block_t: int = 32  # forward: tokens per program
    block_c: int = 128  # forward: channels per program
    bwd_block_t: int = 16  # backward pass 2: tokens per step (2K blocks of BT × BC live)
    bwd_block_c: int = 128  # backward pass 2: channels per program
    bwd_steps: int = 32  # backward pass 2: steps per program (fewer dW partial rows: B · T / (BT · S) of them)
    warps: int = 4
    bwd_warps: int = 8
    interpret: bool = False


def make_config(length: int, channels: int, *, interpret: bool = False, **overrides) -> Config:
    """The default blocks (and backward steps) shrunk to the next power of two of small T and C, then
    ``overrides`` (any :class:`Config` field), checked."""
    names = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"short_conv pallas_triton: unknown config field(s) {unknown}; valid: {sorted(names)}")
    t2, c2 = pl.next_power_of_2(max(length, 1)), pl.next_power_of_2(max(channels, 1))
    base = Config()
    bwd_block_t = min(base.bwd_block_t, t2)
    cfg = Config(block_t=min(base.block_t, t2), block_c=min(base.block_c, c2), bwd_block_t=bwd_block_t,
                 bwd_block_c=min(base.bwd_block_c, c2), bwd_steps=min(base.bwd_steps, t2 // bwd_block_t),
                 interpret=interpret)
    cfg = dataclasses.replace(cfg, **overrides)
    for name in ("block_t", "block_c", "bwd_block_t", "bwd_block_c", "bwd_steps", "warps", "bwd_warps"):
        if not pow2(getattr(cfg, name)):
            raise ValueError(f"short_conv pallas_triton: {name}={getattr(cfg, name)!r}; expected a power of two "
                             f"(Triton block shapes and warp counts)")
    return cfg


def supports(backend: str, dtype, kernel_size: int) -> Optional[str]:
    """``None`` when the kernels can run this call, else the reason."""
    reason = unavailable(backend, "the Pallas-Triton short-conv kernels")
    if reason:
        return reason
    if jnp.dtype(dtype) not in DTYPES:
        return f"x dtype {jnp.dtype(dtype).name} not supported (float32, bfloat16, float16)"
    if kernel_size > MAX_KERNEL_SIZE:
        return f"kernel_size={kernel_size} > {MAX_KERNEL_SIZE} (the backward keeps 2K blocks in registers)"
    return None


# ---------------------------------------------------------------------------------------------------------
# loads and stores


def _index(i: int):
    """A static index as an int32 scalar (the interpreter's masked load/store wants arrays, not Python ints)."""
    return jnp.int32(i)


def _load_block(ref, b, rows, cols, ok):
    """ref[b, rows, cols] as float32 ([BT, BC]); zero where ``ok`` is false. Row indices are clamped into the
    array (a shifted block starts before token 0; the mask drops those rows). Column indices are not: a clamp
    would hide their contiguity from Triton and split the vector loads into scalar ones, and columns past C
    are masked (never read on the GPU; the interpreter's gather clamps them)."""
    r = jnp.clip(rows, 0, ref.shape[1] - 1)[:, None]
    return pltriton.load(ref.at[b, r, cols[None, :]], mask=ok, other=0.0).astype(F32)


def _load_segments(ref, b, rows):
    """seg[b, rows] ([BT] int32), indices clamped into the row (callers mask what lies outside)."""
    return pltriton.load(ref.at[b, jnp.clip(rows, 0, ref.shape[1] - 1)])


def _load_taps(w_ref, cols, col_ok, kernel_size):
    """W's K rows for these channels, float32 [BC] each (zero past C)."""
    return [pltriton.load(w_ref.at[_index(r), cols], mask=col_ok, other=0.0).astype(F32)
            for r in range(kernel_size)]


def _silu_and_grad(acc):
    sig = jax.nn.sigmoid(acc)
    return acc * sig, sig * (1.0 + acc * (1.0 - sig))


# ---------------------------------------------------------------------------------------------------------
# kernels


def _pre_activation(x_ref, seg_ref, taps, b, rows, cols, col_ok, seg_here):
    """a[rows, cols] = Σ_i W[K−1−i] x_{t−i} [seg_{t−i} = seg_t] in float32 ([BT, BC]); ``seg_ref`` None: no
    segments."""
    length, k = x_ref.shape[1], len(taps)
    acc = jnp.zeros((rows.shape[0], cols.shape[0]), F32)
    for i in range(k):  # tap i: i tokens back
        src = rows - i
        ok = (src >= 0) & (src < length)
        if seg_ref is not None:
            ok = ok & (_load_segments(seg_ref, b, src) == seg_here)
        acc = acc + _load_block(x_ref, b, src, cols, ok[:, None] & col_ok[None, :]) * taps[k - 1 - i][None, :]
    return acc


def _pre_activation_block(x_ref, w_ref, seg_ref, block_t, block_c):
    """The program's block on the forward grid: (b, t0, c0), its columns, its store mask and a there (float32)."""
    b, t0, c0 = pl.program_id(0), pl.program_id(1) * block_t, pl.program_id(2) * block_c
    rows, cols = t0 + iota(block_t), c0 + iota(block_c)
    col_ok = cols < x_ref.shape[2]
    taps = _load_taps(w_ref, cols, col_ok, w_ref.shape[0])
    seg_here = _load_segments(seg_ref, b, rows) if seg_ref is not None else None
    acc = _pre_activation(x_ref, seg_ref, taps, b, rows, cols, col_ok, seg_here)
    store_ok = (rows < x_ref.shape[1])[:, None] & col_ok[None, :]
    return (b, t0, c0), rows, cols, store_ok, acc


def _forward_kernel(x_ref, w_ref, *refs, activation, has_segments, block_t, block_c):
    seg_ref, y_ref = refs if has_segments else (None, *refs)
    (b, t0, c0), _, _, store_ok, acc = _pre_activation_block(x_ref, w_ref, seg_ref, block_t, block_c)
    y = _silu_and_grad(acc)[0] if activation else acc
    pltriton.store(y_ref.at[b, pl.ds(t0, block_t), pl.ds(c0, block_c)], y.astype(y_ref.dtype), mask=store_ok)


def _activation_grad_kernel(x_ref, w_ref, dy_ref, *refs, has_segments, block_t, block_c):
    """Backward pass 1: d = dy · SiLU'(a) in float32 on the forward's grid."""
    seg_ref, d_ref = refs if has_segments else (None, *refs)
    (b, t0, c0), rows, cols, store_ok, acc = _pre_activation_block(x_ref, w_ref, seg_ref, block_t, block_c)
    dy = _load_block(dy_ref, b, rows, cols, store_ok)
    pltriton.store(d_ref.at[b, pl.ds(t0, block_t), pl.ds(c0, block_c)], dy * _silu_and_grad(acc)[1],
                   mask=store_ok)


def _steps_then_store_dw(step, dw_ref, row, steps, block_t, c0, col_ok, k):
    """Run ``step(s, dW accumulators)`` over the program's steps with K [BT, BC] float32 accumulators, then reduce
    each over tokens once (not one cross-warp reduction per step) into row ``row`` of the dW partials."""
    zeros = tuple(jnp.zeros((block_t, col_ok.shape[0]), F32) for _ in range(k))
    d_w = jax.lax.fori_loop(0, steps, step, zeros)
    for i in range(k):
        pltriton.store(dw_ref.at[row, _index(k - 1 - i), pl.ds(c0, col_ok.shape[0])], jnp.sum(d_w[i], axis=0),
                       mask=col_ok)


def _conv_grad_kernel(x_ref, w_ref, d_ref, *refs, has_segments, block_t, block_c, steps, groups):
    """Backward pass 2: dx and the dW partial sums from d (pass 1's, or dy with no activation)."""
    seg_ref, dx_ref, dw_ref = refs if has_segments else (None, *refs)
    length, k = x_ref.shape[1], w_ref.shape[0]
    b, g, c0 = pl.program_id(0), pl.program_id(1), pl.program_id(2) * block_c
    cols = c0 + iota(block_c)
    col_ok = cols < x_ref.shape[2]
    taps = _load_taps(w_ref, cols, col_ok, k)

    def step(s, d_w):
        t0 = (g * steps + s) * block_t
        rows = t0 + iota(block_t)
        src = {d: rows + d for d in range(-(k - 1), k)}
        inside = {d: (src[d] >= 0) & (src[d] < length) for d in src}
        seg = {d: _load_segments(seg_ref, b, src[d]) for d in src} if has_segments else None
        same = (lambda d: seg[d] == seg[0]) if has_segments else (lambda d: True)
        d_x = jnp.zeros((block_t, block_c), F32)
        d_here = None
        for i in range(k):  # dx_t = Σ_i W[K−1−i] d_{t+i} [seg_t = seg_{t+i}]; d is zero past T
            d_i = _load_block(d_ref, b, src[i], cols, (inside[i] & same(i))[:, None] & col_ok[None, :])
            d_here = d_i if i == 0 else d_here
            d_x = d_x + d_i * taps[k - 1 - i][None, :]
        store_ok = (rows < length)[:, None] & col_ok[None, :]
        pltriton.store(dx_ref.at[b, pl.ds(t0, block_t), pl.ds(c0, block_c)], d_x.astype(dx_ref.dtype),
                       mask=store_ok)
        new_d_w = []
        for i in range(k):  # dW[K−1−i] += x_{t−i} [seg_{t−i} = seg_t] d_t
            x_i = _load_block(x_ref, b, src[-i], cols, (inside[-i] & same(-i))[:, None] & col_ok[None, :])
            new_d_w.append(d_w[i] + x_i * d_here)
        return tuple(new_d_w)

    _steps_then_store_dw(step, dw_ref, b * groups + g, steps, block_t, c0, col_ok, k)


# ---------------------------------------------------------------------------------------------------------
# pallas_call wrappers


def _compiler_params(cfg, warps):
    return compiler_params(cfg.interpret, warps)


def _forward(cfg, x, w, seg, activation, out_dtype):
    b, t, c = x.shape
    k = w.shape[0]
    grid = (b, pl.cdiv(t, cfg.block_t), pl.cdiv(c, cfg.block_c))
    has_segments = seg is not None
    kernel = functools.partial(_forward_kernel, activation=activation, has_segments=has_segments,
                               block_t=cfg.block_t, block_c=cfg.block_c)
    n = b * t * c
    seg_bytes = k * b * t * 4 * grid[2] if has_segments else 0  # each channel block re-reads the ids per tap
    cost = pl.CostEstimate(
        flops=int(2 * k * n + (4 * n if activation else 0)), transcendentals=int(n if activation else 0),
        bytes_accessed=int(n * (x.dtype.itemsize + jnp.dtype(out_dtype).itemsize) + w.size * 4 * grid[0] * grid[1]
                           + seg_bytes))
    args = (x, w, seg) if has_segments else (x, w)
    return pl.pallas_call(kernel, grid=grid, out_shape=jax.ShapeDtypeStruct((b, t, c), out_dtype),
                          compiler_params=_compiler_params(cfg, cfg.warps), interpret=cfg.interpret,
                          cost_estimate=cost, name="short_conv_fwd")(*args)


def _backward(cfg, x, w, seg, dy, activation):
    b, t, c = x.shape
    k = w.shape[0]
    has_segments = seg is not None
    n = b * t * c
    tail = (seg,) if has_segments else ()
    d = dy
    if activation:  # pass 1: d = dy · SiLU'(a), float32, on the forward's grid
        grid = (b, pl.cdiv(t, cfg.block_t), pl.cdiv(c, cfg.block_c))
        kernel = functools.partial(_activation_grad_kernel, has_segments=has_segments, block_t=cfg.block_t,
                                   block_c=cfg.block_c)
        cost = pl.CostEstimate(
            flops=int(2 * k * n + 6 * n), transcendentals=int(n),
            bytes_accessed=int(n * (x.dtype.itemsize + dy.dtype.itemsize + 4) + w.size * 4 * grid[0] * grid[1]
                               + (k * b * t * 4 * grid[2] if has_segments else 0)))
        d = pl.pallas_call(kernel, grid=grid, out_shape=jax.ShapeDtypeStruct((b, t, c), F32),
                           compiler_params=_compiler_params(cfg, cfg.warps), interpret=cfg.interpret,
                           cost_estimate=cost, name="short_conv_bwd_act")(x, w, dy, *tail)
    per_program = cfg.bwd_block_t * cfg.bwd_steps
    grid = (b, pl.cdiv(t, per_program), pl.cdiv(c, cfg.bwd_block_c))
    kernel = functools.partial(_conv_grad_kernel, has_segments=has_segments, block_t=cfg.bwd_block_t,
                               block_c=cfg.bwd_block_c, steps=cfg.bwd_steps, groups=grid[1])
    partial_rows = b * grid[1]
    seg_bytes = (2 * k - 1) * b * t * 4 * grid[2] if has_segments else 0
    cost = pl.CostEstimate(
        flops=int(4 * k * n), transcendentals=0,
        bytes_accessed=int(n * (2 * x.dtype.itemsize + d.dtype.itemsize) + partial_rows * k * c * 4
                           + w.size * 4 * grid[0] * grid[1] + seg_bytes))
    out_shape = (jax.ShapeDtypeStruct((b, t, c), x.dtype), jax.ShapeDtypeStruct((partial_rows, k, c), F32))
    d_x, d_w_partial = pl.pallas_call(kernel, grid=grid, out_shape=out_shape,
                                      compiler_params=_compiler_params(cfg, cfg.bwd_warps), interpret=cfg.interpret,
                                      cost_estimate=cost, name="short_conv_bwd_conv")(x, w, d, *tail)
    return d_x, jnp.sum(d_w_partial, axis=0)


# ---------------------------------------------------------------------------------------------------------
# custom VJP and the op's run contract


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4, 5))
def _causal_conv(cfg, x, w, seg, activation, out_dtype):
    return _forward(cfg, x, w, seg, activation, out_dtype)


def _causal_conv_fwd(cfg, x, w, seg, activation, out_dtype):
    return _forward(cfg, x, w, seg, activation, out_dtype), (x, w, seg)


def _causal_conv_bwd(cfg, activation, out_dtype, residuals, dy):
    x, w, seg = residuals
    d_x, d_w = _backward(cfg, x, w, seg, dy, activation)
    return d_x, d_w.astype(w.dtype), None


_causal_conv.defvjp(_causal_conv_fwd, _causal_conv_bwd)


def run(x_BTC, w_KC, segment_ids_BT, activation: bool, out_dtype, *, interpret: bool = False, **overrides):
    """x [B, T, C] (float32 / bfloat16 / float16), W [K, C] (read as float32), segment ids [B, T] int or None.
    Returns y [B, T, C] in ``out_dtype``; differentiable in x and W (custom VJP: dx in x's dtype, dW in W's).
    ``overrides``: :class:`Config` fields (block_t, block_c, bwd_block_t, bwd_block_c, bwd_steps, warps,
    bwd_warps)."""
    cfg = make_config(x_BTC.shape[1], x_BTC.shape[2], interpret=interpret, **overrides)
    seg = None if segment_ids_BT is None else segment_ids_BT.astype(jnp.int32)
    return _causal_conv(cfg, x_BTC, w_KC, seg, bool(activation), jnp.dtype(out_dtype))
