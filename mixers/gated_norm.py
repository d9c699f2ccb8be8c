"""Per-head gated RMSNorm on the mixer output: ``y = RMSNorm(o; eps) * omega * act(g)``.

Order as FLA's ``FusedRMSNormGated`` / NVlabs' ``FusedRMSNormSwishGate`` [FLA ``fused_norm_gate.py``,
GDN2-code]: ``y = (o * rstd) * omega * act(g)`` with ``rstd = 1/sqrt(mean(o^2) + eps)`` over the head's d_v
channels. ``omega`` (``[d_v]``, init 1) is shared by all heads. ``act`` is ``silu`` (g * sigmoid(g)),
``sigmoid``, or ``none`` (no gate: a plain RMSNorm). Computed in float32, returned in ``dtype``.
"""
from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

GateActivation = Literal["silu", "sigmoid"]


def gate_activation(name: str):
    if name == "silu":
        return jax.nn.silu
    if name == "sigmoid":
        return jax.nn.sigmoid
    raise ValueError(f"output gate activation must be 'silu' or 'sigmoid', got {name!r}")


class GatedRMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float = 1e-5, activation: str = "silu", dtype=jnp.float32):
        self.eps = eps
        self.act = gate_activation(activation)
        self.dtype = dtype
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))

    def __call__(self, o_BTHV: jax.Array, g_BTHV: jax.Array | None = None) -> jax.Array:
        o = o_BTHV.astype(jnp.float32)
        rstd = jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + self.eps)
        y = o * rstd * self.scale[...]
        if g_BTHV is not None:
            y = y * self.act(g_BTHV.astype(jnp.float32))
        return y.astype(self.dtype)
