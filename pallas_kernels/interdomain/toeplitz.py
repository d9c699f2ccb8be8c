"""Interdomain / S4D with a static decay: the chunked form as GEMMs against one table of decays per head
(docs/math/interdomain.md, 'Static decay: the Toeplitz form'), real arithmetic only.

Without selective decay (the IA paper's language-model runs, and the S4D-only baseline) log Λ_m = r_m + iθ_m
is the same for every token. Then the decay from token j to token s of a chunk depends only on the lag s − j,

    D[s, j, m] = Λ_m^{s−j} = exp((s−j) r_m) e^{i(s−j)θ_m}         (s ≥ j, same document)

so one table T[l] = b ⊙ Λ^l (l = 0..K−1, [K, 2M] per head) serves every chunk and every row of the batch.
Re-indexing each query's row of a K×K matrix from key position j to lag l = s − j (``skew``, a copy) turns the
chunk-local sums of pass (iii) (``xla.py``'s module doc) into plain GEMMs against T, with all B·T tokens as
rows:

    â_s    = e^{ℓ_s} ⊙ (X̂ᵏ₀ ξq_s) + Σ_l skew(Sc)[s,l] T[l]          [B·T, K] · [K, 2M]   per head
    P      = skew(P̃),  P̃[s,l] = Re Σ_m conj(ω_s,m) T[l]_m            [B·T, 2M] · [2M, K]  per head
    o_s    = Re(conj(ω_s) ⊙ e^{ℓ_s})ᵀ X̂ᵛ₀ + Σ_j P[s,j] ṽ_j

The per-token decay tensors of the selective form (K·M or more floats per token, written and read by every
elementwise step) do not exist. Passes (i) and (ii) use the same table: a chunk's end coefficients are T read
backwards from its end e (its last token; in a padded last chunk, its last real token), its decay Λ^K
(Λ^{e+1} for the last chunk).

GEMM operands: the op upcasts q, k, v to float32 and runs every data GEMM at ``precision`` (TF32 on a GPU for
16-bit inputs). With ``operand_dtype`` (the implementation ``toeplitz_16bit``, for 16-bit inputs) q, k, v stay
in their dtype and every data GEMM but the transfer-matrix one rounds both operands to it, accumulating in
float32 (``xla.gemm``), forward and backward (the cotangent too): bf16 tensor cores and half the operand
bytes, the rounding the delta-rule GPU kernels apply to their own operands. The chunk-to-chunk state transfer
(``_states_by_gemm``) keeps float32 operands: its result is every chunk's starting state.

Numerics: every exponent is an integer lag times r ≤ 0 — one rounding, no difference of sums, no overflow
for any r ≤ 0 — and every phase an integer lag times θ, as in the selective form. Gradients: autodiff of
this form (plain XLA); T's cotangent is one GEMM reduction over all tokens and reaches r and θ through the
exp/cos/sin that built it.
"""
from __future__ import annotations

import jax.numpy as jnp

from mixerlab.pallas_kernels.interdomain import xla
from mixerlab.pallas_kernels.interdomain.decode import HIGHEST, split

# Pass (ii) as GEMMs up to this many chunks (the transfer matrices are N × N per row, head and mode), the serial
# scan beyond.
MAX_GEMM_CHUNKS = 64


def supports(call) -> str | None:
    """None if the Toeplitz form can run the call, else the reason (for ``dispatch``)."""
    if call.selective:
        return "the log-modulus varies per token (selective decay); the Toeplitz form needs a static [H, M] one"
    return None


def _powers(r_HM, theta_HM, lags):
    """Λ^lag per head and mode for a float vector of integer ``lags`` ≥ 0: (re, im), each [H, len(lags), M]."""
    lag = lags[None, :, None]
    return xla.polar(jnp.exp(lag * r_HM[:, None, :]), lag * theta_HM[:, None, :])


