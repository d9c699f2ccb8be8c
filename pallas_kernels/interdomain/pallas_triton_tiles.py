"""The tile math of the Pallas-Triton interdomain kernels (``pallas_triton_kernels.py``): 2-D tiles and ops with
Triton lowerings only, traced inside the kernels; complex tiles are (Re, Im) pairs of [K, M] f32 tiles."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mixerlab.pallas_kernels.triton_common import iota

from mixerlab.pallas_kernels.interdomain.pallas_triton_config import F32


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
