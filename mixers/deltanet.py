"""DeltaNet (Schlag et al. 2021; chunkwise by Yang et al. 2024); math in docs/math/delta_rule.md.

    S_t = (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t,   o_t = s q_t S_t
    beta_t = sigmoid(x_t W_beta)   (per head, W_beta: d -> H, no bias; x2 with allow_neg_eigval)
    op inputs: q_hat = s q, k_hat = beta k, v_hat = beta v, no decay.
Output: RMSNorm(o) * omega (FLA default ``use_gate=False``), or RMSNorm(o) * omega * SiLU(x W_g) with
``use_output_gate`` (W_g dense d -> H d_v) [FLA ``fla/layers/delta_net.py``].
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mixerlab.mixers.delta_common import DeltaMixer, DeltaOptions, Gates
from mixerlab.mixers.gates import dense, split_heads
from mixerlab.mixers.registry import register


@dataclasses.dataclass(frozen=True)
class DeltaNetOptions(DeltaOptions):
    """DeltaNet options: the shared ``DeltaOptions`` fields plus

    use_output_gate: bool = False   dense output gate act(x W_g) after the RMSNorm; FLA's DeltaNet default is
                                    off (plain RMSNorm output) [FLA].
    gate_act: "silu"                activation of that gate when enabled (FLA uses swish) [FLA].
    """

    use_output_gate: bool = False


@register("deltanet", DeltaNetOptions)
class DeltaNet(DeltaMixer):
    def _build_gates(self, rngs):
        kw = self._gate_kw(rngs)
        self.b_proj = dense(self.spec.d_model, self.num_heads, **kw)
        if self.options.use_output_gate:
            self.g_proj = dense(self.spec.d_model, self.num_heads * self.value_head_dim, **kw)

    def _gates(self, x):
        beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
        if self.options.allow_neg_eigval:
            beta = 2.0 * beta
        g = split_heads(self.g_proj(x), self.num_heads) if self.options.use_output_gate else None
        return Gates(erase=beta[..., None], write=beta[..., None], q_gain=None, log_decay=None, out_gate=g)
