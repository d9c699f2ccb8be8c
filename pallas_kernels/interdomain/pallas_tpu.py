"""Interdomain attention as Pallas (Mosaic TPU) kernels: pass (iii) of the chunked form — the outputs of every
chunk from its chunk-start states — forward here, backward in ``pallas_tpu_bwd.py``, each kernel pair wired
through a ``jax.custom_vjp`` (docs/math/interdomain.md, 'Chunked form', 'Gradients'; docs/kernels.md, TPU
section). The algorithm is the GPU kernels' (``pallas_triton.py``): the same pivot-tree decays, the same split
at the readout, the same residuals; the layout is Mosaic's.

Passes (i) and (ii) (chunk-local end states, the serial scan over the chunk boundaries) and therefore the
final states stay in XLA (``xla.chunk_start_states``, autodiffed): O(T·M·(R + Dv)) work, one small matmul per
chunk. Split at the readout, both kernels on the grid (B·H, N), both axes "parallel" (a chunk needs only its
own start state), one chunk of one head per grid step:

  ``interdomain_tpu_query``   â = e^{ℓ} ⊙ (X̂ᵏ₀ q) + b ⊙ Σ_{j≤s} Sc[s, j] D[s, j]     (saves Sc under a gradient)
  XLA                         ω = Ĝ â per token (autodiffed: dĜ, dâ)
  ``interdomain_tpu_output``  o = P v + Re(conj(ω) ⊙ e^{ℓ}) X̂ᵛ₀,  P[s, j] = Re Σ_m conj(ω_sm) b_m D[s, j, m]
                                                                                    (saves P under a gradient)

with Sc = q kᵀ on strictly lower same-document pairs, e^{ℓ_s} = exp(r(−1, s]) e^{iθ(s+1)} on the rows of the
carried-in document, and D[s, j] = exp(r(j, s]) e^{iθ(s−j)} never formed: every strictly lower pair (s, j)
belongs to one level of a binary pivot tree (the node of size 2h whose right half holds s and left half j,
pivot p = the left half's last token) and D[s, j] = f_ℓ[s] f_ℓ[j] with f_ℓ = exp(W_ℓ r) e^{iθ n_ℓ}, both
factors decays (every exponent a sum of r ≤ 0 over a half-node: nothing overflows, nothing cancels). Per
level the pair sums are two real [K, K] x [K, M] GEMMs on the MXU; the range sums W_ℓ r are 0/1 matmuls at
f32 HIGHEST (exact weights; ``cumsum`` does not lower in Mosaic); phases are integer offsets times θ.

Layout: tokens as [B·H, Tp, D] (T padded to a multiple of K with zero inputs, r = 0, the last document), so a
grid step sees (K, D) blocks; complex per-token tiles as separate Re / Im arrays [B·H, Tp, M] (no lane
slicing at M); chunk-start states [B·H, N, 2M, D] (rows split at M, a sublane multiple); per-head mode
parameters packed as [H, 3, M] (θ, Re b, Im b); documents relative to the chunk's carried-in document
(0 = carried) as a column [B, Tp, 1] and as rows [B, N, 1, K]. All M modes of a chunk at once (M ≤ 128: the
tiles are at most [128, 128] f32).

Numerics: decays, range sums, states and accumulation in f32; the pair GEMMs and the q/k/v GEMMs with operands
in the caller's dtype (bf16: the MXU's bf16 path with f32 accumulation; f32: Precision.HIGHEST).
``sub_chunk_size`` of the op does not apply (the pivot tree replaces the sub-chunks).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mixerlab.pallas_kernels import common
from mixerlab.pallas_kernels.interdomain import xla

F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST
SUPPORTED_CHUNKS = (32, 64, 128)
SUPPORTED_DIMS = (16, 32, 64, 128, 256)  # R and Dv: full-array lane dims of the token blocks
SUPPORTED_MODES = (16, 32, 64, 128)  # M: every per-mode tile is [K, M]
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

_SQ = pl.Squeezed() if hasattr(pl, "Squeezed") else None
_CompilerParams = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")


# ---------------------------------------------------------------------------------------------------------
# configuration


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    chunk: int
    key_dim: int
    value_dim: int
    modes: int
    heads: int
    operand_dtype: str  # "bfloat16" | "float32": the GEMM operands
    interpret: Any = False  # False | True | pltpu.InterpretParams(...)
    vmem_limit_bytes: Optional[int] = None  # None: the generation's default scoped VMEM limit (enough, see docs)

    @property
    def cdt(self):
        return jnp.dtype(self.operand_dtype)

    @property
    def levels(self) -> tuple[int, ...]:
        """Half sizes h = 1, 2, …, K/2 of the pivot-tree levels."""
        return tuple(2 ** n for n in range(int(math.log2(self.chunk))))


def check_config(chunk_size, key_dim, value_dim, modes) -> Optional[str]:
    if chunk_size not in SUPPORTED_CHUNKS:
        return f"chunk_size={chunk_size} not in {SUPPORTED_CHUNKS}"
    for name, d in (("key_dim", key_dim), ("value_dim", value_dim)):
        if d not in SUPPORTED_DIMS:
            return f"{name}={d} not in {SUPPORTED_DIMS}"
    if modes not in SUPPORTED_MODES:
        return f"modes={modes} not in {SUPPORTED_MODES}"
    return None


def supports(call) -> Optional[str]:
    """None if the Pallas TPU kernels serve ``call`` (an ``api.InterdomainCall``; op "interdomain", or "s4d" whose
    key_dim is 0 and which runs the output kernels alone), else the reason."""
    if call.op not in ("interdomain", "s4d"):
        return f"op {call.op!r} has no Pallas TPU kernel (only 'interdomain' and 's4d')"
    if call.backend != "tpu":
        return f"needs a TPU backend (got {call.backend!r}); on CPU use pallas_tpu.run(..., interpret=True)"
    if jnp.dtype(call.dtype) not in _DTYPES:
        return f"dtype {jnp.dtype(call.dtype).name} not supported (TPU kernels: bfloat16 or float32)"
    key_dim = call.value_dim if call.op == "s4d" else call.key_dim
    return check_config(call.chunk_size, key_dim, call.value_dim, call.modes)


def operand_dtype(dtype) -> str:
    return "bfloat16" if jnp.dtype(dtype) == jnp.bfloat16 else "float32"


# ---------------------------------------------------------------------------------------------------------
# tile math (values, not refs). Complex tiles are (Re, Im) pairs of [K, M] f32 tiles.


def _dot(a, b, dims, cdt):
    precision = _HIGHEST if jnp.dtype(cdt) == jnp.dtype(F32) else None
    return jax.lax.dot_general(a.astype(cdt), b.astype(cdt), (dims, ((), ())), precision=precision,
                               preferred_element_type=F32)


def mm(a, b, cdt):
    """a @ b, operands in ``cdt``, f32 accumulation."""
    return _dot(a, b, ((1,), (0,)), cdt)


def mm_nt(a, b, cdt):
    """a @ bᵀ."""
    return _dot(a, b, ((1,), (1,)), cdt)


def mm_tn(a, b, cdt):
    """aᵀ @ b."""
    return _dot(a, b, ((0,), (0,)), cdt)


def iota2(shape):
    return jax.lax.broadcasted_iota(jnp.int32, shape, 0), jax.lax.broadcasted_iota(jnp.int32, shape, 1)


def cmul(a_re, a_im, b_re, b_im):
    return a_re * b_re - a_im * b_im, a_re * b_im + a_im * b_re


def conj_mul(w_re, w_im, f_re, f_im):
    """conj(w) ⊙ f."""
    return w_re * f_re + w_im * f_im, w_re * f_im - w_im * f_re


def polar(log_amp, offset, theta):
    """exp(log_amp) e^{i·offset·θ}: offset [K, 1] integer-valued f32 (exact), θ [1, M]."""
    amp = jnp.exp(log_amp)
    angle = offset * theta
    return amp * jnp.cos(angle), amp * jnp.sin(angle)


@dataclasses.dataclass(frozen=True)
class Level:
    """One pivot-tree level of a chunk of K tokens (half size h = 2ⁿ)."""

    pairs: Any  # [K, K] bool: s in the right half, j in the left half of the same node of size 2h
    sums: Any  # [K, K] 0/1 f32: row s selects r(p, s] (right half) or r(s, p] (left half)
    offset: Any  # [K, 1] f32: tokens in row s's range (s − p or p − s)


def level(k, n) -> Level:
    """Level n (half size h = 2ⁿ; n may be a traced loop index) of the pivot tree of a chunk of K tokens."""
    i, j = iota2((k, k))
    half_i, half_j = i >> n, j >> n
    right = (half_i & 1) == 1
    pairs = ((half_i >> 1) == (half_j >> 1)) & right & ((half_j & 1) == 0)
    in_range = (right & (j <= i)) | (~right & (j > i))  # boolean algebra: Mosaic has no select of i1 vectors
    sums = jnp.where((half_i == half_j) & in_range, 1.0, 0.0).astype(F32)
    s = jax.lax.broadcasted_iota(jnp.int32, (k, 1), 0)
    last = (1 << n) - 1  # h − 1
    within = s & last  # position inside the half
    offset = jnp.where(((s >> n) & 1) == 1, within + 1, last - within).astype(F32)
    return Level(pairs, sums, offset)


def over_levels(cfg: KernelConfig, body, init):
    """acc = body(level, acc) for the levels h = 1 … K/2, as one loop (scf.for in Mosaic): the kernel body stays
    one level long, which keeps Mosaic's and the CPU interpreter's compile times small."""
    return jax.lax.fori_loop(0, len(cfg.levels), lambda n, acc: body(level(cfg.chunk, n), acc), init)


def range_sums(weights, x, *, transpose=False):
    """weights · x (or weightsᵀ · x) for a 0/1 [K, K] matrix, f32 HIGHEST (exact weights; same-signed terms)."""
    return _dot(weights, x, ((0,), (0,)) if transpose else ((1,), (0,)), F32)


def upto(k):
    """0/1 [K, K]: row s selects the tokens 0..s."""
    i, j = iota2((k, k))
    return jnp.where(j <= i, 1.0, 0.0).astype(F32)


class Chunk:
    """What every kernel of a chunk shares: r [K, M], θ and b [1, M], the document masks (built where used)."""

    def __init__(self, r, params, doc_col, doc_row):
        self.k = r.shape[0]
        self.r = r
        self.theta, self.b_re, self.b_im = params[0:1, :], params[1:2, :], params[2:3, :]
        self.doc_col, self.doc_row = doc_col, doc_row

    @property
    def same_doc(self):
        return self.doc_col == self.doc_row

    @property
    def strict(self):
        i, j = iota2((self.k, self.k))
        return (i > j) & self.same_doc

    @property
    def eye(self):
        i, j = iota2((self.k, self.k))
        return i == j

    def factor(self, lv: Level):
        """f_ℓ = exp(W_ℓ r) e^{iθ n_ℓ} (complex [K, M])."""
        return polar(range_sums(lv.sums, self.r), lv.offset, self.theta)

    def gained(self, f_re, f_im):
        """b ⊙ f."""
        return cmul(self.b_re, self.b_im, f_re, f_im)

    def carry_in(self):
        """e^{ℓ_s} = exp(r(−1, s]) e^{iθ(s+1)} on the carried-in document's rows, 0 elsewhere."""
        s = jax.lax.broadcasted_iota(jnp.int32, (self.k, 1), 0)
        e_re, e_im = polar(range_sums(upto(self.k), self.r), (s + 1).astype(F32), self.theta)
        carried = self.doc_col == 0
        return jnp.where(carried, e_re, 0.0), jnp.where(carried, e_im, 0.0)


