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

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mixerlab.pallas_kernels import common
from mixerlab.pallas_kernels.interdomain import xla
from mixerlab.pallas_kernels.triton_common import compiler_params, iota, pow2, unavailable


F32 = jnp.float32
SUPPORTED_CHUNKS = (16, 32, 64, 128)
MAX_HEAD_DIM = 256
MAX_MODES = 128
_MIN_DIM = 16  # tl.dot needs every matmul dimension ≥ 16
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# ---------------------------------------------------------------------------------------------------------
# configuration


@dataclasses.dataclass(frozen=True)
class Config:
    chunk: int
    key_dim: int
    value_dim: int
    modes: int
    operand_dtype: jnp.dtype  # matmul operands (the caller's q, k, v dtype)
    precision: str = "tf32"  # GEMMs with f32 operands (f32 inputs): "tf32" | "highest"
    range_sums: str = "auto"  # the 0/1 range-sum matmuls: "tf32x3" | "tf32" | "auto" (see sum_precision)
    block_m: int = 32  # modes per pass of the forward kernels (per-mode tiles are [K, BM])
    block_m_backward: int = 16  # the same for the backward kernels (more live tiles: smaller blocks)
    warps_forward: int = 8
    warps_backward: int = 8
    interpret: bool = False

    @property
    def levels(self):
        """Levels of the pivot tree (half sizes 1, 2, …, K/2)."""
        return int(math.log2(self.chunk))

    @property
    def f32_precision(self):
        """"tf32": one TF32 tensor-core pass; "highest": float32-accurate (three TF32 passes on the GPU,
        plain f32 in interpret mode)."""
        if self.interpret:
            return jax.lax.Precision.HIGHEST
        if self.precision == "highest":
            return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
        return jax.lax.Precision.DEFAULT

    @property
    def resolved_range_sums(self):
        """"auto": "tf32" with 16-bit operands, else "tf32x3"."""
        if self.range_sums != "auto":
            return self.range_sums
        return "tf32" if self.operand_dtype.itemsize == 2 else "tf32x3"

    @property
    def sum_precision(self):
        """Range sums (0/1 weights, exact in TF32, times r or a cotangent): "tf32x3" is float32-accurate;
        "tf32" is one tensor-core pass on operands rounded to the nearest TF32 (2⁻¹¹ relative per term: a
        decay e^{Σr} then errs by at most |Σr|·2⁻¹¹·e^{Σr} ≤ 2⁻¹¹/e ≈ 1.8e-4, under a bf16 operand's 2⁻⁹);
        interpret mode: plain f32."""
        if self.interpret:
            return jax.lax.Precision.HIGHEST
        if self.resolved_range_sums == "tf32":
            return jax.lax.Precision.DEFAULT
        return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def make_config(chunk, key_dim, value_dim, modes, operand_dtype, *, interpret=False, **overrides):
    base = dict(chunk=chunk, key_dim=key_dim, value_dim=value_dim, modes=modes,
                operand_dtype=jnp.dtype(operand_dtype), precision="highest" if interpret else "tf32",
                block_m=min(32, modes), block_m_backward=min(16, modes), interpret=interpret)
    base.update(overrides)
    cfg = Config(**base)
    if cfg.precision not in ("tf32", "highest"):
        raise ValueError(f"interdomain pallas_triton: precision={cfg.precision!r}; expected 'tf32' or 'highest'")
    if cfg.range_sums not in ("auto", "tf32", "tf32x3"):
        raise ValueError(f"interdomain pallas_triton: range_sums={cfg.range_sums!r}; expected 'auto', 'tf32' or "
                         "'tf32x3'")
    if not pow2(cfg.chunk):
        raise ValueError(f"interdomain pallas_triton: chunk={cfg.chunk} must be a power of two")
    for name in ("block_m", "block_m_backward"):
        bm = getattr(cfg, name)
        if not pow2(bm) or cfg.modes % bm:
            raise ValueError(f"interdomain pallas_triton: {name}={bm} must be a power of two dividing "
                             f"modes={cfg.modes}")
    return cfg


