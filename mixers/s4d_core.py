"""Pieces shared by the ``interdomain`` and ``s4d`` mixers (docs/math/interdomain.md, 'The layer').

* ``BiasedShortConv``  causal depthwise conv (``mixers.short_conv.ShortConv``, segment resets, decode cache, extend)
                       **with a bias** (the IA parameter counts need it, IA1 Table 3), activation left to the caller.
                       Bias init U(±1/√K) (PyTorch ``nn.Conv1d``).
* ``HeadInputNorm``    Eq. 12: ``RMSNorm(x_h) * γ + β_h`` per head; γ ∈ R^{d_h} shared across heads, β_h per head
                       (both ``SSMParam``: the IA recipe caps the input-norm LR at 1e-3 and never decays them).
* ``S4DCore``          the complex diagonal SSM parameters per head: A = −exp(a_re) + i a_im (a_re = log ½,
                       a_im = S4D-Inv), Δ = exp(log_dt) (log-uniform in [dt_min, dt_max]; both logs smoothly
                       capped so that r = Δ Re A is ≤ 0 and finite for any parameters), full complex C_h
                       (M×M, re + im). A and Δ are ``SSMParam``; C_h is ``DynamicsParam`` (main LR, no weight
                       decay; IAs) or ``SSMParam`` with ``c_lr_group="ssm"`` (IA1). No B_h (B = 1, ZOH gain).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from mixerlab.pallas_kernels import dispatch
from mixerlab.pallas_kernels.interdomain import api as ia_op  # the module, whatever the package re-exports
from mixerlab.mixers.base import DynamicsParam, SSMParam
from mixerlab.mixers.short_conv import ShortConv


def add_channel_bias(y, bias):
    """y + bias over the last axis. On a GPU the bias gradient is reduced apart (``_bias_reduced_apart``): left to
    autodiff, XLA:GPU fuses that reduction over all tokens into the producer of the cotangent (in the interdomain
    mixer, the rotary embedding's backward) as one multi-output fusion, which on the H200 took 0.84 ms per layer
    at 8 × 4096 × 768, about ten times what the elementwise work and the reduction need apart (the 125M
    interdomain step: 0.173 → 0.166 s). On a TPU the fused form is the cheaper one (apart, the cotangent is
    written and read once more), so it stays."""
    if dispatch.target_backend() == "gpu":
        return _bias_reduced_apart(y, bias)
    return y + bias


@jax.custom_vjp
def _bias_reduced_apart(y, bias):
    return y + bias


def _bias_apart_fwd(y, bias):
    return y + bias, (bias, jnp.zeros((), y.dtype))  # the second: y's dtype, for its cotangent


def _bias_apart_bwd(residuals, dy):
    bias, y_dtype = residuals
    apart = jax.lax.optimization_barrier(dy)  # materialised first, then reduced by a fusion of its own
    return dy.astype(y_dtype.dtype), jnp.sum(apart, axis=tuple(range(dy.ndim - 1))).astype(bias.dtype)


_bias_reduced_apart.defvjp(_bias_apart_fwd, _bias_apart_bwd)


class BiasedShortConv(nnx.Module):
    def __init__(self, channels: int, kernel_size: int, *, use_bias: bool = True, rngs: nnx.Rngs):
        self.conv = ShortConv(channels, kernel_size, activation=False, dtype=jnp.float32, rngs=rngs)
        bound = 1.0 / math.sqrt(kernel_size)
        self.bias = (nnx.Param(jax.random.uniform(rngs.params(), (channels,), jnp.float32, -bound, bound))
                     if use_bias else None)

    def _add_bias(self, y):
        return y if self.bias is None else add_channel_bias(y, self.bias[...])

    def __call__(self, x_BTC, segment_ids_BT=None):
        return self._add_bias(self.conv(x_BTC, segment_ids_BT))

    def step(self, x_BC, cache):
        y, cache = self.conv.step(x_BC, cache)
        return self._add_bias(y), cache

    def extend(self, x_BTC, cache):
        y, cache = self.conv.extend(x_BTC, cache)
        return self._add_bias(y), cache

    def init_cache(self, batch_size: int):
        return self.conv.init_cache(batch_size)

    def cache_from_sequence(self, x_BTC, segment_ids_BT=None):
        return self.conv.cache_from_sequence(x_BTC, segment_ids_BT)


def rms(x, eps):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class HeadInputNorm(nnx.Module):
    def __init__(self, num_heads: int, dim: int, *, eps: float):
        self.eps = eps
        self.scale = SSMParam(jnp.ones((dim,), jnp.float32))
        self.bias = SSMParam(jnp.zeros((num_heads, dim), jnp.float32))

    def __call__(self, x_BTHD):
        return rms(x_BTHD, self.eps) * self.scale[...] + self.bias[...]


class S4DCore(nnx.Module):
    def __init__(self, num_heads: int, num_modes: int, *, s4d_inv_n: str, dt_min: float, dt_max: float,
                 c_init: str, c_lr_group: str, rngs: nnx.Rngs):
        if num_modes < 1:
            raise ValueError(f"num_modes must be >= 1, got {num_modes}")
        if s4d_inv_n not in ("M", "2M"):
            raise ValueError(f"s4d_inv_n must be 'M' or '2M', got {s4d_inv_n!r}")
        if not 0.0 < dt_min <= dt_max:
            raise ValueError(f"need 0 < dt_min <= dt_max, got dt_min={dt_min}, dt_max={dt_max}")
        if c_lr_group not in ("main", "ssm"):
            raise ValueError(f"c_lr_group must be 'main' or 'ssm', got {c_lr_group!r}")
        H, M = num_heads, num_modes
        self.num_heads, self.num_modes = H, M
        n = M if s4d_inv_n == "M" else 2 * M
        self.a_re = SSMParam(jnp.full((H, M), math.log(0.5), jnp.float32))
        self.a_im = SSMParam(jnp.broadcast_to(ia_op.s4d_inv_imag(M, n), (H, M)).astype(jnp.float32))
        u = jax.random.uniform(rngs.params(), (H,), jnp.float32)
        self.log_dt = SSMParam(math.log(dt_min) + u * (math.log(dt_max) - math.log(dt_min)))
        c_cls = DynamicsParam if c_lr_group == "main" else SSMParam
        if c_init == "identity":
            c_re, c_im = jnp.broadcast_to(jnp.eye(M, dtype=jnp.float32), (H, M, M)), jnp.zeros((H, M, M), jnp.float32)
        elif c_init == "normal":  # CN(0, 1/M)
            k1, k2 = jax.random.split(rngs.params())
            s = (2.0 * M) ** -0.5
            c_re = s * jax.random.normal(k1, (H, M, M), jnp.float32)
            c_im = s * jax.random.normal(k2, (H, M, M), jnp.float32)
        else:
            raise ValueError(f"c_init must be 'identity' or 'normal', got {c_init!r}")
        self.c_re, self.c_im = c_cls(c_re), c_cls(c_im)

    def dynamics(self):
        """(static log-modulus Δ Re A [H,M], phase Δ Im A [H,M], ZOH gain [H,2M]) in float32.

        The log-modulus r = −exp(a_re)·exp(log_dt) is ≤ 0 for every parameter value, and finite because both
        logs pass a smooth cap first (``soft_cap``: the identity to float32 precision below it, so the S4D
        initialisation and ordinary training are unchanged); |r| ≤ e^{2·LOG_CAP}, Δ ≤ e^{LOG_CAP}."""
        a_re = -jnp.exp(soft_cap(self.a_re[...], LOG_CAP))
        a_im = self.a_im[...]
        delta = jnp.exp(soft_cap(self.log_dt[...], LOG_CAP))
        return delta[:, None] * a_re, delta[:, None] * a_im, ia_op.zoh_input_gain(a_re, a_im, delta)


# exp(20) ≈ 4.9e8: far above any trained |Re A| or Δ (Δ starts ≤ 0.1), far below float32 overflow even as a
# product (|r| ≤ e^{40} ≈ 2.4e17, θ = Δ Im A finite for |Im A| < 7e29)
LOG_CAP = 20.0


def soft_cap(x, cap):
    """x − softplus(x − cap) = cap − softplus(cap − x): smooth and increasing, x − O(e^{x − cap}) below the
    cap (exactly x in float32 well below it), → cap above it, +inf ↦ cap. Not a clamp: the gradient
    1 − sigmoid(x − cap) never becomes exactly zero for finite x. Each branch is the form without cancellation
    on its side of the cap."""
    return jnp.where(x < cap, x - jax.nn.softplus(x - cap), cap - jax.nn.softplus(cap - x))