def factor_grads(sums, offset, f_re, f_im, df_re, df_im):
    """Cotangents of r [K, M] and θ [1, M] through f = exp(sums · r) e^{iθ·offset} given df: the log-amplitude
    cotangent Re(conj(f) df) goes back through the transposed range sums, the phase cotangent Im(conj(f) df)
    times the integer offset is summed over the tokens."""
    d_log = df_re * f_re + df_im * f_im
    d_angle = df_im * f_re - df_re * f_im
    return range_sums(sums, d_log, transpose=True), jnp.sum(offset * d_angle, axis=0, keepdims=True)


# ---------------------------------------------------------------------------------------------------------
# forward kernels


def _query_kernel(q_ref, k_ref, r_ref, params_ref, xk_ref, doc_col_ref, doc_row_ref, a_re_ref, a_im_ref,
                  *scores_out, cfg: KernelConfig):
    cdt, m = cfg.cdt, cfg.modes
    ch = Chunk(r_ref[...], params_ref[...], doc_col_ref[...], doc_row_ref[...])
    q, k = q_ref[...], k_ref[...]
    scores = jnp.where(ch.strict, mm_nt(q, k, cdt), 0.0)
    if scores_out:
        scores_out[0][...] = scores.astype(scores_out[0].dtype)
    diag = jnp.sum(q.astype(F32) * k.astype(F32), axis=1, keepdims=True)
    w_re, w_im = diag * ch.b_re, diag * ch.b_im

    def pair_sums(lv, acc):
        f_re, f_im = ch.factor(lv)
        c_re, c_im = ch.gained(f_re, f_im)
        s_l = jnp.where(lv.pairs, scores, 0.0)
        d_re, d_im = cmul(f_re, f_im, mm(s_l, c_re, cdt), mm(s_l, c_im, cdt))
        return acc[0] + d_re, acc[1] + d_im

    w_re, w_im = over_levels(cfg, pair_sums, (w_re, w_im))
    xk = xk_ref[...]
    y_re, y_im = mm_nt(q, xk[:m], cdt), mm_nt(q, xk[m:], cdt)
    a_re, a_im = cmul(*ch.carry_in(), y_re, y_im)
    a_re_ref[...] = a_re + w_re
    a_im_ref[...] = a_im + w_im


