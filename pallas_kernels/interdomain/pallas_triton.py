"""Interdomain attention on GPU through Pallas' Triton backend: pass (iii) of the chunked form (the outputs of
every chunk from its chunk-start states) as one kernel per chunk, forward and custom-VJP backward
(docs/math/interdomain.md, 'Chunked form', 'Gradients'; docs/kernels_gpu.md, 'Interdomain attention').

Passes (i) and (ii) (chunk-local end states, the serial scan over the chunk boundaries) stay in XLA
(``xla.chunk_start_states``): O(T·M·(R + Dv)) work with one small matmul per chunk. Pass (iii) is where the
pure-JAX form spends its time and memory (it materialises b ⊙ F and b ⊙ D per chunk); here everything of a
chunk stays on chip:

  forward   ``outputs``  grid (B, H, N)   o [K, Dv] of one chunk and head
  backward  ``grads``    grid (B, H, N)   dq, dk, dv, dr (per token), the chunk-start state cotangents, and
                                          per-chunk partial sums of dθ, db, dĜ (reduced by XLA afterwards)

Per chunk (K tokens, M complex modes, all complex tiles as separate Re / Im [K, M] tiles, 2-D only):

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

try:  # Pallas' Triton backend (deprecated upstream since JAX 0.11 but present in 0.10.2 and 0.11.2)
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover
    pltriton = None

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


def _pow2(x: int) -> bool:
    return x >= 1 and x & (x - 1) == 0


def make_config(chunk, key_dim, value_dim, modes, operand_dtype, *, interpret=False, **overrides):
    base = dict(chunk=chunk, key_dim=key_dim, value_dim=value_dim, modes=modes,
                operand_dtype=jnp.dtype(operand_dtype), precision="highest" if interpret else "tf32",
                interpret=interpret)
    base.update(overrides)
    cfg = Config(**base)
    if cfg.precision not in ("tf32", "highest"):
        raise ValueError(f"interdomain pallas_triton: precision={cfg.precision!r}; expected 'tf32' or 'highest'")
    if cfg.range_sums not in ("auto", "tf32", "tf32x3"):
        raise ValueError(f"interdomain pallas_triton: range_sums={cfg.range_sums!r}; expected 'auto', 'tf32' or "
                         "'tf32x3'")
    if not _pow2(cfg.chunk):
        raise ValueError(f"interdomain pallas_triton: chunk={cfg.chunk} must be a power of two")
    return cfg


def supports(call) -> Optional[str]:
    """``None`` when this kernel can serve ``call`` (an ``api.InterdomainCall``), else the reason."""
    if call.op != "interdomain":
        return f"only the interdomain op has a Pallas-Triton kernel (not {call.op!r}; it runs on 'xla')"
    if getattr(call, "backend", None) != "gpu":
        return f"the Pallas-Triton kernel runs on GPU only (backend is {call.backend!r})"
    if pltriton is None:
        return "jax.experimental.pallas.triton is not available in this JAX"
    if call.chunk_size not in SUPPORTED_CHUNKS:
        return f"chunk_size={call.chunk_size} not in {SUPPORTED_CHUNKS}"
    for name, d, top in (("key_dim", call.key_dim, MAX_HEAD_DIM), ("value_dim", call.value_dim, MAX_HEAD_DIM),
                         ("modes", call.modes, MAX_MODES)):
        if not _pow2(d) or d < _MIN_DIM or d > top:
            return f"{name}={d}: needs a power of two in [{_MIN_DIM}, {top}]"
    if jnp.dtype(call.dtype) not in _DTYPES:
        return f"dtype {jnp.dtype(call.dtype).name} not supported (float32, bfloat16, float16)"
    return None


# ---------------------------------------------------------------------------------------------------------
# tile math (traced inside the kernels; only 2-D tiles and ops with Triton lowerings). Complex tiles are
# (Re, Im) pairs of [K, M] f32 tiles.


def _iota(shape, dim):
    return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


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
        return _iota((self.k, self.k), 0), _iota((self.k, self.k), 1)

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
    i = _iota((k, k), 0)
    j = _iota((k, k), 1)
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


class _Tile:
    """One chunk of one head: the kernel's input refs, read where they are used (every property is a fresh
    load), so that no input tile stays live in registers across the level loops."""

    def __init__(self, cfg, q, k, v, r, theta, gain, readout, xk, xv, doc, carry):
        self.m = cfg.modes
        self._q, self._k, self._v, self._r, self._theta = q, k, v, r, theta
        self._gain, self._readout, self._xk, self._xv = gain, readout, xk, xv
        self.masks = _Masks(doc[...], carry[...], cfg.chunk)

    def _halves(self):
        return pl.ds(0, self.m), pl.ds(self.m, self.m)

    q = property(lambda self: self._q[...])  # [K, R] operand dtype
    k = property(lambda self: self._k[...])  # [K, R]
    v = property(lambda self: self._v[...])  # [K, Dv]
    r = property(lambda self: self._r[...].astype(F32))  # [K, M]
    theta = property(lambda self: self._theta[...])  # [M]
    b_re = property(lambda self: self._gain[self._halves()[0]])  # [M]
    b_im = property(lambda self: self._gain[self._halves()[1]])

    @property
    def g(self):
        """Ĝ blocks (rr, ri, ir, ii), each [M, M]: ω_re = a_re G_rrᵀ + a_im G_riᵀ, ω_im = a_re G_irᵀ + a_im G_iiᵀ."""
        lo, hi = self._halves()
        return tuple(self._readout[rows, cols] for rows, cols in ((lo, lo), (lo, hi), (hi, lo), (hi, hi)))

    @property
    def xk(self):
        """Chunk-start key state (Re, Im) [M, R]."""
        lo, hi = self._halves()
        return self._xk[lo, :], self._xk[hi, :]

    @property
    def xv(self):
        """Chunk-start value state (Re, Im) [M, Dv]."""
        lo, hi = self._halves()
        return self._xv[lo, :], self._xv[hi, :]


def _scores(t, cfg):
    """Sc = q kᵀ on strictly lower same-document pairs [K, K], and its diagonal q_s · k_s [K]."""
    s = _dot(t.q, t.k, cfg, trans_b=True)
    diag = jnp.sum(t.q.astype(F32) * t.k.astype(F32), axis=1)
    return jnp.where(t.masks.strict, s, 0.0), diag


def _key_read(t, scores, diag, cfg):
    """b ⊙ Σ_{j≤s} Sc[s, j] D[s, j] (complex [K, M]) through the pivot tree."""
    k = cfg.chunk

    def level(lv, acc):
        pairs, sums = _level(k, lv)
        f_re, f_im = _level_factor(sums, t.r, t.theta, cfg)
        c_re, c_im = _cmul(t.b_re[None, :], t.b_im[None, :], f_re, f_im)
        s_l = jnp.where(pairs, scores, 0.0)
        u_re, u_im = _dot(s_l, c_re, cfg), _dot(s_l, c_im, cfg)
        d_re, d_im = _cmul(f_re, f_im, u_re, u_im)
        return acc[0] + d_re, acc[1] + d_im

    init = (diag[:, None] * t.b_re[None, :], diag[:, None] * t.b_im[None, :])
    return jax.lax.fori_loop(0, cfg.levels, level, init)


def _readout(a_re, a_im, g, cfg):
    """ω = Ĝ â per row (complex [K, M] from the four [M, M] blocks of Ĝ)."""
    g_rr, g_ri, g_ir, g_ii = g
    w_re = _dot(a_re, g_rr, cfg, trans_b=True) + _dot(a_im, g_ri, cfg, trans_b=True)
    w_im = _dot(a_re, g_ir, cfg, trans_b=True) + _dot(a_im, g_ii, cfg, trans_b=True)
    return w_re, w_im


def _pair_weights(t, w_re, w_im, cfg):
    """P[s, j] = Re Σ_m conj(ω_sm) b_m D[s, j, m] on same-document pairs j ≤ s: [K, K] f32."""
    k = cfg.chunk
    same = t.masks.same_doc

    def level(lv, p):
        pairs, sums = _level(k, lv)
        f_re, f_im = _level_factor(sums, t.r, t.theta, cfg)
        c_re, c_im = _cmul(t.b_re[None, :], t.b_im[None, :], f_re, f_im)
        h_re, h_im = _conj_mul(w_re, w_im, f_re, f_im)
        p_l = _dot(h_re, c_re, cfg, trans_b=True) - _dot(h_im, c_im, cfg, trans_b=True)
        return p + jnp.where(pairs & same, p_l, 0.0)

    diag = jnp.sum(w_re * t.b_re[None, :] + w_im * t.b_im[None, :], axis=1)
    return jax.lax.fori_loop(0, cfg.levels, level, jnp.where(t.masks.eye, diag[:, None], 0.0))


def _state_read(t, cfg):
    """X̂ᵏ₀ q per row (complex [K, M])."""
    xk_re, xk_im = t.xk
    return _dot(t.q, xk_re, cfg, trans_b=True), _dot(t.q, xk_im, cfg, trans_b=True)


def _query(t, cfg):
    """â (complex [K, M]): the carried part e^{ℓ} ⊙ (X̂ᵏ₀ q) plus the in-chunk part."""
    scores, diag = _scores(t, cfg)
    w_re, w_im = _key_read(t, scores, diag, cfg)
    a0_re, a0_im = _cmul(*_carry_in(t.r, t.theta, t.masks, cfg), *_state_read(t, cfg))
    return a0_re + w_re, a0_im + w_im


def forward_tile(t: _Tile, cfg):
    """o [K, Dv] f32 of one chunk and head."""
    om_re, om_im = _readout(*_query(t, cfg), t.g, cfg)
    o = _dot(_pair_weights(t, om_re, om_im, cfg), t.v, cfg)
    g_re, g_im = _conj_mul(om_re, om_im, *_carry_in(t.r, t.theta, t.masks, cfg))  # e^{ℓ} again: fewer live tiles
    xv_re, xv_im = t.xv
    return o + _dot(g_re, xv_re, cfg) - _dot(g_im, xv_im, cfg)


def _factor_grads(sums, f_re, f_im, df_re, df_im, cfg):
    """Cotangents of r [K, M] and θ [M] through f = exp(sums · r) e^{iθ·offset} given df: the log-amplitude
    cotangent Re(conj(f) df) goes back through the range sums (their transpose: every r_τ in the row's range
    receives it), the phase cotangent Im(conj(f) df) is multiplied by the integer offset and summed."""
    d_log = df_re * f_re + df_im * f_im
    d_angle = df_im * f_re - df_re * f_im
    offset = jnp.sum(sums, axis=1)[:, None]
    return _range_sums(sums, d_log, cfg, trans=True), jnp.sum(offset * d_angle, axis=0)


def _gain_grads(dc_re, dc_im, f_re, f_im, b_re, b_im):
    """c = b ⊙ f: (df_re, df_im, db_re [M], db_im [M]) from dc."""
    df_re = dc_re * b_re[None, :] + dc_im * b_im[None, :]
    df_im = dc_im * b_re[None, :] - dc_re * b_im[None, :]
    return df_re, df_im, jnp.sum(dc_re * f_re + dc_im * f_im, axis=0), jnp.sum(dc_im * f_re - dc_re * f_im, axis=0)


def backward_tile(t: _Tile, d_out, cfg):
    """Cotangents of one chunk and head from dO [K, Dv] (docs/math/interdomain.md, 'Gradients'): a dict with
    q, k, v [K, ·]; r [K, M]; theta [M]; b_re, b_im [M]; g (rr, ri, ir, ii) [M, M]; xk, xv (Re, Im).
    The carry-in factor e^{ℓ}, X̂ᵏ₀ q and the scores are recomputed where needed rather than kept live."""
    k_len = cfg.chunk
    same = t.masks.same_doc
    b_re, b_im = t.b_re, t.b_im
    # the forward again up to ω
    a_re, a_im = _query(t, cfg)
    om_re, om_im = _readout(a_re, a_im, t.g, cfg)
    # o = P v + Re(conj(ω) ⊙ e^{ℓ}) X̂ᵛ₀: first P (its diagonal, then the pivot levels)
    d_pairs = _dot(d_out, t.v, cfg, trans_b=True)  # dP [K, K]
    dp_diag = jnp.sum(jnp.where(t.masks.eye, d_pairs, 0.0), axis=1)[:, None]
    dom_re, dom_im = dp_diag * b_re[None, :], dp_diag * b_im[None, :]
    db = (jnp.sum(dp_diag * om_re, axis=0), jnp.sum(dp_diag * om_im, axis=0))

    def value_level(lv, acc):
        p, dom_re, dom_im, db_re, db_im, dr, dth = acc
        pairs, sums = _level(k_len, lv)
        f_re, f_im = _level_factor(sums, t.r, t.theta, cfg)
        c_re, c_im = _cmul(b_re[None, :], b_im[None, :], f_re, f_im)
        h_re, h_im = _conj_mul(om_re, om_im, f_re, f_im)
        mask = pairs & same
        p = p + jnp.where(mask, _dot(h_re, c_re, cfg, trans_b=True) - _dot(h_im, c_im, cfg, trans_b=True), 0.0)
        dp_l = jnp.where(mask, d_pairs, 0.0)
        dh_re, dh_im = _dot(dp_l, c_re, cfg), -_dot(dp_l, c_im, cfg)
        dc_re, dc_im = _dot(dp_l, h_re, cfg, trans_a=True), -_dot(dp_l, h_im, cfg, trans_a=True)
        dom_re = dom_re + dh_re * f_re + dh_im * f_im
        dom_im = dom_im + dh_re * f_im - dh_im * f_re
        df_re, df_im, db_l_re, db_l_im = _gain_grads(dc_re, dc_im, f_re, f_im, b_re, b_im)
        df_re = df_re + dh_re * om_re - dh_im * om_im
        df_im = df_im + dh_re * om_im + dh_im * om_re
        dr_l, dth_l = _factor_grads(sums, f_re, f_im, df_re, df_im, cfg)
        return p, dom_re, dom_im, db_re + db_l_re, db_im + db_l_im, dr + dr_l, dth + dth_l

    diag_p = jnp.sum(om_re * b_re[None, :] + om_im * b_im[None, :], axis=1)
    init = (jnp.where(t.masks.eye, diag_p[:, None], 0.0), dom_re, dom_im, *db, jnp.zeros_like(t.r),
            jnp.zeros_like(t.theta))
    p, dom_re, dom_im, db_re, db_im, dr, dth = jax.lax.fori_loop(0, cfg.levels, value_level, init)
    dv = _dot(p, d_out, cfg, trans_a=True)
    # the carried value part Re(conj(ω) ⊙ e^{ℓ}) X̂ᵛ₀
    e_re, e_im = _carry_in(t.r, t.theta, t.masks, cfg)
    g_re, g_im = _conj_mul(om_re, om_im, e_re, e_im)
    xv_re, xv_im = t.xv
    dxv = (_dot(g_re, d_out, cfg, trans_a=True), -_dot(g_im, d_out, cfg, trans_a=True))
    dg_re, dg_im = _dot(d_out, xv_re, cfg, trans_b=True), -_dot(d_out, xv_im, cfg, trans_b=True)
    dom_re = dom_re + dg_re * e_re + dg_im * e_im
    dom_im = dom_im + dg_re * e_im - dg_im * e_re
    de_re = dg_re * om_re - dg_im * om_im
    de_im = dg_re * om_im + dg_im * om_re
    # ω = Ĝ â
    g_rr, g_ri, g_ir, g_ii = t.g
    da_re = _dot(dom_re, g_rr, cfg) + _dot(dom_im, g_ir, cfg)
    da_im = _dot(dom_re, g_ri, cfg) + _dot(dom_im, g_ii, cfg)
    dg = (_dot(dom_re, a_re, cfg, trans_a=True), _dot(dom_re, a_im, cfg, trans_a=True),
          _dot(dom_im, a_re, cfg, trans_a=True), _dot(dom_im, a_im, cfg, trans_a=True))
    # carried key part e^{ℓ} ⊙ (X̂ᵏ₀ q)
    y_re, y_im = _state_read(t, cfg)
    dy_re = da_re * e_re + da_im * e_im
    dy_im = da_im * e_re - da_re * e_im
    de_re = de_re + da_re * y_re + da_im * y_im
    de_im = de_im + da_im * y_re - da_re * y_im
    xk_re, xk_im = t.xk
    dq = _dot(dy_re, xk_re, cfg) + _dot(dy_im, xk_im, cfg)
    q = t.q
    dxk = (_dot(dy_re, q, cfg, trans_a=True), _dot(dy_im, q, cfg, trans_a=True))
    dr_e, dth_e = _factor_grads(t.masks.upto, e_re, e_im, de_re, de_im, cfg)  # e = 0 off the carried rows
    dr, dth = dr + dr_e, dth + dth_e
    # in-chunk part: the diagonal (D = 1), then the pivot levels
    d_diag = jnp.sum(da_re * b_re[None, :] + da_im * b_im[None, :], axis=1)[:, None]

    def key_level(lv, acc):
        d_scores, db_re, db_im, dr, dth = acc
        pairs, sums = _level(k_len, lv)
        f_re, f_im = _level_factor(sums, t.r, t.theta, cfg)
        c_re, c_im = _cmul(b_re[None, :], b_im[None, :], f_re, f_im)
        s_l = jnp.where(pairs, scores, 0.0)
        u_re, u_im = _dot(s_l, c_re, cfg), _dot(s_l, c_im, cfg)
        du_re, du_im = _conj_mul(f_re, f_im, da_re, da_im)  # conj(f) ⊙ da
        d_scores = d_scores + jnp.where(pairs, _dot(du_re, c_re, cfg, trans_b=True)
                                        + _dot(du_im, c_im, cfg, trans_b=True), 0.0)
        dc_re, dc_im = _dot(s_l, du_re, cfg, trans_a=True), _dot(s_l, du_im, cfg, trans_a=True)
        df_re, df_im, db_l_re, db_l_im = _gain_grads(dc_re, dc_im, f_re, f_im, b_re, b_im)
        df_re = df_re + da_re * u_re + da_im * u_im
        df_im = df_im + da_im * u_re - da_re * u_im
        dr_l, dth_l = _factor_grads(sums, f_re, f_im, df_re, df_im, cfg)
        return d_scores, db_re + db_l_re, db_im + db_l_im, dr + dr_l, dth + dth_l

    scores, diag = _scores(t, cfg)
    db_re = db_re + jnp.sum(diag[:, None] * da_re, axis=0)
    db_im = db_im + jnp.sum(diag[:, None] * da_im, axis=0)
    init = (jnp.zeros((k_len, k_len), F32), db_re, db_im, dr, dth)
    d_scores, db_re, db_im, dr, dth = jax.lax.fori_loop(0, cfg.levels, key_level, init)
    d_scores = jnp.where(t.masks.strict, d_scores, 0.0)
    k, q = t.k, t.q
    dq = dq + _dot(d_scores, k, cfg) + d_diag * k.astype(F32)
    dk = _dot(d_scores, q, cfg, trans_a=True) + d_diag * q.astype(F32)
    return dict(q=dq, k=dk, v=dv, r=dr, theta=dth, b_re=db_re, b_im=db_im, g=dg, xk=dxk, xv=dxv)


# ---------------------------------------------------------------------------------------------------------
# pallas_call wrappers (inputs padded to a multiple of the chunk)


def _forward_kernel(cfg):
    def kernel(*refs):
        *in_refs, o_ref = refs
        o_ref[...] = forward_tile(_Tile(cfg, *in_refs), cfg).astype(o_ref.dtype)

    return kernel


def _backward_kernel(cfg):
    m = cfg.modes
    lo, hi = pl.ds(0, m), pl.ds(m, m)

    def kernel(*refs):
        in_refs, d_out_ref = refs[:11], refs[11]
        dq_ref, dk_ref, dv_ref, dr_ref, dth_ref, db_ref, dg_ref, dxk_ref, dxv_ref = refs[12:]
        g = backward_tile(_Tile(cfg, *in_refs), d_out_ref[...], cfg)
        for ref, name in ((dq_ref, "q"), (dk_ref, "k"), (dv_ref, "v"), (dr_ref, "r"), (dth_ref, "theta")):
            ref[...] = g[name].astype(ref.dtype)
        db_ref[lo] = g["b_re"]
        db_ref[hi] = g["b_im"]
        for (rows, cols), block in zip(((lo, lo), (lo, hi), (hi, lo), (hi, hi)), g["g"]):
            dg_ref[rows, cols] = block
        for ref, (re, im) in ((dxk_ref, g["xk"]), (dxv_ref, g["xv"])):
            ref[lo, :] = re
            ref[hi, :] = im

    return kernel


def _token_spec(cfg, width):
    """[B, T, H, width] read per chunk: block [K, width] at (b, n, h)."""
    return pl.BlockSpec((None, cfg.chunk, None, width), lambda b, h, n: (b, n, h, 0))


def _chunk_spec(*tail):
    """[B, H, N, *tail] per chunk."""
    return pl.BlockSpec((None, None, None, *tail), lambda b, h, n: (b, h, n, *([0] * len(tail))))


def _head_spec(*tail):
    """[H, *tail] per head."""
    return pl.BlockSpec((None, *tail), lambda b, h, n: (h, *([0] * len(tail))))


def _in_specs(cfg):
    c, m, r, dv = cfg.chunk, cfg.modes, cfg.key_dim, cfg.value_dim
    return [_token_spec(cfg, r), _token_spec(cfg, r), _token_spec(cfg, dv), _token_spec(cfg, m), _head_spec(m),
            _head_spec(2 * m), _head_spec(2 * m, 2 * m), _chunk_spec(2 * m, r), _chunk_spec(2 * m, dv),
            pl.BlockSpec((None, c), lambda b, h, n: (b, n)), pl.BlockSpec((None, None), lambda b, h, n: (b, n))]


def _params(cfg, warps):
    if cfg.interpret or pltriton is None:
        return None
    return pltriton.CompilerParams(num_warps=warps, num_stages=1)


def flop_counts(cfg):
    """(forward, backward) FLOPs, transcendentals and HBM bytes per chunk and head, as the kernels execute
    them (full masked tiles; a range sum counted once, though with "tf32x3" it runs as three TF32 passes)."""
    k, m, r, dv, lv = cfg.chunk, cfg.modes, cfg.key_dim, cfg.value_dim, cfg.levels
    kkm, kmm = 2 * k * k * m, 2 * k * m * m
    od = jnp.dtype(cfg.operand_dtype).itemsize
    # forward: Sc, X̂ᵏ₀ q, carry-in sums, key-read levels (sums + 2 GEMMs), Ĝ, carried value, P levels, P v
    fwd = (2 * k * k * r + 2 * 2 * k * r * m + kkm + lv * 3 * kkm + 4 * kmm + 2 * 2 * k * m * dv
           + lv * 3 * kkm + 2 * k * k * dv)
    fwd_exp = 3 * k * m * (1 + 2 * lv)
    inputs = k * (2 * r + dv) * od + k * m * 4 + 2 * m * (r + dv) * 4 + (4 * m * m + 3 * m) * 4
    fwd_bytes = inputs + k * dv * od
    # backward: the forward up to ω again, then per level P (2), dh (2), dc (2), dr (1) and Sc c (2), dS (2),
    # dc (2), dr (1) GEMMs; the state and readout cotangents
    bwd = (fwd - lv * 3 * kkm - 2 * k * k * dv + 2 * k * k * dv * 2 + 2 * 2 * k * m * dv + lv * 16 * kkm
           + 4 * kmm * 2 + 2 * 2 * k * m * r + 2 * k * k * r * 2 + 2 * k * r * m * 2)
    bwd_exp = 3 * k * m * (1 + 3 * lv)
    bwd_bytes = inputs + k * dv * od + k * (2 * r + dv) * od + k * m * 4 + (3 * m + 4 * m * m) * 4 \
        + 2 * m * (r + dv) * 4
    return (fwd, fwd_exp, fwd_bytes), (bwd, bwd_exp, bwd_bytes)


def _cost(cfg, which, programs):
    flops, exps, nbytes = flop_counts(cfg)[which]
    return pl.CostEstimate(flops=int(programs * flops), transcendentals=int(programs * exps),
                           bytes_accessed=int(programs * nbytes))


def _forward(cfg, q, k, v, r, phase, gain, readout, xk, xv, doc, carry):
    b, t, h, _ = q.shape
    grid = (b, h, t // cfg.chunk)
    return pl.pallas_call(
        _forward_kernel(cfg), out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype), grid=grid,
        in_specs=_in_specs(cfg), out_specs=_token_spec(cfg, cfg.value_dim), interpret=cfg.interpret,
        compiler_params=_params(cfg, cfg.warps_forward), cost_estimate=_cost(cfg, 0, b * h * grid[2]),
        name="interdomain_outputs")(q, k, v, r, phase, gain, readout, xk, xv, doc, carry)


def _backward(cfg, q, k, v, r, phase, gain, readout, xk, xv, doc, carry, d_out):
    """(dq, dk, dv, dr, dθ, db, dĜ, dX̂ᵏ₀, dX̂ᵛ₀); the per-head parameter cotangents summed over the
    per-chunk partials of the kernel."""
    b, t, h, _ = q.shape
    n = t // cfg.chunk
    c, m, r_dim, dv = cfg.chunk, cfg.modes, cfg.key_dim, cfg.value_dim
    shape = jax.ShapeDtypeStruct
    out_shape = (shape(q.shape, q.dtype), shape(k.shape, k.dtype), shape(v.shape, v.dtype), shape(r.shape, F32),
                 shape((b, h, n, m), F32), shape((b, h, n, 2 * m), F32), shape((b, h, n, 2 * m, 2 * m), F32),
                 shape(xk.shape, F32), shape(xv.shape, F32))
    out_specs = (_token_spec(cfg, r_dim), _token_spec(cfg, r_dim), _token_spec(cfg, dv), _token_spec(cfg, m),
                 _chunk_spec(m), _chunk_spec(2 * m), _chunk_spec(2 * m, 2 * m), _chunk_spec(2 * m, r_dim),
                 _chunk_spec(2 * m, dv))
    grads = pl.pallas_call(
        _backward_kernel(cfg), out_shape=out_shape, grid=(b, h, n),
        in_specs=_in_specs(cfg) + [_token_spec(cfg, dv)], out_specs=out_specs, interpret=cfg.interpret,
        compiler_params=_params(cfg, cfg.warps_backward), cost_estimate=_cost(cfg, 1, b * h * n),
        name="interdomain_outputs_bwd")(q, k, v, r, phase, gain, readout, xk, xv, doc, carry, d_out)
    dq, dk, dv_, dr, dth, db, dg, dxk, dxv = grads
    del c
    return (dq, dk, dv_, dr.astype(r.dtype), jnp.sum(dth, axis=(0, 2)).astype(phase.dtype),
            jnp.sum(db, axis=(0, 2)).astype(gain.dtype), jnp.sum(dg, axis=(0, 2)).astype(readout.dtype),
            dxk.astype(xk.dtype), dxv.astype(xv.dtype))


# ---------------------------------------------------------------------------------------------------------
# custom VJP


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _outputs(cfg, q, k, v, r, phase, gain, readout, xk, xv, doc, carry):
    return _forward(cfg, q, k, v, r, phase, gain, readout, xk, xv, doc, carry)


def _outputs_fwd(cfg, *args):
    out = common.keep_for_backward(_forward(cfg, *args))
    return out, common.keep_for_backward(args)


def _outputs_bwd(cfg, residuals, d_out):
    return (*_backward(cfg, *residuals, d_out.astype(residuals[2].dtype)), None, None)


_outputs.defvjp(_outputs_fwd, _outputs_bwd)


# ---------------------------------------------------------------------------------------------------------
# public entry (the op's impl.run contract)


def run(q, k, v, log_modulus, phase, gain, readout, key_state, value_state, document_BT, *, chunk_size,
        sub_chunk_size=None, interpret=False, **overrides):
    """q, k [B, T, H, R], v [B, T, H, Dv] in the caller's dtype (bf16 runs bf16 GEMM operands); log_modulus
    [B, T, H, M], phase [H, M], gain [H, 2M], readout [H, 2M, 2M], states [B, H, 2M, R] / [B, H, 2M, Dv] in
    float32; document_BT [B, T] int. Returns (o [B, T, H, Dv] in v's dtype, key state, value state float32).
    Differentiable (custom VJP). ``overrides``: :class:`Config` fields (precision, warps_*)."""
    del sub_chunk_size  # the pivot tree replaces the sub-chunks
    b, t, h, r_dim = q.shape
    cfg = make_config(chunk_size, r_dim, v.shape[-1], phase.shape[-1], v.dtype, interpret=interpret, **overrides)
    ct = log_modulus.dtype
    xk, xv, key, value = xla.chunk_start_states(k.astype(ct), v.astype(ct), log_modulus, phase, gain, key_state,
                                                value_state, document_BT, chunk_size=chunk_size)
    padded = [common.pad_time(x, chunk_size) for x in (q, k, v, log_modulus)]
    document = common.pad_time(document_BT.astype(jnp.int32), chunk_size, mode="edge")
    _, carried = common.chunk_documents(document, chunk_size)
    out = _outputs(cfg, *padded, phase, gain, readout, xk, xv, document, carried)
    return out[:, :t], key, value
