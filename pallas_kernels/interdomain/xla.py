"""Chunkwise pure-JAX form of the interdomain / S4D recurrences (docs/math/interdomain.md, 'Chunked form'), real
arithmetic only.

Per head, chunk of K tokens (local s = 0..K-1), log Λ_{s,m} = r_{s,m} + iθ_m (r ≤ 0, θ static), and
r(a, b] = Σ_{a<τ≤b} r_τ ≤ 0, the log-modulus accumulated over a contiguous token range:

    e^{ℓ_s}   = exp(r(−1, s]) · e^{iθ(s+1)}            carried state → token s               |·| ≤ 1
    D[s,j,m]  = exp(r(j, s]) · e^{iθ(s−j)} · 1[j ≤ s, same document]         token j → s     |D| ≤ 1

Three passes (the IA paper's Appendix A.2; docs/math/interdomain.md):

  (i)   local end state of every chunk from a zero start (parallel over chunks):
        X_loc = Σ_j (b ⊙ D[e, j]) z_jᵀ     e = the chunk's last (real) token   (relative to the chunk end)
  (ii)  serial scan over the chunk boundaries: X_{n+1} = e^{ℓ_e} ⊙ X_n + X_loc,n (reset-masked)
  (iii) outputs per chunk from the corrected initial states (parallel), for the interdomain readout:
        a_s = e^{ℓ_s} ⊙ (X̂ᵏ₀ ξq_s) + b ⊙ Σ_j (ξq_s·k̃_j) D[s,j]         (query-contracted key state)
        ω_s = Ĝ â_s                                                     (readout Gram, real 2M×2M)
        o_s = Re(conj(ω_s) ⊙ e^{ℓ_s})ᵀ X⁰ᵛ + Σ_j Re(Σ_m conj(ω_{s,m}) b_m D[s,j,m]) ṽ_j
      and for S4D-only ω_s = ω is a fixed vector per head.

**Every exponent is a sum of r ≤ 0 over a contiguous token range, never a difference of prefix sums**, so
every exp has a non-positive argument: nothing overflows for any r ≤ 0, decays underflow to 0 only when
the true value is below the float range, and a small exponent is never the difference of two large ones
(which loses its absolute accuracy once |Σ r| over the chunk is large). The range sums are small 0/1
matmuls (``_range_sums``).

D (K×K×M) is never materialised. The chunk is cut into S sub-chunks of ``sub`` tokens (default 8); for s in
sub-chunk I with anchor p = (first token of I) − 1:

    j before I:  D[s,j] = E[s] · F[I,j],   E[s] = exp(r(p, s]) e^{iθ(s−p)},  F[I,j] = exp(r(j, p]) e^{iθ(p−j)}
                 r(j, p] = (rest of j's sub-chunk J after j) + (whole sub-chunks strictly between J and I)
    j inside I:  D[s,j] exact, a sub × sub × M tensor per sub-chunk (K·sub·M per chunk)

both factors and all pairwise decays have |·| ≤ 1. The cross-sub-chunk sums are one GEMM per sub-chunk:
    Σ_j Sc[s,j] b D[s,j] = E[s] ⊙ (Sc[I rows] · (b ⊙ F[I])) + Σ_{j∈I} Sc[s,j] b D[s,j]
    P[s,j]              = Re((conj(ω_s) ⊙ E[s]) · (b ⊙ F[I,j]))   (j before I),  Re(conj(ω_s) · b D[s,j]) (j ∈ I)
with Sc = tril(ξQ K̃ᵀ) ⊙ same document; masks only touch the K×K matrices (never the decays), so document
resets cost nothing extra.

Phases come from integer offsets (s+1, s−p, p−j, s−j, e−j) times θ — never from a cumsum of θ — so there is
no phase drift in float32; the last chunk ends at the last real token, so padding never rotates the final
state. Complex numbers are carried as (Re, Im) pairs; states as stacked ``[Re X; Im X]`` rows ``[.., 2M, C]``;
complex products against the decays are real GEMMs over the stacked 2M axis. Gradients: autodiff of this
form; pass (iii) runs under ``jax.checkpoint`` so the backward pass recomputes the sub-chunk factors instead
of storing them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mixerlab.pallas_kernels import common
from mixerlab.pallas_kernels.interdomain.decode import HIGHEST, split


def data_precision(input_dtype):
    """Matmul precision of the data contractions (scores, state reads and writes, decay-weighted sums) for a
    caller whose q/k/v (or z) arrive in ``input_dtype``: DEFAULT for 16-bit inputs (on a GPU, float32
    operands then take the tensor cores' TF32 path, 10 mantissa bits, finer than the inputs' own 8), HIGHEST
    otherwise (float32 inputs keep the ≤ 1e-4 accuracy the float32 tests check). The range sums of r, which
    become exponents, are always HIGHEST (``_range_sums``)."""
    return jax.lax.Precision.DEFAULT if jnp.dtype(input_dtype).itemsize <= 2 else HIGHEST


def _ein(spec, *args, precision=HIGHEST):
    return jnp.einsum(spec, *args, precision=precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _narrow_einsum(spec, a, b):
    """einsum of two 16-bit operands with a float32 result; the backward rounds the cotangent to the operands'
    dtype, so its two products are 16-bit GEMMs too (their results in the operands' dtype, as the inputs')."""
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _narrow_einsum_fwd(spec, a, b):
    return _narrow_einsum(spec, a, b), (a, b)


def _narrow_einsum_bwd(spec, residuals, g):
    a, b = residuals
    _, pullback = jax.vjp(lambda x, y: jnp.einsum(spec, x, y), a, b)
    return pullback(g.astype(a.dtype))


_narrow_einsum.defvjp(_narrow_einsum_fwd, _narrow_einsum_bwd)


def gemm(spec, a, b, precision, operand_dtype):
    """A data GEMM: at ``precision`` on the operands as they are, or (``operand_dtype`` given) on both operands
    rounded to it with a float32 result."""
    if operand_dtype is None:
        return jnp.einsum(spec, a, b, precision=precision)
    return _narrow_einsum(spec, a.astype(operand_dtype), b.astype(operand_dtype))


def to_chunks(x_BTH, chunk):
    """[B, T, H, ...] -> [B, H, N, K, ...] (T a multiple of chunk)."""
    b, t, h = x_BTH.shape[:3]
    x = x_BTH.reshape(b, t // chunk, chunk, h, *x_BTH.shape[3:])
    return jnp.moveaxis(x, 3, 1)


def from_chunks(x_BHNK):
    b, h, n, k = x_BHNK.shape[:4]
    return jnp.moveaxis(x_BHNK, 1, 3).reshape(b, n * k, h, *x_BHNK.shape[4:])


def cmul(a_re, a_im, b_re, b_im):
    return a_re * b_re - a_im * b_im, a_re * b_im + a_im * b_re


def polar(mag, ang):
    return mag * jnp.cos(ang), mag * jnp.sin(ang)


def _range_sums(x, ranges):
    """Σ_τ ranges[..., τ] x[.., τ, m] over the token axis (second to last; modes last) for a 0/1 matrix
    ``ranges`` [..., n] whose rows each select a contiguous token range: every result is a sum of same-signed
    terms over that range, never a difference of prefix sums. One small matmul (exact 0/1 weights; any
    summation order is accurate for same-signed terms), cheaper than a cumsum on TPU and in the backward.
    The token axis is replaced by the leading axes of ``ranges``."""
    out = jnp.einsum("...tm,pt->...pm", x, ranges.reshape(-1, ranges.shape[-1]).astype(x.dtype), precision=HIGHEST)
    return out.reshape(*x.shape[:-2], *ranges.shape[:-1], x.shape[-1])


def _upto(n):
    """[s, τ] = 1[τ ≤ s]: the range 0..s."""
    return jnp.tril(jnp.ones((n, n), bool))


def _after(n):
    """[j, τ] = 1[τ > j]: the range j+1..n−1."""
    return jnp.triu(jnp.ones((n, n), bool), 1)


def _masked_exp(mask, exponent):
    """exp where ``mask`` (exponent ≤ 0 there), 0 elsewhere; the exponent is masked first so that neither the
    value nor its gradient sees an unused entry."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, exponent, 0.0)), 0.0)


