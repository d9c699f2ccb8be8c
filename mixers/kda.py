"""KDA, Kimi Delta Attention (Kimi Linear, arXiv 2510.26692); math in docs/math/delta_rule.md.

    S_t = (I - beta_t k_t^T k_t) Diag(alpha_t) S_{t-1} + beta_t k_t^T v_t,   o_t = s q_t S_t
    lambda_t = -exp(A_log_h) * softplus(x_t W_f_down W_f_up + dt_bias)   channel-wise [B,T,H,d_k]
               (W_f_down: d -> decay_rank, W_f_up: decay_rank -> H d_k, no biases, nothing in between;
                A_log in R^H ~ log U(1, 16); dt_bias in R^{H d_k} per channel)
    beta_t   = sigmoid(x_t W_b)        per head, W_b: d -> H
    g_t      = x_t W_g_down W_g_up + c_g   (rank gate_rank, bias c_g init 0)
    y        = RMSNorm(o) * omega * sigmoid(g)
    op inputs: q_hat = s q, k_hat = beta k, v_hat = beta v, log_decay channel-wise.
"Safe gate" option [FLA ``fla/ops/kda/gate.py``]: lambda = lb * sigmoid(exp(A_log) (z + dt_bias)) with
lb = safe_gate_lower_bound in [-5, 0), A_log init 0: bounds the per-token log-decay.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from mixerlab.mixers.base import DynamicsParam
from mixerlab.mixers.delta_common import DeltaMixer, DeltaOptions, Gates
from mixerlab.mixers.gates import LowRank, a_log_init, dense, dt_bias_init, log_decay, split_heads
from mixerlab.mixers.registry import register


@dataclasses.dataclass(frozen=True)
class KDAOptions(DeltaOptions):
    """KDA options: the shared ``DeltaOptions`` fields plus

    gate_act: "sigmoid"            KDA's output gate is a sigmoid [FLA ``fla/layers/kda.py``].
    decay_rank: int = 128          rank of the decay projection f (FLA: head_v_dim = 128) [FLA].
    gate_rank: int = 128           rank of the output-gate projection g (FLA: head_v_dim = 128) [FLA].
    safe_gate: bool = False        bounded decay lambda = lb*sigmoid(exp(A_log)(z+dt_bias)) [FLA option].
    safe_gate_lower_bound: float = -5.0   lb of the safe gate (must be in [-5, 0)) [FLA].
    """

    gate_act: Literal["silu", "sigmoid"] = "sigmoid"
    decay_rank: int = 128
    gate_rank: int = 128
    safe_gate: bool = False
    safe_gate_lower_bound: float = -5.0

    def __post_init__(self):
        if self.safe_gate and not -5.0 <= self.safe_gate_lower_bound < 0.0:
            raise ValueError(f"mixers.kda.safe_gate_lower_bound must be in [-5, 0), got {self.safe_gate_lower_bound}")


@register("kda", KDAOptions)
class KDA(DeltaMixer):
    def _build_gates(self, rngs):
        d, H, Dk, Dv = self.spec.d_model, self.num_heads, self.head_dim, self.value_head_dim
        o = self.options
        kw = self._gate_kw(rngs)
        self.f_proj = LowRank(d, o.decay_rank, H * Dk, use_bias=False, **kw)
        self.b_proj = dense(d, H, **kw)
        self.g_proj = LowRank(d, o.gate_rank, H * Dv, use_bias=True, **kw)
        a_log = jnp.zeros((H,), jnp.float32) if o.safe_gate else a_log_init(rngs.params(), (H,), 1.0, 16.0)
        self.A_log = DynamicsParam(a_log)
        self.dt_bias = DynamicsParam(dt_bias_init(rngs.params(), (H * Dk,)))

    def _gates(self, x):
        H = self.num_heads
        a_log = self.A_log[...][:, None]  # [H, 1] broadcasts over d_k
        z = split_heads(self.f_proj(x) + self.dt_bias[...], H)
        if self.options.safe_gate:
            lam = self.options.safe_gate_lower_bound * jax.nn.sigmoid(jnp.exp(a_log) * z)
        else:
            lam = log_decay(z, a_log)
        beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
        if self.options.allow_neg_eigval:
            beta = 2.0 * beta
        g = split_heads(self.g_proj(x), H)
        return Gates(erase=beta[..., None], write=beta[..., None], q_gain=None, log_decay=lam, out_gate=g)