def supports(call) -> Optional[str]:
    """``None`` when this kernel can serve ``call`` (an ``api.InterdomainCall``; op "interdomain" or "s4d",
    whose key_dim is 0), else the reason."""
    if call.op not in ("interdomain", "s4d"):
        return f"op {call.op!r} has no Pallas-Triton kernel"
    reason = unavailable(getattr(call, "backend", None))
    if reason:
        return reason
    if call.chunk_size not in SUPPORTED_CHUNKS:
        return f"chunk_size={call.chunk_size} not in {SUPPORTED_CHUNKS}"
    dims = [("value_dim", call.value_dim, MAX_HEAD_DIM), ("modes", call.modes, MAX_MODES)]
    if call.op == "interdomain":
        dims.insert(0, ("key_dim", call.key_dim, MAX_HEAD_DIM))
    for name, d, top in dims:
        if not pow2(d) or d < _MIN_DIM or d > top:
            return f"{name}={d}: needs a power of two in [{_MIN_DIM}, {top}]"
    if jnp.dtype(call.dtype) not in _DTYPES:
        return f"dtype {jnp.dtype(call.dtype).name} not supported (float32, bfloat16, float16)"
    return None


# ---------------------------------------------------------------------------------------------------------
# tile math (traced inside the kernels; only 2-D tiles and ops with Triton lowerings). Complex tiles are
# (Re, Im) pairs of [K, M] f32 tiles.


def _matmul(a, b, trans_a, trans_b, precision):
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


def _dot(a, b, cfg, *, trans_a=False, trans_b=False):
    """Matmul with f32 accumulation; operands in the operand dtype (f32 at ``cfg.precision``)."""
    od = cfg.operand_dtype
    if od == jnp.dtype(F32):
        return _matmul(a.astype(F32), b.astype(F32), trans_a, trans_b, cfg.f32_precision)
    return _matmul(a.astype(od), b.astype(od), trans_a, trans_b, None)


def _to_tf32(x):
    """x rounded to the nearest TF32 value (low 13 mantissa bits cleared), exact as a tensor-core operand."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jax.lax.bitcast_convert_type((bits + 4096) & jnp.int32(-8192), F32)


def _range_sums(weights, x, cfg, *, trans=False):
    """weights · x (or weightsᵀ · x) for a 0/1 [K, K] matrix at ``cfg.sum_precision``."""
    if not cfg.interpret and cfg.resolved_range_sums == "tf32":
        x = _to_tf32(x)
    return _matmul(weights, x, trans, False, cfg.sum_precision)


def _cmul(a_re, a_im, b_re, b_im):
    return a_re * b_re - a_im * b_im, a_re * b_im + a_im * b_re


def _conj_mul(w_re, w_im, f_re, f_im):
    """conj(w) ⊙ f."""
    return w_re * f_re + w_im * f_im, w_re * f_im - w_im * f_re


def _polar(log_amp, offset, theta):
    """exp(log_amp) e^{i·offset·θ}: offset [K, 1] integers (exact in f32), θ [M]."""
    amp = jnp.exp(log_amp)
    angle = offset * theta[None, :]
    return amp * jnp.cos(angle), amp * jnp.sin(angle)


class _Masks:
    """Masks of one chunk, built where they are used (properties), so no [K, K] mask stays live in loops."""

    def __init__(self, doc, carry, k):
        self.doc, self.carry, self.k = doc, carry, k

    def _ij(self):
        return iota((self.k, self.k), 0), iota((self.k, self.k), 1)

    @property
    def same_doc(self):
        return self.doc[:, None] == self.doc[None, :]

    @property
    def eye(self):
        i, j = self._ij()
        return i == j

    @property
    def strict(self):
        i, j = self._ij()
        return (i > j) & self.same_doc

    @property
    def carried(self):
        return (self.doc == self.carry)[:, None]

    @property
    def upto(self):
        """0/1 [K, K]: row s selects the tokens 0..s."""
        i, j = self._ij()
        return jnp.where(j <= i, 1.0, 0.0).astype(F32)


def _level(k, level):
    """Level ``level`` of the pivot tree (half size h = 2^level; may be traced). Returns
      pairs [K, K] bool: (s, j) with s in the right and j in the left half of the same node of size 2h;
      sums  [K, K] 0/1: row s selects r(p, s] (right half) or r(s, p] (left half), p the node's pivot."""
    i = iota((k, k), 0)
    j = iota((k, k), 1)
    half_i = jax.lax.shift_right_logical(i, level)
    half_j = jax.lax.shift_right_logical(j, level)
    right = (half_i & 1) == 1
    pairs = ((half_i >> 1) == (half_j >> 1)) & right & ((half_j & 1) == 0)
    sums = jnp.where((half_i == half_j) & jnp.where(right, j <= i, j > i), 1.0, 0.0).astype(F32)
    return pairs, sums


