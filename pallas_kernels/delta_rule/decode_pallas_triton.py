"""One-token delta-rule step on GPU through Pallas' Triton backend: the decode path of generation.

The same fused single pass as the XLA step in ``decode.py`` (docs/math/delta_rule.md, 'Decode step'), as one
kernel that reads each state block once and writes it once:

    a = e^λ;  S̃ = Diag(a) S;  r = k̂ S̃;  p = q̂ S̃;  u = v̂ − r;  o = p + ⟨q̂, k⟩ u;  S ← S̃ + kᵀ u

Grid (B, H, Dv / BV): a program owns the state block S[:, j·BV:(j+1)·BV] (Dk × BV, float32) in registers.
Decoding is memory-bound (the whole state is read and written per token, 2·4·Dk·Dv bytes per head), so the
kernel's job is to touch S exactly twice; XLA's step reads it for the two products and again for the update.
The state is updated in place (``input_output_aliases``), so a jitted decode loop keeps one state buffer.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from mixerlab.pallas_kernels.triton_common import compiler_params, unavailable


F32 = jnp.float32
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_MIN_DIM, _MAX_DIM = 16, 256


def block_v(value_dim: int) -> int:
    """Value columns per program: 32 keeps a Dk=256 state block at 64 registers per thread (4 warps)."""
    return min(32, value_dim)


def supports(backend: str, key_dim: int, value_dim: int, dtype, state_dtype) -> Optional[str]:
    """``None`` when the kernel can run this step, else the reason."""
    reason = unavailable(backend, "the Pallas-Triton decode kernel")
    if reason:
        return reason
    for name, d in (("key_dim", key_dim), ("value_dim", value_dim)):
        if d < _MIN_DIM or d > _MAX_DIM or d & (d - 1):
            return f"{name}={d}: needs a power of two in [{_MIN_DIM}, {_MAX_DIM}]"
    if jnp.dtype(dtype) not in _DTYPES:
        return f"dtype {jnp.dtype(dtype).name} not supported (float32, bfloat16, float16)"
    if jnp.dtype(state_dtype) != jnp.dtype(F32):
        return f"state dtype {jnp.dtype(state_dtype).name}: the kernel keeps a float32 state"
    return None


def _kernel(q_ref, k_ref, erase_ref, log_decay_ref, v_ref, state_ref, out_ref, state_out):
    decay = jnp.exp(log_decay_ref[...].astype(F32))
    q, k, erase = (r[...].astype(F32) for r in (q_ref, k_ref, erase_ref))
    decayed = decay[:, None] * state_ref[...]
    pseudo_value = v_ref[...].astype(F32) - jnp.sum(erase[:, None] * decayed, axis=0)
    out = jnp.sum(q[:, None] * decayed, axis=0) + jnp.sum(q * k) * pseudo_value
    state_out[...] = decayed + k[:, None] * pseudo_value[None, :]
    out_ref[...] = out.astype(out_ref.dtype)


def step(q, k, erase, v, log_decay, state, *, interpret: bool = False, num_warps: int = 4):
    """q, k, erase, log_decay [B, H, Dk]; v [B, H, Dv]; state [B, H, Dk, Dv] float32.
    Returns (o [B, H, Dv] in v's dtype, new state float32)."""
    b, h, dk = q.shape
    dv = v.shape[-1]
    bv = block_v(dv)
    vec = pl.BlockSpec((None, None, dk), lambda i, j, n: (i, j, 0))
    val = pl.BlockSpec((None, None, bv), lambda i, j, n: (i, j, n))
    st = pl.BlockSpec((None, None, dk, bv), lambda i, j, n: (i, j, 0, n))
    params = compiler_params(interpret, num_warps)
    bytes_accessed = 2 * state.size * 4 + 4 * q.size * q.dtype.itemsize + 2 * v.size * v.dtype.itemsize
    return pl.pallas_call(
        _kernel,
        grid=(b, h, dv // bv),
        in_specs=[vec, vec, vec, vec, val, st],
        out_specs=[val, st],
        out_shape=[jax.ShapeDtypeStruct((b, h, dv), v.dtype), jax.ShapeDtypeStruct((b, h, dk, dv), F32)],
        input_output_aliases={5: 1},
        compiler_params=params,
        interpret=interpret,
        cost_estimate=pl.CostEstimate(flops=int(8 * b * h * dk * dv), transcendentals=int(b * h * dk),
                                      bytes_accessed=int(bytes_accessed)),
        name="delta_rule_decode_step",
    )(q, k, erase, log_decay, v, state)
