"""Interdomain Attention (Kiyohara et al., arXiv 2605.24330); math in docs/math/interdomain.md.

Per head h (R = head_dim, d_h = value_head_dim, M complex modes; docs/math/interdomain.md, 'The layer'):
```
q, k, v  = x W_Q (+ W_2 SiLU(x W_1), residual query MLP, optional), x W_K, x W_V        no bias
q, k     = ShortConv_K4(q) + bias, ShortConv_K4(k) + bias        causal depthwise, before the head split
q, k     = RoPE(q), RoPE(k)                      (rope_placement="pre_silu": after SC, before SiLU) [R]
ξ(q)     = L2(SiLU(q)),  k̄ = SiLU(k),  ξ(k) = L2(k̄)                                           (IA1 Eq. 10)
k̃, ṽ     = RMSNorm(ξ(k)) γ_k + β_k^h,  RMSNorm(v^h) γ_v + β_v^h        γ shared across heads   (Eq. 12)
[write]  g = exp(α ⊙ tanh(w ⊙ RMS₀(k̄) + b));  k̃, ṽ ← √g ⊙ k̃, √g ⊙ ṽ                   (optional, IAs §3.3)
Λ_t      = exp(δ_t Δ Re A + i Δ Im A),  δ_t = 2^{tanh(w_δ·RMS₀(k̄_t) + b_δ)} (selective decay) or 1
X^k, X^v = Λ_t ⊙ X_{t−1} + b [k̃ | ṽ]ᵀ,   b = (e^{ΔA} − 1)/A                                  (Eq. 11, ZOH)
o_t      = Re(ξ(q_t)ᵀ (C X^k_t)ᴴ (C X^v_t))     Hermitian (default) | bilinear Re(ξᵀ Uᵀ Γ) (flag)  (Eq. 13)
o_t     += D ⊙ v_t^h  (d_skip);   o_t *= act(x W_g)_h  (output_gate)
y        = concat_h(o) W_O,  W_O ~ N(0, 0.02/√(2L))
```
The recurrence runs in ``pallas_kernels.interdomain`` (real 2×2 rotation-scaling blocks, no complex dtype).
Parameters per layer at the defaults: 4d² + 2HM² (C) + 10d (two convs with bias) + 2d (norm biases)
+ 2d_h (shared norm scales) + (2M + 1)H (A, Δ) — the accounting of IA1 Table 3 (docs/interdomain.md).

Cache: ``{"key": [B,H,2M,R], "value": [B,H,2M,d_h]`` float32 (stacked [Re; Im]), ``"conv_q"/"conv_k"
(/"conv_v")``: [B, K−1, C]}. ``decode`` resets a row when its position is 0.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from mixerlab.pallas_kernels.interdomain import api as ia_op  # the module, whatever the package re-exports
from mixerlab.mixers.base import DynamicsParam, MixerSpec, reset_rows
from mixerlab.mixers.delta_common import l2_normalize
from mixerlab.mixers.gates import dense, split_heads, zeros_like_linear
from mixerlab.mixers.registry import register
from mixerlab.mixers.s4d_core import BiasedShortConv, HeadInputNorm, S4DCore, rms
from mixerlab.mixers.blocks import rotary


@dataclasses.dataclass(frozen=True)
class InterdomainOptions:
    """Options of ``interdomain`` (config keys ``mixers.interdomain.<field>``). Tags: [S] sourced, [R] ours.

    num_modes: int = 64            M complex modes per head [S: IA1 §4, all LM runs].
    conv_size: int = 4             short-conv width on q and k (LM 4, genomics 8) [S: IA1 Eq. 10, IAs A.1].
    conv_bias: bool = True         bias in the short convs [S: exact param counts, IA1 Table 3].
    use_rope: bool = True          RoPE on q/k [S: IA1 §3.3; no-RoPE within noise at 125M].
    rope_theta: float = 10000.0    RoPE base [R: Llama-2 value].
    rope_placement: "pre_silu"     after SC, before SiLU (IA1 Fig. 3) | "post_l2" on ξ(q), ξ(k) [R].
    readout: "hermitian"           Re(ξᵀUᴴΓ) | "bilinear" Re(ξᵀUᵀΓ) [R: docs/math/interdomain.md].
    s4d_inv_n: "M"                 N in a_im(n) = (N/π)(N/(2n+1) − 1): "M" as printed | "2M" as the S4 code
                                   [S: IA1 §3.3 as printed; R: 2M option].
    dt_min: float = 1e-3           Δ log-uniform in [dt_min, dt_max], scalar per head [S].
    dt_max: float = 1e-1
    c_init: "identity"             C_h init: "identity" (HiPPO-faithful) | "normal" CN(0, 1/M) [R].
    c_lr_group: "main"             C_h: main LR, no weight decay (IAs) | "ssm" LR-capped group (IA1) [S: versions
    differ].
    norm_eps: float = 1e-6         eps of the input RMSNorms (Eq. 12) [R].
    query_mlp_hidden: int = 0      residual query MLP q += W_2 SiLU(W_1 x), W_2 zero-init; 0 = off
                                   (IAs ablation: 317) [S widths; form R].
    value_conv: bool = False       v = SiLU(SC(W_V x) + bias) (genomics) [S: IAs §3.3].
    d_skip: bool = False           o += D ⊙ v_h (pre-norm v), D init 1 [S: IAs §3.3; which v R].
    output_gate: "none"            "none" | "silu" | "sigmoid": o *= act(x W_g) per head [S: IAs; act ambiguous].
    selective_write: bool = False  g = exp(α tanh(w RMS₀(k̄) + b)), init w = b = 0, α = 1 (g = 1) [S form; init R].
    selective_decay: bool = False  δ_t = 2^{tanh(w_δ·RMS₀(k̄) + b_δ)} ∈ [½, 2] scales Re log Λ only, scalar per
                                   head and token, init w_δ = b_δ = 0 [S range; form R].
    implementation: str = "auto"   op implementation ("auto" | "reference" | "xla" | "toeplitz": static decay,
                                   taken by auto | "toeplitz_16bit": the same with bf16 GEMM operands, opt-in |
                                   "pallas_tpu": TPU, taken by auto for a selective decay |
                                   "pallas_triton": GPU, opt-in).
    chunk_size: int = 0            op chunk length; 0 = the op's default (128 for toeplitz, else 64).
    """

    num_modes: int = 64
    conv_size: int = 4
    conv_bias: bool = True
    use_rope: bool = True
    rope_theta: float = 10000.0
    rope_placement: Literal["pre_silu", "post_l2"] = "pre_silu"
    readout: Literal["hermitian", "bilinear"] = "hermitian"
    s4d_inv_n: Literal["M", "2M"] = "M"
    dt_min: float = 1e-3
    dt_max: float = 1e-1
    c_init: Literal["identity", "normal"] = "identity"
    c_lr_group: Literal["main", "ssm"] = "main"
    norm_eps: float = 1e-6
    query_mlp_hidden: int = 0
    value_conv: bool = False
    d_skip: bool = False
    output_gate: Literal["none", "silu", "sigmoid"] = "none"
    selective_write: bool = False
    selective_decay: bool = False
    implementation: str = "auto"
    chunk_size: int = 0


def _chunk(n):
    return n if n > 0 else None


@register("interdomain", InterdomainOptions)
class Interdomain(nnx.Module):
    def __init__(self, spec: MixerSpec, options: InterdomainOptions, *, rngs: nnx.Rngs):
        o = options
        d, H, R, Dv = spec.d_model, spec.num_heads, spec.head_dim, spec.value_head_dim
        if o.selective_write and R != Dv:
            raise ValueError(f"mixers.interdomain.selective_write needs head_dim == value_head_dim, got {R} != {Dv}")
        if o.conv_size < 1:
            raise ValueError(f"mixers.interdomain.conv_size must be >= 1, got {o.conv_size}")
        if o.use_rope and R % 2:
            raise ValueError(f"mixers.interdomain.use_rope needs an even head_dim, got {R}")
        self.spec, self.options = spec, o
        self.num_heads, self.head_dim, self.value_head_dim = H, R, Dv
        self.dtype = spec.dtype
        kw = dict(init_scheme="normal", std=spec.init_std, dtype=spec.dtype, rngs=rngs)
        self.q_proj = dense(d, H * R, **kw)
        self.k_proj = dense(d, H * R, **kw)
        self.v_proj = dense(d, H * Dv, **kw)
        if o.query_mlp_hidden > 0:
            self.q_mlp_in = dense(d, o.query_mlp_hidden, **kw)
            self.q_mlp_out = dense(o.query_mlp_hidden, H * R, **kw)
            zeros_like_linear(self.q_mlp_out)
        self.q_conv = BiasedShortConv(H * R, o.conv_size, use_bias=o.conv_bias, rngs=rngs)
        self.k_conv = BiasedShortConv(H * R, o.conv_size, use_bias=o.conv_bias, rngs=rngs)
        if o.value_conv:
            self.v_conv = BiasedShortConv(H * Dv, o.conv_size, use_bias=o.conv_bias, rngs=rngs)
        self.k_norm = HeadInputNorm(H, R, eps=o.norm_eps)
        self.v_norm = HeadInputNorm(H, Dv, eps=o.norm_eps)
        self.core = S4DCore(H, o.num_modes, s4d_inv_n=o.s4d_inv_n, dt_min=o.dt_min, dt_max=o.dt_max,
                            c_init=o.c_init, c_lr_group=o.c_lr_group, rngs=rngs)
        if o.selective_write:
            self.write_w = DynamicsParam(jnp.zeros((H, R), jnp.float32))
            self.write_b = DynamicsParam(jnp.zeros((H, R), jnp.float32))
            self.write_alpha = DynamicsParam(jnp.ones((H, R), jnp.float32))
        if o.selective_decay:
            self.decay_w = DynamicsParam(jnp.zeros((H, R), jnp.float32))
            self.decay_b = DynamicsParam(jnp.zeros((H,), jnp.float32))
        if o.d_skip:
            self.skip = DynamicsParam(jnp.ones((H, Dv), jnp.float32))
        if o.output_gate != "none":
            self.g_proj = dense(d, H * Dv, **kw)
        self.o_proj = dense(H * Dv, d, init_scheme="normal", std=spec.out_init_std, dtype=spec.dtype, rngs=rngs)

    # ---- pieces shared by the parallel forward and decode ---------------------------------------------------
    def _project(self, x):
        q = self.q_proj(x)
        if self.options.query_mlp_hidden > 0:
            q = q + self.q_mlp_out(jax.nn.silu(self.q_mlp_in(x)))
        return q, self.k_proj(x), self.v_proj(x)

    def _rope(self, a, positions):
        return rotary(a, positions, theta=self.options.rope_theta)

    def _inputs(self, qc, kc, v, positions):
        """Post-conv (pre-activation) q, k and v [B,T,C] -> op inputs (float32) and per-head v."""
        o, H = self.options, self.num_heads
        q, k = split_heads(qc.astype(jnp.float32), H), split_heads(kc.astype(jnp.float32), H)
        if o.use_rope and o.rope_placement == "pre_silu":
            q, k = self._rope(q, positions), self._rope(k, positions)
        k_bar = jax.nn.silu(k)
        xi_q, xi_k = l2_normalize(jax.nn.silu(q)), l2_normalize(k_bar)
        if o.use_rope and o.rope_placement == "post_l2":
            xi_q, xi_k = self._rope(xi_q, positions), self._rope(xi_k, positions)
        v_h = split_heads(v.astype(jnp.float32), H)
        k_t, v_t = self.k_norm(xi_k), self.v_norm(v_h)
        if o.selective_write or o.selective_decay:
            k0 = rms(k_bar, o.norm_eps)
        if o.selective_write:
            half_log_g = 0.5 * self.write_alpha[...] * jnp.tanh(self.write_w[...] * k0 + self.write_b[...])
            sqrt_g = jnp.exp(half_log_g)
            k_t, v_t = k_t * sqrt_g, v_t * sqrt_g
        log_mod, phase, gain = self.core.dynamics()
        if o.selective_decay:
            delta_t = jnp.exp2(jnp.tanh(jnp.sum(self.decay_w[...] * k0, -1) + self.decay_b[...]))  # [B,T,H]
            log_mod = delta_t[..., None] * log_mod
        return xi_q, k_t, v_t, v_h, log_mod, phase, gain

    def _readout(self):
        return ia_op.readout_matrix(self.core.c_re[...], self.core.c_im[...],
                                    conjugate=self.options.readout == "hermitian")

    def _finish(self, out_BTHV, v_h, x):
        o = self.options
        if o.d_skip:
            out_BTHV = out_BTHV + self.skip[...] * v_h
        if o.output_gate != "none":
            g = split_heads(self.g_proj(x).astype(jnp.float32), self.num_heads)
            out_BTHV = out_BTHV * (jax.nn.silu(g) if o.output_gate == "silu" else jax.nn.sigmoid(g))
        y = out_BTHV.reshape(*out_BTHV.shape[:-2], -1).astype(self.dtype)
        return self.o_proj(y).astype(self.dtype)

    def _run(self, x_BTD, segment_ids, positions, initial_state=None):
        x = x_BTD.astype(self.dtype)
        b, t = x.shape[:2]
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        q, k, v = self._project(x)
        qc, kc = self.q_conv(q, segment_ids), self.k_conv(k, segment_ids)
        if self.options.value_conv:
            v = jax.nn.silu(self.v_conv(v, segment_ids))
        y, state = self._mix(x, qc, kc, v, segment_ids, positions, initial_state)
        return y, state, (q, k, v)

    def _mix(self, x, qc, kc, v, segment_ids, positions, initial_state):
        """Post-conv q, k and v -> (y, final state): the op's inputs, the op and the output projection."""
        xi_q, k_t, v_t, v_h, log_mod, phase, gain = self._inputs(qc, kc, v, positions)
        # q, k, v enter the op in the activation dtype, like the delta-rule mixers': a bf16 model runs the op's data
        # GEMMs on bf16/TF32 tensor cores (float32 inputs would ask for float32-exact GEMMs); state and
        # accumulation stay float32 inside the op
        out, state = ia_op.interdomain(
            xi_q.astype(self.dtype), k_t.astype(self.dtype), v_t.astype(self.dtype), log_modulus=log_mod,
            phase=phase, input_gain=gain, readout=self._readout(),
            initial_state=initial_state, segment_ids=segment_ids, chunk_size=_chunk(self.options.chunk_size),
            implementation=self.options.implementation)
        return self._finish(out, v_h, x), state

    # ---- mixer protocol ----------------------------------------------------------------------------------
    def __call__(self, x_BTD, *, segment_ids=None, positions=None):
        return self._run(x_BTD, segment_ids, positions)[0]

    def init_cache(self, batch_size: int, max_length: int = 0) -> dict:
        del max_length  # constant-size state
        H, R, Dv, M = self.num_heads, self.head_dim, self.value_head_dim, self.options.num_modes
        cache = {"key": jnp.zeros((batch_size, H, 2 * M, R), jnp.float32),
                 "value": jnp.zeros((batch_size, H, 2 * M, Dv), jnp.float32),
                 "conv_q": self.q_conv.init_cache(batch_size), "conv_k": self.k_conv.init_cache(batch_size)}
        if self.options.value_conv:
            cache["conv_v"] = self.v_conv.init_cache(batch_size)
        return cache

    def prefill(self, x_BTD, *, segment_ids=None, positions=None):
        """Parallel forward that also returns the decode cache continuing each row's last document."""
        y, state, (q, k, v) = self._run(x_BTD, segment_ids, positions)
        cache = {"key": state.key.astype(jnp.float32), "value": state.value.astype(jnp.float32),
                 "conv_q": self.q_conv.cache_from_sequence(q, segment_ids),
                 "conv_k": self.k_conv.cache_from_sequence(k, segment_ids)}
        if self.options.value_conv:
            cache["conv_v"] = self.v_conv.cache_from_sequence(self.v_proj(x_BTD.astype(self.dtype)), segment_ids)
        return y, cache

    def _cached_convs(self, q, k, v, cache, new, advance: str):
        """Post-conv q, k (and v with ``value_conv``) continuing the cached conv inputs (``advance``: "step" for one
        token, "extend" for a chunk); the new conv caches go into ``new``."""
        qc, new["conv_q"] = getattr(self.q_conv, advance)(q, cache["conv_q"])
        kc, new["conv_k"] = getattr(self.k_conv, advance)(k, cache["conv_k"])
        if self.options.value_conv:
            v, new["conv_v"] = getattr(self.v_conv, advance)(v, cache["conv_v"])
            v = jax.nn.silu(v)
        return qc, kc, v

    def extend(self, x_BCD, cache, positions_BC):
        """C tokens of one document per row continuing ``cache``: the chunked op from the cached state."""
        cache = reset_rows(cache, positions_BC[:, 0])
        x = x_BCD.astype(self.dtype)
        q, k, v = self._project(x)
        new = {}
        qc, kc, v = self._cached_convs(q, k, v, cache, new, "extend")
        y, state = self._mix(x, qc, kc, v, None, positions_BC, ia_op.InterdomainState(cache["key"], cache["value"]))
        new["key"], new["value"] = state.key.astype(jnp.float32), state.value.astype(jnp.float32)
        return y, new

    def decode(self, x_B1D, cache, positions_B):
        cache = reset_rows(cache, positions_B)
        x = x_B1D.astype(self.dtype)
        q, k, v = self._project(x[:, 0])
        new = {}
        qc, kc, v = self._cached_convs(q, k, v, cache, new, "step")
        xi_q, k_t, v_t, v_h, log_mod, phase, gain = self._inputs(qc[:, None], kc[:, None], v[:, None],
                                                                 positions_B[:, None])
        if log_mod.ndim == 4:
            log_mod = log_mod[:, 0]
        out, state = ia_op.interdomain_step(
            xi_q[:, 0], k_t[:, 0], v_t[:, 0], log_modulus=log_mod, phase=phase, input_gain=gain,
            readout=self._readout(), state=ia_op.InterdomainState(cache["key"], cache["value"]))
        new["key"], new["value"] = state.key.astype(jnp.float32), state.value.astype(jnp.float32)
        return self._finish(out[:, None], v_h, x), new
