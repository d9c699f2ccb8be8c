"""S4D-only baseline of the Interdomain Attention paper (IA1 §4, Fig. 3d); math in
docs/math/interdomain.md, 'S4D-only baseline'.

Per head h (d_h = head_dim, M complex modes):
```
a, b   = SiLU(ShortConv_K4(x W_a) + bias), SiLU(ShortConv_K4(x W_b) + bias)     no L2 norm
a      = RoPE(a) (optional, on the pre-SiLU a-half, like IA's placement)  [R]
ã, b̃   = RMSNorm(a_h) γ_a + β_a^h,  RMSNorm(b_h) γ_b + β_b^h       γ shared across heads (Eq. 12 as IA)
X_t    = Λ ⊙ X_{t−1} + b_zoh [ã | b̃]ᵀ ∈ C^{M×2d_h}         the same S4D core as IA (iso-state)
o_t    = Re(c_outᵀ C_h X_t) ∈ R^{2d_h}, c_out ∈ R^M per head           [R: consistent with the counts, B8]
y      = concat_h(o_t) W_O,  W_O ∈ R^{2d × d}
```
Parameters per layer: 4d² + IA's extras + M·H (c_out). Under this reconstruction C_h is redundant
(c̃ = C_hᵀ c_out); it is kept so the parameter count matches IA1 Table 3. Core: ``pallas_kernels.interdomain.s4d``.
Cache: ``{"state": [B, H, 2M, 2d_h]`` float32, ``"conv_a"/"conv_b"``}.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from mixerlab.pallas_kernels.interdomain import api as ia_op  # the module, whatever the package re-exports
from mixerlab.mixers.base import DynamicsParam, MixerSpec, SSMParam, reset_rows
from mixerlab.mixers.gates import dense, split_heads
from mixerlab.mixers.registry import register
from mixerlab.mixers.s4d_core import BiasedShortConv, HeadInputNorm, S4DCore
from mixerlab.mixers.blocks import rotary


@dataclasses.dataclass(frozen=True)
class S4DOptions:
    """Options of ``s4d`` (config keys ``mixers.s4d.<field>``). Tags: [S] sourced, [R] ours.

    num_modes: int = 64          M complex modes per head [S: IA1].
    conv_size: int = 4           short-conv width on a and b [S: IA1 Fig. 3d "SC"].
    conv_bias: bool = True       bias in the short convs [S: exact param counts, IA1 Table 3].
    use_rope: bool = False       RoPE on the a-half (IA1 Tab. 4: "S4D-only + RoPE" 19.77 vs 19.22 without) [S].
    rope_theta: float = 10000.0  RoPE base [R].
    s4d_inv_n: "M"               as ``interdomain`` [S as printed; docs/math/interdomain.md].
    dt_min: float = 1e-3         Δ log-uniform in [dt_min, dt_max] [S].
    dt_max: float = 1e-1
    c_init: "identity"           C_h init, as ``interdomain`` [R].
    c_lr_group: "main"           C_h and c_out: main LR, no weight decay | "ssm" (LR-capped group) [S/R, B9].
    c_out_std: float = 0.125     c_out ~ N(0, c_out_std²) per head (0.125 = 1/√64) [R].
    norm_eps: float = 1e-6       eps of the input RMSNorms [R].
    implementation: str = "auto" op implementation ("auto" | "reference" | "xla" | "toeplitz": taken by auto,
                                 the decay is static | "toeplitz_16bit": the same with bf16 GEMM operands,
                                 opt-in | "pallas_tpu": TPU | "pallas_triton": GPU, opt-in).
    chunk_size: int = 0          op chunk length; 0 = the op's default (128 for toeplitz, else 64).
    """

    num_modes: int = 64
    conv_size: int = 4
    conv_bias: bool = True
    use_rope: bool = False
    rope_theta: float = 10000.0
    s4d_inv_n: Literal["M", "2M"] = "M"
    dt_min: float = 1e-3
    dt_max: float = 1e-1
    c_init: Literal["identity", "normal"] = "identity"
    c_lr_group: Literal["main", "ssm"] = "main"
    c_out_std: float = 0.125
    norm_eps: float = 1e-6
    implementation: str = "auto"
    chunk_size: int = 0


@register("s4d", S4DOptions)
class S4DOnly(nnx.Module):
    def __init__(self, spec: MixerSpec, options: S4DOptions, *, rngs: nnx.Rngs):
        o = options
        d, H, Dh = spec.d_model, spec.num_heads, spec.head_dim
        if spec.value_head_dim != Dh:
            raise ValueError(f"s4d needs model.value_head_dim == head_dim ({Dh}), got {spec.value_head_dim}")
        if o.use_rope and Dh % 2:
            raise ValueError(f"mixers.s4d.use_rope needs an even head_dim, got {Dh}")
        self.spec, self.options = spec, o
        self.num_heads, self.head_dim = H, Dh
        self.dtype = spec.dtype
        kw = dict(init_scheme="normal", std=spec.init_std, dtype=spec.dtype, rngs=rngs)
        self.a_proj = dense(d, H * Dh, **kw)
        self.b_proj = dense(d, H * Dh, **kw)
        self.a_conv = BiasedShortConv(H * Dh, o.conv_size, use_bias=o.conv_bias, rngs=rngs)
        self.b_conv = BiasedShortConv(H * Dh, o.conv_size, use_bias=o.conv_bias, rngs=rngs)
        self.a_norm = HeadInputNorm(H, Dh, eps=o.norm_eps)
        self.b_norm = HeadInputNorm(H, Dh, eps=o.norm_eps)
        self.core = S4DCore(H, o.num_modes, s4d_inv_n=o.s4d_inv_n, dt_min=o.dt_min, dt_max=o.dt_max,
                            c_init=o.c_init, c_lr_group=o.c_lr_group, rngs=rngs)
        c_cls = DynamicsParam if o.c_lr_group == "main" else SSMParam
        self.c_out = c_cls(o.c_out_std * jax.random.normal(rngs.params(), (H, o.num_modes), jnp.float32))
        self.o_proj = dense(2 * H * Dh, d, init_scheme="normal", std=spec.out_init_std, dtype=spec.dtype, rngs=rngs)

    def _inputs(self, ac, bc, positions):
        H = self.num_heads
        a, b = split_heads(ac.astype(jnp.float32), H), split_heads(bc.astype(jnp.float32), H)
        if self.options.use_rope:
            a = rotary(a, positions, theta=self.options.rope_theta)
        z = jnp.concatenate([self.a_norm(jax.nn.silu(a)), self.b_norm(jax.nn.silu(b))], axis=-1)
        log_mod, phase, gain = self.core.dynamics()
        readout = ia_op.readout_vector(self.core.c_re[...], self.core.c_im[...], self.c_out[...])
        return z, log_mod, phase, gain, readout

    def _finish(self, out):
        return self.o_proj(out.reshape(*out.shape[:-2], -1).astype(self.dtype)).astype(self.dtype)

    def _run(self, x_BTD, segment_ids, positions):
        x = x_BTD.astype(self.dtype)
        b, t = x.shape[:2]
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        a, bb = self.a_proj(x), self.b_proj(x)
        y, state = self._mix(self.a_conv(a, segment_ids), self.b_conv(bb, segment_ids), segment_ids, positions)
        return y, state, (a, bb)

    def _mix(self, ac, bc, segment_ids, positions, initial_state=None):
        """Post-conv a and b -> (y, final state)."""
        z, log_mod, phase, gain, readout = self._inputs(ac, bc, positions)
        # z enters the op in the activation dtype, like the delta-rule mixers' q, k, v: a bf16 model runs the op's
        # data GEMMs on bf16/TF32 tensor cores (float32 inputs would ask for float32-exact GEMMs)
        out, state = ia_op.s4d(z.astype(self.dtype), log_modulus=log_mod, phase=phase, input_gain=gain, readout=readout,
                               initial_state=initial_state, segment_ids=segment_ids,
                               chunk_size=self.options.chunk_size or None, implementation=self.options.implementation)
        return self._finish(out), state

    def __call__(self, x_BTD, *, segment_ids=None, positions=None):
        return self._run(x_BTD, segment_ids, positions)[0]

    def init_cache(self, batch_size: int, max_length: int = 0) -> dict:
        del max_length
        H, Dh, M = self.num_heads, self.head_dim, self.options.num_modes
        return {"state": jnp.zeros((batch_size, H, 2 * M, 2 * Dh), jnp.float32),
                "conv_a": self.a_conv.init_cache(batch_size), "conv_b": self.b_conv.init_cache(batch_size)}

    def prefill(self, x_BTD, *, segment_ids=None, positions=None):
        y, state, (a, bb) = self._run(x_BTD, segment_ids, positions)
        return y, {"state": state.astype(jnp.float32), "conv_a": self.a_conv.cache_from_sequence(a, segment_ids),
                   "conv_b": self.b_conv.cache_from_sequence(bb, segment_ids)}

    def extend(self, x_BCD, cache, positions_BC):
        """C tokens of one document per row continuing ``cache``: the chunked op from the cached state."""
        cache = reset_rows(cache, positions_BC[:, 0])
        x = x_BCD.astype(self.dtype)
        new = {}
        ac, new["conv_a"] = self.a_conv.extend(self.a_proj(x), cache["conv_a"])
        bc, new["conv_b"] = self.b_conv.extend(self.b_proj(x), cache["conv_b"])
        y, state = self._mix(ac, bc, None, positions_BC, cache["state"])
        new["state"] = state.astype(jnp.float32)
        return y, new

    def decode(self, x_B1D, cache, positions_B):
        cache = reset_rows(cache, positions_B)
        x = x_B1D.astype(self.dtype)[:, 0]
        new = {}
        ac, new["conv_a"] = self.a_conv.step(self.a_proj(x), cache["conv_a"])
        bc, new["conv_b"] = self.b_conv.step(self.b_proj(x), cache["conv_b"])
        z, log_mod, phase, gain, readout = self._inputs(ac[:, None], bc[:, None], positions_B[:, None])
        out, state = ia_op.s4d_step(z[:, 0], log_modulus=log_mod, phase=phase, input_gain=gain, readout=readout,
                                    state=cache["state"])
        new["state"] = state.astype(jnp.float32)
        return self._finish(out[:, None]), new