def _output_kernel(om_re_ref, om_im_ref, v_ref, r_ref, params_ref, xv_ref, doc_col_ref, doc_row_ref, o_ref,
                   *pairs_out, cfg: KernelConfig):
    cdt, m = cfg.cdt, cfg.modes
    ch = Chunk(r_ref[...], params_ref[...], doc_col_ref[...], doc_row_ref[...])
    om_re, om_im = om_re_ref[...], om_im_ref[...]
    diag = jnp.sum(om_re * ch.b_re + om_im * ch.b_im, axis=1, keepdims=True)  # Re(conj(ω)·b), D = 1
    p = jnp.where(ch.eye, diag, 0.0)
    same = ch.same_doc

    def pair_matrix(lv, p):
        f_re, f_im = ch.factor(lv)
        c_re, c_im = ch.gained(f_re, f_im)
        h_re, h_im = conj_mul(om_re, om_im, f_re, f_im)
        p_l = mm_nt(h_re, c_re, cdt) - mm_nt(h_im, c_im, cdt)
        return p + jnp.where(lv.pairs & same, p_l, 0.0)

    p = over_levels(cfg, pair_matrix, p)
    g_re, g_im = conj_mul(om_re, om_im, *ch.carry_in())
    xv = xv_ref[...]
    out = mm(g_re, xv[:m], cdt) - mm(g_im, xv[m:], cdt) + mm(p, v_ref[...], cdt)
    o_ref[...] = out.astype(o_ref.dtype)
    if pairs_out:
        pairs_out[0][...] = p.astype(pairs_out[0].dtype)


