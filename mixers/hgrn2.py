"""HGRN2 (Qin, Yang, Sun, Shen, Li, Sun, Zhong, "HGRN2: Gated Linear RNNs with State Expansion", COLM 2024,
§3); the block of FLA ``fla/layers/hgrn2.py`` with the per-layer forget-gate lower bound of FLA's HGRN2Model.

    q   = SiLU(x W_q)                                    (FLA: swish; W_q: d -> H d_k, no bias)
    f_t = gamma + (1 - gamma) sigmoid(x_t W_f)           forget gate, channel-wise, gamma = the layer's lower bound
    lambda_t = log f_t = logaddexp(log gamma, log(1 - gamma) + logsigmoid(x_t W_f))     [B,T,H,d_k]
    k_t = 1 - f_t                                        (input gate tied to the forget gate)
    v_t = x_t W_i                                        (FLA's i_proj, d -> H d_v, no activation)
    S_t = Diag(f_t) S_{t-1} + k_t^T v_t,   o_t = s q_t S_t,  s = d_k^-1/2 (FLA chunk_gla's default scale)
    out = RMSNorm(concat_heads(o)) * omega W_o          (one RMSNorm over all H d_v channels; no output gate)
    op inputs: q_hat = s q, k_hat = 1 - f, v_hat = v, erase_key None, log_decay = lambda.

W_f and W_i are this module's ``k_proj`` and ``v_proj`` (the shared q/k/v projections and short convs).
Head layout: FLA sets H = d / expand_ratio, d_k = expand_ratio (128) and d_v = d / H; here H = model.num_heads,
d_k = model.head_dim (FLA's expand_ratio) and d_v = model.value_head_dim, so FLA's layout is model.head_dim =
model.value_head_dim = 128 with H = d / 128 (configs/paper/hgrn2_166m.yaml: 8 heads of 128 at d = 1024).

Lower bound (FLA HGRN2Model, use_lower_bound=True): one parameter row P_l per layer, gamma_l =
cumsum_l(softmax_layers(P)) - softmax(P)_0, P init 0, so gamma_l = l / L at init (layer 0: none) and the
bounds increase with depth. A mixer sees only its own layer, so ``lower_bound="learned"`` (default) gives
each layer its own logit theta_l [H d_k] (``DynamicsParam``), gamma_l = sigmoid(theta_l), initialised to
FLA's l / L; the monotone-in-depth coupling is not kept. "fixed": gamma_l = l / L, no parameter. "none":
gamma = 0 in every layer (FLA's layer called without a lower bound). Layer 0 has no bound in every mode.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp

from mixerlab.mixers.base import DynamicsParam
from mixerlab.mixers.gated_norm import GatedRMSNorm
from mixerlab.mixers.gates import split_heads
from mixerlab.mixers.gla_common import Features, GatedLinearMixer
from mixerlab.mixers.registry import register


@dataclasses.dataclass(frozen=True)
class HGRN2Options:
    """HGRN2 options (docs/mixers.md, 'hgrn2').

    lower_bound: "learned"         per-layer forget-gate lower bound gamma_l: "learned" (sigmoid of a
                                   per-channel DynamicsParam, init l/L) | "fixed" (l/L) | "none" [FLA
                                   HGRN2Model init; per-layer parameterisation ours, see the module docstring].
    use_short_conv: bool = False   causal depthwise conv (K=conv_size, no bias, no activation) on the q, f and i
                                   projections [FLA].
    conv_size: int = 4             its kernel width [FLA].
    norm_eps: float = 1e-6         eps of the output RMSNorm [FLA HGRN2Config; the bare layer: 1e-5].
    init_scheme: "normal"          N(0, spec.init_std) for input-side matrices (FLA _init_weights)
                                   | "xavier_uniform" (gain 2^-2.5) [ours]. W_o: N(0, spec.out_init_std).
    implementation: str = "auto"   which implementation of the op.
    chunk_size: int = 0            chunk length of the chunkwise op; 0 = the op's default.
    leaf_size: int = 0             leaf size of the op's block inverse; 0 = the op's default.
    """

    lower_bound: Literal["learned", "fixed", "none"] = "learned"
    use_short_conv: bool = False
    conv_size: int = 4
    norm_eps: float = 1e-6
    init_scheme: Literal["normal", "xavier_uniform"] = "normal"
    implementation: str = "auto"
    chunk_size: int = 0
    leaf_size: int = 0

    def __post_init__(self):
        if self.lower_bound not in ("learned", "fixed", "none"):
            raise ValueError(f"mixers.hgrn2.lower_bound must be 'learned', 'fixed' or 'none', got "
                             f"{self.lower_bound!r}")


def initial_lower_bound(layer_index: int, num_layers: int) -> float:
    """FLA HGRN2Model's gamma_l at init: cumsum of a uniform softmax over the layers minus its first entry."""
    return layer_index / num_layers


def forget_log(z: jax.Array, bound_logit: jax.Array | float | None) -> jax.Array:
    """log f = log(gamma + (1 - gamma) sigmoid(z)) with gamma = sigmoid(bound_logit), in log space (float32 at least);
    ``bound_logit`` None: log f = logsigmoid(z)."""
    g = jax.nn.log_sigmoid(z.astype(jnp.promote_types(z.dtype, jnp.float32)))
    if bound_logit is None:
        return g
    return jnp.logaddexp(jax.nn.log_sigmoid(bound_logit), jax.nn.log_sigmoid(-bound_logit) + g)


@register("hgrn2", HGRN2Options)
class HGRN2(GatedLinearMixer):
    CONV_ACTIVATION = False  # FLA's HGRN2: ShortConvolution(activation=None)

    def _build_gates(self, rngs):
        H, Dk, Dv = self.num_heads, self.head_dim, self.value_head_dim
        o, spec = self.options, self.spec
        gamma = initial_lower_bound(spec.layer_index, spec.num_layers)
        self._fixed_bound_logit = None
        if o.lower_bound == "learned" and gamma > 0:
            self.lower_bound_logit = DynamicsParam(jnp.full((H * Dk,), math.log(gamma / (1 - gamma)), jnp.float32))
        elif o.lower_bound == "fixed" and gamma > 0:
            self._fixed_bound_logit = math.log(gamma / (1 - gamma))
        self.o_norm = GatedRMSNorm(H * Dv, eps=o.norm_eps, dtype=self.dtype)

    def _bound_logit(self):
        if hasattr(self, "lower_bound_logit"):
            return self.lower_bound_logit[...]
        return self._fixed_bound_logit

    def _features(self, x, q, k, v):
        del x
        H = self.num_heads
        s = self.head_dim ** -0.5
        q = (jax.nn.silu(split_heads(q, H).astype(self.gate_dtype)) * s).astype(self.dtype)
        lam = split_heads(forget_log(k.astype(self.gate_dtype), self._bound_logit()), H)
        k_hat = (-jnp.expm1(lam)).astype(self.dtype)  # 1 - f
        return Features(q, k_hat, split_heads(v, H).astype(self.dtype), lam, None)

    def _output(self, o, out_gate):
        del out_gate
        return self.o_norm(o.reshape(*o.shape[:-2], -1))
