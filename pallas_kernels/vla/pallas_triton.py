"""VLA A-pass on GPU through Pallas' Triton backend: every write direction α̂_t and the final penalty inverse,
forward and custom-VJP backward (docs/math/vla.md, 'Recurrence' and 'Gradients'; design: docs/kernels_gpu.md).

Token-level Sherman–Morrison, one program per (batch row, head), the d×d f32 penalty inverse A held on chip
for the whole sequence (d = 64: a 16 KB tile):

    A ← I/λ₀ at a document start;   w = A u;   δ = 1 + u·w;   ŵ = w / √δ;   A ← A − ŵ ŵᵀ
    g = A k̂;   A ← A + ρ I after a refresh token;      then in XLA: α̂ = g / max(‖g‖, ε)

(A stays exactly symmetric in floating point: the symmetric start is updated by ŵ ŵᵀ, whose (i, j) and
(j, i) entries are the same product, so the reference's explicit symmetrisation is a no-op here.)

Forward kernel (grid (B, H)): serial over the tokens; writes g_t and ŵ_t (both [B, T, H, d] f32), the
final A, and A at the start of every ``anchor_every`` tokens ("anchors", [B, H, N + 1, d, d] f32, the last
one the final A) for the backward. The normalisation α̂ = g / max(‖g‖, ε) is left to XLA (autodiff of it is
cheap and parallel), which keeps two reductions per token off the kernels' serial path.

Chunked forward (``Config.forward="chunked"``, opt-in: slower than the token forward on the H200): the same
outputs from chunks of at most ``chunk_rows`` tokens that share a start matrix, through a c × c factorisation
and f32 dots (``_chunked_forward_kernel``; docs/kernels_gpu.md, 'Chunked forward').

Backward kernel (grid (B, H)): reverse over the anchor chunks, each from its end anchor, reverse over its
tokens. It walks A backwards exactly as the forward subtracted it: A_{t−1} = A_t − ρ_t I + ŵ_t ŵ_tᵀ (the
same stored ŵ_t, so only rounding separates it from the forward's A; the anchors bound that to one chunk).
Across a document start inside a chunk (A_{t−1} belongs to the previous document and cannot be rebuilt
backwards) it replays the chunk's rank-1 updates forwards from the chunk's start anchor. The adjoint of one
token (derived in docs/math/vla.md, 'Gradients') takes dg_t, carries the symmetric cotangent Ā and gives
dk̂_t, du_t and at the end dA₀.

Split forward (``Config.forward="split"``, opt-in until it is timed): g_t = A_t k̂_t hangs off the chain, so the
token kernel leaves it out and ``_readout_kernel`` (grid (B, H, anchor blocks)) forms it afterwards, replaying A
through each block from its start anchor with the token kernel's own operations on the stored ŵ.

Split backward (``Config.backward="split"``, opt-in until it is timed): the cotangent Ā's recurrence needs no A
(ȳ = Ā ŵ + ..., δ̄, w̄ and Ā's update read only the stored ŵ and the inputs), so pass 1 (grid (B, H),
``_adjoint_kernel``) carries Ā alone through the tokens in reverse, writes w̄_t and du's first term, and ends
with dA₀; pass 2 (grid (B, H, anchor blocks), ``_replay_kernel``) rebuilds A forwards through each block from its
start anchor, as the forward built it, for the two products that need it: dk̂_t = A_t dg_t and
du_t += A_{t−1} w̄_t. The serial pass loses the A tile, its rebuild, its two matrix-vector products and the
replays at document starts; the replays run as 64× as many short programs.

Per-token vectors (k̂, u, ŵ, dg) are loaded one token ahead (carried in the loop) so the load latency
overlaps the previous token's arithmetic; matrix-vector products are broadcast-multiplies with a row
reduction (2-D tiles, 1-D vectors; no tl.dot: the products are d×1).

The inputs k̂ and u arrive unit-normalised (the normalisation stays in XLA) and float32; all state and
accumulation is float32. A must be symmetric positive definite (the op checks the caller's A₀), so
1 + u·Au ≥ 1 and the ε floor of δ never binds; the backward relies on that.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from mixerlab.pallas_kernels import common
from mixerlab.pallas_kernels.vla import penalty_vjp
from mixerlab.pallas_kernels.vla.penalty_vjp import REFRESH, RESET, token_flags  # noqa: F401 (token_flags: public)
from mixerlab.pallas_kernels.vla.reference import floored_norm
from mixerlab.pallas_kernels.triton_common import compiler_params, iota, pow2, unavailable


F32 = jnp.float32
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128  # a d×d f32 tile per program: 64 KB at d = 128 already spills
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# ---------------------------------------------------------------------------------------------------------
# configuration


@dataclasses.dataclass(frozen=True)
class Config:
    key_dim: int
    lambda0: float
    refresh_magnitude: float
    anchor_every: int = 64  # tokens per saved A (backward memory N·d²·4 bytes per head; rebuild error ∝ it)
    warps_forward: int = 4
    warps_backward: int = 4  # the fastest on the H200 (--sweep-warps), though ~4 d×d tiles stay live
    forward: str = "token"  # "token": one Sherman–Morrison step per token; "chunked": Woodbury per chunk; "split":
    # the token steps without g, then g read out per anchor block (below)
    backward: str = "token"  # "token": one kernel; "split": the Ā scan, then A replayed per anchor block (below)
    chunk_rows: int = 32  # "chunked": tile rows, the longest chunk (chunks also end at refreshes and documents)
    interpret: bool = False


def make_config(key_dim, *, lambda0, refresh_magnitude, interpret=False, **overrides):
    cfg = Config(key_dim=key_dim, lambda0=float(lambda0), refresh_magnitude=float(refresh_magnitude),
                 interpret=interpret, **overrides)
    if not pow2(cfg.anchor_every):
        raise ValueError(f"vla pallas_triton: anchor_every={cfg.anchor_every}; expected a power of two")
    if cfg.forward not in ("token", "chunked", "split"):
        raise ValueError(f"vla pallas_triton: forward={cfg.forward!r}; expected 'token', 'chunked' or 'split'")
    if cfg.backward not in ("token", "split"):
        raise ValueError(f"vla pallas_triton: backward={cfg.backward!r}; expected 'token' or 'split'")
    if not pow2(cfg.chunk_rows) or cfg.chunk_rows < 16:
        raise ValueError(f"vla pallas_triton: chunk_rows={cfg.chunk_rows}; expected a power of two >= 16")
    return cfg


def supports(call) -> Optional[str]:
    """``None`` when this kernel can serve ``call`` (an ``api.VLACall``), else the reason."""
    reason = unavailable(getattr(call, "backend", None))
    if reason:
        return reason
    if not pow2(call.key_dim) or not MIN_HEAD_DIM <= call.key_dim <= MAX_HEAD_DIM:
        return f"key_dim={call.key_dim}: needs a power of two in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]"
    if jnp.dtype(call.dtype) not in DTYPES:
        return f"dtype {jnp.dtype(call.dtype).name} not supported (float32, bfloat16, float16)"
    return None


# ---------------------------------------------------------------------------------------------------------
# in-kernel helpers (traced inside the kernels; only ops with Triton lowerings)


def _eye(d):
    rows = iota((d, d), 0)
    cols = iota((d, d), 1)
    return jnp.where(rows == cols, 1.0, 0.0).astype(F32)


def _matvec(a, x):
    """a x for a symmetric [d, d] tile and a [d] vector (a row reduction)."""
    return jnp.sum(a * x[None, :], axis=1)


def _outer(x, y):
    return x[:, None] * y[None, :]


def _flag(flags, bit):
    return jnp.bitwise_and(flags, bit) != 0


def _bit(flags, bit):
    """The flag as a float32 0 or 1 (integer arithmetic: Triton's lowering cannot multiply a bool scalar
    broadcast to a tile)."""
    return (jnp.bitwise_and(flags, bit) // bit).astype(F32)


def _rank1_factor(a, u):
    """ŵ = A u / √(1 + u·A u): the Sherman–Morrison update is A − ŵ ŵᵀ."""
    w = _matvec(a, u)
    return w / jnp.sqrt(1.0 + jnp.sum(u * w))


def _adjoint_directions(d_a, k_hat, u, factor, d_g):
    """One token of the cotangent recurrence (docs/math/vla.md, 'Gradients'), which needs no A, first half: from
    Ā (the cotangent of A after the token's rank-1 update) and the token's k̂, u, stored ŵ and dg, w̄ and du's
    first term δ̄ √δ ŵ."""
    # Sherman–Morrison: A = A_prev − w wᵀ/δ with w = √δ ŵ, δ = 1 + u·w, so u·ŵ = (δ − 1)/√δ
    cu = jnp.sum(u * factor)
    root = 0.5 * (cu + jnp.sqrt(cu * cu + 4.0))                        # √δ
    # with B̄ = Ā + sym(dg k̂ᵀ) (g = A k̂): B̄ ŵ = Ā ŵ + (dg (k̂·ŵ) + k̂ (dg·ŵ))/2 without forming B̄ (the two dots
    # are off Ā's chain)
    y = _matvec(d_a, factor) + 0.5 * (d_g * jnp.sum(k_hat * factor) + k_hat * jnp.sum(d_g * factor))
    d_delta = jnp.sum(factor * y) / (root * root)                      # ŵᵀB̄ŵ / δ
    return -2.0 * y / root + d_delta * u, d_delta * root * factor


def _adjoint_update(d_a, k_hat, u, d_g, d_w):
    """Second half: Ā before the token's update (a document start's reset is the caller's)."""
    # Ā_{t−1} = Ā + sym(dg k̂ᵀ + dw uᵀ) = Ā + sym((dw + dg) k̂ᵀ + dw (u − k̂)ᵀ): every outer product has dw, a
    # reduction result, on one side, so Triton keeps the tile in the layout of Ā instead of building dg k̂ᵀ (two
    # loaded vectors) in another layout and converting the whole d×d tile
    left = d_w + d_g
    right = u - k_hat
    return d_a + 0.5 * (_outer(left, k_hat) + _outer(k_hat, left) + _outer(d_w, right) + _outer(right, d_w))


def _row(ref, t):
    return ref[t, :].astype(F32)


# ---------------------------------------------------------------------------------------------------------
# kernels


def _forward_kernel(cfg, n_chunks, readout=True):
    """The token steps; ``readout=False`` (the split forward): without g = A k̂, which ``_readout_kernel`` forms
    afterwards from the anchors and the stored ŵ, off this kernel's serial chain."""
    c, d = cfg.anchor_every, cfg.key_dim
    n_tokens = n_chunks * c

    def kernel(k_ref, u_ref, flags_ref, a0_ref, *outs):
        g_out, factor_out, anchors_out, a_final_out = outs if readout else (None, *outs)
        eye = _eye(d)

        def token(j, carry, n):
            a, k_hat, u, flags = carry
            t = n * c + j
            ahead = jnp.minimum(t + 1, n_tokens - 1)  # next token's inputs, loaded while this one computes
            nxt = (_row(k_ref, ahead) if readout else k_hat, _row(u_ref, ahead), flags_ref[ahead])
            a = jnp.where(_flag(flags, RESET), eye * (1.0 / cfg.lambda0), a)
            factor = _rank1_factor(a, u)
            a = a - _outer(factor, factor)
            if readout:
                g_out[t, :] = _matvec(a, k_hat)
            factor_out[t, :] = factor
            a = a + (cfg.refresh_magnitude * _bit(flags, REFRESH)) * eye
            return (a, *nxt)

        def chunk(n, carry):
            anchors_out[n] = carry[0]
            return jax.lax.fori_loop(0, c, functools.partial(token, n=n), carry)

        k0 = _row(k_ref, 0) if readout else jnp.zeros((d,), F32)
        first = (a0_ref[...].astype(F32), k0, _row(u_ref, 0), flags_ref[0])
        a = jax.lax.fori_loop(0, n_chunks, chunk, first)[0]
        anchors_out[n_chunks] = a
        a_final_out[...] = a

    return kernel


def _replay_block(cfg, anchor_ref, flags_ref, factor_ref, before_update, after_update):
    """A forwards through one anchor block from the block's start anchor, with the token kernel's own operations
    on the stored ŵ; at token j, ``before_update(j, A)`` sees A before the rank-1 update (after a reset) and
    ``after_update(j, A)`` A after it (before ρI). The split kernels' second passes."""
    eye = _eye(cfg.key_dim)

    def token(j, a):
        flags = flags_ref[j]
        factor = _row(factor_ref, j)
        a = jnp.where(_flag(flags, RESET), eye * (1.0 / cfg.lambda0), a)
        before_update(j, a)
        a = a - _outer(factor, factor)
        after_update(j, a)
        return a + (cfg.refresh_magnitude * _bit(flags, REFRESH)) * eye

    jax.lax.fori_loop(0, cfg.anchor_every, token, anchor_ref[...].astype(F32))


def _readout_kernel(cfg):
    """Split forward, second kernel: one anchor block replayed (``_replay_block``), g_t = A_t k̂_t."""

    def kernel(k_ref, factor_ref, flags_ref, anchor_ref, g_out):
        def readout(j, a):
            g_out[j, :] = _matvec(a, _row(k_ref, j))

        _replay_block(cfg, anchor_ref, flags_ref, factor_ref, lambda j, a: None, readout)

    return kernel


def _chunked_forward_kernel(cfg, n_chunks):
    """The forward kernel's outputs by chunks instead of tokens (docs/kernels_gpu.md, 'Chunked forward').

    A chunk is at most ``chunk_rows`` tokens that share one start matrix A₀: it ends after a refresh token,
    before a document start and at an anchor boundary. For its rows U, K̂ (padding rows zero):

        X = U A₀,  Y = K̂ A₀,  G = I + U Xᵀ = L D Lᵀ  (c × c, SPD, every pivot ≥ 1)
        Ŵ = D^{-1/2} L^{-1} X      row t = ŵ_t, exactly the token form's factor
        g_t = Y_t − Σ_{s≤t} (k̂_t·ŵ_s) ŵ_s,      A ← A₀ − Ŵᵀ Ŵ

    The factorisation is the only serial part: c elimination steps on the c × c tile, each a column
    extraction, a pivot and two rank-1 updates (G's Schur complement and L⁻¹ by Gauss–Jordan), instead of c
    token steps on the d × d tile. The matrix products run as f32 ``dot``s at full precision (no TF32)."""
    c, d, cm = cfg.anchor_every, cfg.key_dim, cfg.chunk_rows
    hi = jax.lax.Precision.HIGHEST

    def dot(a, b):
        return jnp.dot(a, b, precision=hi, preferred_element_type=F32)

    def kernel(k_ref, u_ref, flags_ref, a0_ref, g_out, factor_out, anchors_out, a_final_out):
        eye = _eye(d)
        eye_c = _eye(cm)
        rows = iota((cm,), 0)
        row2 = iota((cm, cm), 0)
        col2 = iota((cm, cm), 1)
        causal = row2 >= col2

        def chunk(state, block_end):
            pos, a = state
            inside = pos + rows < block_end
            fl = pltriton.load(flags_ref.at[pl.ds(pos, cm)], mask=inside, other=0)
            # the chunk: up to and including its first refresh, before the next document start
            after_refresh = jnp.where(inside & _flag(fl, REFRESH), rows + 1, cm)
            new_document = jnp.where(inside & _flag(fl, RESET) & (rows > 0), rows, cm)
            length = jnp.minimum(jnp.minimum(jnp.min(after_refresh), jnp.min(new_document)), block_end - pos)
            valid = rows < length
            a = jax.lax.cond(_flag(flags_ref[pos], RESET), lambda: eye * (1.0 / cfg.lambda0), lambda: a)
            u = pltriton.load(u_ref.at[pl.ds(pos, cm), :], mask=valid[:, None], other=0.0).astype(F32)
            k = pltriton.load(k_ref.at[pl.ds(pos, cm), :], mask=valid[:, None], other=0.0).astype(F32)
            x = dot(u, a)
            y = dot(k, a)
            gram = eye_c + dot(u, x.T)

            def eliminate(j, carry):
                gm, linv, piv = carry
                column = jnp.sum(jnp.where(col2 == j, gm, 0.0), axis=1)       # G[:, j] (Schur complement)
                pivot = jnp.sum(jnp.where(rows == j, column, 0.0))
                ell = jnp.where(rows > j, column / pivot, 0.0)                 # L[:, j] below the diagonal
                gm = gm - _outer(ell, column)
                linv = linv - _outer(ell, jnp.sum(jnp.where(row2 == j, linv, 0.0), axis=0))
                return gm, linv, jnp.where(rows == j, pivot, piv)

            _, linv, piv = jax.lax.fori_loop(0, length, eliminate, (gram, eye_c, jnp.ones((cm,), F32)))
            w = dot(linv, x) / jnp.sqrt(piv)[:, None]
            kw = jnp.where(causal, dot(k, w.T), 0.0)
            pltriton.store(g_out.at[pl.ds(pos, cm), :], y - dot(kw, w), mask=valid[:, None])
            pltriton.store(factor_out.at[pl.ds(pos, cm), :], w, mask=valid[:, None])
            a = a - dot(w.T, w)
            a = jax.lax.cond(_flag(flags_ref[pos + length - 1], REFRESH), lambda: a + cfg.refresh_magnitude * eye,
                             lambda: a)
            return pos + length, a

        def block(n, a):
            anchors_out[n] = a
            end = (n + 1) * c
            return jax.lax.while_loop(lambda st: st[0] < end, functools.partial(chunk, block_end=end),
                                      (n * c, a))[1]

        a = jax.lax.fori_loop(0, n_chunks, block, a0_ref[...].astype(F32))
        anchors_out[n_chunks] = a
        a_final_out[...] = a

    return kernel


def _backward_kernel(cfg, n_chunks):
    c, d = cfg.anchor_every, cfg.key_dim
    rho = cfg.refresh_magnitude

    def kernel(k_ref, u_ref, factor_ref, flags_ref, d_g_ref, anchors_ref, d_final_ref, dk_out, du_out,
               d_a0_out):
        eye = _eye(d)

        def load(t):
            return (_row(k_ref, t), _row(u_ref, t), _row(factor_ref, t), _row(d_g_ref, t), flags_ref[t])

        def replay(n, stop):
            """A after token stop − 1 (stop inside chunk n), from the chunk's start anchor: the forward's
            updates again, the same operations on the same stored factors."""
            def step(j, a):
                t = n * c + j
                flags = flags_ref[t]
                factor = _row(factor_ref, t)
                a = jnp.where(_flag(flags, RESET), eye * (1.0 / cfg.lambda0), a)
                a = a - _outer(factor, factor)
                return a + (rho * _bit(flags, REFRESH)) * eye

            return jax.lax.fori_loop(0, stop - n * c, step, anchors_ref[n])

        def token(i, carry, n):
            a_post, d_a, (k_hat, u, factor, d_g, flags) = carry
            t = n * c + c - 1 - i
            nxt = load(jnp.maximum(t - 1, 0))
            reset = _flag(flags, RESET)
            a = a_post - (rho * _bit(flags, REFRESH)) * eye      # A after the update, before ρI
            # g = A k̂ (α̂ = g / max(‖g‖, ε) is XLA's, outside the kernel): dk̂ = A dg
            dk_out[t, :] = _matvec(a, d_g)
            d_w, du_first = _adjoint_directions(d_a, k_hat, u, factor, d_g)
            a_prev = jnp.where(reset, eye * (1.0 / cfg.lambda0), a + _outer(factor, factor))
            du_out[t, :] = du_first + _matvec(a_prev, d_w)
            d_a = _adjoint_update(d_a, k_hat, u, d_g, d_w)
            # step back to token t − 1: across a document start A is the previous document's (replayed)
            # and no gradient flows into it
            inside = reset & (t > n * c)
            a_prev = jax.lax.cond(inside, lambda: replay(n, t), lambda: a_prev)
            d_a = jnp.where(reset, 0.0, d_a)
            return a_prev, d_a, nxt

        def chunk(i, carry):
            n = n_chunks - 1 - i
            d_a, ahead = carry
            _, d_a, ahead = jax.lax.fori_loop(0, c, functools.partial(token, n=n), (anchors_ref[n + 1], d_a, ahead))
            return d_a, ahead

        d_a, _ = jax.lax.fori_loop(0, n_chunks, chunk, (d_final_ref[...], load(n_chunks * c - 1)))
        d_a0_out[...] = d_a

    return kernel


def _adjoint_kernel(cfg, n_tokens):
    """Split backward, pass 1: Ā alone, reverse over every token (the adjoint of ``_backward_kernel`` without its A
    tile). Writes w̄_t, du's first term δ̄ √δ ŵ_t, and dA₀."""

    def kernel(k_ref, u_ref, factor_ref, flags_ref, d_g_ref, d_final_ref, d_w_out, du_out, d_a0_out):
        def load(t):
            return (_row(k_ref, t), _row(u_ref, t), _row(factor_ref, t), _row(d_g_ref, t), flags_ref[t])

        def token(i, carry):
            d_a, (k_hat, u, factor, d_g, flags) = carry
            t = n_tokens - 1 - i
            nxt = load(jnp.maximum(t - 1, 0))
            d_w, du_out[t, :] = _adjoint_directions(d_a, k_hat, u, factor, d_g)
            d_w_out[t, :] = d_w
            d_a = _adjoint_update(d_a, k_hat, u, d_g, d_w)
            return jnp.where(_flag(flags, RESET), 0.0, d_a), nxt  # no gradient into the previous document's A

        d_a, _ = jax.lax.fori_loop(0, n_tokens, token, (d_final_ref[...].astype(F32), load(n_tokens - 1)))
        d_a0_out[...] = d_a

    return kernel


def _replay_kernel(cfg):
    """Split backward, pass 2: one anchor block replayed (``_replay_block``) for the two products that need A:
    du_t = (du's first term) + A_{t−1} w̄_t (A before token t's update, after a reset) and dk̂_t = A_t dg_t."""

    def kernel(factor_ref, flags_ref, d_g_ref, d_w_ref, du_first_ref, anchor_ref, dk_out, du_out):
        def du(j, a):
            du_out[j, :] = _row(du_first_ref, j) + _matvec(a, _row(d_w_ref, j))

        def dk(j, a):
            dk_out[j, :] = _matvec(a, _row(d_g_ref, j))

        _replay_block(cfg, anchor_ref, flags_ref, factor_ref, du, dk)

    return kernel


# ---------------------------------------------------------------------------------------------------------
# pallas_call wrappers (inputs padded to a multiple of anchor_every)


def flops_per_token(d: int, chunk_rows: Optional[int] = None) -> dict:
    """Executed FLOPs per token and head of each kernel (d×d element-wise work counted in full):
    forward: A u, u·w, the ŵŵᵀ update, g = A k̂, the refresh add: ≈ 8 d²;
    backward: the ρ removal, A dg, Ā ŵ, the A rebuild, A_prev dw, the symmetric rank-4 cotangent update:
    ≈ 20 d². Replays at document starts inside a chunk add ≈ 4 d² per replayed token
    (data-dependent, not counted).
    split forward: the token steps ≈ 6 d² (the forward less g = A k̂), the readout's replay and A k̂ ≈ 6 d²;
    split backward: pass 1 Ā ŵ and the symmetric rank-4 update with its reset select ≈ 10 d², pass 2 the reset
    select, A_{t−1} w̄, the rank-1 update, A dg and the refresh add ≈ 9 d².
    ``chunk_rows`` = c: the chunked forward per tile row, for full tiles (a shorter chunk costs a whole tile):
    X, Y, ŴᵀŴ 6 c d² and G, L⁻¹X, K̂Ŵᵀ, its product with Ŵ 8 c² d per tile, the elimination ≈ 4 c³
    (c steps of two c × c rank-1 updates), the refresh add d²; divided by c."""
    if chunk_rows is None:
        forward = 8 * d * d + 4 * d
    else:
        c = chunk_rows
        forward = (6 * c * d * d + 8 * c * c * d + 4 * c ** 3 + d * d) // c
    return {"forward": forward, "backward": 20 * d * d + 10 * d, "backward_adjoint": 10 * d * d + 14 * d,
            "backward_replay": 9 * d * d + 2 * d, "forward_chain": 6 * d * d + 4 * d, "forward_readout": 6 * d * d}


def _cost(cfg, kernel, batch_heads, n_tokens):
    d = cfg.key_dim
    vectors = {"forward": 4, "backward": 6, "backward_adjoint": 6, "backward_replay": 6, "forward_chain": 2,
               "forward_readout": 3}[kernel]  # [d] f32 rows read + written per token
    anchors = 0 if kernel == "backward_adjoint" else (n_tokens // cfg.anchor_every + 1) * d * d * 4
    rows = cfg.chunk_rows if cfg.forward == "chunked" else None
    return pl.CostEstimate(flops=int(batch_heads * n_tokens * flops_per_token(d, rows)[kernel]),
                           # one square root per token on the chains; none in the replays
                           transcendentals=0 if kernel in ("backward_replay", "forward_readout")
                           else int(batch_heads * n_tokens),
                           bytes_accessed=int(batch_heads * (n_tokens * (vectors * d * 4 + 4) + anchors
                                                             + 2 * d * d * 4)))


def _params(cfg, warps):
    return compiler_params(cfg.interpret, warps)


def _specs(cfg, b, t, h):
    d, n = cfg.key_dim, t // cfg.anchor_every
    token = pl.BlockSpec((None, t, None, d), lambda b_, h_: (b_, 0, h_, 0))
    flags = pl.BlockSpec((None, t), lambda b_, h_: (b_, 0))
    square = pl.BlockSpec((None, None, d, d), lambda b_, h_: (b_, h_, 0, 0))
    anchors = pl.BlockSpec((None, None, n + 1, d, d), lambda b_, h_: (b_, h_, 0, 0, 0))
    return token, flags, square, anchors, n


def _block_specs(cfg, d):
    """BlockSpecs of one anchor block on the grid (B, H, blocks): token rows, flags, the block's start anchor."""
    c = cfg.anchor_every
    return (pl.BlockSpec((None, c, None, d), lambda b_, h_, n_: (b_, n_, h_, 0)),
            pl.BlockSpec((None, c), lambda b_, h_, n_: (b_, n_)),
            pl.BlockSpec((None, None, None, d, d), lambda b_, h_, n_: (b_, h_, n_, 0, 0)))


def _forward(cfg, k_hat, u, a0, flags):
    b, t, h, d = k_hat.shape
    _, _, square, anchors, n = _specs(cfg, b, t, h)
    if cfg.forward == "chunked":  # tiles of chunk_rows from any token: chunk_rows rows of zeros past the end
        k_hat, u, flags = (common.pad_time(x, t + cfg.chunk_rows) for x in (k_hat, u, flags))
    tp = k_hat.shape[1]
    token, flag_spec, _, _, _ = _specs(cfg, b, tp, h)  # the (padded) token axis; the anchors stay t's
    rows = jax.ShapeDtypeStruct((b, tp, h, d), F32)
    states = (jax.ShapeDtypeStruct((b, h, n + 1, d, d), F32), jax.ShapeDtypeStruct((b, h, d, d), F32))
    readout = cfg.forward != "split"
    kernel = (_chunked_forward_kernel(cfg, n) if cfg.forward == "chunked" else
              _forward_kernel(cfg, n, readout=readout))
    outs = pl.pallas_call(
        kernel, grid=(b, h), in_specs=[token, token, flag_spec, square],
        out_specs=((token,) if readout else ()) + (token, anchors, square),
        out_shape=((rows,) if readout else ()) + (rows, *states),
        interpret=cfg.interpret, compiler_params=_params(cfg, cfg.warps_forward),
        cost_estimate=_cost(cfg, "forward" if readout else "forward_chain", b * h, t),
        name="vla_penalty_forward")(k_hat, u, flags, a0)
    if readout:
        g, factors, anchor_states, a_final = outs
    else:
        factors, anchor_states, a_final = outs
        block, block_flags, anchor = _block_specs(cfg, d)
        g = pl.pallas_call(
            _readout_kernel(cfg), grid=(b, h, n), in_specs=[block, block, block_flags, anchor], out_specs=block,
            out_shape=rows, interpret=cfg.interpret, compiler_params=_params(cfg, cfg.warps_forward),
            cost_estimate=_cost(cfg, "forward_readout", b * h, t), name="vla_penalty_forward_readout")(
            k_hat, factors, flags, anchor_states)
    return g[:, :t], factors[:, :t], anchor_states, a_final


def _backward(cfg, k_hat, u, factors, flags, d_g, anchors, d_final):
    b, t, h, d = k_hat.shape
    token, flag_spec, square, anchor_spec, n = _specs(cfg, b, t, h)
    return pl.pallas_call(
        _backward_kernel(cfg, n), grid=(b, h),
        in_specs=[token, token, token, flag_spec, token, anchor_spec, square],
        out_specs=(token, token, square),
        out_shape=(jax.ShapeDtypeStruct((b, t, h, d), F32), jax.ShapeDtypeStruct((b, t, h, d), F32),
                   jax.ShapeDtypeStruct((b, h, d, d), F32)),
        interpret=cfg.interpret, compiler_params=_params(cfg, cfg.warps_backward),
        cost_estimate=_cost(cfg, "backward", b * h, t), name="vla_penalty_backward")(
        k_hat, u, factors, flags, d_g, anchors, d_final)


def _split_backward(cfg, k_hat, u, factors, flags, d_g, anchors, d_final):
    b, t, h, d = k_hat.shape
    token, flag_spec, square, _, n = _specs(cfg, b, t, h)
    rows = jax.ShapeDtypeStruct((b, t, h, d), F32)
    d_w, du_first, d_a0 = pl.pallas_call(
        _adjoint_kernel(cfg, t), grid=(b, h),
        in_specs=[token, token, token, flag_spec, token, square], out_specs=(token, token, square),
        out_shape=(rows, rows, jax.ShapeDtypeStruct((b, h, d, d), F32)),
        interpret=cfg.interpret, compiler_params=_params(cfg, cfg.warps_backward),
        cost_estimate=_cost(cfg, "backward_adjoint", b * h, t), name="vla_penalty_backward_adjoint")(
        k_hat, u, factors, flags, d_g, d_final)
    block, block_flags, anchor = _block_specs(cfg, d)
    dk, du = pl.pallas_call(
        _replay_kernel(cfg), grid=(b, h, n),
        in_specs=[block, block_flags, block, block, block, anchor], out_specs=(block, block),
        out_shape=(rows, rows), interpret=cfg.interpret, compiler_params=_params(cfg, cfg.warps_forward),
        cost_estimate=_cost(cfg, "backward_replay", b * h, t), name="vla_penalty_backward_replay")(
        factors, flags, d_g, d_w, du_first, anchors)
    return dk, du, d_a0


def _either_backward(cfg, *args):
    return (_split_backward if cfg.backward == "split" else _backward)(cfg, *args)


_penalty_pass = penalty_vjp.penalty_pass_with_vjp(_forward, _either_backward)


# ---------------------------------------------------------------------------------------------------------
# public entry


def penalty_pass(k_hat_BTHK, u_BTHK, penalty_BHKK, document_BT, refresh_BT, *, lambda0, refresh_magnitude, eps,
                 normalize_write_direction=True, interpret=False, **overrides):
    """All α̂_t [B, T, H, K] float32 and the final A [B, H, K, K] float32, as ``xla.penalty_pass``
    (k̂ and u unit-normalised; ``document_BT`` the running count of boundaries; ``refresh_BT`` refresh after
    token t). Differentiable w.r.t. k̂, u and A₀ (custom VJP). ``overrides``: :class:`Config` fields.
    ``normalize_write_direction=False`` returns g = k̂ A_t itself (the kernels never normalise, so nothing else
    changes)."""
    b, t, h, d = k_hat_BTHK.shape
    cfg = make_config(d, lambda0=lambda0, refresh_magnitude=refresh_magnitude, interpret=interpret, **overrides)
    # padded tokens: u = k̂ = 0 (no update, α̂ = 0), no reset, no refresh, so A_T is the last real token's
    flags = common.pad_time(token_flags(document_BT, refresh_BT), cfg.anchor_every)
    k_hat, u = (common.pad_time(x.astype(F32), cfg.anchor_every) for x in (k_hat_BTHK, u_BTHK))
    g, a_final = _penalty_pass(cfg, k_hat, u, penalty_BHKK.astype(F32), flags)
    # the normalisation in XLA (autodiff): no reductions for it on the kernels' serial path
    g = g[:, :t]
    return (g / floored_norm(g, eps) if normalize_write_direction else g), a_final
