"""Mamba-2 (Dao & Gu 2024, "Transformers are SSMs", §7 the Mamba-2 block, SSD layer §6); block as FLA's
``fla/layers/mamba2.py`` (its ``torch_forward`` path). Math in docs/mixers.md, 'Recurrent baselines'.

Heads and widths from the model spec: H = spec.num_heads heads of P = spec.value_head_dim channels (Mamba's
``head_dim``; the inner width H·P is Mamba's ``expand · d_model``), state size N = spec.head_dim (Mamba's
``d_state``, the key width of the op), G = ``n_groups`` groups of B and C.

```
z, xBC, dt_raw = split(x W_in)                     widths H·P, H·P + 2·G·N, H;  W_in: d -> 2·H·P + 2·G·N + H
xBC            = SiLU(ShortConv_K(xBC) + b_conv)   one causal depthwise conv over [x, B, C] (resets at documents)
x, B, C        = split(xBC)                        x [H, P]; B, C [G, N], group g = h // (H/G) serves head h
dt             = softplus(dt_raw + dt_bias)        per head, float32 (float64 under x64);  A = -exp(A_log)
S_t            = exp(dt_t A) S_{t-1} + B_t^T (dt_t x_t)        S in R^{N x P} per head
y_t            = C_t S_t + D x_t
out            = (RMSNorm_group(y ⊙ SiLU(z)) * omega) W_out     the norm over each group's H·P/G channels
op inputs:  q = C, k = B per group [B,T,G,N], v = dt·x, log_decay = dt·A [B,T,H] (no scale on q): the SSD op
            (pallas_kernels.ssd; the one-token decode step repeats q and k per head for the delta-rule step).
```
Inits [FLA ``Mamba2`` / ``Mamba2PreTrainedModel._init_weights``]: A_log = log U(1, 16), dt_bias = inv_softplus(dt)
with dt ~ logU(1e-3, 1e-1) clamped >= 1e-4, D = 1 (all per head, ``DynamicsParam``); conv bias 0; omega 1.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from mixerlab import pallas_kernels
from mixerlab.mixers.base import DynamicsParam, MixerSpec, reset_rows
from mixerlab.mixers.gates import a_log_init, dense, dt_bias_init
from mixerlab.mixers.registry import register
from mixerlab.mixers.short_conv import ShortConv


@dataclasses.dataclass(frozen=True)
class Mamba2Options:
    """Mamba-2 options (config keys ``mixers.mamba2.<field>``).

    n_groups: int = 1            groups of B and C, each shared by H/G consecutive heads [FLA, Mamba-2 §7.2].
    conv_size: int = 4           kernel width of the short conv over [x, B, C] [FLA ``conv_kernel``].
    use_conv_bias: bool = True   a bias after the conv, before SiLU, init 0 [FLA ``use_conv_bias``].
    a_init_low: float = 1.0      A = U(a_init_low, a_init_high), A_log = log A [FLA ``A_init_range``].
    a_init_high: float = 16.0
    dt_min: float = 1e-3         dt init range, log-uniform [FLA].
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4  dt init clamp [FLA].
    norm_eps: float = 1e-5       eps of the gated RMSNorm [FLA].
    init_scheme: "normal"        N(0, spec.init_std) for W_in (FLA's ``initializer_range``) | "xavier_uniform";
                                 W_out is N(0, spec.out_init_std) [ours: the decoder's convention, where FLA
                                 re-inits ``out_proj`` by kaiming-uniform / sqrt(L)].
    implementation: str = "auto" which implementation of the SSD op (pallas_kernels.ssd: "auto", "xla",
                                 "reference", "pallas_triton", "pallas_tpu", "delta_rule_triton").
    chunk_size: int = 0          chunk length of the chunkwise op; 0 = the op's default.
    leaf_size: int = 0           leaf size of the op's block inverse; 0 = the op's default.
    """

    n_groups: int = 1
    conv_size: int = 4
    use_conv_bias: bool = True
    a_init_low: float = 1.0
    a_init_high: float = 16.0
    dt_min: float = 1e-3
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    norm_eps: float = 1e-5
    init_scheme: Literal["normal", "xavier_uniform"] = "normal"
    implementation: str = "auto"
    chunk_size: int = 0
    leaf_size: int = 0

    def __post_init__(self):
        if self.n_groups < 1:
            raise ValueError(f"mixers.mamba2.n_groups must be >= 1, got {self.n_groups}")
        if not 0 < self.a_init_low <= self.a_init_high:
            raise ValueError("mixers.mamba2.a_init_low/a_init_high must satisfy 0 < low <= high, got "
                             f"{self.a_init_low}, {self.a_init_high}")
        if not 0 < self.dt_min <= self.dt_max:
            raise ValueError(f"mixers.mamba2.dt_min/dt_max must satisfy 0 < min <= max, got {self.dt_min}, "
                             f"{self.dt_max}")


@register("mamba2", Mamba2Options)
class Mamba2(nnx.Module):
    def __init__(self, spec: MixerSpec, options: Mamba2Options, *, rngs: nnx.Rngs):
        H, G = spec.num_heads, options.n_groups
        if H % G:
            raise ValueError(f"mixers.mamba2.n_groups={G} must divide model.num_heads={H}")
        self.spec, self.options, self.dtype = spec, options, spec.dtype
        self.acc = jnp.promote_types(spec.dtype, jnp.float32)  # gates, skip and norm: float32 (float64 for float64)
        self.num_heads, self.state_dim, self.head_dim = H, spec.head_dim, spec.value_head_dim
        self.inner = H * self.head_dim
        self.conv_dim = self.inner + 2 * G * self.state_dim
        kw = dict(init_scheme=options.init_scheme, std=spec.init_std, dtype=spec.dtype, rngs=rngs)
        self.in_proj = dense(spec.d_model, self.inner + self.conv_dim + H, **kw)
        self.conv = ShortConv(self.conv_dim, options.conv_size, activation=False, dtype=spec.dtype, rngs=rngs)
        self.conv_bias = nnx.Param(jnp.zeros((self.conv_dim,), jnp.float32)) if options.use_conv_bias else None
        self.A_log = DynamicsParam(a_log_init(rngs.params(), (H,), options.a_init_low, options.a_init_high))
        self.dt_bias = DynamicsParam(dt_bias_init(rngs.params(), (H,), options.dt_min, options.dt_max,
                                                  options.dt_init_floor))
        self.D = DynamicsParam(jnp.ones((H,), jnp.float32))
        self.norm_scale = nnx.Param(jnp.ones((self.inner,), jnp.float32))
        self.out_proj = dense(self.inner, spec.d_model, init_scheme="normal", std=spec.out_init_std,
                              dtype=spec.dtype, rngs=rngs)

    # ---- pieces ----------------------------------------------------------------------------------------
    def _project(self, x):
        """x [..., d] -> z [..., H·P], pre-conv xBC [..., conv_dim], dt_raw [..., H]."""
        zxbcdt = self.in_proj(x.astype(self.dtype))
        return jnp.split(zxbcdt, [self.inner, self.inner + self.conv_dim], axis=-1)

    def _conv_act(self, y):
        """The conv output -> SiLU(y + b_conv), in the compute dtype."""
        y = y.astype(self.acc)
        if self.conv_bias is not None:
            y = y + self.conv_bias[...]
        return jax.nn.silu(y).astype(self.dtype)

    def _op_inputs(self, xbc, dt_raw):
        """Post-conv xBC [..., conv_dim] and dt_raw [..., H] -> q = C, k = B (per group [..., G, N]), v = dt·x, the
        log decay dt·A [..., H], and x itself (for the D skip); heads on axis -2. Group g serves heads
        g·H/G .. (g+1)·H/G - 1 (Mamba-2's kernels; FLA's decode path)."""
        H, G, N, P = self.num_heads, self.options.n_groups, self.state_dim, self.head_dim
        x, b, c = jnp.split(xbc, [self.inner, self.inner + G * N], axis=-1)
        x = x.reshape(*x.shape[:-1], H, P)
        b, c = b.reshape(*b.shape[:-1], G, N), c.reshape(*c.shape[:-1], G, N)
        dt = jax.nn.softplus(dt_raw.astype(self.acc) + self.dt_bias[...])
        lam = -jnp.exp(self.A_log[...].astype(self.acc)) * dt
        v = (x.astype(self.acc) * dt[..., None]).astype(self.dtype)
        return c.astype(self.dtype), b.astype(self.dtype), v, lam, x

    def _output(self, o, x, z):
        """o [..., H, P] from the op, x the SSM input, z the gate -> the block output [..., d]."""
        G = self.options.n_groups
        y = o.astype(self.acc) + self.D[...][:, None] * x.astype(self.acc)
        y = y.reshape(*y.shape[:-2], self.inner) * jax.nn.silu(z.astype(self.acc))
        yg = y.reshape(*y.shape[:-1], G, self.inner // G)
        yg = yg * jax.lax.rsqrt(jnp.mean(yg * yg, axis=-1, keepdims=True) + self.options.norm_eps)
        y = (yg.reshape(y.shape) * self.norm_scale[...]).astype(self.dtype)
        return self.out_proj(y).astype(self.dtype)

    def _mix(self, z, xbc, dt_raw, segment_ids, initial_state):
        q, k, v, lam, x = self._op_inputs(xbc, dt_raw)
        o = self.options
        out, state = pallas_kernels.ssd(
            q, k, v, log_decay=lam, initial_state=initial_state, segment_ids=segment_ids,
            chunk_size=o.chunk_size or None, leaf_size=o.leaf_size or None, implementation=o.implementation)
        return self._output(out, x, z), state

    def _run(self, x_BTD, segment_ids):
        z, xbc_raw, dt_raw = self._project(x_BTD)
        xbc = self._conv_act(self.conv(xbc_raw, segment_ids))
        y, state = self._mix(z, xbc, dt_raw, segment_ids, None)
        return y, state, xbc_raw

    # ---- mixer protocol --------------------------------------------------------------------------------
    def __call__(self, x_BTD, *, segment_ids=None, positions=None):
        del positions  # recurrent: order is given by the sequence itself
        return self._run(x_BTD, segment_ids)[0]

    def init_cache(self, batch_size: int, max_length: int = 0) -> dict:
        del max_length  # constant-size state
        return {"state": jnp.zeros((batch_size, self.num_heads, self.state_dim, self.head_dim), self.acc),
                "conv": self.conv.init_cache(batch_size)}

    def prefill(self, x_BTD, *, segment_ids=None, positions=None):
        """Parallel forward that also returns the decode cache continuing each row's last document."""
        del positions
        y, state, xbc_raw = self._run(x_BTD, segment_ids)
        return y, {"state": state.astype(self.acc), "conv": self.conv.cache_from_sequence(xbc_raw, segment_ids)}

    def extend(self, x_BCD, cache, positions_BC):
        """C tokens of one document per row continuing ``cache``: the chunked op from the cached state."""
        cache = reset_rows(cache, positions_BC[:, 0])
        z, xbc_raw, dt_raw = self._project(x_BCD)
        xbc, conv_cache = self.conv.extend(xbc_raw, cache["conv"])
        y, state = self._mix(z, self._conv_act(xbc), dt_raw, None, cache["state"])
        return y, {"state": state.astype(self.acc), "conv": conv_cache}

    def decode(self, x_B1D, cache, positions_B):
        cache = reset_rows(cache, positions_B)
        z, xbc_raw, dt_raw = self._project(x_B1D[:, 0])
        xbc, conv_cache = self.conv.step(xbc_raw, cache["conv"])
        q, k, v, lam, x = self._op_inputs(self._conv_act(xbc), dt_raw)
        r = self.num_heads // self.options.n_groups  # the one-token step takes q and k per head
        q, k = jnp.repeat(q, r, axis=-2), jnp.repeat(k, r, axis=-2)
        o, state = pallas_kernels.delta_rule_step(q, k, v, log_decay=lam, state=cache["state"])
        y = self._output(o, x, z)
        return y[:, None], {"state": state.astype(self.acc), "conv": conv_cache}