def lag_table(r_HM, theta_HM, gain_H2M, chunk):
    """b ⊙ Λ^l for the lags l = 0..K−1: [H, K, 2M], stacked [Re | Im] on the last axis."""
    d_re, d_im = _powers(r_HM, theta_HM, jnp.arange(chunk, dtype=r_HM.dtype))
    b_re, b_im = split(gain_H2M, axis=-1)
    return jnp.concatenate(xla.cmul(b_re[:, None, :], b_im[:, None, :], d_re, d_im), axis=-1)


def skew(x):
    """out[..., s, l] = x[..., s, s − l] for l ≤ s and 0 for l > s, over the last two axes [K, K]: a query's
    row re-indexed from key position j to lag s − j. It is its own inverse on lower-triangular matrices. Pads,
    a reversal and reshapes (one copy), no gather: row s of the reversed, left-padded [K, 2K] matrix read with
    a row stride of 2K − 1 starts s entries later."""
    k = x.shape[-1]
    lead = x.shape[:-2]
    padded = jnp.pad(x, [(0, 0)] * len(lead) + [(0, 0), (k, 0)])[..., ::-1]  # [s, c] = x[s, K − 1 − c], 0 for c ≥ K
    flat = padded.reshape(*lead, 2 * k * k)[..., : k * (2 * k - 1)]
    return flat.reshape(*lead, k, 2 * k - 1)[..., k - 1:]


def _chunk_states(z_BHNKC, table, r_HM, theta_HM, doc, carry_doc, pad, state, precision, max_gemm_chunks,
                  operand_dtype=None):
    """Passes (i) and (ii): (the state before every chunk [B,H,N,2M,C], the final state [B,H,2M,C]). Pass (ii)
    as GEMMs (``_states_by_gemm``) up to ``max_gemm_chunks`` chunks, else the serial scan."""
    k = z_BHNKC.shape[3]
    end = k - 1 - pad
    # only the tokens of the chunk's last document reach its end
    z = jnp.where((doc == doc[..., -1:])[:, None, :, :, None], z_BHNKC, 0.0)
    # token j reaches the end e with lag e − j: the table read backwards
    loc = xla.gemm("hjm,bhnjc->bhnmc", table[:, ::-1], z, precision, operand_dtype)
    if pad:  # the last chunk ends at its last real token e (its padded tokens carry no input)
        last = xla.gemm("hjm,bhjc->bhmc", table[:, end::-1], z[:, :, -1, : end + 1], precision, operand_dtype)
        loc = loc.at[:, :, -1].set(last)
    n = z.shape[2]
    keep = doc[..., -1] == carry_doc  # [B, N]: no document starts inside the chunk
    steps = jnp.full((n,), float(k), r_HM.dtype).at[-1].set(end + 1.0)
    dec_re, dec_im = _powers(r_HM, theta_HM, steps)  # [H, N, M]
    decay = tuple(jnp.where(keep[:, None, :, None], d[None], 0.0) for d in (dec_re, dec_im))
    if n > max_gemm_chunks:
        return xla.scan_chunk_states(loc, decay, state)
    starts = _states_by_gemm(loc, state, r_HM, theta_HM, keep, k, precision)
    last_re, last_im = split(starts[:, :, -1])
    final = jnp.concatenate(xla.cmul(decay[0][:, :, -1, :, None], decay[1][:, :, -1, :, None], last_re, last_im),
                            axis=-2) + loc[:, :, -1]
    return starts, final