# ---------------------------------------------------------------------------------------------------------
# cost model: what each kernel issues per chunk and head (matmul FLOPs 2·M·N·K at the issued shapes, an f32
# HIGHEST matmul counted once; transcendentals = exp, cos, sin elements; HBM bytes read and written)


def kernel_counts(cfg: KernelConfig):
    """{kernel: (FLOPs, transcendentals, bytes)} per chunk and head. The backward kernels recompute the decay
    factors and read the [K, K] matrix (Sc or P) that the forward saves under a gradient (``saved`` bytes, added
    to the forward's by ``cost``)."""
    k, m, r, dv = cfg.chunk, cfg.modes, cfg.key_dim, cfg.value_dim
    n_lv = len(cfg.levels)
    od = cfg.cdt.itemsize
    kkm = 2 * k * k * m  # one [K, K] x [K, M] (or [K, M] x [M, K]) matmul
    factor = 3 * k * m  # exp, cos, sin of one [K, M] factor
    common_in = 4 * (k * m + 3 * m + 2 * k)  # r, mode parameters, documents (column and row)
    cplx = 2 * 4 * k * m  # one complex per-token [K, M] f32 pair (â, ω, dâ or dω)
    query = (2 * k * k * r + n_lv * 3 * kkm + kkm + 2 * 2 * k * m * r, factor * (n_lv + 1),
             common_in + 2 * k * r * od + 4 * 2 * m * r + cplx)
    output = (n_lv * 3 * kkm + kkm + 2 * 2 * k * m * dv + 2 * k * k * dv, factor * (n_lv + 1),
              common_in + cplx + 2 * k * dv * od + 4 * 2 * m * dv)
    # query_bwd: Sc's diagonal terms; per level: range sum, u (2), dSc (2), dc (2), dr (transposed range sum);
    # dk, dq from dSc; the carried part: y (2), dX̂ᵏ₀ (2), dq (2), carry-in sum and its transpose
    query_bwd = (n_lv * 8 * kkm + 2 * 2 * k * k * r + 3 * 2 * 2 * k * m * r + 2 * kkm, factor * (n_lv + 1),
                 common_in + 2 * k * r * od + 4 * 2 * m * r + cplx + k * k * od
                 + 2 * k * r * od + 4 * k * m + 4 * 3 * m + 4 * 2 * m * r)
    # output_bwd: dv = Pᵀ dO, dP = dO vᵀ; per level: range sum, dh (2), dc (2), dr; the carried part: dX̂ᵛ₀ (2),
    # dg (2), carry-in sum and its transpose
    output_bwd = (2 * 2 * k * k * dv + n_lv * 6 * kkm + 2 * 2 * 2 * k * m * dv + 2 * kkm, factor * (n_lv + 1),
                  common_in + cplx + 2 * k * dv * od + 4 * 2 * m * dv + k * k * od + k * dv * od
                  + cplx + k * dv * od + 4 * k * m + 4 * 3 * m + 4 * 2 * m * dv)
    return dict(query=query, output=output, query_bwd=query_bwd, output_bwd=output_bwd)


