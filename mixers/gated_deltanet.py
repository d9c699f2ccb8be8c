"""Gated DeltaNet (Yang, Kautz, Hatamizadeh, ICLR 2025); math in docs/math/delta_rule.md.

    S_t = alpha_t (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t,   o_t = s q_t S_t
    lambda_t = log alpha_t = -exp(A_log) softplus(x_t W_a + dt_bias)   (per head; W_a: d -> H, no bias)
    beta_t   = sigmoid(x_t W_b)                                        (per head; W_b: d -> H, no bias)
    op inputs: q_hat = s q, k_hat = beta k, v_hat = beta v, log_decay [B,T,H] (per-head scalar).
    y = RMSNorm(o) * omega * SiLU(x W_g),  W_g dense d -> H d_v, no bias.
Init [FLA ``fla/layers/gated_deltanet.py``]: A_log = log U(0, 16) per head; dt_bias = inv_softplus(dt),
dt ~ logU(1e-3, 1e-1) clamped >= 1e-4, per head. Both are ``DynamicsParam`` (no weight decay).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mixerlab.mixers.base import DynamicsParam
from mixerlab.mixers.delta_common import DeltaMixer, DeltaOptions, Gates
from mixerlab.mixers.gates import a_log_init, dense, dt_bias_init, log_decay, split_heads
from mixerlab.mixers.registry import register


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetOptions(DeltaOptions):
    """Gated DeltaNet options: the shared ``DeltaOptions`` fields plus

    use_output_gate: bool = True    dense SiLU output gate (FLA ``use_gate=True``); False: plain RMSNorm [FLA].
    gate_act: "silu"                FLA's ``FusedRMSNormGated`` swish gate [FLA].
    """

    use_output_gate: bool = True


@register("gated_deltanet", GatedDeltaNetOptions)
class GatedDeltaNet(DeltaMixer):
    def _build_gates(self, rngs):
        d, H = self.spec.d_model, self.num_heads
        kw = self._gate_kw(rngs)
        self.a_proj = dense(d, H, **kw)
        self.b_proj = dense(d, H, **kw)
        self.A_log = DynamicsParam(a_log_init(rngs.params(), (H,), 0.0, 16.0))
        self.dt_bias = DynamicsParam(dt_bias_init(rngs.params(), (H,)))
        if self.options.use_output_gate:
            self.g_proj = dense(d, H * self.value_head_dim, **kw)

    def _gates(self, x):
        lam = log_decay(self.a_proj(x), self.A_log[...], self.dt_bias[...])  # [B,T,H]
        beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
        if self.options.allow_neg_eigval:
            beta = 2.0 * beta
        g = split_heads(self.g_proj(x), self.num_heads) if self.options.use_output_gate else None
        return Gates(erase=beta[..., None], write=beta[..., None], q_gain=None, log_decay=lam, out_gate=g)
