"""RWKV-7 time mixing (Peng et al. 2025, "RWKV-7 'Goose' with Expressive Dynamic State Evolution"), following
fla's ``RWKV7Attention`` [FLA ``fla/layers/rwkv7.py``]; the recurrence is the DPLR delta-rule op
(docs/math/dplr_delta_rule.md), docs in docs/mixers.md, 'Recurrent baselines'.

```
δ_t     = x_{t−1} − x_t          (x_{t−1} = 0 at a document start; the decode cache carries x_{t−1})
x_s     = x_t + μ_s ⊙ δ_t        for s ∈ {r, w, k, v, a, g}, μ_s ∈ R^d learned
r, k, v = x_r W_r, x_k W_k, x_v W_v                                   (per head: H heads of d_k / d_v)
λ       = −e^{−1/2} σ(tanh(x_w A_w) B_w + b_w)        (log-decay per key channel, in (−0.607, 0))
a       = σ(x_a A_a B_a + b_a)                        (in-context learning rate, per key channel)
g       = σ(x_g A_g) B_g                              (output gate, no bias)
κ̂       = normalize(k ⊙ k_k) per head;   k ← k ⊙ (1 + (a − 1) ⊙ k_a)
o, S    = dplr_delta_rule(q=r, k, v, alpha=−κ̂, beta=κ̂ ⊙ a, log_decay=λ)
          S_t = (Diag(e^{λ_t}) − (κ̂_t⊙a_t)ᵀ κ̂_t) S_{t−1} + k_tᵀ v_t,  o_t = r_t S_t
y       = (GroupNorm_H(o) + Σ_c (r ⊙ k ⊙ r_k)_c · v) ⊙ g;     out = y W_o
```
Not implemented: the value residual (fla mixes layer 0's v into every later layer's v through ``v_first``);
the decoder passes nothing between layers, so ``value_residual=True`` raises.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mixerlab import pallas_kernels
from mixerlab.mixers.base import DynamicsParam, MixerSpec, reset_rows
from mixerlab.mixers.gates import split_heads
from mixerlab.mixers.registry import register

LOG_DECAY_SCALE = math.exp(-0.5)  # λ = −e^{−1/2} σ(·) ∈ (−0.6065, 0) [FLA: −0.6065306597126334 · sigmoid]
KAPPA_EPS = 1e-12  # F.normalize's eps: κ̂ = x / max(‖x‖, eps) [FLA]
STREAMS = ("r", "w", "k", "v", "a", "g")


@dataclasses.dataclass(frozen=True)
class RWKV7Options:
    """RWKV-7 options (sources: [FLA] fla/layers/rwkv7.py, [RWKV-7] the paper, [ours]).

    decay_low_rank_dim: int = 0   rank of the decay LoRA; 0 = FLA's max(32, round(2.5·√d·d_k/64 / 32)·32) [FLA].
    a_low_rank_dim: int = 0       rank of the in-context-learning-rate LoRA; 0 = the same formula [FLA].
    gate_low_rank_dim: int = 0    rank of the output-gate LoRA; 0 = max(32, round(5·√d / 32)·32) [FLA].
    norm_eps: float = 1e-5        GroupNorm eps per unit of head dim (eps = d_k · norm_eps) [FLA].
    value_residual: bool = False  RWKV-7's v_first mixing [RWKV-7 paper; FLA v_lora]; True raises: the decoder has
                                  no channel to pass layer 0's values to later layers [ours].
    implementation: str = "auto"  implementation of the dplr_delta_rule op; "auto" = "delta_pairs" (each token as two
                                  delta-rule tokens on that op's Pallas kernels: exact, and safe here because
                                  λ > −0.61), or "xla" (the op's pure-JAX chunked form), "reference" [ours].
    chunk_size: int = 0           chunk length of the op; 0 = its default (xla: 64 tokens [FLA chunk 64];
                                  delta_pairs: the delta-rule op's default, in delta-rule tokens).
    leaf_size: int = 0            block size inside a chunk; 0 = the op's default.
    """

    decay_low_rank_dim: int = 0
    a_low_rank_dim: int = 0
    gate_low_rank_dim: int = 0
    norm_eps: float = 1e-5
    value_residual: bool = False
    implementation: str = "auto"
    chunk_size: int = 0
    leaf_size: int = 0


def lora_rank(d_model: int, multiplier: float, head_dim_factor: float = 1.0) -> int:
    """FLA's default LoRA width: max(32, round(multiplier·√d·factor / 32)·32)."""
    return max(32, int(round(multiplier * d_model ** 0.5 * head_dim_factor / 32) * 32))


def orthogonal(gain: float = 1.0):
    return jax.nn.initializers.orthogonal(scale=gain)


def _linear(d_in, d_out, init, dtype, rngs):
    return nnx.Linear(d_in, d_out, use_bias=False, kernel_init=init, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)


class LoRA(nnx.Module):
    """``act(x A) B (+ b)`` [FLA rwkv6 LoRA]: A zero-initialised, B orthogonal × 0.1 (gain √(r/out) when r > out),
    bias a ``DynamicsParam`` set by the layer's init."""

    def __init__(self, d_in, rank, d_out, *, activation, bias: bool, dtype, rngs):
        self.activation = activation
        gain = 0.1 * (math.sqrt(rank / d_out) if rank > d_out else 1.0)
        self.down = _linear(d_in, rank, jax.nn.initializers.zeros, dtype, rngs)
        self.up = _linear(rank, d_out, orthogonal(gain), dtype, rngs)
        self.bias = DynamicsParam(jnp.zeros((d_out,), jnp.float32)) if bias else None

    def __call__(self, x):
        wide = jnp.promote_types(jnp.float32, x.dtype)  # gate pre-activations in float32 (float64 for f64 x)
        h = self.down(x)
        if self.activation is not None:
            h = self.activation(h.astype(wide)).astype(x.dtype)
        z = self.up(h).astype(wide)
        return z if self.bias is None else z + self.bias[...]


def fla_init_vectors(d_model: int, head_dim: int, layer_index: int, num_layers: int) -> dict:
    """FLA's per-layer init of the token-shift mixes, k_k and the LoRA biases (``_initialize_weights``)."""
    n = np.arange(d_model, dtype=np.float64)
    ratio_0_to_1 = layer_index / max(num_layers - 1, 1)
    ratio_1_to_almost0 = 1.0 - layer_index / num_layers
    ddd = n / d_model
    linear = n / (d_model - 1) - 0.5 if d_model > 1 else np.zeros(1)
    zigzag = ((n % head_dim) - (head_dim - 1) / 2) / max((head_dim - 1) / 2, 1e-9)
    zigzag = zigzag * np.abs(zigzag)
    www = -6 + 6 * (n / max(d_model - 1, 1)) ** (1 + ratio_0_to_1 ** 0.3)
    powers = dict(r=0.2, w=0.9, k=0.7, v=0.7, a=0.9, g=0.2)
    out = {f"mu_{s}": 1.0 - ddd ** (p * ratio_1_to_almost0) for s, p in powers.items()}
    out.update(k_k=0.71 - linear * 0.1, w_bias=www + 0.5 + zigzag * 2.5, a_bias=-0.19 + zigzag * 0.3 + linear * 0.4)
    return {name: jnp.asarray(v, jnp.float32) for name, v in out.items()}


def token_shift_delta(x_BTD, segment_ids):
    """δ_t = x_{t−1} − x_t with x_{t−1} = 0 at t = 0 and wherever a document starts (the id changes)."""
    prev = jnp.concatenate([jnp.zeros_like(x_BTD[:, :1]), x_BTD[:, :-1]], axis=1)
    if segment_ids is not None:
        start = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
                                axis=1)
        prev = jnp.where(start[..., None], jnp.zeros_like(prev), prev)
    return prev - x_BTD


@register("rwkv7", RWKV7Options)
class RWKV7(nnx.Module):
    def __init__(self, spec: MixerSpec, options: RWKV7Options, *, rngs: nnx.Rngs):
        if options.value_residual:
            raise ValueError("mixers.rwkv7.value_residual=true is not supported: the decoder has no cross-layer "
                             "channel to pass layer 0's values (v_first) to later layers; set it to false")
        self.spec, self.options, self.dtype = spec, options, spec.dtype
        self.wide = jnp.promote_types(jnp.float32, spec.dtype)  # gates, norms: float32 (float64 for f64 runs)
        d, H, Dk, Dv = spec.d_model, spec.num_heads, spec.head_dim, spec.value_head_dim
        self.num_heads, self.head_dim, self.value_head_dim = H, Dk, Dv
        factor = Dk / 64
        ranks = dict(w=options.decay_low_rank_dim or lora_rank(d, 2.5, factor),
                     a=options.a_low_rank_dim or lora_rank(d, 2.5, factor),
                     g=options.gate_low_rank_dim or lora_rank(d, 5.0))
        init = fla_init_vectors(d, Dk, spec.layer_index, spec.num_layers)
        for s in STREAMS:
            setattr(self, f"mu_{s}", DynamicsParam(init[f"mu_{s}"]))
        # FLA's key width is d; ours is H·d_k: the key-channel ramps are laid over H·d_k (equal when H·d_k = d)
        keyed = fla_init_vectors(H * Dk, Dk, spec.layer_index, spec.num_layers)
        self.k_k = DynamicsParam(keyed["k_k"])
        self.k_a = DynamicsParam(jnp.full((H * Dk,), 1.02, jnp.float32))
        self.r_k = DynamicsParam(jnp.full((H, Dk), -0.04, jnp.float32))
        self.r_proj = _linear(d, H * Dk, orthogonal(), self.dtype, rngs)
        self.k_proj = _linear(d, H * Dk, orthogonal(0.1), self.dtype, rngs)
        self.v_proj = _linear(d, H * Dv, orthogonal(), self.dtype, rngs)
        lora = dict(dtype=self.dtype, rngs=rngs)
        self.w_lora = LoRA(d, ranks["w"], H * Dk, activation=jnp.tanh, bias=True, **lora)
        self.a_lora = LoRA(d, ranks["a"], H * Dk, activation=None, bias=True, **lora)
        self.g_lora = LoRA(d, ranks["g"], H * Dv, activation=jax.nn.sigmoid, bias=False, **lora)
        self.w_lora.bias[...] = keyed["w_bias"]
        self.a_lora.bias[...] = keyed["a_bias"]
        self.norm_scale = nnx.Param(jnp.full((H * Dv,), ((spec.layer_index + 1) / spec.num_layers) ** 0.7,
                                             jnp.float32))
        self.norm_bias = nnx.Param(jnp.zeros((H * Dv,), jnp.float32))
        # FLA zero-initialises o_proj; ours keeps the project-wide residual-output init
        self.o_proj = _linear(H * Dv, d, jax.nn.initializers.normal(spec.out_init_std), self.dtype, rngs)

    # ---- the block -----------------------------------------------------------------------------------
    def _op_inputs(self, x, delta):
        """x, δ [..., d] -> r, k, v, α, β (compute dtype), λ (float32) per head, and the gate g [..., H, Dv]."""
        H = self.num_heads
        mixed = {s: x + (delta.astype(self.wide) * getattr(self, f"mu_{s}")[...]).astype(x.dtype) for s in STREAMS}
        r = split_heads(self.r_proj(mixed["r"]), H).astype(self.wide)
        k = self.k_proj(mixed["k"]).astype(self.wide)
        v = split_heads(self.v_proj(mixed["v"]), H).astype(self.wide)
        lam = -LOG_DECAY_SCALE * jax.nn.sigmoid(self.w_lora(mixed["w"]))
        a = jax.nn.sigmoid(self.a_lora(mixed["a"]))
        g = split_heads(self.g_lora(mixed["g"]), H)
        kappa = split_heads(k * self.k_k[...], H)
        kappa = kappa / jnp.maximum(jnp.linalg.norm(kappa, axis=-1, keepdims=True), KAPPA_EPS)
        k = split_heads(k * (1.0 + (a - 1.0) * self.k_a[...]), H)
        a = split_heads(a, H)
        cast = lambda t: t.astype(self.dtype)  # noqa: E731
        return dict(r=cast(r), k=cast(k), v=cast(v), alpha=cast(-kappa), beta=cast(kappa * a),
                    log_decay=split_heads(lam, H)), g

    def _output(self, o, inputs, g):
        """GroupNorm per head, the bonus (Σ r⊙k⊙r_k)·v, the gate, o_proj."""
        o = o.astype(self.wide)
        mean = jnp.mean(o, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(o - mean), axis=-1, keepdims=True)
        eps = self.head_dim * self.options.norm_eps
        H, Dv = self.num_heads, self.value_head_dim
        normed = (o - mean) * jax.lax.rsqrt(var + eps)
        normed = normed * self.norm_scale[...].reshape(H, Dv) + self.norm_bias[...].reshape(H, Dv)
        r, k, v = (inputs[n].astype(self.wide) for n in ("r", "k", "v"))
        bonus = jnp.sum(r * k * self.r_k[...], axis=-1, keepdims=True) * v
        y = (normed + bonus) * g
        return self.o_proj(y.reshape(*y.shape[:-2], H * Dv).astype(self.dtype)).astype(self.dtype)

    def _run(self, x_BTD, segment_ids, initial_state=None):
        x = x_BTD.astype(self.dtype)
        inputs, g = self._op_inputs(x, token_shift_delta(x, segment_ids))
        opts = self.options
        o, state = pallas_kernels.dplr_delta_rule(
            inputs["r"], inputs["k"], inputs["v"], alpha=inputs["alpha"], beta=inputs["beta"],
            log_decay=inputs["log_decay"], initial_state=initial_state, segment_ids=segment_ids,
            chunk_size=opts.chunk_size or None, leaf_size=opts.leaf_size or None,
            implementation="delta_pairs" if opts.implementation == "auto" else opts.implementation)
        return self._output(o, inputs, g), state

    # ---- mixer protocol --------------------------------------------------------------------------------
    def __call__(self, x_BTD, *, segment_ids=None, positions=None):
        del positions  # recurrent: order is given by the sequence itself
        return self._run(x_BTD, segment_ids)[0]

    def init_cache(self, batch_size: int, max_length: int = 0) -> dict:
        del max_length  # constant-size state
        H, Dk, Dv = self.num_heads, self.head_dim, self.value_head_dim
        return {"state": jnp.zeros((batch_size, H, Dk, Dv), jnp.float32),
                "shift": jnp.zeros((batch_size, self.spec.d_model), self.dtype)}

    def prefill(self, x_BTD, *, segment_ids=None, positions=None):
        """Parallel forward that also returns the decode cache continuing each row's last document."""
        del positions
        y, state = self._run(x_BTD, segment_ids)
        return y, {"state": state.astype(jnp.float32), "shift": x_BTD[:, -1].astype(self.dtype)}

    def decode(self, x_B1D, cache, positions_B):
        cache = reset_rows(cache, positions_B)  # a new document: zero state and no previous token
        x = x_B1D[:, 0].astype(self.dtype)
        inputs, g = self._op_inputs(x, cache["shift"] - x)
        o, state = pallas_kernels.dplr_delta_rule_step(
            inputs["r"], inputs["k"], inputs["v"], alpha=inputs["alpha"], beta=inputs["beta"],
            log_decay=inputs["log_decay"], state=cache["state"])
        y = self._output(o, inputs, g)
        return y[:, None], {"state": state.astype(jnp.float32), "shift": x}