def cost(cfg: KernelConfig, name: str, steps: int, saving: bool = False) -> pl.CostEstimate:
    flops, exps, nbytes = kernel_counts(cfg)[name]
    nbytes += cfg.chunk * cfg.chunk * cfg.cdt.itemsize if saving else 0
    return pl.CostEstimate(flops=int(steps * flops), transcendentals=int(steps * exps),
                           bytes_accessed=int(steps * nbytes))


# ---------------------------------------------------------------------------------------------------------
# pallas_call builders (grid (B·H, N), every input and output per chunk)


class Specs:
    def __init__(self, cfg: KernelConfig):
        k, heads = cfg.chunk, cfg.heads
        self.cfg = cfg
        self.doc_col = pl.BlockSpec((_SQ, k, 1), lambda b, n: (jax.lax.div(b, heads), n, 0))
        self.doc_row = pl.BlockSpec((_SQ, _SQ, 1, k), lambda b, n: (jax.lax.div(b, heads), n, 0, 0))
        self.params = pl.BlockSpec((_SQ, 3, cfg.modes), lambda b, n: (jax.lax.rem(b, heads), 0, 0))
        self.pair_matrix = pl.BlockSpec((_SQ, _SQ, k, k), lambda b, n: (b, n, 0, 0))
        self.mode_grads = pl.BlockSpec((_SQ, _SQ, 3, cfg.modes), lambda b, n: (b, n, 0, 0))

    def tokens(self, width):
        return pl.BlockSpec((_SQ, self.cfg.chunk, width), lambda b, n: (b, n, 0))

    def state(self, width):
        return pl.BlockSpec((_SQ, _SQ, 2 * self.cfg.modes, width), lambda b, n: (b, n, 0, 0))


