"""What every Pallas-Triton (GPU) kernel file shares: the backend module, the refusal for a call it cannot run
here, compiler parameters, and the small integer helpers of its tile code."""
from __future__ import annotations

import numbers
from typing import Optional

import jax
import jax.numpy as jnp

try:  # Pallas' Triton backend (deprecated upstream since JAX 0.11 but present in 0.10.2 and 0.11.2)
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover
    pltriton = None


def unavailable(backend: str, what: str = "the Pallas-Triton kernel") -> Optional[str]:
    """The reason ``what`` cannot run for ``backend`` (GPU only, Triton backend present), or None."""
    if backend != "gpu":
        return f"{what} runs on GPU only (backend is {backend!r})"
    if pltriton is None:
        return "jax.experimental.pallas.triton is not available in this JAX"
    return None


# JAX's matmul-precision settings that ask a float32 matmul for float32 accuracy (jax.default_matmul_precision)
_FLOAT32_SETTINGS = frozenset({"highest", "float32", "F32_F32_F32", "TF32_TF32_F32_X3"})


def f32_matmul_precision(interpret: bool) -> str:
    """The default precision of a kernel's float32-operand matmuls: what XLA does for a float32 ``jnp.dot`` under
    the same setting. On the GPU XLA's default is one TF32 tensor-core pass ("tf32"); under
    ``jax.default_matmul_precision("highest" / "float32")`` it is float32-accurate, and so are the kernels
    ("highest"), so that a float32 run compared with another implementation means float32. The interpreter
    (CPU) always computes in float32."""
    setting = jax.config.jax_default_matmul_precision
    return "highest" if interpret or str(setting) in _FLOAT32_SETTINGS else "tf32"


def dot_precision(name: str, interpret: bool):
    """A kernel config's float32-matmul precision name -> what ``dot_general`` takes. "tf32": one TF32 tensor-core
    pass; "highest": float32-accurate, as three TF32 passes on the GPU (Triton's tf32x3; a true IEEE float32
    ``tl.dot`` is an FMA loop that compiles for minutes); "ieee": that FMA loop (debugging only). The interpreter
    (CPU) computes plain float32 whatever the name."""
    if interpret or name == "ieee":
        return jax.lax.Precision.HIGHEST
    if name == "tf32":
        return jax.lax.Precision.DEFAULT
    if name == "highest":
        return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    raise ValueError(f"float32 matmul precision {name!r}; expected 'tf32', 'highest' or 'ieee'")


def compiler_params(interpret: bool, num_warps: int, num_stages: Optional[int] = 1):
    """Triton compiler parameters; None in interpret mode (or without the backend)."""
    if interpret or pltriton is None:
        return None
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def pow2(x) -> bool:
    return isinstance(x, numbers.Integral) and x >= 1 and x & (x - 1) == 0


def iota(shape, dim: int = 0):
    """int32 indices along ``dim`` of a tile of ``shape`` (an int: a 1-D tile)."""
    shape = (shape,) if isinstance(shape, numbers.Integral) else tuple(shape)
    return jax.lax.broadcasted_iota(jnp.int32, shape, dim)