def _level_factor(sums, r, theta, cfg):
    """f_ℓ (complex [K, M]): exp(sums · r) e^{iθ·offset}; the offset (s − p or p − s) is the number of tokens
    in the row's range, i.e. the row sum of ``sums``."""
    return _polar(_range_sums(sums, r, cfg), jnp.sum(sums, axis=1)[:, None], theta)


def _carry_in(r, theta, masks, cfg):
    """e^{ℓ_s} = exp(r(−1, s]) e^{iθ(s+1)} on the carried-in document's rows (0 elsewhere)."""
    upto = masks.upto
    e_re, e_im = _polar(_range_sums(upto, r, cfg), jnp.sum(upto, axis=1)[:, None], theta)
    carried = masks.carried
    return jnp.where(carried, e_re, 0.0), jnp.where(carried, e_im, 0.0)


def _scores(q, k, masks, cfg):
    """Sc = q kᵀ on strictly lower same-document pairs [K, K], and its diagonal q_s · k_s [K, 1]."""
    s = _dot(q, k, cfg, trans_b=True)
    diag = jnp.sum(q.astype(F32) * k.astype(F32), axis=1)[:, None]
    return jnp.where(masks.strict, s, 0.0), diag


class _Modes:
    """One block of BM modes: its column slices (Re, Im) of the stacked 2M axis and its loaded per-mode inputs."""

    def __init__(self, mb, cfg, r_ref, theta_ref, gain_ref):
        bm, m = cfg.block_m, cfg.modes
        self.re = pl.ds(pl.multiple_of(mb * bm, bm), bm)
        self.im = pl.ds(pl.multiple_of(m + mb * bm, bm), bm)
        self.r = r_ref[:, self.re].astype(F32)  # [K, BM]
        self.theta = theta_ref[self.re]  # [BM]
        self.b_re, self.b_im = gain_ref[self.re][None, :], gain_ref[self.im][None, :]  # [1, BM]

    def factor(self, sums, cfg):
        return _level_factor(sums, self.r, self.theta, cfg)

    def gained(self, f_re, f_im):
        """b ⊙ f."""
        return _cmul(self.b_re, self.b_im, f_re, f_im)


def _factor_grads(sums, f_re, f_im, df_re, df_im, cfg):
    """Cotangents of r [K, BM] and θ [BM] through f = exp(sums · r) e^{iθ·offset} given df: the log-amplitude
    cotangent Re(conj(f) df) goes back through the range sums (their transpose: every r_τ in the row's range
    receives it), the phase cotangent Im(conj(f) df) is multiplied by the integer offset and summed."""
    d_log = df_re * f_re + df_im * f_im
    d_angle = df_im * f_re - df_re * f_im
    offset = jnp.sum(sums, axis=1)[:, None]
    return _range_sums(sums, d_log, cfg, trans=True), jnp.sum(offset * d_angle, axis=0)


def _gain_grads(dc_re, dc_im, f_re, f_im, modes):
    """c = b ⊙ f: (df_re, df_im, db_re [BM], db_im [BM]) from dc."""
    df_re = dc_re * modes.b_re + dc_im * modes.b_im
    df_im = dc_im * modes.b_re - dc_re * modes.b_im
    return df_re, df_im, jnp.sum(dc_re * f_re + dc_im * f_im, axis=0), jnp.sum(dc_im * f_re - dc_re * f_im, axis=0)


def _n_blocks(cfg):
    return cfg.modes // cfg.block_m


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
