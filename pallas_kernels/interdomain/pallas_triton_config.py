"""The Pallas-Triton interdomain kernels' :class:`Config`, its checks (``make_config``) and :func:`supports`."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp

from mixerlab.pallas_kernels.triton_common import dot_precision, f32_matmul_precision, pow2, unavailable

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
    precision: str = "tf32"  # GEMMs with f32 operands (f32 inputs): "tf32" | "highest"; make_config's default
    #   follows jax.default_matmul_precision (f32_matmul_precision)
    range_sums: str = "auto"  # the 0/1 range-sum matmuls: "tf32x3" | "tf32" | "auto" (see sum_precision)
    block_m: int = 32  # modes per pass of the forward kernels (per-mode tiles are [K, BM])
    block_m_backward: int = 16  # the same for the backward kernels (more live tiles: smaller blocks)
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
        return dot_precision(self.precision, self.interpret)

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


def make_config(chunk, key_dim, value_dim, modes, operand_dtype, *, interpret=False, **overrides):
    base = dict(chunk=chunk, key_dim=key_dim, value_dim=value_dim, modes=modes,
                operand_dtype=jnp.dtype(operand_dtype), precision=f32_matmul_precision(interpret),
                block_m=min(32, modes), block_m_backward=min(16, modes), interpret=interpret)
    base.update(overrides)
    cfg = Config(**base)
    if cfg.precision not in ("tf32", "highest"):
        raise ValueError(f"interdomain pallas_triton: precision={cfg.precision!r}; expected 'tf32' or 'highest'")
    if cfg.range_sums not in ("auto", "tf32", "tf32x3"):
        raise ValueError(f"interdomain pallas_triton: range_sums={cfg.range_sums!r}; expected 'auto', 'tf32' or "
                         "'tf32x3'")
    if not pow2(cfg.chunk):
        raise ValueError(f"interdomain pallas_triton: chunk={cfg.chunk} must be a power of two")
    for name in ("block_m", "block_m_backward"):
        bm = getattr(cfg, name)
        if not pow2(bm) or cfg.modes % bm:
            raise ValueError(f"interdomain pallas_triton: {name}={bm} must be a power of two dividing "
                             f"modes={cfg.modes}")
    return cfg


def supports(call) -> Optional[str]:
    """``None`` when this kernel can serve ``call`` (an ``api.InterdomainCall``; op "interdomain" or "s4d",
    whose key_dim is 0), else the reason."""
    if call.op not in ("interdomain", "s4d"):
        return f"op {call.op!r} has no Pallas-Triton kernel"
    reason = unavailable(getattr(call, "backend", None))
    if reason:
        return reason
    if call.chunk_size not in SUPPORTED_CHUNKS:
        return f"chunk_size={call.chunk_size} not in {SUPPORTED_CHUNKS}"
    dims = [("value_dim", call.value_dim, MAX_HEAD_DIM), ("modes", call.modes, MAX_MODES)]
    if call.op == "interdomain":
        dims.insert(0, ("key_dim", call.key_dim, MAX_HEAD_DIM))
    for name, d, top in dims:
        if not pow2(d) or d < _MIN_DIM or d > top:
            return f"{name}={d}: needs a power of two in [{_MIN_DIM}, {top}]"
    if jnp.dtype(call.dtype) not in _DTYPES:
        return f"dtype {jnp.dtype(call.dtype).name} not supported (float32, bfloat16, float16)"
    return None