def _decays(r_BHNKM, phase_HM, doc_BNK, carry_doc_BN, pad):
    """Chunk-level factors: carry-in e^{ℓ_s}, end coefficients D[e, j] and the chunk decays e^{ℓ_e}, where the
    chunk's end e is its last token (K − 1), or in the last chunk its last real token (K − 1 − pad).
    Exponents: Σ_{τ≤s} r_τ (carry-in) and Σ_{j<τ≤e} r_τ (to the chunk end), both contiguous ranges; the
    padded tokens have r = 0 and no input, so ending at the last real token only changes the phases: the
    final state is never rotated past the sequence and back (which would cost float32 phase gradients)."""
    n, k = r_BHNKM.shape[2:4]
    dtype = r_BHNKM.dtype
    pos = jnp.arange(k, dtype=dtype)
    end = jnp.full((n,), k - 1.0, dtype).at[-1].set(k - 1.0 - pad)[:, None, None]  # [N,1,1]
    theta = phase_HM[None, :, None, None, :]  # [1,H,1,1,M]
    # carry-in: state before the chunk -> token s (s+1 transitions), only in the carried document
    valid = (doc_BNK == carry_doc_BN[..., None])[:, None, :, :, None]
    carried = _masked_exp(valid, _range_sums(r_BHNKM, _upto(k)))
    ein = polar(carried, (pos + 1.0)[:, None] * theta)
    # end coefficients: token j -> end of chunk, only tokens of the chunk's last document
    same_end = (doc_BNK == doc_BNK[..., -1:])[:, None, :, :, None]
    to_end = _range_sums(r_BHNKM, _after(k))
    eend = polar(_masked_exp(same_end, to_end), (end - pos[:, None]) * theta)
    chunk_decay = polar(carried[..., -1, :], (end[:, 0] + 1.0) * phase_HM[None, :, None, :])  # [B,H,N,M]
    return ein, eend, chunk_decay