def _states_by_gemm(loc, state, r_HM, theta_HM, keep, k, precision):
    """Pass (ii) without a serial loop: the state before chunk n is Σ_{i<n} Λ^{K(n−1−i)} ⊙ X_loc,i plus
    Λ^{Kn} ⊙ X₀, each term only while no document starts in a chunk in between. Per (row, head, mode) that is
    one real GEMM [2N, 2N] · [2N, C] (the complex [N, N] transfer matrix as a 2×2 real block), exact like the
    scan: every power is an integer lag times r and θ. Work and memory grow as N², hence ``max_gemm_chunks``."""
    b, h, n, m2, c = loc.shape
    m = m2 // 2
    resets = jnp.cumsum(~keep, axis=1)  # [B, N]: documents started inside chunks 0..n
    before = jnp.concatenate([jnp.zeros_like(resets[:, :1]), resets[:, :-1]], axis=1)  # ... inside chunks 0..n−1
    idx = jnp.arange(n)
    reach = (idx[:, None] > idx[None, :]) & (before[:, :, None] == resets[:, None, :])  # [B, n, i]
    lags = (jnp.maximum(idx[:, None] - 1 - idx[None, :], 0) * k).astype(r_HM.dtype)  # [n, i]
    t_re, t_im = (jnp.moveaxis(x.reshape(h, n, n, m), 3, 1) for x in _powers(r_HM, theta_HM, lags.reshape(-1)))
    mask = reach[:, None, None]  # [B, 1, 1, n, i]
    t_re, t_im = jnp.where(mask, t_re[None], 0.0), jnp.where(mask, t_im[None], 0.0)  # [B, H, M, n, i]
    block = jnp.concatenate([jnp.concatenate([t_re, -t_im], axis=-1), jnp.concatenate([t_im, t_re], axis=-1)],
                            axis=-2)  # [B, H, M, 2n, 2i]
    by_mode = jnp.moveaxis(loc.reshape(b, h, n, 2, m, c), (3, 2), (3, 4)).reshape(b, h, m, 2 * n, c)
    starts = jnp.einsum("bhmij,bhmjc->bhmic", block, by_mode, precision=precision)
    starts = jnp.moveaxis(starts.reshape(b, h, m, 2, n, c), (3, 4), (3, 2)).reshape(b, h, n, m2, c)
    # the initial state: Λ^{Kn} while no document has started before chunk n
    i_re, i_im = _powers(r_HM, theta_HM, (idx * k).astype(r_HM.dtype))  # [H, N, M]
    first = (before == 0)[:, None, :, None]
    i_re, i_im = jnp.where(first, i_re[None], 0.0), jnp.where(first, i_im[None], 0.0)  # [B, H, N, M]
    x_re, x_im = split(state)  # [B, H, M, C]
    carried = xla.cmul(i_re[..., None], i_im[..., None], x_re[:, :, None], x_im[:, :, None])
    return starts + jnp.concatenate(carried, axis=-2)


def _carry_in(r_HM, theta_HM, doc, carry_doc, k):
    """e^{ℓ_s} = Λ^{s+1} (state before the chunk -> token s), zero outside the carried document: (re, im)
    [B,H,N,K,M]."""
    e_re, e_im = _powers(r_HM, theta_HM, jnp.arange(1, k + 1, dtype=r_HM.dtype))  # [H, K, M]
    carried = (doc == carry_doc[..., None])[:, None, :, :, None]
    return jnp.where(carried, e_re[None, :, None], 0.0), jnp.where(carried, e_im[None, :, None], 0.0)


