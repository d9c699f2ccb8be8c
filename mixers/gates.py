"""Gate building blocks shared by the delta-family mixers: projections, inits, decay parameterisation.

* ``dense(...)``       a bias-free ``nnx.Linear`` with the layer's init scheme.
* ``LowRank``          ``x W_down W_up (+ c)``: two bias-free factors with **no nonlinearity between them**
                       [FLA kda/gdn2 ``f_proj``/``g_proj``; Muir, Table 19 truncates the product by SVD], and an
                       optional additive bias ``c`` kept as a ``DynamicsParam`` (no weight decay).
* ``a_log_init``       ``A_log = log U(lo, hi)`` per head (GDN: (0, 16); KDA/GDN-2/Muir: (1, 16)) [FLA].
* ``dt_bias_init``     ``inv_softplus(dt)``, ``dt = exp(U(log 1e-3, log 1e-1))`` clamped >= 1e-4 [FLA].
* ``log_decay``        ``lambda = -exp(A_log) * softplus(z + dt_bias)`` in float32 [FLA, GDN2-code].
* ``ReadoutGain``      Muir's static readout gain gamma^stat: a ``DynamicsParam`` (no weight decay) that is
                       nevertheless counted in the "matrices only" parameter convention (models/param_count.py).

Init schemes (``init_scheme`` option of every delta-family layer):
  ``normal``          N(0, spec.init_std) (0.02) for every input-side matrix, as FLA's ``_init_weights``
                      (initializer_range 0.02) and the rest of mixerlab's decoder [FLA].
  ``xavier_uniform``  xavier_uniform with gain 2^-2.5 for every Linear, as the NVlabs GDN-2 training code
                      [GDN2-code].
The output projection always uses N(0, spec.out_init_std) (0.02/sqrt(2L)), the project-wide convention.
"""
from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from mixerlab.mixers.base import DynamicsParam

InitScheme = Literal["normal", "xavier_uniform"]
XAVIER_GAIN = 2.0 ** -2.5


class ReadoutGain(DynamicsParam):
    """Muir's gamma^stat: dynamics (never weight-decayed) but counted as a "matrix" parameter
    (models/param_count.py)."""


def kernel_init(scheme: str, std: float):
    if scheme == "normal":
        return jax.nn.initializers.normal(stddev=std)
    if scheme == "xavier_uniform":
        # variance_scaling(gain^2, fan_avg, uniform) == torch.nn.init.xavier_uniform_(gain=gain)
        return jax.nn.initializers.variance_scaling(XAVIER_GAIN ** 2, "fan_avg", "uniform")
    raise ValueError(f"init_scheme must be 'normal' or 'xavier_uniform', got {scheme!r}")


def dense(d_in: int, d_out: int, *, init_scheme: str, std: float, dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=False, kernel_init=kernel_init(init_scheme, std),
                      dtype=dtype, param_dtype=jnp.float32, rngs=rngs)


def build_qkv(layer: nnx.Module, spec, options, rngs: nnx.Rngs, *, conv_activation: bool = True) -> None:
    """The q, k, v projections (no bias) every recurrent mixer starts with, as ``layer.q_proj/k_proj/v_proj``,
    and with ``options.use_short_conv`` the causal depthwise convs ``layer.q_conv/k_conv/v_conv``
    (SiLU after the conv unless ``conv_activation=False``)."""
    from mixerlab.mixers.short_conv import ShortConv

    d, H, Dk, Dv = spec.d_model, spec.num_heads, spec.head_dim, spec.value_head_dim
    kw = dict(init_scheme=options.init_scheme, std=spec.init_std, dtype=spec.dtype, rngs=rngs)
    layer.q_proj = dense(d, H * Dk, **kw)
    layer.k_proj = dense(d, H * Dk, **kw)
    layer.v_proj = dense(d, H * Dv, **kw)
    if options.use_short_conv:
        ck = dict(kernel_size=options.conv_size, activation=conv_activation, dtype=spec.dtype, rngs=rngs)
        layer.q_conv = ShortConv(H * Dk, **ck)
        layer.k_conv = ShortConv(H * Dk, **ck)
        layer.v_conv = ShortConv(H * Dv, **ck)


QKV_CONVS = (("conv_q", "q_conv"), ("conv_k", "k_conv"), ("conv_v", "v_conv"))  # cache key, layer attribute


def qkv_conv_cache(layer: nnx.Module, batch_size: int) -> dict:
    """Empty decode caches of ``build_qkv``'s short convs (``{}`` without them)."""
    if not layer.options.use_short_conv:
        return {}
    return {key: getattr(layer, conv).init_cache(batch_size) for key, conv in QKV_CONVS}


