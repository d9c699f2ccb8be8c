"""Configuration of the Pallas-Triton delta-rule kernels (``pallas_triton.py``): the :class:`Config` of tile
sizes, warps, precisions and numerical options, :func:`make_config` (defaults and checks) and :func:`supports`
(what the kernels serve)."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax.numpy as jnp

from mixerlab.pallas_kernels.triton_common import dot_precision, f32_matmul_precision, pow2, unavailable


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
    leaf: int  # diagonal blocks of the inverse (Neumann product), then 2×2 merges up to the chunk
    key_dim: int
    value_dim: int
    operand_dtype: jnp.dtype  # matmul operands of the big products (bf16 or f32)
    inverse_precision: str = "highest"  # f32-operand matmuls (P = (I + A)⁻¹; all with f32 inputs): "tf32" |
    #   "highest" | "ieee"; make_config's default follows jax.default_matmul_precision (f32_matmul_precision)
    scan_block_v: int = 64  # Dv block of the sequential kernels (more CTAs when B·H is small)
    block_k: int = 64  # key channels per pass of K1 and B2
    warps_intra: int = 4
    warps_rhs: int = 4
    warps_scan: int = 4
    warps_output: int = 4
    warps_cotangents: int = 4
    warps_key_grads: int = 4
    stages_scan: int = 2
    stages_scan_output: int = 2  # make_config: 1 for ≥ 256 programs (242 registers and 32 KB instead of 136 KB:
    #                              two per SM), else 2 (the loads of the next chunk in flight)
    decay_sums: str = "auto"  # log-decay sums on the tensor cores: "tf32x2" | "tf32" | "auto" (see _split)
    end_decays: str = "sums"  # E's exponent: "sums" (its own 0/1 matmul) or "difference" (the chunk total minus
    #                           π's: one decay-sum matmul fewer per key block in K1, B0 and B2b; off by
    #                           ≈ 2⁻²³·|Λ_C|, 1.5e-4 relative in E for a chunk total of −1280; passes the GPU
    #                           tests; on the H200 no faster: forward 1.931 against 1.917 ms at 8·4096)
    two_pass: bool = True  # with bounded_span: K1 runs a first pass specialised to the whole chunk's cut (every pair
    #                        through the middle pivot, no cut search, no exact level) that flags the chunks where
    #                        some key block's half-chunk sums leave [−span, 0]; a second pass recomputes only those
    #                        with the search (H200, 8·4096·16·128 bf16: the forward's K1 1.43 → 1.19 ms with the
    #                        search removed; see _chunk_matrices)
    two_pass_key_grads: bool = True  # with two_pass in training: B2b as two kernels too (every program on the whole
    #                                  chunk's cut where K1 flagged nothing, then the search for the flagged chunks)
    fold_solve: bool = True  # a forward without backward: K1 writes M P, K̂⊙π and Pᵀ(K⊙E) instead of M, U = P V̂,
    #                          Y and K⊙E, and scan_output reads V̂ itself (Ũ = P (V̂ − (K̂⊙π) S₀) is never formed:
    #                          O = (Q̂⊙π) S₀ + (M P) W, S ← π_C S₀ + (Pᵀ(K⊙E))ᵀ W with W = V̂ − (K̂⊙π) S₀;
    #                          H200, 8·4096·16·128 bf16: forward 2.08 → 1.99 ms, K1 1.71 → 1.60 ms)
    pair_grads_f32: bool = False  # B2b's pivot-level matmuls with f32 operands (TF32 on the GPU): bf16 dλ error
    #                               6.3e-3 -> 2.5e-3 in interpret mode, +3.1 ms in B2b on the H200 (of 5.1)
    bounded_span: Optional[float] = 60.0  # per key block, pairs inside the largest nodes whose half-node decay
    #                                        sums all lie in [−span, 0] take one product through the node's pivot
    #                                        (factors e^{±x}, x ≤ span) instead of one per pivot level; None:
    #                                        always the exact tree (every exponent ≤ 0; the default for float16
    #                                        operands, whose range ends at e^11). See _bounded_cut.
    save_rhs: bool = True  # keep the forward's U, Y, Q̂⊙π, K⊙E, π_C for the backward instead of running B0
    #                        (with save_matrices; 3·Dk + Dv operand-dtype numbers more per token and head)
    fuse_output: bool = True  # a forward without backward (inference, evaluation) runs K2 and K3 as one kernel
    #                           that writes no S₀ or Ũ (the training forward keeps S₀ and runs them apart)
    save_matrices: bool = True  # keep M and P (C×C per chunk, operand dtype) for the backward instead of
    #                             running K1 again (≈ 17 % more residual bytes at C 64, D 128, bf16, f32 λ)
    has_erase: bool = True  # False (the op got no erase key: linear attention, GLA-style gated mixers): no A, no
    #                         inverse P, no U = P V̂, Y = P (K̂⊙π) or Ũ = U − Y S₀ and none of their backward; the
    #                         chunk is O = (Q̂⊙π) S₀ + M V̂, S ← Diag(π_C) S + (K⊙E)ᵀ V̂ (kernels specialised on it)
    interpret: bool = False

    @property
    def levels(self):
        """Levels of the pivot tree, half sizes 1, 2, …, C/2 (every strictly lower pair is in one level);
        the inverse merges the levels with half ≥ leaf."""
        return int(math.log2(self.chunk))

    @property
    def resolved_decay_sums(self):
        """"auto": "tf32" with 16-bit operands (the sums' error stays under the operands' rounding), else
        "tf32x2" (f32-accurate)."""
        if self.decay_sums != "auto":
            return self.decay_sums
        return "tf32" if self.operand_dtype.itemsize == 2 else "tf32x2"

    @property
    def precision(self):
        """"tf32": one TF32 tensor-core pass; "highest": float32-accurate, as three TF32 passes on the GPU
        (Triton's tf32x3; a true IEEE f32 tl.dot is an FMA loop that compiles for minutes) and plain f32 in
        interpret mode; "ieee": Triton's FMA-based IEEE f32 dot (slow to compile and run; debugging only)."""
        return dot_precision(self.inverse_precision, self.interpret)


def default_block_v(batch_heads: int, value_dim: int) -> int:
    """Dv block of the sequential kernels: the largest of 64/32/16 that still gives ≥ 128 CTAs."""
    for bv in (64, 32):
        if bv <= value_dim and batch_heads * (value_dim // bv) >= 128:
            return bv
    return min(16, value_dim) if value_dim >= 16 else value_dim


def make_config(chunk, leaf, key_dim, value_dim, operand_dtype, *, batch_heads=128, interpret=False, **overrides):
    operand_dtype = jnp.dtype(operand_dtype)
    base = dict(chunk=chunk, leaf=leaf, key_dim=key_dim, value_dim=value_dim, operand_dtype=operand_dtype,
                inverse_precision=f32_matmul_precision(interpret),
                scan_block_v=default_block_v(batch_heads, value_dim), block_k=min(32, key_dim),
                bounded_span=None if operand_dtype == jnp.dtype(jnp.float16) else 60.0, interpret=interpret)
    base.update(overrides)
    if "stages_scan_output" not in overrides:  # one buffer lets two programs share an SM; worth it with more
        # programs than SMs (8·4096, 16 heads: 256 programs, forward 0.05 ms faster on the H200); with one
        # program per SM the second buffer hides the loads (1·32768: with one stage the forward went 3.10 →
        # 3.70 ms although K1 got faster)
        programs = batch_heads * (value_dim // base["scan_block_v"])
        base["stages_scan_output"] = 1 if programs >= 256 else 2
    cfg = Config(**base)
    if cfg.decay_sums not in ("auto", "tf32", "tf32x2"):
        raise ValueError(f"pallas_triton: decay_sums={cfg.decay_sums!r}; expected 'auto', 'tf32' or 'tf32x2'")
    if cfg.end_decays not in ("sums", "difference"):
        raise ValueError(f"pallas_triton: end_decays={cfg.end_decays!r}; expected 'sums' or 'difference'")
    if cfg.bounded_span is not None and operand_dtype == jnp.dtype(jnp.float16):
        raise ValueError(f"pallas_triton: bounded_span={cfg.bounded_span!r} with float16 operands; the factors "
                         "e^{±span} need an 8-bit exponent (float32, bfloat16): float16 overflows above e^11. "
                         "Use bounded_span=None (the default for float16)")
    if cfg.bounded_span is not None and not 0 < cfg.bounded_span <= 80:
        raise ValueError(f"pallas_triton: bounded_span={cfg.bounded_span!r}; expected None (the exact pivot tree) "
                         "or a number in (0, 80] (factors e^{±span} stay normal f32 / bf16 numbers)")
    if cfg.key_dim % cfg.block_k or cfg.block_k < _MIN_DIM or not pow2(cfg.block_k):
        raise ValueError(f"pallas_triton: block_k={cfg.block_k} must be a power of two ≥ {_MIN_DIM} dividing "
                         f"key_dim={cfg.key_dim}")
    return cfg


def supports(call) -> Optional[str]:
    """``None`` when this kernel can serve ``call`` (an ``api.DeltaRuleCall``), else the reason."""
    reason = unavailable(getattr(call, "backend", None))
    if reason:
        return reason
    if call.chunk_size not in SUPPORTED_CHUNKS:
        return f"chunk_size={call.chunk_size} not in {SUPPORTED_CHUNKS}"
    if call.leaf_size not in SUPPORTED_LEAVES or call.leaf_size * 2 > call.chunk_size:
        return f"leaf_size={call.leaf_size} not in {SUPPORTED_LEAVES} (with chunk_size ≥ 2·leaf_size)"
    for name, d in (("key_dim", call.key_dim), ("value_dim", call.value_dim)):
        if not pow2(d) or d < _MIN_DIM or d > MAX_HEAD_DIM:
            return f"{name}={d}: needs a power of two in [{_MIN_DIM}, {MAX_HEAD_DIM}]"
    if jnp.dtype(call.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(call.dtype).name} not supported (float32, bfloat16, float16)"
    return None
