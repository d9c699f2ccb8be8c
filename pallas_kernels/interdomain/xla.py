"""Chunkwise pure-JAX form of the interdomain / S4D recurrences (spec IA B6), real arithmetic only.

Per head, chunk of K tokens (local s = 0..K-1), log Λ_{s,m} = r_{s,m} + iθ_m (r ≤ 0, θ static):

    L_s = Σ_{τ≤s} r_τ                         (real cumsum inside the chunk)
    e^{ℓ_s}   = exp(L_s) · e^{iθ(s+1)}         carried state → token s
    D[s,j,m]  = exp(L_s − L_j) · e^{iθ(s−j)} · 1[j ≤ s, same document]      |D| ≤ 1  (stable relative form)

Phases come from integer offsets (s+1, s−j, K−1−j) times θ — never from a cumsum of θ — so there is no
phase drift in float32. Three passes (IAs A.2):

  (i)   local end state of every chunk from a zero start (parallel over chunks):
        X_loc = Σ_j (b ⊙ D[K−1, j]) z_jᵀ
  (ii)  serial scan over the chunk boundaries: X_{n+1} = e^{ℓ_{K−1}} ⊙ X_n + X_loc,n (reset-masked)
  (iii) outputs per chunk from the corrected initial states (parallel), for the interdomain readout:
        a_s = e^{ℓ_s} ⊙ (X̂ᵏ₀ ξq_s) + b ⊙ Σ_j (ξq_s·k̃_j) D[s,j]         (query-contracted key state)
        ω_s = Ĝ â_s                                                     (readout Gram, real 2M×2M)
        o_s = Re(conj(ω_s) ⊙ e^{ℓ_s})ᵀ X⁰ᵛ + Σ_j Re(Σ_m conj(ω_{s,m}) b_m D[s,j,m]) ṽ_j
      and for S4D-only ω_s = ω is a fixed vector per head.

Complex numbers are carried as (Re, Im) pairs; states as stacked ``[Re X; Im X]`` rows ``[.., 2M, C]``.
The relative form costs K²M per chunk (the K×K×M decay tensor); pass (iii) runs under ``jax.checkpoint`` so
the backward pass recomputes that tensor instead of storing it. Gradients: autodiff of this form.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.interdomain.decode import HIGHEST, split


def _ein(spec, *args):
    return jnp.einsum(spec, *args, precision=HIGHEST)


def pad_time(x, chunk, mode="constant"):
    t = x.shape[1]
    pad = (-t) % chunk
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x, widths, mode=mode)


def to_chunks(x_BTH, chunk):
    """[B, T, H, ...] -> [B, H, N, K, ...] (T a multiple of chunk)."""
    b, t, h = x_BTH.shape[:3]
    x = x_BTH.reshape(b, t // chunk, chunk, h, *x_BTH.shape[3:])
    return jnp.moveaxis(x, 3, 1)


def from_chunks(x_BHNK):
    b, h, n, k = x_BHNK.shape[:4]
    return jnp.moveaxis(x_BHNK, 1, 3).reshape(b, n * k, h, *x_BHNK.shape[4:])


def _cmul(a_re, a_im, b_re, b_im):
    return a_re * b_re - a_im * b_im, a_re * b_im + a_im * b_re


def _decays(r_BHNKM, phase_HM, doc_BNK, carry_doc_BN):
    """Carry-in factors e^{ℓ_s}, end coefficients D[K−1, j], chunk decays, and the D tensor builder."""
    k = r_BHNKM.shape[3]
    dtype = r_BHNKM.dtype
    L = jnp.cumsum(r_BHNKM, axis=3)
    pos = jnp.arange(k, dtype=dtype)
    theta = phase_HM[None, :, None, None, :]  # [1,H,1,1,M]
    # carry-in: state before the chunk -> token s (s+1 transitions), only in the carried document
    valid = (doc_BNK == carry_doc_BN[..., None])[:, None, :, :, None]
    mag_in = jnp.where(valid, jnp.exp(L), 0.0)
    ang_in = (pos + 1.0)[None, None, None, :, None] * theta
    ein = (mag_in * jnp.cos(ang_in), mag_in * jnp.sin(ang_in))
    # end coefficients: token j -> end of chunk, only tokens of the chunk's last document
    last_doc = doc_BNK[..., -1:]
    same_end = (doc_BNK == last_doc)[:, None, :, :, None]
    d_end = jnp.where(same_end, L[..., -1:, :] - L, 0.0)
    mag_end = jnp.where(same_end, jnp.exp(d_end), 0.0)
    ang_end = ((k - 1.0) - pos)[None, None, None, :, None] * theta
    eend = (mag_end * jnp.cos(ang_end), mag_end * jnp.sin(ang_end))
    chunk_decay = (ein[0][..., -1, :], ein[1][..., -1, :])  # [B,H,N,M]
    return L, ein, eend, chunk_decay


def _relative(L_BHNKM, phase_HM, doc_BNK):
    """D[s, j, m] (re, im) [B,H,N,K,K,M], zero above the diagonal and across documents."""
    k = L_BHNKM.shape[3]
    dtype = L_BHNKM.dtype
    pos = jnp.arange(k)
    causal = pos[:, None] >= pos[None, :]
    mask = (causal[None, None] & (doc_BNK[..., :, None] == doc_BNK[..., None, :]))[:, None, ..., None]
    diff = jnp.where(mask, L_BHNKM[..., :, None, :] - L_BHNKM[..., None, :, :], 0.0)
    mag = jnp.where(mask, jnp.exp(diff), 0.0)
    offset = (pos[:, None] - pos[None, :]).astype(dtype)
    ang = offset[None, :, :, None] * phase_HM[:, None, None, :]  # [H,K,K,M]
    return mag * jnp.cos(ang)[None, :, None], mag * jnp.sin(ang)[None, :, None]


def _value_readout(omega, ein, d_rel, gain, x0_re, x0_im, zv):
    """o_s = Re(conj(ω_s) ⊙ e^{ℓ_s})·X⁰ + Σ_j Re(Σ_m conj(ω_sm) b_m D[s,j,m]) z_j."""
    w_re, w_im = split(omega, axis=-1)
    g_re = w_re * ein[0] + w_im * ein[1]
    g_im = w_re * ein[1] - w_im * ein[0]
    out = _ein("bhnkm,bhnmc->bhnkc", g_re, x0_re) - _ein("bhnkm,bhnmc->bhnkc", g_im, x0_im)
    b_re, b_im = gain
    h_re = w_re * b_re + w_im * b_im
    h_im = w_re * b_im - w_im * b_re
    p = _ein("bhnsm,bhnsjm->bhnsj", h_re, d_rel[0]) - _ein("bhnsm,bhnsjm->bhnsj", h_im, d_rel[1])
    return out + _ein("bhnsj,bhnjc->bhnsc", p, zv)


def _split_gain(gain_H2M):
    b_re, b_im = split(gain_H2M, axis=-1)
    return b_re[None, :, None, None, :], b_im[None, :, None, None, :]


def _scan_states(z, ein_end_coef, chunk_decay, state, gain):
    """Passes (i) and (ii). Returns (initial state of every chunk [B,H,N,2M,C], final state [B,H,2M,C])."""
    b_re, b_im = gain
    c_re, c_im = _cmul(b_re, b_im, *ein_end_coef)  # b ⊙ D[K−1, j]   [B,H,N,K,M]
    loc = jnp.concatenate([_ein("bhnkm,bhnkc->bhnmc", c_re, z), _ein("bhnkm,bhnkc->bhnmc", c_im, z)], axis=-2)

    def body(x, xs):
        a_re, a_im, local = xs
        x_re, x_im = split(x)
        n_re, n_im = _cmul(a_re[..., None], a_im[..., None], x_re, x_im)
        return jnp.concatenate([n_re, n_im], axis=-2) + local, x

    xs = (jnp.moveaxis(chunk_decay[0], 2, 0), jnp.moveaxis(chunk_decay[1], 2, 0), jnp.moveaxis(loc, 2, 0))
    final, starts = jax.lax.scan(body, state, xs)
    return jnp.moveaxis(starts, 0, 2), final


def _prepare(arrays, r, document_BT, chunk):
    t = document_BT.shape[1]
    pad = (-t) % chunk
    arrays = [to_chunks(pad_time(x, chunk), chunk) for x in arrays]
    r = to_chunks(pad_time(r, chunk), chunk)
    doc = pad_time(document_BT, chunk, mode="edge")
    doc = doc.reshape(doc.shape[0], -1, chunk)
    carry_doc = jnp.concatenate([doc[:, :1, 0], doc[:, :-1, -1]], axis=1)
    return arrays, r, doc, carry_doc, pad


def _unrotate(state, phase_HM, pad):
    """Padded tail tokens (r = 0, zero input) only rotated the final state by θ·pad: undo it exactly."""
    if pad == 0:
        return state
    ang = -float(pad) * phase_HM
    c, s = jnp.cos(ang)[None, :, :, None], jnp.sin(ang)[None, :, :, None]
    re, im = split(state)
    return jnp.concatenate([c * re - s * im, s * re + c * im], axis=-2)


def interdomain_chunked(q, k, v, log_modulus, phase, gain, readout, key_state, value_state, document_BT, *,
                        chunk_size):
    """Same contract as ``reference.interdomain_reference`` (all inputs in the compute dtype)."""
    t, r_dim = q.shape[1], q.shape[-1]
    (qc, kc, vc), r, doc, carry_doc, pad = _prepare([q, k, v], log_modulus, document_BT, chunk_size)
    g = _split_gain(gain)
    L, ein, eend, chunk_decay = _decays(r, phase, doc, carry_doc)
    z = jnp.concatenate([kc, vc], axis=-1)
    state = jnp.concatenate([key_state, value_state], axis=-1)
    starts, final = _scan_states(z, eend, chunk_decay, state, g)

    @jax.checkpoint
    def outputs(qc, kc, vc, L, ein, starts):
        d_rel = _relative(L, phase, doc)
        x_re, x_im = split(starts)
        # query-contracted key state a_s (complex M)
        y_re = _ein("bhnkr,bhnmr->bhnkm", qc, x_re[..., :r_dim])
        y_im = _ein("bhnkr,bhnmr->bhnkm", qc, x_im[..., :r_dim])
        a_re, a_im = _cmul(ein[0], ein[1], y_re, y_im)
        scores = _ein("bhnsr,bhnjr->bhnsj", qc, kc)
        u_re = _ein("bhnsj,bhnsjm->bhnsm", scores, d_rel[0])
        u_im = _ein("bhnsj,bhnsjm->bhnsm", scores, d_rel[1])
        w_re, w_im = _cmul(g[0], g[1], u_re, u_im)
        a_hat = jnp.concatenate([a_re + w_re, a_im + w_im], axis=-1)
        omega = _ein("hij,bhnkj->bhnki", readout, a_hat)
        return _value_readout(omega, ein, d_rel, g, x_re[..., r_dim:], x_im[..., r_dim:], vc)

    o = from_chunks(outputs(qc, kc, vc, L, ein, starts))[:, :t]
    final = _unrotate(final, phase, pad)
    return o, final[..., :r_dim], final[..., r_dim:]


def s4d_chunked(z, log_modulus, phase, gain, readout, state, document_BT, *, chunk_size):
    """Same contract as ``reference.s4d_reference``."""
    t = z.shape[1]
    (zc,), r, doc, carry_doc, pad = _prepare([z], log_modulus, document_BT, chunk_size)
    g = _split_gain(gain)
    L, ein, eend, chunk_decay = _decays(r, phase, doc, carry_doc)
    starts, final = _scan_states(zc, eend, chunk_decay, state, g)

    @jax.checkpoint
    def outputs(zc, L, ein, starts):
        d_rel = _relative(L, phase, doc)
        x_re, x_im = split(starts)
        omega = jnp.broadcast_to(readout[None, :, None, None, :], (*zc.shape[:4], readout.shape[-1]))
        return _value_readout(omega, ein, d_rel, g, x_re, x_im, zc)

    o = from_chunks(outputs(zc, L, ein, starts))[:, :t]
    return o, _unrotate(final, phase, pad)