def qkv_conv_cache_from_sequence(layer: nnx.Module, q, k, v, segment_ids) -> dict:
    """The convs' decode caches after the pre-conv streams q, k, v (each row's last document; ``{}`` without
    convs)."""
    if not layer.options.use_short_conv:
        return {}
    return {key: getattr(layer, conv).cache_from_sequence(x, segment_ids)
            for (key, conv), x in zip(QKV_CONVS, (q, k, v))}


def advance_qkv_convs(layer: nnx.Module, q, k, v, cache: dict, new_cache: dict, advance: str):
    """q, k, v through the short convs continuing their cached inputs (``advance``: "step" for one token,
    "extend" for a chunk); the new conv caches are written into ``new_cache``."""
    out = []
    for (key, conv), x in zip(QKV_CONVS, (q, k, v)):
        y, new_cache[key] = getattr(getattr(layer, conv), advance)(x, cache[key])
        out.append(y)
    return tuple(out)


class StateAndConvCache(nnx.Module):
    """The mixer protocol of a recurrent layer with ``build_qkv``'s projections: one [B, H, d_k, d_v] float32 state
    plus the short convs' caches. A subclass provides ``_run(x, segment_ids) -> (y, final state)`` and
    ``_project(x) -> (q, k, v)`` before the convs, and its own ``extend`` / ``decode``."""

    # ---- mixer protocol --------------------------------------------------------------------------------
    def __call__(self, x_BTD: jax.Array, *, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        del positions  # recurrent: order is given by the sequence itself
        return self._run(x_BTD, segment_ids)[0]

    def init_cache(self, batch_size: int, max_length: int = 0) -> dict:
        del max_length  # constant-size state
        H, Dk, Dv = self.num_heads, self.head_dim, self.value_head_dim
        return {"state": jnp.zeros((batch_size, H, Dk, Dv), jnp.float32), **qkv_conv_cache(self, batch_size)}

    def prefill(self, x_BTD: jax.Array, *, segment_ids: jax.Array | None = None,
                positions: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """Parallel forward that also returns the decode cache continuing each row's last document."""
        del positions
        y, state = self._run(x_BTD, segment_ids)
        convs = (qkv_conv_cache_from_sequence(self, *self._project(x_BTD.astype(self.dtype)), segment_ids)
                 if self.options.use_short_conv else {})
        return y, {"state": state.astype(jnp.float32), **convs}


def zeros_like_linear(layer: nnx.Linear) -> None:
    layer.kernel[...] = jnp.zeros_like(layer.kernel[...])


class LowRank(nnx.Module):
    """``z = x W_down W_up + c`` (bias optional). Output in float32 (gate pre-activations)."""

    def __init__(self, d_in: int, rank: int, d_out: int, *, use_bias: bool, init_scheme: str, std: float,
                 dtype, rngs: nnx.Rngs):
        self.down = dense(d_in, rank, init_scheme=init_scheme, std=std, dtype=dtype, rngs=rngs)
        self.up = dense(rank, d_out, init_scheme=init_scheme, std=std, dtype=dtype, rngs=rngs)
        self.bias = DynamicsParam(jnp.zeros((d_out,), jnp.float32)) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        z = self.up(self.down(x)).astype(jnp.float32)
        return z + self.bias[...] if self.bias is not None else z


def a_log_init(key: jax.Array, shape, low: float, high: float) -> jax.Array:
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, low, high))


def inverse_softplus(x: jax.Array) -> jax.Array:
    return x + jnp.log(-jnp.expm1(-x))


def dt_bias_init(key: jax.Array, shape, dt_min: float = 1e-3, dt_max: float = 1e-1,
                 dt_floor: float = 1e-4) -> jax.Array:
    u = jax.random.uniform(key, shape, jnp.float32)
    dt = jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    return inverse_softplus(jnp.maximum(dt, dt_floor))


def log_decay(z: jax.Array, a_log: jax.Array | None, dt_bias: jax.Array | None = None) -> jax.Array:
    """``lambda = -exp(A_log) * softplus(z + dt_bias)`` (float32, <= 0). ``a_log`` broadcasts against z."""
    z = z.astype(jnp.float32)
    if dt_bias is not None:
        z = z + dt_bias
    sp = jax.nn.softplus(z)
    return -sp if a_log is None else -jnp.exp(a_log) * sp


def split_heads(x: jax.Array, num_heads: int) -> jax.Array:
    return x.reshape(*x.shape[:-1], num_heads, x.shape[-1] // num_heads)