def _pad_chunk_axis(x, size, axis=3, value=0):
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _sub_chunk_factors(r_BHNKM, phase_HM, gain_H2M, sub):
    """Exact decay factors of one chunk cut into S sub-chunks of ``sub`` tokens (the chunk axis padded to
    Kp = S·sub with r = 0). Every exponent is a sum of r over a contiguous token range (module doc):

      E[s]      [B,H,N,Kp,M] (re, im)     anchor p of s's sub-chunk -> s:  Σ_{p<τ≤s} r_τ
      b ⊙ F[I,j] [B,H,N,S,Kp,2M] stacked  j -> anchor of I, only j before I: Σ_{j<τ≤p} r_τ (0 elsewhere)
      b ⊙ D[s,j] [B,H,N,S,sub,sub,M] (re, im)  inside a sub-chunk, j ≤ s:     Σ_{j<τ≤s} r_τ (0 for j > s)
    """
    b_, h_, n_, k = r_BHNKM.shape[:4]
    m = r_BHNKM.shape[-1]
    n_sub = -(-k // sub)
    kp = n_sub * sub
    dtype = r_BHNKM.dtype
    r = _pad_chunk_axis(r_BHNKM, kp).reshape(b_, h_, n_, n_sub, sub, m)
    theta = phase_HM[None, :, None, None, None, :]  # [1,H,1,1,1,M]
    local = jnp.arange(sub)
    b_re, b_im = split(gain_H2M, axis=-1)
    # E: a running sum from the sub-chunk's first token; s − p = local + 1 transitions
    head = _range_sums(r, _upto(sub))
    e_q = polar(jnp.exp(head), (local + 1).astype(dtype)[:, None] * theta)
    e_q = tuple(x.reshape(b_, h_, n_, kp, m) for x in e_q)
    # F across sub-chunks: (rest of j's sub-chunk J after j) + (whole sub-chunks strictly between J and I)
    after_j = _range_sums(r, _after(sub))  # [B,H,N,S_J,sub,M]
    total = head[..., -1, :]  # [B,H,N,S_B,M]
    blocks = jnp.arange(n_sub)
    between_mask = ((blocks[None, :, None] < blocks[None, None, :])
                    & (blocks[None, None, :] < blocks[:, None, None]))  # [S_I, S_J, S_B]: J < B < I
    between = jnp.sum(jnp.where(between_mask[..., None], total[..., None, None, :, :], 0.0), axis=-2)
    earlier = (blocks[None, :] < blocks[:, None])[:, :, None, None]  # [S_I, S_J, 1, 1]: J < I
    expo = after_j[..., None, :, :, :] + between[..., :, :, None, :]  # [B,H,N,S_I,S_J,sub,M]
    pos = jnp.arange(kp)
    offset = ((blocks * sub - 1)[:, None] - pos[None, :]).astype(dtype)  # p − j, [S_I, Kp]
    f = polar(_masked_exp(earlier, expo).reshape(b_, h_, n_, n_sub, kp, m),
               offset[None, None, None, :, :, None] * phase_HM[None, :, None, None, None, :])
    bf = cmul(b_re[None, :, None, None, None, :], b_im[None, :, None, None, None, :], *f)
    # D inside a sub-chunk: for each query s, a running sum of r from s downwards (exclusive of j)
    causal = local[:, None] >= local[None, :]  # [s, j]
    between_js = _upto(sub)[:, None, :] & _after(sub)[None, :, :]  # [s, j, τ]: j < τ ≤ s
    pair_expo = _range_sums(r, between_js)  # [B,H,N,S,s,j,M]
    lag = (local[:, None] - local[None, :]).astype(dtype)  # s − j
    d = polar(_masked_exp(causal[..., None], pair_expo), lag[..., None] * theta[..., None, :])
    bd = cmul(b_re[None, :, None, None, None, None, :], b_im[None, :, None, None, None, None, :], *d)
    return e_q, jnp.concatenate(bf, axis=-1), bd


def pair_mask(doc_BNK, kp):
    """1[j ≤ s, same document] as [B,1,N,Kp,Kp] (causal within the chunk; padded positions never match)."""
    k = doc_BNK.shape[-1]
    pos = jnp.arange(k)
    causal = pos[:, None] >= pos[None, :]
    mask = (causal & (doc_BNK[..., :, None] == doc_BNK[..., None, :]))[:, None]
    return _pad_chunk_axis(_pad_chunk_axis(mask, kp, axis=3, value=False), kp, axis=4, value=False)


def _by_sub_chunk(x_BHNK, n_sub):
    """[B,H,N,Kp,...] -> [B,H,N,S,sub,...]."""
    return x_BHNK.reshape(*x_BHNK.shape[:3], n_sub, -1, *x_BHNK.shape[4:])


def _diagonal_blocks(x_BHNKK, n_sub):
    """[B,H,N,Kp,Kp] -> its S diagonal sub×sub blocks [B,H,N,S,sub,sub]."""
    b, h, n, kp = x_BHNKK.shape[:4]
    sub = kp // n_sub
    blocks = x_BHNKK.reshape(b, h, n, n_sub, sub, n_sub, sub)
    return jnp.moveaxis(jnp.diagonal(blocks, axis1=3, axis2=5), -1, 3)


def _with_diagonal_blocks(x_BHNKK, blocks_BHNSss):
    """[B,H,N,Kp,Kp] with its diagonal sub×sub blocks replaced by ``blocks`` [B,H,N,S,sub,sub]."""
    b, h, n, n_sub, sub = blocks_BHNSss.shape[:5]
    eye = jnp.eye(n_sub, dtype=bool)[:, None, :, None]
    x = x_BHNKK.reshape(b, h, n, n_sub, sub, n_sub, sub)
    return jnp.where(eye, blocks_BHNSss[..., :, :, None, :], x).reshape(x_BHNKK.shape)


def _keys_read(scores, e_q, bf, bd, precision):
    """b ⊙ Σ_j Sc[s,j] D[s,j] = E[s] ⊙ (Sc[I rows] · bF[I]) + Σ_{j∈I} Sc[s,j] bD[s,j]: complex [.., Kp, M]."""
    n_sub = bf.shape[3]
    u = _ein("bhnisj,bhnijm->bhnism", _by_sub_chunk(scores, n_sub), bf, precision=precision)
    u_re, u_im = split(u.reshape(*scores.shape[:4], -1), axis=-1)
    w_re, w_im = cmul(e_q[0], e_q[1], u_re, u_im)
    inside = _diagonal_blocks(scores, n_sub)
    in_re = _ein("bhnisj,bhnisjm->bhnism", inside, bd[0], precision=precision).reshape(w_re.shape)
    in_im = _ein("bhnisj,bhnisjm->bhnism", inside, bd[1], precision=precision).reshape(w_im.shape)
    return w_re + in_re, w_im + in_im


def carried_values(omega, ein, x0_re, x0_im, precision, operand_dtype=None):
    """Re(conj(ω_s) ⊙ e^{ℓ_s})ᵀ X̂⁰: the carried value state's share of every output [B,H,N,K,C] (``gemm``'s
    ``operand_dtype``)."""
    w_re, w_im = split(omega, axis=-1)
    g_re = w_re * ein[0] + w_im * ein[1]
    g_im = w_re * ein[1] - w_im * ein[0]
    return (gemm("bhnkm,bhnmc->bhnkc", g_re, x0_re, precision, operand_dtype)
            - gemm("bhnkm,bhnmc->bhnkc", g_im, x0_im, precision, operand_dtype))


def _value_readout(omega, ein, e_q, bf, bd, mask, x0_re, x0_im, zv, precision):
    """o_s = Re(conj(ω_s) ⊙ e^{ℓ_s})·X⁰ + Σ_j P[s,j] z_j, P[s,j] = Re Σ_m conj(ω_sm) b_m D[s,j,m]: across
    sub-chunks through E[s] F[I,j], inside a sub-chunk from the exact pairwise bD."""
    w_re, w_im = split(omega, axis=-1)
    out = carried_values(omega, ein, x0_re, x0_im, precision)
    # conj(ω) ⊙ E, stacked as [Re; −Im] so that Re(g · bF) is one real contraction over 2M
    h_re = w_re * e_q[0] + w_im * e_q[1]
    h_im = w_re * e_q[1] - w_im * e_q[0]
    n_sub = bf.shape[3]
    h = _by_sub_chunk(jnp.concatenate([h_re, -h_im], axis=-1), n_sub)
    p = _ein("bhnism,bhnijm->bhnisj", h, bf, precision=precision).reshape(*h_re.shape[:4], -1)
    # Re(conj(ω) · bD) = Re ω · Re bD + Im ω · Im bD
    p_in = (_ein("bhnism,bhnisjm->bhnisj", _by_sub_chunk(w_re, n_sub), bd[0], precision=precision)
            + _ein("bhnism,bhnisjm->bhnisj", _by_sub_chunk(w_im, n_sub), bd[1], precision=precision))
    p = jnp.where(mask, _with_diagonal_blocks(p, p_in), 0.0)
    return out + _ein("bhnsj,bhnjc->bhnsc", p, zv, precision=precision)


def _split_gain(gain_H2M):
    b_re, b_im = split(gain_H2M, axis=-1)
    return b_re[None, :, None, None, :], b_im[None, :, None, None, :]


def _scan_states(z, ein_end_coef, chunk_decay, state, gain, precision=HIGHEST):
    """Passes (i) and (ii). Returns (initial state of every chunk [B,H,N,2M,C], final state [B,H,2M,C])."""
    b_re, b_im = gain
    c_re, c_im = cmul(b_re, b_im, *ein_end_coef)  # b ⊙ D[K−1, j]   [B,H,N,K,M]
    loc = jnp.concatenate([_ein("bhnkm,bhnkc->bhnmc", c_re, z, precision=precision),
                           _ein("bhnkm,bhnkc->bhnmc", c_im, z, precision=precision)], axis=-2)
    return scan_chunk_states(loc, chunk_decay, state)


def scan_chunk_states(loc, chunk_decay, state):
    """Pass (ii): X_{n+1} = e^{ℓ_e} ⊙ X_n + X_loc,n over the chunks. ``loc`` [B,H,N,2M,C] (the chunks' local
    end states), ``chunk_decay`` (re, im) [B,H,N,M] (zero where a document starts inside the chunk), ``state``
    [B,H,2M,C]. Returns (the state before every chunk [B,H,N,2M,C], the final state)."""
    def body(x, xs):
        a_re, a_im, local = xs
        x_re, x_im = split(x)
        n_re, n_im = cmul(a_re[..., None], a_im[..., None], x_re, x_im)
        return jnp.concatenate([n_re, n_im], axis=-2) + local, x

    xs = (jnp.moveaxis(chunk_decay[0], 2, 0), jnp.moveaxis(chunk_decay[1], 2, 0), jnp.moveaxis(loc, 2, 0))
    final, starts = jax.lax.scan(body, state, xs)
    return jnp.moveaxis(starts, 0, 2), final


def prepare_chunks(arrays, r, document_BT, chunk):
    """Pad T to whole chunks and cut [B,T,H,..] arrays (and a per-token r, unless None) into [B,H,N,K,..]."""
    t = document_BT.shape[1]
    pad = (-t) % chunk
    arrays = [to_chunks(common.pad_time(x, chunk), chunk) for x in arrays]
    r = None if r is None else to_chunks(common.pad_time(r, chunk), chunk)
    doc, carry_doc = common.chunk_documents(common.pad_time(document_BT, chunk, mode="edge"), chunk)
    return arrays, r, doc, carry_doc, pad


def _padded_to_sub_chunks(arrays, k, sub):
    """Pad the chunk axis (3) of every array to a multiple of ``sub`` (zero inputs, r = 0): Kp = S·sub."""
    kp = -(-k // sub) * sub
    return [_pad_chunk_axis(x, kp) for x in arrays], kp


def interdomain_chunked(q, k, v, log_modulus, phase, gain, readout, key_state, value_state, document_BT, *,
                        chunk_size, sub_chunk_size, precision=HIGHEST):
    """Same contract as ``reference.interdomain_reference`` (all inputs in the compute dtype).
    ``sub_chunk_size`` ≤ ``chunk_size`` need not divide it (the chunk is then padded to whole sub-chunks);
    ``precision``: of the data contractions (``data_precision``)."""
    t, r_dim = q.shape[1], q.shape[-1]
    sub = min(sub_chunk_size, chunk_size)
    (qc, kc, vc), r, doc, carry_doc, pad = prepare_chunks([q, k, v], log_modulus, document_BT, chunk_size)
    g = _split_gain(gain)
    ein, eend, chunk_decay = _decays(r, phase, doc, carry_doc, pad)
    z = jnp.concatenate([kc, vc], axis=-1)
    state = jnp.concatenate([key_state, value_state], axis=-1)
    starts, final = _scan_states(z, eend, chunk_decay, state, g, precision)

    @jax.checkpoint
    def outputs(qc, kc, vc, r, ein, starts):
        k_len = qc.shape[3]
        e_q, bf, bd = _sub_chunk_factors(r, phase, gain, sub)
        (qc, kc, vc, *ein), kp = _padded_to_sub_chunks([qc, kc, vc, *ein], k_len, sub)
        mask = pair_mask(doc, kp)
        x_re, x_im = split(starts)
        # query-contracted key state a_s (complex M): carried part ...
        y_re = _ein("bhnkr,bhnmr->bhnkm", qc, x_re[..., :r_dim], precision=precision)
        y_im = _ein("bhnkr,bhnmr->bhnkm", qc, x_im[..., :r_dim], precision=precision)
        a_re, a_im = cmul(ein[0], ein[1], y_re, y_im)
        # ... plus the in-chunk part b ⊙ Σ_j Sc[s,j] D[s,j]
        scores = jnp.where(mask, _ein("bhnsr,bhnjr->bhnsj", qc, kc, precision=precision), 0.0)
        w_re, w_im = _keys_read(scores, e_q, bf, bd, precision)
        a_hat = jnp.concatenate([a_re + w_re, a_im + w_im], axis=-1)
        omega = _ein("hij,bhnkj->bhnki", readout, a_hat, precision=precision)
        o = _value_readout(omega, ein, e_q, bf, bd, mask, x_re[..., r_dim:], x_im[..., r_dim:], vc,
                           precision)
        return o[:, :, :, :k_len]

    o = from_chunks(outputs(qc, kc, vc, r, ein, starts))[:, :t]
    return o, final[..., :r_dim], final[..., r_dim:]


def chunk_start_states(inputs, states, log_modulus, phase, gain, document_BT, *, chunk_size):
    """Passes (i) and (ii) alone, for a kernel that runs pass (iii) itself. ``inputs``: the written arrays
    ([B,T,H,C_i] in the compute dtype: k̃ and ṽ, or z for S4D; T need not be a multiple of the chunk);
    ``states``: their initial states [B,H,2M,C_i]. Returns (the states before every chunk [B,H,N,2M,C_i],
    the final states [B,H,2M,C_i]), one list entry per input; differentiable (plain JAX)."""
    widths = [x.shape[-1] for x in inputs]
    chunked, r, doc, carry_doc, pad = prepare_chunks(list(inputs), log_modulus, document_BT, chunk_size)
    _, eend, chunk_decay = _decays(r, phase, doc, carry_doc, pad)
    state = jnp.concatenate(states, axis=-1)
    starts, final = _scan_states(jnp.concatenate(chunked, axis=-1), eend, chunk_decay, state, _split_gain(gain))
    cuts = [sum(widths[:i]) for i in range(len(widths) + 1)]
    return ([starts[..., a:b] for a, b in zip(cuts, cuts[1:])], [final[..., a:b] for a, b in zip(cuts, cuts[1:])])


def s4d_chunked(z, log_modulus, phase, gain, readout, state, document_BT, *, chunk_size, sub_chunk_size,
                precision=HIGHEST):
    """Same contract as ``reference.s4d_reference``; sub-chunks and ``precision`` as ``interdomain_chunked``."""
    t = z.shape[1]
    sub = min(sub_chunk_size, chunk_size)
    (zc,), r, doc, carry_doc, pad = prepare_chunks([z], log_modulus, document_BT, chunk_size)
    g = _split_gain(gain)
    ein, eend, chunk_decay = _decays(r, phase, doc, carry_doc, pad)
    starts, final = _scan_states(zc, eend, chunk_decay, state, g, precision)

    @jax.checkpoint
    def outputs(zc, r, ein, starts):
        k_len = zc.shape[3]
        e_q, bf, bd = _sub_chunk_factors(r, phase, gain, sub)
        (zc, *ein), kp = _padded_to_sub_chunks([zc, *ein], k_len, sub)
        x_re, x_im = split(starts)
        omega = jnp.broadcast_to(readout[None, :, None, None, :], (*zc.shape[:4], readout.shape[-1]))
        o = _value_readout(omega, ein, e_q, bf, bd, pair_mask(doc, kp), x_re, x_im, zc, precision)
        return o[:, :, :, :k_len]

    o = from_chunks(outputs(zc, r, ein, starts))[:, :t]
    return o, final