def compiler_params(cfg: KernelConfig):
    kw = dict(dimension_semantics=("parallel", "parallel"))
    if cfg.vmem_limit_bytes:
        kw["vmem_limit_bytes"] = cfg.vmem_limit_bytes
    return _CompilerParams(**kw)


def pallas(cfg: KernelConfig, kernel, name, grid, in_specs, out_shape, out_specs, saving=False):
    return pl.pallas_call(functools.partial(kernel, cfg=cfg), out_shape=out_shape, grid=grid, in_specs=in_specs,
                          out_specs=out_specs, compiler_params=compiler_params(cfg),
                          cost_estimate=cost(cfg, name, grid[0] * grid[1], saving), interpret=cfg.interpret,
                          name=f"interdomain_tpu_{name}")


def _query_call(cfg, q, k, r, params, xk, doc_col, doc_row, save_scores=False):
    """(â_re, â_im) [B·H, Tp, M] f32 [, Sc [B·H, N, K, K] in the operand dtype]."""
    bh, tp, _ = q.shape
    grid = (bh, tp // cfg.chunk)
    sp = Specs(cfg)
    out = [jax.ShapeDtypeStruct((bh, tp, cfg.modes), F32)] * 2
    out_specs = [sp.tokens(cfg.modes)] * 2
    if save_scores:
        out.append(jax.ShapeDtypeStruct((*grid, cfg.chunk, cfg.chunk), cfg.cdt))
        out_specs.append(sp.pair_matrix)
    in_specs = [sp.tokens(cfg.key_dim)] * 2 + [sp.tokens(cfg.modes), sp.params, sp.state(cfg.key_dim), sp.doc_col,
                                               sp.doc_row]
    return pallas(cfg, _query_kernel, "query", grid, in_specs, tuple(out), tuple(out_specs), save_scores)(
        q, k, r, params, xk, doc_col, doc_row)


def _output_call(cfg, om_re, om_im, v, r, params, xv, doc_col, doc_row, save_pairs=False):
    """o [B·H, Tp, Dv] in v's dtype [, P [B·H, N, K, K] in the operand dtype]."""
    bh, tp, dv = v.shape
    grid = (bh, tp // cfg.chunk)
    sp = Specs(cfg)
    out = [jax.ShapeDtypeStruct(v.shape, v.dtype)]
    out_specs = [sp.tokens(dv)]
    if save_pairs:
        out.append(jax.ShapeDtypeStruct((*grid, cfg.chunk, cfg.chunk), cfg.cdt))
        out_specs.append(sp.pair_matrix)
    in_specs = [sp.tokens(cfg.modes)] * 2 + [sp.tokens(dv), sp.tokens(cfg.modes), sp.params, sp.state(dv),
                                             sp.doc_col, sp.doc_row]
    return pallas(cfg, _output_kernel, "output", grid, in_specs, tuple(out), tuple(out_specs), save_pairs)(
        om_re, om_im, v, r, params, xv, doc_col, doc_row)


# ---------------------------------------------------------------------------------------------------------
# custom VJPs (the readout ω = Ĝ â between them is plain JAX)


def _mode_param_grads(grads, bh_shape):
    """Per-chunk partial sums [B·H, N, 3, M] -> [H, 3, M] (summed over the batch and the chunks)."""
    b, h = bh_shape
    return jnp.sum(grads.reshape(b, h, *grads.shape[1:]), axis=(0, 2))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _query(cfg, q, k, r, params, xk, doc_col, doc_row):
    return tuple(_query_call(cfg, q, k, r, params, xk, doc_col, doc_row)[:2])


def _query_fwd(cfg, q, k, r, params, xk, doc_col, doc_row):
    a_re, a_im, scores = common.keep_for_backward(_query_call(cfg, q, k, r, params, xk, doc_col, doc_row,
                                                              save_scores=True))
    return (a_re, a_im), (*common.keep_for_backward((q, k, r, params, xk, doc_col, doc_row)), scores)


def _query_bwd(cfg, residuals, cotangents):
    from mixerlab.pallas_kernels.interdomain import pallas_tpu_bwd

    q, k, r, params, xk, doc_col, doc_row, _ = residuals
    dq, dk, dr, dparams, dxk = pallas_tpu_bwd.query_bwd_call(cfg, *residuals, *(c.astype(F32) for c in cotangents))
    b = doc_col.shape[0]
    return (dq, dk, dr.astype(r.dtype), _mode_param_grads(dparams, (b, cfg.heads)).astype(params.dtype),
            dxk.astype(xk.dtype), None, None)


_query.defvjp(_query_fwd, _query_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _output(cfg, om_re, om_im, v, r, params, xv, doc_col, doc_row):
    return _output_call(cfg, om_re, om_im, v, r, params, xv, doc_col, doc_row)[0]


def _output_fwd(cfg, om_re, om_im, v, r, params, xv, doc_col, doc_row):
    o, pairs = common.keep_for_backward(_output_call(cfg, om_re, om_im, v, r, params, xv, doc_col, doc_row,
                                                     save_pairs=True))
    return o, (*common.keep_for_backward((om_re, om_im, v, r, params, xv, doc_col, doc_row)), pairs)


def _output_bwd(cfg, residuals, d_out):
    from mixerlab.pallas_kernels.interdomain import pallas_tpu_bwd

    om_re, om_im, v, r, params, xv, doc_col, doc_row, _ = residuals
    dom_re, dom_im, dv, dr, dparams, dxv = pallas_tpu_bwd.output_bwd_call(cfg, *residuals, d_out.astype(v.dtype))
    b = doc_col.shape[0]
    return (dom_re, dom_im, dv, dr.astype(r.dtype),
            _mode_param_grads(dparams, (b, cfg.heads)).astype(params.dtype), dxv.astype(xv.dtype), None, None)


_output.defvjp(_output_fwd, _output_bwd)


# ---------------------------------------------------------------------------------------------------------
# public entry (the op's impl.run contract)


def _to_bh(x, tp):
    """[B, T, H, D] -> [B·H, Tp, D] (zero-padded in time)."""
    b, t, h, d = x.shape
    x = x.transpose(0, 2, 1, 3).reshape(b * h, t, d)
    return jnp.pad(x, ((0, 0), (0, tp - t), (0, 0))) if tp != t else x


def relative_documents(document_BT, chunk_size, tp):
    """Document index relative to each chunk's carried-in document (0 = the document of the state entering the
    chunk), as a column [B, Tp, 1] and as rows [B, N, 1, K], int32; padding stays in the last document."""
    b = document_BT.shape[0]
    chunks, carried = common.chunk_documents(common.pad_time(document_BT.astype(jnp.int32), chunk_size, mode="edge"),
                                             chunk_size)
    rel = chunks - carried[..., None]
    return rel.reshape(b, tp, 1), rel.reshape(b, tp // chunk_size, 1, chunk_size)


def _readout(cfg, a_re, a_im, readout, b):
    """ω = Ĝ â per token as (Re, Im) [B·H, Tp, M] f32: one XLA GEMM per head, operands in the operand dtype."""
    bh, tp, m = a_re.shape
    a = jnp.concatenate([a_re, a_im], axis=-1).reshape(b, cfg.heads, tp, 2 * m)
    precision = _HIGHEST if cfg.cdt == jnp.dtype(F32) else None
    omega = jnp.einsum("bhtj,hij->bhti", a.astype(cfg.cdt), readout.astype(cfg.cdt), precision=precision,
                       preferred_element_type=F32).reshape(bh, tp, 2 * m)
    return omega[..., :m], omega[..., m:]


def run(q, k, v, log_modulus, phase, gain, readout, key_state, value_state, document_BT, *, chunk_size,
        sub_chunk_size=None, interpret=False):
    """q, k [B, T, H, R], v [B, T, H, Dv] in the caller's dtype (bf16 runs bf16 MXU operands); log_modulus
    [B, T, H, M], phase [H, M], gain [H, 2M], readout [H, 2M, 2M], states [B, H, 2M, R] / [B, H, 2M, Dv] in
    float32; document_BT [B, T] int. Returns (o [B, T, H, Dv] in v's dtype, key state, value state float32).
    Differentiable (custom VJPs around both kernel pairs; passes (i)–(ii) and the readout autodiffed by XLA).
    ``interpret``: True or a ``pltpu.InterpretParams`` runs the kernels on the CPU."""
    del sub_chunk_size  # the pivot tree replaces the sub-chunks
    b, t, h, r_dim = q.shape
    dv, m = v.shape[-1], phase.shape[-1]
    reason = check_config(chunk_size, r_dim, dv, m)
    if reason:
        raise ValueError(f"interdomain pallas_tpu: {reason}")
    if jnp.dtype(q.dtype) not in _DTYPES:
        raise ValueError(f"interdomain pallas_tpu: dtype {jnp.dtype(q.dtype).name} not supported (bfloat16 or "
                         f"float32)")
    cfg = KernelConfig(chunk_size, r_dim, dv, m, h, operand_dtype(q.dtype), interpret)
    (xk, xv), (key, value) = xla.chunk_start_states([k.astype(F32), v.astype(F32)],
                                                    [key_state.astype(F32), value_state.astype(F32)],
                                                    log_modulus.astype(F32), phase.astype(F32), gain.astype(F32),
                                                    document_BT, chunk_size=chunk_size)
    tp = -(-t // chunk_size) * chunk_size
    n = tp // chunk_size
    qb, kb, vb = (_to_bh(x.astype(cfg.cdt), tp) for x in (q, k, v))
    rb = _to_bh(log_modulus.astype(F32), tp)
    params = jnp.stack([phase, gain[:, :m], gain[:, m:]], axis=1).astype(F32)  # [H, 3, M]
    doc_col, doc_row = relative_documents(document_BT, chunk_size, tp)
    xk = xk.reshape(b * h, n, 2 * m, r_dim)
    xv = xv.reshape(b * h, n, 2 * m, dv)
    a_re, a_im = _query(cfg, qb, kb, rb, params, xk, doc_col, doc_row)
    om_re, om_im = _readout(cfg, a_re, a_im, readout, b)
    out = _output(cfg, om_re, om_im, vb, rb, params, xv, doc_col, doc_row)
    out = out[:, :t].reshape(b, h, t, dv).transpose(0, 2, 1, 3).astype(v.dtype)
    return out, key.astype(F32), value.astype(F32)


def run_s4d(z, log_modulus, phase, gain, readout, state, document_BT, *, chunk_size, sub_chunk_size=None,
            interpret=False):
    """The S4D-only core (the ``s4d`` op's contract; z [B, T, H, C] in the caller's dtype, readout ω [H, 2M]): the
    output kernel pair alone with ω fixed per head (no query side; its gradient is dω summed over the tokens by
    XLA). Returns (o [B, T, H, C] in z's dtype, final state [B, H, 2M, C] float32)."""
    del sub_chunk_size
    b, t, h, c = z.shape
    m = phase.shape[-1]
    reason = check_config(chunk_size, c, c, m)
    if reason:
        raise ValueError(f"s4d pallas_tpu: {reason}")
    cfg = KernelConfig(chunk_size, c, c, m, h, operand_dtype(z.dtype), interpret)
    (xs,), (final,) = xla.chunk_start_states([z.astype(F32)], [state.astype(F32)], log_modulus.astype(F32),
                                             phase.astype(F32), gain.astype(F32), document_BT, chunk_size=chunk_size)
    tp = -(-t // chunk_size) * chunk_size
    params = jnp.stack([phase, gain[:, :m], gain[:, m:]], axis=1).astype(F32)
    doc_col, doc_row = relative_documents(document_BT, chunk_size, tp)
    omega = jnp.broadcast_to(readout.astype(F32)[None, :, None, :], (b, h, tp, 2 * m)).reshape(b * h, tp, 2 * m)
    out = _output(cfg, omega[..., :m], omega[..., m:], _to_bh(z.astype(cfg.cdt), tp),
                  _to_bh(log_modulus.astype(F32), tp), params, xs.reshape(b * h, tp // chunk_size, 2 * m, c),
                  doc_col, doc_row)
    out = out[:, :t].reshape(b, h, t, c).transpose(0, 2, 1, 3).astype(z.dtype)
    return out, final.astype(F32)
