"""Chunkwise VLA in pure JAX (docs/math/vla.md, 'Chunked A-pass', 'S-pass as a delta rule'): Woodbury–Cholesky A-pass,
then the S-pass.

**A-pass.** ``A`` does not depend on ``S``, so all α̂_t are computed first, chunk by chunk (serial over
chunks on the d×d state, parallel inside a chunk). For a chunk whose rows are ``U`` (c×d) and ``K̂`` with
start state ``A₀``:

    L = chol(I_c + U A₀ Uᵀ);   W = L⁻¹ (U A₀)            rows w_s,  A_t = A₀ − Σ_{s≤t} w_sᵀ w_s
    G = K̂ A₀ − tril(K̂ Wᵀ) W                             row t = k̂_t A_t  (tril includes the diagonal)
    α̂ = G / max(rownorm G, ε);    A_end = A₀ − Wᵀ W  (+ ρ I if the last token refreshes)

(the Cholesky factors are nested, so one c×c factorisation serves every prefix of the chunk).

Documents and refreshes inside a chunk split it into *pieces* that share a start matrix ("base"):
  * the carried document (the one of the chunk's first token) before its refresh point: base A₀ (I/λ₀ if
    that document starts exactly at the chunk's first token);
  * the carried document after its refresh point r:  base B₂ = A_r + ρI = A₀ + ρI − W₁ᵀW₁ (W₁ = the rows of
    the first piece, from a first, smaller Cholesky pass);
  * every document that starts inside the chunk: base I/λ₀.
With ``chunk_size ≤ refresh_period − refresh_offset`` the carried document refreshes at most once in a chunk
and a document that starts inside a chunk never does, so these three kinds of piece are all there is. The
Gram matrix is block-diagonal over pieces (cross-piece pairs masked), which keeps the nesting property; so
one Cholesky of the masked ``I + [u_i · base u_j]`` gives every α̂ in the chunk exactly.

**S-pass.** Given α̂, ``S_t = S_{t−1} + α̂_tᵀ (v_t − k̂_t S_{t−1})`` is the delta rule with write key α̂ and
erase/read key k̂ (the generalised/DPLR delta rule, UT/WY chunk form; docs/math/vla.md), which is exactly
``pallas_kernels.delta_rule(q, α̂, v, erase_key=k̂)``; its chunkwise ``xla`` implementation (with its own
custom VJP, segment resets and initial state) is reused as is.

**Gradients.** The A-pass is differentiated by JAX autodiff through the Cholesky factorisation and the triangular
solve (``small_linalg``: loops on CPU, where jaxlib's LAPACK Cholesky can deadlock XLA's thread pool), with
``jax.checkpoint`` on the per-chunk body (only the d×d chunk-boundary states are saved).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from mixerlab.pallas_kernels.vla.reference import floored_norm
from mixerlab.pallas_kernels.vla.small_linalg import cholesky, solve_lower

_HIGHEST = jax.lax.Precision.HIGHEST


def _mm(spec, *ops):
    return jnp.einsum(spec, *ops, precision=_HIGHEST)


def _chunk_body(A0, chunk, *, lambda0, refresh_magnitude, eps, normalize_write_direction=True):
    """One chunk, all (B, H) at once. A0 [B,H,K,K]; chunk = (k_hat, u [B,H,c,K], doc [B,c] int,
    refresh [B,c] bool, starts_document [B] bool). Returns (A_end, G-normalised α̂ [B,H,c,K])."""
    k_hat, u, doc, refresh, starts_document = chunk
    dtype = A0.dtype
    c, dk = u.shape[-2], u.shape[-1]
    eye_c = jnp.eye(c, dtype=dtype)
    eye_k = jnp.eye(dk, dtype=dtype)
    # a document that starts exactly at the chunk's first token is the chunk's "carried" document, from I/λ₀
    A0 = jnp.where(starts_document[:, None, None, None], eye_k / lambda0, A0)
    carry_doc = doc[:, 0]

    f = refresh.astype(jnp.int32)
    cnt = jnp.cumsum(f, axis=1) - f                       # refreshes strictly before i (0 or 1)  [B,c]
    total = jnp.sum(f, axis=1)                            # [B]
    carried = doc == carry_doc[:, None]                   # [B,c]
    piece1 = carried & (cnt == 0)
    piece2 = carried & (cnt == 1)
    same = (doc[:, :, None] == doc[:, None, :]) & (cnt[:, :, None] == cnt[:, None, :])   # [B,c,c]
    col = lambda m: m[:, None, :, None]                   # [B,c] -> [B,1,c,1]  # noqa: E731
    mat = lambda m: m[:, None, :, :]                      # [B,c,c] -> [B,1,c,c]  # noqa: E731

    AU = _mm("bhck,bhkj->bhcj", u, A0)                    # rows u_j A₀ (A₀ symmetric)
    AK = _mm("bhck,bhkj->bhcj", k_hat, A0)

    # stage 1: first piece (carried document up to and including its refresh point)
    X1 = jnp.where(col(piece1), AU, 0.0)
    M1 = jnp.where(mat(piece1[:, :, None] & piece1[:, None, :]), _mm("bhik,bhjk->bhij", u, X1), 0.0)
    L1 = cholesky(eye_c + 0.5 * (M1 + jnp.swapaxes(M1, -1, -2)))
    W1 = solve_lower(L1, X1)                              # zero rows outside piece 1
    BU2 = AU + refresh_magnitude * u - _mm("bhij,bhjk->bhik", _mm("bhik,bhjk->bhij", u, W1), W1)
    BK2 = AK + refresh_magnitude * k_hat - _mm("bhij,bhjk->bhik", _mm("bhik,bhjk->bhij", k_hat, W1), W1)

    # stage 2: every piece, block-diagonal Gram matrix
    X = jnp.where(col(piece1), AU, jnp.where(col(piece2), BU2, u / lambda0))
    Y = jnp.where(col(piece1), AK, jnp.where(col(piece2), BK2, k_hat / lambda0))
    M = jnp.where(mat(same), _mm("bhik,bhjk->bhij", u, X), 0.0)
    L = cholesky(eye_c + 0.5 * (M + jnp.swapaxes(M, -1, -2)))
    W = solve_lower(L, X)
    causal_same = same & jnp.tril(jnp.ones((c, c), bool))[None]
    KW = jnp.where(mat(causal_same), _mm("bhik,bhjk->bhij", k_hat, W), 0.0)
    G = Y - _mm("bhij,bhjk->bhik", KW, W)
    alpha = G / floored_norm(G, eps) if normalize_write_direction else G

    # state after the chunk: base of the last token's piece minus that piece's rank-1 terms
    end_doc = doc[:, -1]
    in_end = (doc == end_doc[:, None]) & (cnt == total[:, None])
    B2 = A0 + refresh_magnitude * eye_k - _mm("bhck,bhcj->bhkj", W1, W1)
    base = jnp.where((carried[:, -1] & (total > 0))[:, None, None, None], B2,
                     jnp.where(carried[:, -1][:, None, None, None], A0, eye_k / lambda0))
    We = jnp.where(col(in_end), W, 0.0)
    A_end = base - _mm("bhck,bhcj->bhkj", We, W)
    return 0.5 * (A_end + jnp.swapaxes(A_end, -1, -2)), alpha


def penalty_pass(k_hat_BTHK, u_BTHK, penalty_BHKK, document_BT, refresh_BT, *, chunk_size, lambda0,
                 refresh_magnitude, eps, normalize_write_direction=True, checkpoint=True):
    """All α̂_t [B,T,H,K] and the final A [B,H,K,K], chunk by chunk (serial ``lax.scan`` over T/c chunks).

    ``document_BT`` = running count of boundaries; ``refresh_BT`` = refresh after token t. Requires that a
    chunk holds at most one refresh, of the carried document only (``api`` checks chunk_size against the
    refresh period and offset)."""
    b, t, h, dk = k_hat_BTHK.shape
    c = chunk_size
    n = -(-t // c)
    pad = n * c - t

    def chunks(x):  # [B,T,H,K] -> [N,B,H,c,K], zero padding (u = k̂ = 0 rows change nothing)
        x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
        return jnp.transpose(x.reshape(b, n, c, h, dk), (1, 0, 3, 2, 4))

    doc = jnp.pad(document_BT, ((0, 0), (0, pad)), mode="edge").reshape(b, n, c)
    ref = jnp.pad(refresh_BT, ((0, 0), (0, pad))).reshape(b, n, c)   # padded tokens never refresh
    prev_doc = jnp.concatenate([jnp.zeros((b, 1), doc.dtype), doc[:, :-1, -1]], axis=1)
    starts_document = doc[:, :, 0] != prev_doc                       # [B, N]
    xs = (chunks(k_hat_BTHK), chunks(u_BTHK), jnp.moveaxis(doc, 1, 0), jnp.moveaxis(ref, 1, 0),
          jnp.moveaxis(starts_document, 1, 0))

    def body(A0, chunk):
        return _chunk_body(A0, chunk, lambda0=lambda0, refresh_magnitude=refresh_magnitude, eps=eps,
                           normalize_write_direction=normalize_write_direction)

    if checkpoint:
        body = jax.checkpoint(body)
    A_end, alpha_NBHcK = jax.lax.scan(body, penalty_BHKK, xs)
    alpha = jnp.transpose(alpha_NBHcK, (1, 0, 3, 2, 4)).reshape(b, n * c, h, dk)[:, :t]
    return alpha, A_end