def interdomain_toeplitz(q, k, v, log_modulus, phase, gain, readout, key_state, value_state, document_BT, *,
                         chunk_size, precision=HIGHEST, max_gemm_chunks=MAX_GEMM_CHUNKS, operand_dtype=None):
    """``reference.interdomain_reference``'s contract with a static ``log_modulus`` [H, M] (everything but q, k, v
    in the compute dtype; ``precision``: of the data contractions, ``xla.data_precision``; ``operand_dtype``:
    their operands rounded to it instead, the module docstring)."""
    t, r_dim = q.shape[1], q.shape[-1]
    (qc, kc, vc), _, doc, carry_doc, pad = xla.prepare_chunks([q, k, v], None, document_BT, chunk_size)
    table = lag_table(log_modulus, phase, gain, chunk_size)
    state = jnp.concatenate([key_state, value_state], axis=-1)
    starts, final = _chunk_states(jnp.concatenate([kc, vc], axis=-1), table, log_modulus, phase, doc, carry_doc,
                                  pad, state, precision, max_gemm_chunks, operand_dtype)
    x_re, x_im = split(starts)
    ein = _carry_in(log_modulus, phase, doc, carry_doc, chunk_size)
    mask = xla.pair_mask(doc, chunk_size)
    # â_s: the carried key state read by the query, plus the in-chunk keys through the table
    y_re = xla.gemm("bhnkr,bhnmr->bhnkm", qc, x_re[..., :r_dim], precision, operand_dtype)
    y_im = xla.gemm("bhnkr,bhnmr->bhnkm", qc, x_im[..., :r_dim], precision, operand_dtype)
    a_re, a_im = xla.cmul(ein[0], ein[1], y_re, y_im)
    scores = jnp.where(mask, xla.gemm("bhnsr,bhnjr->bhnsj", qc, kc, precision, operand_dtype), 0.0)
    # the per-head table and readout broadcast over the batch: GEMMs batched over (row, head) need no transpose
    # of the [B, H, ...] operands (batched over the head alone, XLA moves H in front first)
    per_row = lambda x: jnp.broadcast_to(x[None], (qc.shape[0], *x.shape))  # noqa: E731
    table_b = per_row(table)
    by_lag = xla.gemm("bhnsl,bhlm->bhnsm", skew(scores), table_b, precision, operand_dtype)
    a_hat = jnp.concatenate([a_re, a_im], axis=-1) + by_lag
    omega = xla.gemm("bhij,bhnkj->bhnki", per_row(readout), a_hat, precision, operand_dtype)
    # P[s, j] = Re Σ_m conj(ω_sm) (b Λ^{s−j})_m = ω_re·T_re + ω_im·T_im at lag s − j: one contraction over the
    # stacked 2M per lag, then back from lags to key positions
    p_lag = xla.gemm("bhnsm,bhlm->bhnsl", omega, table_b, precision, operand_dtype)
    p = jnp.where(mask, skew(p_lag), 0.0)
    o = (xla.gemm("bhnsj,bhnjc->bhnsc", p, vc, precision, operand_dtype)
         + xla.carried_values(omega, ein, x_re[..., r_dim:], x_im[..., r_dim:], precision, operand_dtype))
    return xla.from_chunks(o)[:, :t], final[..., :r_dim], final[..., r_dim:]


def s4d_toeplitz(z, log_modulus, phase, gain, readout, state, document_BT, *, chunk_size, precision=HIGHEST,
                 max_gemm_chunks=MAX_GEMM_CHUNKS, operand_dtype=None):
    """``reference.s4d_reference``'s contract with a static ``log_modulus`` [H, M]: with a fixed readout ω per
    head, P = Re(conj(ω) · table) is one [K, K] matrix per head (``operand_dtype``: as ``interdomain_toeplitz``)."""
    t = z.shape[1]
    (zc,), _, doc, carry_doc, pad = xla.prepare_chunks([z], None, document_BT, chunk_size)
    table = lag_table(log_modulus, phase, gain, chunk_size)
    starts, final = _chunk_states(zc, table, log_modulus, phase, doc, carry_doc, pad, state, precision,
                                  max_gemm_chunks, operand_dtype)
    x_re, x_im = split(starts)
    ein = _carry_in(log_modulus, phase, doc, carry_doc, chunk_size)
    p_lag = jnp.einsum("hm,hlm->hl", readout, table, precision=HIGHEST)  # the same for every query
    p_head = skew(jnp.broadcast_to(p_lag[:, None, :], (*p_lag.shape[:1], chunk_size, chunk_size)))
    p = jnp.where(xla.pair_mask(doc, chunk_size), p_head[None, :, None], 0.0)
    omega = readout[None, :, None, None, :]
    o = (xla.gemm("bhnsj,bhnjc->bhnsc", p, zc, precision, operand_dtype)
         + xla.carried_values(omega, ein, x_re, x_im, precision, operand_dtype))
    return xla.from_chunks(o)[:, :t], final
