"""Chunkwise pure-JAX form of the interdomain / S4D recurrences (docs/math/interdomain.md, 'Chunked form'), real
arithmetic only.

Per head, chunk of K tokens (local s = 0..K-1), log Λ_{s,m} = r_{s,m} + iθ_m (r ≤ 0, θ static):

    L_s       = Σ_{τ≤s} r_τ                    (real cumsum inside the chunk)
    e^{ℓ_s}   = exp(L_s) · e^{iθ(s+1)}         carried state → token s                          |·| ≤ 1
    D[s,j,m]  = exp(L_s − L_j) · e^{iθ(s−j)} · 1[j ≤ s, same document]                            |D| ≤ 1

Three passes (the IA paper's Appendix A.2; docs/math/interdomain.md):

  (i)   local end state of every chunk from a zero start (parallel over chunks):
        X_loc = Σ_j (b ⊙ D[K−1, j]) z_jᵀ                     (relative to the chunk end, |·| ≤ 1)
  (ii)  serial scan over the chunk boundaries: X_{n+1} = e^{ℓ_{K−1}} ⊙ X_n + X_loc,n (reset-masked)
  (iii) outputs per chunk from the corrected initial states (parallel), for the interdomain readout:
        a_s = e^{ℓ_s} ⊙ (X̂ᵏ₀ ξq_s) + b ⊙ Σ_j (ξq_s·k̃_j) D[s,j]         (query-contracted key state)
        ω_s = Ĝ â_s                                                     (readout Gram, real 2M×2M)
        o_s = Re(conj(ω_s) ⊙ e^{ℓ_s})ᵀ X⁰ᵛ + Σ_j Re(Σ_m conj(ω_{s,m}) b_m D[s,j,m]) ṽ_j
      and for S4D-only ω_s = ω is a fixed vector per head.

Inside a chunk, D is never materialised (K×K×M). The chunk is cut into sub-chunks of ``sub`` tokens
(default 16); for s in sub-chunk I, with anchor p = first token of I minus one (the state before I):

    D[s,j] = E[s] · F[I,j],   E[s] = exp(L_s − L_p) e^{iθ(s−p)},   F[I,j] = exp(L_p − L_j) e^{iθ(p−j)}

|E| ≤ 1 always. For j in earlier sub-chunks (j ≤ p) F is itself a decay, |F| ≤ 1: the stable relative form
across sub-chunks. For j inside sub-chunk I, |F| ≤ exp(−Σ_{τ∈I} r_τ) ≤ |Λ|^{−sub}: the factorised form,
bounded because the sub-chunk is short (float32: −Σ_{τ∈I} r_τ < 88, so r > −5.5 per token at sub = 16;
factorising a whole 64-token chunk overflows already at r < −1.4, docs/math/interdomain.md, 'Numerics'). With that, both
intra-chunk sums are GEMMs per sub-chunk:
    Σ_j Sc[s,j] D[s,j] = E[s] ⊙ (Sc[I rows] · F[I])          Sc = tril(FQ KKᵀ) ⊙ same-document
    P[s,j]            = Re((conj(ω_s) ⊙ E[s]) · (b ⊙ F[I,j])) ⊙ tril ⊙ same-document
Masks only touch the K×K matrices (never the decays), so document resets cost nothing extra.

Phases come from integer offsets (s+1, s−p, p−j, K−1−j) times θ — never from a cumsum of θ — so there is
no phase drift in float32. Complex numbers are carried as (Re, Im) pairs; states as stacked
``[Re X; Im X]`` rows ``[.., 2M, C]``; complex products against the decays are real GEMMs over the
stacked 2M axis. Gradients: autodiff of this form; pass (iii) runs under ``jax.checkpoint`` so the
backward pass recomputes the sub-chunk factors (K/sub · K · M per chunk) instead of storing them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mixerlab.pallas_kernels import common
from mixerlab.pallas_kernels.interdomain.decode import HIGHEST, split


def _ein(spec, *args):
    return jnp.einsum(spec, *args, precision=HIGHEST)


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


def _polar(mag, ang):
    return mag * jnp.cos(ang), mag * jnp.sin(ang)


def _decays(r_BHNKM, phase_HM, doc_BNK, carry_doc_BN):
    """Chunk-level factors: carry-in e^{ℓ_s}, end coefficients D[K−1, j] and the chunk decays e^{ℓ_{K−1}}."""
    k = r_BHNKM.shape[3]
    dtype = r_BHNKM.dtype
    L = jnp.cumsum(r_BHNKM, axis=3)
    pos = jnp.arange(k, dtype=dtype)
    theta = phase_HM[None, :, None, None, :]  # [1,H,1,1,M]
    # carry-in: state before the chunk -> token s (s+1 transitions), only in the carried document
    valid = (doc_BNK == carry_doc_BN[..., None])[:, None, :, :, None]
    ein = _polar(jnp.where(valid, jnp.exp(L), 0.0), (pos + 1.0)[:, None] * theta)
    # end coefficients: token j -> end of chunk, only tokens of the chunk's last document
    same_end = (doc_BNK == doc_BNK[..., -1:])[:, None, :, :, None]
    d_end = jnp.where(same_end, L[..., -1:, :] - L, 0.0)
    eend = _polar(jnp.where(same_end, jnp.exp(d_end), 0.0), ((k - 1.0) - pos)[:, None] * theta)
    chunk_decay = (ein[0][..., -1, :], ein[1][..., -1, :])  # [B,H,N,M]
    return L, ein, eend, chunk_decay


def _sub_chunk_factors(L_BHNKM, phase_HM, gain_H2M, sub):
    """E [B,H,N,K,M] (re, im) and b ⊙ F stacked [Re; Im] on the last axis, [B,H,N,S,K,2M] (module doc).

    F[I, j] is zero for j past the end of sub-chunk I (no query of I reaches it); the exponent is masked
    before ``exp`` so those entries, and their gradients, stay finite."""
    k = L_BHNKM.shape[3]
    dtype = L_BHNKM.dtype
    n_sub = -(-k // sub)
    pos = jnp.arange(k)
    start = jnp.arange(n_sub) * sub  # first token of each sub-chunk; its anchor p = start − 1
    # L_before[i] = L_{i−1} (L_{−1} = 0): the log-modulus of the state before token i
    L_before = jnp.concatenate([jnp.zeros_like(L_BHNKM[..., :1, :]), L_BHNKM], axis=3)
    theta = phase_HM[None, :, None, None, :]
    # query side: anchor of s's sub-chunk -> s; s − p = (s mod sub) + 1 transitions
    first = (pos // sub) * sub
    e_q = _polar(jnp.exp(L_BHNKM - L_before[..., first, :]), (pos - first + 1).astype(dtype)[:, None] * theta)
    # key side: j -> anchor of sub-chunk I (a decay for j ≤ p, bounded growth inside I)
    reach = (pos[None, :] < (start + sub)[:, None])[None, None, None, :, :, None]  # [1,1,1,S,K,1]
    expo = jnp.where(reach, L_before[..., start, :][..., :, None, :] - L_BHNKM[..., None, :, :], 0.0)
    offset = (start[:, None] - 1 - pos[None, :]).astype(dtype)  # p − j, [S, K]
    f = _polar(jnp.where(reach, jnp.exp(expo), 0.0), offset[None, None, None, :, :, None] * theta[..., None, :])
    b_re, b_im = split(gain_H2M, axis=-1)
    bf = _cmul(b_re[None, :, None, None, None, :], b_im[None, :, None, None, None, :], *f)
    return e_q, jnp.concatenate(bf, axis=-1)


def _rows_by_sub_chunk(x_BHNK, sub, n_sub):
    """[B,H,N,K,...] -> [B,H,N,S,sub,...]; a ragged last sub-chunk is padded with zero rows."""
    pad = n_sub * sub - x_BHNK.shape[3]
    if pad:
        x_BHNK = jnp.pad(x_BHNK, [(0, 0)] * 3 + [(0, pad)] + [(0, 0)] * (x_BHNK.ndim - 4))
    return x_BHNK.reshape(*x_BHNK.shape[:3], n_sub, sub, *x_BHNK.shape[4:])


def _rows_from_sub_chunks(x_BHNSc, k):
    return x_BHNSc.reshape(*x_BHNSc.shape[:3], -1, *x_BHNSc.shape[5:])[:, :, :, :k]


def _pair_mask(doc_BNK):
    """1[j ≤ s, same document] as [B,1,N,K,K] (causal within the chunk)."""
    k = doc_BNK.shape[-1]
    pos = jnp.arange(k)
    causal = pos[:, None] >= pos[None, :]
    return (causal & (doc_BNK[..., :, None] == doc_BNK[..., None, :]))[:, None]


def _value_readout(omega, ein, e_q, bf, mask, sub, x0_re, x0_im, zv):
    """o_s = Re(conj(ω_s) ⊙ e^{ℓ_s})·X⁰ + Σ_j P[s,j] z_j, P[s,j] = Re Σ_m conj(ω_sm) b_m E[s,m] F[I,j,m]."""
    w_re, w_im = split(omega, axis=-1)
    g_re = w_re * ein[0] + w_im * ein[1]
    g_im = w_re * ein[1] - w_im * ein[0]
    out = _ein("bhnkm,bhnmc->bhnkc", g_re, x0_re) - _ein("bhnkm,bhnmc->bhnkc", g_im, x0_im)
    # conj(ω) ⊙ E, stacked as [Re; −Im] so that Re(g · bF) is one real contraction over 2M
    h_re = w_re * e_q[0] + w_im * e_q[1]
    h_im = w_re * e_q[1] - w_im * e_q[0]
    k, n_sub = zv.shape[3], bf.shape[3]
    h = _rows_by_sub_chunk(jnp.concatenate([h_re, -h_im], axis=-1), sub, n_sub)
    p = _rows_from_sub_chunks(_ein("bhnism,bhnijm->bhnisj", h, bf), k)
    p = jnp.where(mask, p, 0.0)
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
    arrays = [to_chunks(common.pad_time(x, chunk), chunk) for x in arrays]
    r = to_chunks(common.pad_time(r, chunk), chunk)
    doc, carry_doc = common.chunk_documents(common.pad_time(document_BT, chunk, mode="edge"), chunk)
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
                        chunk_size, sub_chunk_size):
    """Same contract as ``reference.interdomain_reference`` (all inputs in the compute dtype).
    ``sub_chunk_size`` ≤ ``chunk_size`` need not divide it (the last sub-chunk of a chunk is then shorter)."""
    t, r_dim = q.shape[1], q.shape[-1]
    sub = min(sub_chunk_size, chunk_size)
    (qc, kc, vc), r, doc, carry_doc, pad = _prepare([q, k, v], log_modulus, document_BT, chunk_size)
    g = _split_gain(gain)
    L, ein, eend, chunk_decay = _decays(r, phase, doc, carry_doc)
    z = jnp.concatenate([kc, vc], axis=-1)
    state = jnp.concatenate([key_state, value_state], axis=-1)
    starts, final = _scan_states(z, eend, chunk_decay, state, g)

    @jax.checkpoint
    def outputs(qc, kc, vc, L, ein, starts):
        e_q, bf = _sub_chunk_factors(L, phase, gain, sub)
        mask = _pair_mask(doc)
        x_re, x_im = split(starts)
        # query-contracted key state a_s (complex M): carried part ...
        y_re = _ein("bhnkr,bhnmr->bhnkm", qc, x_re[..., :r_dim])
        y_im = _ein("bhnkr,bhnmr->bhnkm", qc, x_im[..., :r_dim])
        a_re, a_im = _cmul(ein[0], ein[1], y_re, y_im)
        # ... plus the in-chunk part E[s] ⊙ Σ_j Sc[s,j] b F[I,j]: one GEMM per sub-chunk of queries
        scores = jnp.where(mask, _ein("bhnsr,bhnjr->bhnsj", qc, kc), 0.0)
        u = _ein("bhnisj,bhnijm->bhnism", _rows_by_sub_chunk(scores, sub, bf.shape[3]), bf)
        u_re, u_im = split(_rows_from_sub_chunks(u, qc.shape[3]), axis=-1)
        w_re, w_im = _cmul(e_q[0], e_q[1], u_re, u_im)
        a_hat = jnp.concatenate([a_re + w_re, a_im + w_im], axis=-1)
        omega = _ein("hij,bhnkj->bhnki", readout, a_hat)
        return _value_readout(omega, ein, e_q, bf, mask, sub, x_re[..., r_dim:], x_im[..., r_dim:], vc)

    o = from_chunks(outputs(qc, kc, vc, L, ein, starts))[:, :t]
    final = _unrotate(final, phase, pad)
    return o, final[..., :r_dim], final[..., r_dim:]


def s4d_chunked(z, log_modulus, phase, gain, readout, state, document_BT, *, chunk_size, sub_chunk_size):
    """Same contract as ``reference.s4d_reference``; sub-chunks as ``interdomain_chunked``."""
    t = z.shape[1]
    sub = min(sub_chunk_size, chunk_size)
    (zc,), r, doc, carry_doc, pad = _prepare([z], log_modulus, document_BT, chunk_size)
    g = _split_gain(gain)
    L, ein, eend, chunk_decay = _decays(r, phase, doc, carry_doc)
    starts, final = _scan_states(zc, eend, chunk_decay, state, g)

    @jax.checkpoint
    def outputs(zc, L, ein, starts):
        e_q, bf = _sub_chunk_factors(L, phase, gain, sub)
        x_re, x_im = split(starts)
        omega = jnp.broadcast_to(readout[None, :, None, None, :], (*zc.shape[:4], readout.shape[-1]))
        return _value_readout(omega, ein, e_q, bf, _pair_mask(doc), sub, x_re, x_im, zc)

    o = from_chunks(outputs(zc, L, ein, starts))[:, :t]
    return o, _unrotate(final, phase, pad)
