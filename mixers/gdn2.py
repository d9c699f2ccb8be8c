"""Gated DeltaNet-2 (Hatamizadeh, Choi, Kautz, arXiv 2605.22791); math in docs/math/delta_rule.md.

    S_t = (I - k_t^T (b_t * k_t)) Diag(alpha_t) S_{t-1} + k_t^T (w_t * v_t),   o_t = s q_t S_t
    lambda_t = -exp(A_log_h) * softplus(x_t W_f_down W_f_up + dt_bias)   channel-wise, as KDA
    b_t = sigmoid(x_t W_b) in (0,1)^{d_k}   W_b dense d -> H d_k, no bias (x2 with allow_neg_eigval)
    w_t = sigmoid(x_t W_w) in (0,1)^{d_v}   W_w dense d -> H d_v, no bias
    g_t = x_t W_g_down W_g_up + c_g          rank 128, bias c_g
    y   = RMSNorm(o) * omega * act(g),  act = SiLU [GDN2-code FusedRMSNormSwishGate] (FLA's port: sigmoid)
    op inputs: q_hat = s q, k_hat = b * k, v_hat = w * v, log_decay channel-wise.
Matrices per layer: 4d^2 (q,k,v,o) + 2d^2 (b, w) + 2 (2 128 d) (f, g) = 6d^2 + 512d at H d_k = d.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mixerlab.mixers.base import DynamicsParam
from mixerlab.mixers.delta_common import DeltaMixer, DeltaOptions, Gates
from mixerlab.mixers.gates import LowRank, a_log_init, dense, dt_bias_init, log_decay, split_heads
from mixerlab.mixers.registry import register


@dataclasses.dataclass(frozen=True)
class GDN2Options(DeltaOptions):
    """GDN-2 options: the shared ``DeltaOptions`` fields plus

    gate_act: "silu"        NVlabs training code (FusedRMSNormSwishGate) [GDN2-code]; FLA's port uses sigmoid.
    decay_rank: int = 128   rank of the decay projection f [GDN2-code, FLA; Muir, Table 5 "r=128"].
    gate_rank: int = 128    rank of the output-gate projection g [GDN2-code, FLA; Muir, Table 5].
    """

    decay_rank: int = 128
    gate_rank: int = 128


@register("gdn2", GDN2Options)
class GDN2(DeltaMixer):
    def _build_gates(self, rngs):
        d, H, Dk, Dv = self.spec.d_model, self.num_heads, self.head_dim, self.value_head_dim
        o = self.options
        kw = self._gate_kw(rngs)
        self.f_proj = LowRank(d, o.decay_rank, H * Dk, use_bias=False, **kw)
        self.b_proj = dense(d, H * Dk, **kw)
        self.w_proj = dense(d, H * Dv, **kw)
        self.g_proj = LowRank(d, o.gate_rank, H * Dv, use_bias=True, **kw)
        self.A_log = DynamicsParam(a_log_init(rngs.params(), (H,), 1.0, 16.0))
        self.dt_bias = DynamicsParam(dt_bias_init(rngs.params(), (H * Dk,)))

    def _gates(self, x):
        H = self.num_heads
        lam = log_decay(split_heads(self.f_proj(x) + self.dt_bias[...], H), self.A_log[...][:, None])
        b = jax.nn.sigmoid(split_heads(self.b_proj(x).astype(jnp.float32), H))
        if self.options.allow_neg_eigval:
            b = 2.0 * b
        w = jax.nn.sigmoid(split_heads(self.w_proj(x).astype(jnp.float32), H))
        g = split_heads(self.g_proj(x), H)
        return Gates(erase=b, write=w, q_gain=None, log_decay=lam, out_gate=g)
