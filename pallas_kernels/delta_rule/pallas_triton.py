"""Boundary-pivoted chunkwise delta rule on GPU through Pallas' Triton backend (spec §4.7, §6; forward and
custom-VJP backward).

Recurrence (row vectors, state key-major [Dk, Dv]):  S_t = (I − k_tᵀ k̂_t) Diag(e^{λ_t}) S_{t−1} + k_tᵀ v̂_t,
o_t = q̂_t S_t.  Entry point: :func:`run` with the op's ``impl.run`` contract, and :func:`supports`.

Structure (FLA-like: the state-independent work runs for every chunk in parallel, only the small
S-dependent products are sequential):

  forward   K1 ``intra``   grid (B, H, N)     per chunk: decay factors, A and M (exact leaves + pivoted
                                               cross blocks), P = (I + A)⁻¹ (Neumann leaves + 2×2 merges),
                                               U = P V̂, Y = P (K̂⊙π), Q̂⊙π, K⊙E, π_C
            K2 ``scan``    grid (B, H, Dv/BV) sequential over chunks: S₀ saved, Ũ = U − Y S₀,
                                               S ← Diag(π_C) S + (K⊙E)ᵀ Ũ
            K3 ``output``  grid (B, H, N)     O = (Q̂⊙π) S₀ + M Ũ
  backward  K1 again (also writes P), then
            B1 ``scan_bwd`` grid (B, H, Dv/BV) reverse over chunks: dŨ = Mᵀ dO + (K⊙E) dS,
                                               dS ← (Q̂⊙π)ᵀ dO + Diag(π_C) dS − Yᵀ dŨ   (dS_C saved)
            B2 ``grads``   grid (B, H, N)     everything else of spec §6.2 per chunk, in parallel.
  Saved for the backward: the (padded) inputs and the chunk-start states S₀ only (stored in the operand
  dtype: with bf16 inputs every consumer of S₀ and dS_C is a bf16 matmul operand anyway; the carried state
  and the final state are f32).

Numerics (every exponent ≤ 0, spec §4.7–§4.8):
  * all log-decay sums are sums of λ ≤ 0 over token ranges; the only differences taken are inside one
    leaf (n0 tokens): leaf-local cumsum Λ^leaf and Σ_{s>j in leaf} = total − Λ^leaf_j. Ranges that span
    several leaves add whole-leaf totals (no cancellation across leaves);
  * leaves (n0 × n0): exact e^{Λ_i − Λ_j}, masked to j ≤ i BEFORE the exp;
  * cross blocks of the binary tree (half h = n0, 2n0, …, C/2): pivot at the last row of the left half,
    ρ_i = e^{Σ_{p<s≤i} λ}, κ_j = e^{Σ_{j<s≤p} λ} (both ≤ 1), A[R,L] = (K̂⊙ρ)(K⊙κ)ᵀ, M likewise with Q̂.
    On the GPU the cross blocks of one level are one masked C×Dk×C matmul;
  * P = (I + A)⁻¹: leaves by the Neumann product (I − N)(I + N²)…, then per level P ← P − P A_ℓ P
    (= −P_RR A_RL P_LL in the (R, L) blocks; f32 operands, ``inverse_precision``);
  * state, accumulation, decay factors and the inverse in f32; matmul operands in the input dtype
    (bf16 inputs: bf16 tensor-core matmuls with f32 accumulation).
Segments: ``document_BT`` (running count of boundaries); A and M keep same-document pairs, the S₀ rows
(Q̂⊙π, K̂⊙π) only the carried-in document, K⊙E only the chunk's last document, π_C is zero in a chunk with
a boundary — the same rules as ``xla.py``.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # Pallas' Triton backend (deprecated upstream since JAX 0.11 but present in 0.10.2 and 0.11.2)
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover
    pltriton = None

F32 = jnp.float32
SUPPORTED_CHUNKS = (32, 64, 128)
SUPPORTED_LEAVES = (8, 16)
MAX_HEAD_DIM = 256
_MIN_DIM = 16  # tl.dot needs every matmul dimension ≥ 16


# ---------------------------------------------------------------------------------------------------------
# configuration


@dataclasses.dataclass(frozen=True)
class Config:
    chunk: int
    leaf: int
    key_dim: int
    value_dim: int
    operand_dtype: jnp.dtype  # matmul operands of the big products (bf16 or f32)
    inverse_precision: str = "highest"  # f32 matmuls (P = (I + A)⁻¹, f32 operands): "tf32" | "highest" | "ieee"
    scan_block_v: int = 64  # Dv block of the sequential kernels (more CTAs when B·H is small)
    slab: int = 16  # key channels per pass of the exact n0×n0×slab leaf tensors
    warps_intra: int = 8
    warps_scan: int = 4
    warps_output: int = 4
    warps_grads: int = 8
    stages_scan: int = 2
    interpret: bool = False

    @property
    def leaves(self):
        return self.chunk // self.leaf

    @property
    def halves(self):
        h, out = self.leaf, []
        while h < self.chunk:
            out.append(h)
            h *= 2
        return tuple(out)

    @property
    def precision(self):
        """"tf32": one TF32 tensor-core pass; "highest": float32-accurate, as three TF32 passes on the GPU
        (Triton's tf32x3; a true IEEE f32 tl.dot is an FMA loop that compiles for minutes) and plain f32 in
        interpret mode; "ieee": Triton's FMA-based IEEE f32 dot (slow to compile and run; debugging only)."""
        if self.inverse_precision == "tf32":
            return jax.lax.Precision.DEFAULT
        if self.inverse_precision == "highest" and not self.interpret:
            return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
        return jax.lax.Precision.HIGHEST


def _pow2(x: int) -> bool:
    return x >= 1 and x & (x - 1) == 0


def default_block_v(batch_heads: int, value_dim: int) -> int:
    """Dv block of the sequential kernels: the largest of 64/32/16 that still gives ≥ 128 CTAs."""
    for bv in (64, 32):
        if bv <= value_dim and batch_heads * (value_dim // bv) >= 128:
            return bv
    return min(16, value_dim) if value_dim >= 16 else value_dim


def make_config(chunk, leaf, key_dim, value_dim, operand_dtype, *, batch_heads=128, interpret=False, **overrides):
    operand_dtype = jnp.dtype(operand_dtype)
    slab = max(8, min(key_dim, 8192 // (chunk * leaf)))
    base = dict(chunk=chunk, leaf=leaf, key_dim=key_dim, value_dim=value_dim, operand_dtype=operand_dtype,
                inverse_precision="highest" if interpret else "tf32",
                scan_block_v=default_block_v(batch_heads, value_dim), slab=slab, interpret=interpret)
    base.update(overrides)
    return Config(**base)


def supports(call) -> Optional[str]:
    """``None`` when this kernel can serve ``call`` (an ``api.DeltaRuleCall``), else the reason."""
    if getattr(call, "backend", None) != "gpu":
        return f"the Pallas-Triton kernel runs on GPU only (backend is {call.backend!r})"
    if pltriton is None:
        return "jax.experimental.pallas.triton is not available in this JAX"
    if call.chunk_size not in SUPPORTED_CHUNKS:
        return f"chunk_size={call.chunk_size} not in {SUPPORTED_CHUNKS}"
    if call.leaf_size not in SUPPORTED_LEAVES or call.leaf_size * 2 > call.chunk_size:
        return f"leaf_size={call.leaf_size} not in {SUPPORTED_LEAVES} (with chunk_size ≥ 2·leaf_size)"
    for name, d in (("key_dim", call.key_dim), ("value_dim", call.value_dim)):
        if not _pow2(d) or d < _MIN_DIM or d > MAX_HEAD_DIM:
            return f"{name}={d}: needs a power of two in [{_MIN_DIM}, {MAX_HEAD_DIM}]"
    if jnp.dtype(call.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(call.dtype).name} not supported (float32, bfloat16, float16)"
    return None


# ---------------------------------------------------------------------------------------------------------
# in-kernel helpers (traced inside the Pallas kernels; only ops with Triton lowerings)


def _iota(shape, dim):
    return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def _matmul(a, b, trans_a, trans_b, precision):
    """a @ b (optionally transposed) with f32 accumulation, as a plain dot_general (pl.dot is gone in
    JAX 0.11.2; the Triton lowering turns a contraction over dim 0 / dim 1 into a transpose + tl.dot)."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


def _dot(a, b, cfg, *, trans_a=False, trans_b=False, f32=False):
    """Matmul with f32 accumulation. ``f32``: both operands f32 at ``cfg.inverse_precision``; otherwise
    both operands cast to the operand dtype (bf16 tensor cores for bf16 inputs)."""
    if f32 or cfg.operand_dtype == jnp.dtype(F32):
        return _matmul(a.astype(F32), b.astype(F32), trans_a, trans_b, cfg.precision)
    return _matmul(a.astype(cfg.operand_dtype), b.astype(cfg.operand_dtype), trans_a, trans_b, None)


def _leaf_group_sum(tot, cfg, group, *, before):
    """Σ of whole-leaf totals over the other leaves of the same aligned group of ``group`` leaves:
    before=True: leaves m' < m; False: leaves m' > m. tot [nb, Dk] -> [nb, Dk] (sums of λ ≤ 0)."""
    nb = cfg.leaves
    m = _iota((nb, nb), 0)
    mp = _iota((nb, nb), 1)
    order = (mp < m) if before else (mp > m)
    keep = order & ((mp // group) == (m // group))
    return jnp.sum(jnp.where(keep[:, :, None], tot[None, :, :], 0.0), axis=1)


class _Decay:
    """Per-chunk log-decay sums (f32): leaf-local inclusive cumsum, leaf-local Σ_{s>j}, whole-leaf totals.
    Level factors are products of two exps ≤ 1, e^{leaf-local part}·e^{sum of whole-leaf totals}, so the
    [C, Dk] exps are taken once for all levels (the product underflows only where the true value does)."""

    def __init__(self, lam, cfg):
        nb, n0, dk = cfg.leaves, cfg.leaf, cfg.key_dim
        lam3 = lam.reshape(nb, n0, dk)
        self.cfg = cfg
        inc = jnp.cumsum(lam3, axis=1)  # Σ_{leaf start ≤ s ≤ i}
        self.tot = jnp.sum(lam3, axis=1)  # [nb, Dk]
        self.exp_inc = jnp.exp(inc)
        self.exp_rexc = jnp.exp(self.tot[:, None, :] - inc)  # Σ_{i < s ≤ leaf end} (difference inside one leaf)

    def rho(self, group):
        """e^{Σ_{start of the aligned group of leaves ≤ s ≤ i}}: [C, Dk] ≤ 1."""
        cfg = self.cfg
        pre = jnp.exp(_leaf_group_sum(self.tot, cfg, group, before=True))
        return (self.exp_inc * pre[:, None, :]).reshape(cfg.chunk, cfg.key_dim)

    def kappa(self, group):
        """e^{Σ_{j < s ≤ end of the aligned group of leaves}}: [C, Dk] ≤ 1."""
        cfg = self.cfg
        suf = jnp.exp(_leaf_group_sum(self.tot, cfg, group, before=False))
        return (self.exp_rexc * suf[:, None, :]).reshape(cfg.chunk, cfg.key_dim)

    def chunk_total(self):
        return jnp.sum(self.tot, axis=0)  # [Dk]


def _level_mask(cfg, half):
    """(i, j) with i in the right and j in the left half of the same node of size 2·half: [C, C]."""
    c = cfg.chunk
    i = _iota((c, c), 0)
    j = _iota((c, c), 1)
    return ((i // (2 * half)) == (j // (2 * half))) & (((i // half) % 2) == 1) & (((j // half) % 2) == 0)


def _same_leaf(cfg):
    c = cfg.chunk
    return (_iota((c, c), 0) // cfg.leaf) == (_iota((c, c), 1) // cfg.leaf)


def _embed_leaf_blocks(blocks, cfg):
    """[nb, n0, n0] diagonal blocks -> block-diagonal [C, C]."""
    nb, n0 = cfg.leaves, cfg.leaf
    onehot = _iota((nb, 1, nb, 1), 0) == _iota((nb, 1, nb, 1), 2)
    return jnp.where(onehot, blocks[:, :, None, :], 0.0).reshape(cfg.chunk, cfg.chunk)


def _leaf_blocks(mat, cfg):
    """[C, C] -> its [nb, n0, n0] diagonal blocks."""
    nb, n0 = cfg.leaves, cfg.leaf
    onehot = _iota((nb, 1, nb, 1), 0) == _iota((nb, 1, nb, 1), 2)
    return jnp.sum(jnp.where(onehot, mat.reshape(nb, n0, nb, n0), 0.0), axis=2)


def _embed_columns(x, slab_index, cfg):
    """[C, slab] placed at key channels [slab_index·slab, …) of a zero [C, Dk]."""
    nslab = cfg.key_dim // cfg.slab
    onehot = _iota((1, nslab, 1), 1) == slab_index
    return jnp.where(onehot, x[:, None, :], 0.0).reshape(cfg.chunk, cfg.key_dim)


def _slab_columns(s, cfg):
    """Key channels [s·slab, (s+1)·slab) for a (possibly traced) slab index s."""
    return pl.ds(pl.multiple_of(s * cfg.slab, cfg.slab), cfg.slab)


def _leaf_decay_slab(lam_ref, cols, cfg):
    """Exact leaf decays e^{Λ_i − Λ_j} (j ≤ i, same leaf; zero elsewhere, masked before the exp) for the
    key channels ``cols``: [nb, n0(i), n0(j), slab]."""
    nb, n0, slab = cfg.leaves, cfg.leaf, cfg.slab
    lam = lam_ref[:, cols].astype(F32).reshape(nb, n0, slab)
    inc = jnp.cumsum(lam, axis=1)
    causal = _iota((1, n0, n0, 1), 1) >= _iota((1, n0, n0, 1), 2)
    diff = jnp.where(causal, inc[:, :, None, :] - inc[:, None, :, :], 0.0)
    return jnp.where(causal, jnp.exp(diff), 0.0)


def _rows_by_leaf(x, cfg, axis):
    """[C, slab] -> [nb, n0, 1, slab] (axis=2: row index i) or [nb, 1, n0, slab] (axis=1: column j)."""
    r = x.astype(F32).reshape(cfg.leaves, cfg.leaf, cfg.slab)
    return r[:, :, None, :] if axis == 2 else r[:, None, :, :]


class _ChunkMasks:
    def __init__(self, doc, carry, last, cfg):
        c = cfg.chunk
        self.same_doc = doc[:, None] == doc[None, :]
        self.causal = _iota((c, c), 0) >= _iota((c, c), 1)
        self.strict = _iota((c, c), 0) > _iota((c, c), 1)
        self.carried = (doc == carry)[:, None]  # rows whose document is the carried-in one
        self.in_last = (doc == last)[:, None]  # rows in the chunk's last document
        self.no_boundary = last == carry


def _chunk_masks(doc_ref, carry_ref, cfg):
    return _ChunkMasks(doc_ref[...], carry_ref[...], doc_ref[cfg.chunk - 1], cfg)


def _chunk_setup(lam_ref, doc_ref, carry_ref, cfg, masks=None):
    """Decay sums, document masks and the chunk-boundary decays π (start), E (end), π_C."""
    masks = _chunk_masks(doc_ref, carry_ref, cfg) if masks is None else masks
    decay = _Decay(lam_ref[...].astype(F32), cfg)
    start = jnp.where(masks.carried, decay.rho(cfg.leaves), 0.0)
    end = jnp.where(masks.in_last, decay.kappa(cfg.leaves), 0.0)
    chunk_decay = jnp.where(masks.no_boundary, jnp.exp(decay.chunk_total()), 0.0)
    return masks, decay, start, end, chunk_decay


def _chunk_matrices(q_ref, k_ref, e_ref, lam_ref, masks, decay, cfg):
    """M (lower incl. diagonal) and P = (I + A)⁻¹, both [C, C] f32."""
    c, dk = cfg.chunk, cfg.key_dim
    # exact leaves, key channels in slabs (n0 × n0 × slab tensors)
    def leaf_slab(s, acc):
        cols = _slab_columns(s, cfg)
        x = _leaf_decay_slab(lam_ref, cols, cfg) * _rows_by_leaf(k_ref[:, cols], cfg, 1)
        return (acc[0] + jnp.sum(x * _rows_by_leaf(e_ref[:, cols], cfg, 2), axis=3),
                acc[1] + jnp.sum(x * _rows_by_leaf(q_ref[:, cols], cfg, 2), axis=3))

    zeros = jnp.zeros((cfg.leaves, cfg.leaf, cfg.leaf), F32)
    a_leaf, m_leaf = jax.lax.fori_loop(0, dk // cfg.slab, leaf_slab, (zeros, zeros))
    leaf_doc = _same_leaf(cfg) & masks.same_doc
    a_diag = jnp.where(leaf_doc & masks.strict, _embed_leaf_blocks(a_leaf, cfg), 0.0)
    m_full = jnp.where(leaf_doc & masks.causal, _embed_leaf_blocks(m_leaf, cfg), 0.0)

    # pivoted cross blocks, one masked matmul per tree level
    q = q_ref[...].astype(F32)
    k = k_ref[...].astype(F32)
    e = e_ref[...].astype(F32)
    a_levels = []
    for half in cfg.halves:
        group = half // cfg.leaf
        rho = decay.rho(group)
        col = k * decay.kappa(group)
        mask = _level_mask(cfg, half) & masks.same_doc
        a_levels.append(jnp.where(mask, _dot(e * rho, col, cfg, trans_b=True), 0.0))
        m_full += jnp.where(mask, _dot(q * rho, col, cfg, trans_b=True), 0.0)

    # P = (I + A)⁻¹: Neumann product on the leaves, then P ← P − P A_ℓ P level by level
    eye = jnp.where(_iota((c, c), 0) == _iota((c, c), 1), 1.0, 0.0).astype(F32)
    inverse = eye - a_diag
    power = a_diag
    for _ in range(int(math.log2(cfg.leaf)) - 1):
        power = _dot(power, power, cfg, f32=True)
        inverse = _dot(inverse, eye + power, cfg, f32=True)
    for a_level in a_levels:
        inverse = inverse - _dot(_dot(inverse, a_level, cfg, f32=True), inverse, cfg, f32=True)
    return m_full, inverse


# ---------------------------------------------------------------------------------------------------------
# kernels


def _intra_kernel(cfg, with_inverse):
    def kernel(q_ref, k_ref, e_ref, v_ref, lam_ref, doc_ref, carry_ref,
               m_out, u_out, y_out, qpi_out, keff_out, pic_out, *maybe_p_out):
        masks, decay, start, end, chunk_decay = _chunk_setup(lam_ref, doc_ref, carry_ref, cfg)
        m, p = _chunk_matrices(q_ref, k_ref, e_ref, lam_ref, masks, decay, cfg)
        od = cfg.operand_dtype
        m_out[...] = m.astype(m_out.dtype)
        u_out[...] = _dot(p, v_ref[...], cfg).astype(od)
        y_out[...] = _dot(p, e_ref[...].astype(F32) * start, cfg).astype(od)
        qpi_out[...] = (q_ref[...].astype(F32) * start).astype(od)
        keff_out[...] = (k_ref[...].astype(F32) * end).astype(od)
        pic_out[...] = chunk_decay
        if with_inverse:
            maybe_p_out[0][...] = p

    return kernel


def _scan_kernel(cfg, n_chunks):
    def kernel(y_ref, u_ref, keff_ref, pic_ref, s_init_ref, s0_out, ut_out, s_final_out):
        def body(n, state):
            s0_out[n] = state.astype(s0_out.dtype)
            ut = u_ref[n].astype(F32) - _dot(y_ref[n], state, cfg)
            ut_out[n] = ut.astype(ut_out.dtype)
            return pic_ref[n][:, None] * state + _dot(keff_ref[n], ut, cfg, trans_a=True)

        s_final_out[...] = jax.lax.fori_loop(0, n_chunks, body, s_init_ref[...].astype(F32))

    return kernel


def _output_kernel(cfg):
    def kernel(qpi_ref, s0_ref, m_ref, ut_ref, o_ref):
        o = _dot(qpi_ref[...], s0_ref[...], cfg) + _dot(m_ref[...], ut_ref[...], cfg)
        o_ref[...] = o.astype(o_ref.dtype)

    return kernel


def _scan_bwd_kernel(cfg, n_chunks):
    c = cfg.chunk

    def kernel(m_ref, do_ref, keff_ref, qpi_ref, y_ref, pic_ref, ds_final_ref, dsc_out, dut_out, ds0_out):
        def body(i, d_state):
            n = n_chunks - 1 - i
            dsc_out[n] = d_state.astype(dsc_out.dtype)
            d_out = do_ref[pl.ds(n * c, c), :]
            dut = _dot(m_ref[n], d_out, cfg, trans_a=True) + _dot(keff_ref[n], d_state, cfg)
            dut_out[n] = dut.astype(dut_out.dtype)
            return (_dot(qpi_ref[n], d_out, cfg, trans_a=True) + pic_ref[n][:, None] * d_state
                    - _dot(y_ref[n], dut, cfg, trans_a=True))

        ds0_out[...] = jax.lax.fori_loop(0, n_chunks, body, ds_final_ref[...].astype(F32))

    return kernel


def _grads_kernel(cfg):
    c, dk, dv = cfg.chunk, cfg.key_dim, cfg.value_dim
    bv = min(64, dv)

    def kernel(q_ref, k_ref, e_ref, lam_ref, doc_ref, carry_ref, p_ref, u_ref, y_ref, s0_ref, dsc_ref, do_ref,
               dut_ref, dq_out, dk_out, de_out, dv_out, dlam_out):
        masks = _chunk_masks(doc_ref, carry_ref, cfg)
        p = p_ref[...]
        y = y_ref[...]

        d_qpi = jnp.zeros((c, dk), F32)
        d_keff = jnp.zeros((c, dk), F32)
        d_y = jnp.zeros((c, dk), F32)
        d_pic = jnp.zeros((dk,), F32)
        d_m = jnp.zeros((c, c), F32)
        d_a = jnp.zeros((c, c), F32)
        for vb in range(dv // bv):
            cols = pl.ds(vb * bv, bv)
            s0 = s0_ref[:, cols]
            dsc = dsc_ref[:, cols]
            d_out = do_ref[:, cols]
            dut = dut_ref[:, cols]
            u = u_ref[:, cols]
            ut = u.astype(F32) - _dot(y, s0, cfg)
            d_qpi += _dot(d_out, s0, cfg, trans_b=True)
            d_keff += _dot(ut, dsc, cfg, trans_b=True)
            d_y -= _dot(dut, s0, cfg, trans_b=True)
            d_pic += jnp.sum(s0.astype(F32) * dsc.astype(F32), axis=1)
            d_m += _dot(d_out, ut, cfg, trans_b=True)
            d_v = _dot(p, dut, cfg, trans_a=True)
            dv_out[:, cols] = d_v.astype(dv_out.dtype)
            d_a += _dot(d_v, u, cfg, trans_b=True)
        d_r = _dot(p, d_y, cfg, trans_a=True)
        d_a = jnp.where(masks.strict & masks.same_doc, -(d_a + _dot(d_r, y, cfg, trans_b=True)), 0.0)
        d_m = jnp.where(masks.causal & masks.same_doc, d_m, 0.0)

        # decay factors only now (fewer live registers in the value loop above)
        _, decay, start, end, chunk_decay = _chunk_setup(lam_ref, doc_ref, carry_ref, cfg, masks)

        # pair gradients through the pivoted cross blocks (same factors as the forward)
        d_e_pair = jnp.zeros((c, dk), F32)
        d_q_pair = jnp.zeros((c, dk), F32)
        d_k_pair = jnp.zeros((c, dk), F32)
        q = q_ref[...].astype(F32)
        k = k_ref[...].astype(F32)
        e = e_ref[...].astype(F32)
        for half in cfg.halves:
            group = half // cfg.leaf
            rho, kappa = decay.rho(group), decay.kappa(group)
            mask = _level_mask(cfg, half)
            da_l = jnp.where(mask, d_a, 0.0)
            dm_l = jnp.where(mask, d_m, 0.0)
            col = k * kappa
            d_e_pair += _dot(da_l, col, cfg) * rho
            d_q_pair += _dot(dm_l, col, cfg) * rho
            d_k_pair += (_dot(da_l, e * rho, cfg, trans_a=True) + _dot(dm_l, q * rho, cfg, trans_a=True)) * kappa
        # ... and through the exact leaves, key channels in slabs
        da_leaf = _leaf_blocks(d_a, cfg)[..., None]
        dm_leaf = _leaf_blocks(d_m, cfg)[..., None]

        def leaf_slab(s, acc):
            cols = _slab_columns(s, cfg)
            x = _leaf_decay_slab(lam_ref, cols, cfg)
            xk = x * _rows_by_leaf(k_ref[:, cols], cfg, 1)
            rows_e = _rows_by_leaf(e_ref[:, cols], cfg, 2)
            rows_q = _rows_by_leaf(q_ref[:, cols], cfg, 2)
            shape = (c, cfg.slab)
            return (acc[0] + _embed_columns(jnp.sum(da_leaf * xk, axis=2).reshape(shape), s, cfg),
                    acc[1] + _embed_columns(jnp.sum(dm_leaf * xk, axis=2).reshape(shape), s, cfg),
                    acc[2] + _embed_columns(
                        jnp.sum((da_leaf * rows_e + dm_leaf * rows_q) * x, axis=1).reshape(shape), s, cfg))

        d_e_pair, d_q_pair, d_k_pair = jax.lax.fori_loop(0, dk // cfg.slab, leaf_slab,
                                                         (d_e_pair, d_q_pair, d_k_pair))

        dq_out[...] = (d_qpi * start + d_q_pair).astype(dq_out.dtype)
        de_out[...] = (d_r * start + d_e_pair).astype(de_out.dtype)
        dk_out[...] = (d_keff * end + d_k_pair).astype(dk_out.dtype)

        # log-decay: every exponent is Λ_i − Λ_j (pairs, π, E, π_C), so dΛ_i collects +g, dΛ_j −g;
        # dλ = reverse cumsum of dΛ within the chunk.
        end_terms = end * d_keff * k
        d_cum = (e * d_e_pair - k * d_k_pair + q * d_q_pair + start * (d_qpi * q + d_r * e) - end_terms)
        chunk_end = jnp.sum(end_terms, axis=0) + d_pic * chunk_decay
        total = jnp.sum(d_cum, axis=0)
        d_lam = total[None, :] - jnp.cumsum(d_cum, axis=0) + d_cum + chunk_end[None, :]
        dlam_out[...] = d_lam.astype(dlam_out.dtype)

    return kernel


# ---------------------------------------------------------------------------------------------------------
# pallas_call wrappers (inputs already padded to a multiple of the chunk)


def _params(cfg, warps, stages=None):
    if cfg.interpret or pltriton is None:
        return None
    return pltriton.CompilerParams(num_warps=warps, num_stages=stages)


def _token_spec(cfg, width):
    """[B, T, H, width] read per chunk: block [C, width] at (b, n, h)."""
    return pl.BlockSpec((None, cfg.chunk, None, width), lambda b, h, n: (b, n, h, 0))


def _chunk_spec(*tail):
    """[B, H, N, *tail] per chunk."""
    return pl.BlockSpec((None, None, None, *tail), lambda b, h, n: (b, h, n, *([0] * len(tail))))


def _intra(cfg, q, k, e, v, lam, doc, carry, with_inverse):
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    c = cfg.chunk
    n = t // c
    od = cfg.operand_dtype
    shapes = [jax.ShapeDtypeStruct((b, h, n, c, c), od),  # M
              jax.ShapeDtypeStruct((b, h, n, c, dv), od),  # U
              jax.ShapeDtypeStruct((b, h, n, c, dk), od),  # Y
              jax.ShapeDtypeStruct((b, h, n, c, dk), od),  # Q̂⊙π
              jax.ShapeDtypeStruct((b, h, n, c, dk), od),  # K⊙E
              jax.ShapeDtypeStruct((b, h, n, dk), F32)]  # π_C
    specs = [_chunk_spec(c, c), _chunk_spec(c, dv), _chunk_spec(c, dk), _chunk_spec(c, dk), _chunk_spec(c, dk),
             _chunk_spec(dk)]
    if with_inverse:
        shapes.append(jax.ShapeDtypeStruct((b, h, n, c, c), F32))
        specs.append(_chunk_spec(c, c))
    in_specs = [_token_spec(cfg, dk)] * 3 + [_token_spec(cfg, dv), _token_spec(cfg, dk),
                                             pl.BlockSpec((None, c), lambda b_, h_, n_: (b_, n_)),
                                             pl.BlockSpec((None, None), lambda b_, h_, n_: (b_, n_))]
    return pl.pallas_call(_intra_kernel(cfg, with_inverse), out_shape=tuple(shapes), grid=(b, h, n),
                          in_specs=in_specs, out_specs=tuple(specs), interpret=cfg.interpret,
                          compiler_params=_params(cfg, cfg.warps_intra), name="delta_rule_intra")(
        q, k, e, v, lam, doc, carry)


def _scan(cfg, y, u, keff, pic, state):
    b, h, n, c, dk = y.shape
    dv = u.shape[-1]
    bv = cfg.scan_block_v
    per_bh = lambda *tail: pl.BlockSpec((None, None, *tail), lambda b_, h_, j: (b_, h_, *([0] * len(tail))))  # noqa
    per_bhv = lambda *tail: pl.BlockSpec((None, None, *tail), lambda b_, h_, j: (b_, h_, *([0] * (len(tail) - 1)), j))  # noqa
    return pl.pallas_call(
        _scan_kernel(cfg, n),
        out_shape=(jax.ShapeDtypeStruct((b, h, n, dk, dv), cfg.operand_dtype),
                   jax.ShapeDtypeStruct((b, h, n, c, dv), u.dtype), jax.ShapeDtypeStruct((b, h, dk, dv), F32)),
        grid=(b, h, dv // bv),
        in_specs=[per_bh(n, c, dk), per_bhv(n, c, bv), per_bh(n, c, dk), per_bh(n, dk), per_bhv(dk, bv)],
        out_specs=(per_bhv(n, dk, bv), per_bhv(n, c, bv), per_bhv(dk, bv)),
        interpret=cfg.interpret, compiler_params=_params(cfg, cfg.warps_scan, cfg.stages_scan),
        name="delta_rule_scan")(y, u, keff, pic, state)


def _output(cfg, qpi, s0, m, ut, out_dtype):
    b, h, n, c, dk = qpi.shape
    dv = ut.shape[-1]
    return pl.pallas_call(
        _output_kernel(cfg), out_shape=jax.ShapeDtypeStruct((b, n * c, h, dv), out_dtype), grid=(b, h, n),
        in_specs=[_chunk_spec(c, dk), _chunk_spec(dk, dv), _chunk_spec(c, c), _chunk_spec(c, dv)],
        out_specs=_token_spec(cfg, dv), interpret=cfg.interpret,
        compiler_params=_params(cfg, cfg.warps_output), name="delta_rule_output")(qpi, s0, m, ut)


def _scan_bwd(cfg, m, d_out, keff, qpi, y, pic, d_final):
    b, h, n, c, dk = y.shape
    dv = d_out.shape[-1]
    bv = cfg.scan_block_v
    per_bh = lambda *tail: pl.BlockSpec((None, None, *tail), lambda b_, h_, j: (b_, h_, *([0] * len(tail))))  # noqa
    per_bhv = lambda *tail: pl.BlockSpec((None, None, *tail), lambda b_, h_, j: (b_, h_, *([0] * (len(tail) - 1)), j))  # noqa
    do_spec = pl.BlockSpec((None, n * c, None, bv), lambda b_, h_, j: (b_, 0, h_, j))
    return pl.pallas_call(
        _scan_bwd_kernel(cfg, n),
        out_shape=(jax.ShapeDtypeStruct((b, h, n, dk, dv), cfg.operand_dtype),
                   jax.ShapeDtypeStruct((b, h, n, c, dv), y.dtype), jax.ShapeDtypeStruct((b, h, dk, dv), F32)),
        grid=(b, h, dv // bv),
        in_specs=[per_bh(n, c, c), do_spec, per_bh(n, c, dk), per_bh(n, c, dk), per_bh(n, c, dk), per_bh(n, dk),
                  per_bhv(dk, bv)],
        out_specs=(per_bhv(n, dk, bv), per_bhv(n, c, bv), per_bhv(dk, bv)),
        interpret=cfg.interpret, compiler_params=_params(cfg, cfg.warps_scan, cfg.stages_scan),
        name="delta_rule_scan_bwd")(m, d_out, keff, qpi, y, pic, d_final)


def _grads(cfg, q, k, e, lam, doc, carry, p, u, y, s0, dsc, d_out, dut, dtypes):
    b, t, h, dk = q.shape
    dv = u.shape[-1]
    c = cfg.chunk
    n = t // c
    out_shape = (jax.ShapeDtypeStruct(q.shape, dtypes[0]), jax.ShapeDtypeStruct(k.shape, dtypes[1]),
                 jax.ShapeDtypeStruct(e.shape, dtypes[2]), jax.ShapeDtypeStruct((b, t, h, dv), dtypes[3]),
                 jax.ShapeDtypeStruct(lam.shape, dtypes[4]))
    in_specs = [_token_spec(cfg, dk)] * 4 + [
        pl.BlockSpec((None, c), lambda b_, h_, n_: (b_, n_)),
        pl.BlockSpec((None, None), lambda b_, h_, n_: (b_, n_)),
        _chunk_spec(c, c), _chunk_spec(c, dv), _chunk_spec(c, dk), _chunk_spec(dk, dv), _chunk_spec(dk, dv), _token_spec(cfg, dv),
        _chunk_spec(c, dv)]
    out_specs = (_token_spec(cfg, dk),) * 3 + (_token_spec(cfg, dv), _token_spec(cfg, dk))
    return pl.pallas_call(_grads_kernel(cfg), out_shape=out_shape, grid=(b, h, n), in_specs=in_specs,
                          out_specs=out_specs, interpret=cfg.interpret,
                          compiler_params=_params(cfg, cfg.warps_grads), name="delta_rule_grads")(
        q, k, e, lam, doc, carry, p, u, y, s0, dsc, d_out, dut)


# ---------------------------------------------------------------------------------------------------------
# custom VJP (padded inputs, documents and the carried-in document per chunk)


def _forward(cfg, q, k, e, v, lam, state, doc, carry):
    m, u, y, qpi, keff, pic = _intra(cfg, q, k, e, v, lam, doc, carry, with_inverse=False)
    s0, ut, final = _scan(cfg, y, u, keff, pic, state)
    out = _output(cfg, qpi, s0, m, ut, v.dtype)
    return out, final, s0


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _delta_rule(cfg, q, k, e, v, lam, state, doc, carry):
    out, final, _ = _forward(cfg, q, k, e, v, lam, state, doc, carry)
    return out, final


def _delta_rule_fwd(cfg, q, k, e, v, lam, state, doc, carry):
    out, final, s0 = _forward(cfg, q, k, e, v, lam, state, doc, carry)
    return (out, final), (q, k, e, v, lam, state, doc, carry, s0)


def _delta_rule_bwd(cfg, residuals, cotangents):
    q, k, e, v, lam, state, doc, carry, s0 = residuals
    d_out, d_final = cotangents
    m, u, y, qpi, keff, pic, p = _intra(cfg, q, k, e, v, lam, doc, carry, with_inverse=True)
    dsc, dut, d_state = _scan_bwd(cfg, m, d_out.astype(v.dtype), keff, qpi, y, pic, d_final.astype(F32))
    dq, dk, de, dv, dlam = _grads(cfg, q, k, e, lam, doc, carry, p, u, y, s0, dsc, d_out.astype(v.dtype), dut,
                                  (q.dtype, k.dtype, e.dtype, v.dtype, lam.dtype))
    return dq, dk, de, dv, dlam, d_state.astype(state.dtype), None, None


_delta_rule.defvjp(_delta_rule_fwd, _delta_rule_bwd)


# ---------------------------------------------------------------------------------------------------------
# public entry (the op's impl.run contract)


def _pad_time(x, multiple, mode="constant"):
    extra = -x.shape[1] % multiple
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, extra)
    return jnp.pad(x, widths, mode=mode)


def carried_documents(document_BT, chunk_size):
    """Document of the state entering each chunk: that of token nC − 1 (chunk 0: of token 0). [B, N]."""
    b, t = document_BT.shape
    chunked = document_BT.reshape(b, t // chunk_size, chunk_size)
    return jnp.concatenate([chunked[:, :1, 0], chunked[:, :-1, -1]], axis=1)


def run(q, k, erase, v, lam, state, document_BT, *, chunk_size, leaf_size, interpret=False, **overrides):
    """q, k, erase [B, T, H, Dk]; v [B, T, H, Dv] (one float dtype: bf16 runs bf16 matmul operands);
    lam [B, T, H, Dk] log-decay ≤ 0 (f32 recommended); state [B, H, Dk, Dv]; document_BT [B, T] int32.
    Returns (o [B, T, H, Dv] in v's dtype, final_state [B, H, Dk, Dv] f32). Differentiable (custom VJP).
    ``overrides``: :class:`Config` fields (scan_block_v, inverse_precision, warps_*, ...)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    cfg = make_config(chunk_size, leaf_size, dk, dv, v.dtype, batch_heads=b * h, interpret=interpret, **overrides)
    padded = [_pad_time(x, chunk_size) for x in (q, k, erase, v, lam)]
    doc = _pad_time(document_BT.astype(jnp.int32), chunk_size, mode="edge")
    carry = carried_documents(doc, chunk_size)
    out, final = _delta_rule(cfg, *padded[:5], state.astype(F32), doc, carry)
    return out[:, :t], final
