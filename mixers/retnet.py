"""RetNet multi-scale retention (Sun et al. 2023, "Retentive Network", §2.1–2.2); block as FLA's
``fla/layers/multiscale_retention.py``. Math in docs/mixers.md, 'Recurrent baselines'.

```
q, k = RoPE(x W_q), RoPE(x W_k)            per head [H, d_k], positions restart at every document
v    = x W_v                               [H, d_v]  (FLA's expand_v = 2: d_v = 2 d_k, set by model.value_head_dim)
S_t  = gamma_h S_{t-1} + k_t^T v_t,   o_t = d_k^-1/2 q_t S_t,   gamma_h = 1 - 2^(-5-h), h = 0..H-1 (fixed)
y    = RMSNorm(o; eps) * omega * SiLU(x W_g)     per head, omega [d_v] shared by the heads (FLA FusedRMSNormGated)
out  = concat_heads(y) W_o
op inputs: q_hat = d_k^-1/2 q, k, v, log_decay = log gamma_h [B,T,H] (constant), erase_key = None.
```
No parameter is dynamics: the decays are constants of the architecture, as in the paper and FLA.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mixerlab import pallas_kernels
from mixerlab.mixers.base import MixerSpec, reset_rows
from mixerlab.mixers.blocks import rotary
from mixerlab.mixers.gated_norm import GatedRMSNorm
from mixerlab.mixers.gates import dense, split_heads
from mixerlab.mixers.registry import register
from mixerlab.pallas_kernels import common


@dataclasses.dataclass(frozen=True)
class RetNetOptions:
    """Multi-scale retention options (config keys ``mixers.retnet.<field>``).

    rope_theta: float = 10000.0     RoPE base on q and k (half-split layout) [FLA ``RotaryEmbedding``; the paper's
                                    xPos-style rotation, §2.1].
    use_output_gate: bool = True    y = RMSNorm(o) * omega * act(x W_g) [FLA; RetNet §2.2 swish gate]; False: a plain
                                    per-head RMSNorm [FLA].
    gate_act: "silu"                output-gate activation (FLA ``gate_fn='swish'``) | "sigmoid" [FLA].
    norm_eps: float = 1e-5          eps of the per-head RMSNorm [FLA]; the paper has a GroupNorm there (§2.2).
    init_scheme: "normal"           N(0, spec.init_std) for W_q, W_k, W_v, W_g (FLA's ``initializer_range``) |
                                    "xavier_uniform"; W_o is N(0, spec.out_init_std) [ours: the decoder's
                                    convention].
    implementation: str = "auto"    which implementation of the op.
    chunk_size: int = 0             chunk length of the chunkwise op; 0 = the op's default.
    leaf_size: int = 0              leaf size of the op's block inverse; 0 = the op's default.
    """

    rope_theta: float = 10000.0
    use_output_gate: bool = True
    gate_act: Literal["silu", "sigmoid"] = "silu"
    norm_eps: float = 1e-5
    init_scheme: Literal["normal", "xavier_uniform"] = "normal"
    implementation: str = "auto"
    chunk_size: int = 0
    leaf_size: int = 0


def retention_log_decay(num_heads: int) -> np.ndarray:
    """log gamma_h, gamma_h = 1 - 2^(-5-h) (RetNet §2.2; FLA ``naive_retention``), float64 [H]."""
    return np.log1p(-np.exp2(-5.0 - np.arange(num_heads, dtype=np.float64)))


def document_positions(segment_ids, batch: int, length: int):
    """[B, T] position of each token inside its document (0 at every document start), for RoPE."""
    document = common.document_index(segment_ids, batch, length)
    idx = jnp.arange(length, dtype=jnp.int32)
    start = jnp.concatenate([jnp.ones((batch, 1), bool), document[:, 1:] != document[:, :-1]], axis=1)
    first = jax.lax.cummax(jnp.where(start, idx, 0), axis=1)
    return idx - first


@register("retnet", RetNetOptions)
class RetNet(nnx.Module):
    def __init__(self, spec: MixerSpec, options: RetNetOptions, *, rngs: nnx.Rngs):
        if spec.head_dim % 2:
            raise ValueError(f"retnet's RoPE needs an even model.head_dim, got {spec.head_dim}")
        self.spec, self.options, self.dtype = spec, options, spec.dtype
        self.acc = jnp.promote_types(spec.dtype, jnp.float32)  # float32 (float64 under x64) for the state
        d, H, Dk, Dv = spec.d_model, spec.num_heads, spec.head_dim, spec.value_head_dim
        self.num_heads, self.head_dim, self.value_head_dim = H, Dk, Dv
        kw = dict(init_scheme=options.init_scheme, std=spec.init_std, dtype=spec.dtype, rngs=rngs)
        self.q_proj = dense(d, H * Dk, **kw)
        self.k_proj = dense(d, H * Dk, **kw)
        self.v_proj = dense(d, H * Dv, **kw)
        if options.use_output_gate:
            self.g_proj = dense(d, H * Dv, **kw)
        self.g_norm = GatedRMSNorm(Dv, eps=options.norm_eps, activation=options.gate_act, dtype=spec.dtype)
        self.o_proj = dense(H * Dv, d, init_scheme="normal", std=spec.out_init_std, dtype=spec.dtype, rngs=rngs)
        self.log_gamma = retention_log_decay(H)  # a constant, not a parameter

    def _op_inputs(self, x, positions):
        """x [B, T, d], positions [B, T] -> q_hat, k (rotated), v per head, and the log decay [B, T, H]."""
        H = self.num_heads
        theta = self.options.rope_theta
        q = rotary(split_heads(self.q_proj(x), H), positions, theta=theta)
        k = rotary(split_heads(self.k_proj(x), H), positions, theta=theta)
        v = split_heads(self.v_proj(x), H)
        q = (q.astype(self.acc) * self.head_dim ** -0.5).astype(self.dtype)
        lam = jnp.broadcast_to(jnp.asarray(self.log_gamma, self.acc), (*x.shape[:2], H))
        return q, k.astype(self.dtype), v.astype(self.dtype), lam

    def _output(self, o_BTHV, x):
        g = split_heads(self.g_proj(x), self.num_heads) if self.options.use_output_gate else None
        y = self.g_norm(o_BTHV, g)
        return self.o_proj(y.reshape(*y.shape[:-2], -1)).astype(self.dtype)

    def _run(self, x_BTD, segment_ids, positions, initial_state=None):
        x = x_BTD.astype(self.dtype)
        b, t, _ = x.shape
        if positions is None:
            positions = document_positions(segment_ids, b, t)
        q, k, v, lam = self._op_inputs(x, positions)
        o = self.options
        out, state = pallas_kernels.delta_rule(
            q, k, v, erase_key=None, log_decay=lam, initial_state=initial_state, segment_ids=segment_ids,
            chunk_size=o.chunk_size or None, leaf_size=o.leaf_size or None, implementation=o.implementation)
        return self._output(out, x), state

    # ---- mixer protocol --------------------------------------------------------------------------------
    def __call__(self, x_BTD, *, segment_ids=None, positions=None):
        """``positions`` (restarting at 0 in every document) place RoPE; None: computed from ``segment_ids``."""
        return self._run(x_BTD, segment_ids, positions)[0]

    def init_cache(self, batch_size: int, max_length: int = 0) -> dict:
        del max_length  # constant-size state
        H, Dk, Dv = self.num_heads, self.head_dim, self.value_head_dim
        return {"state": jnp.zeros((batch_size, H, Dk, Dv), self.acc)}

    def prefill(self, x_BTD, *, segment_ids=None, positions=None):
        """Parallel forward that also returns the decode cache continuing each row's last document."""
        y, state = self._run(x_BTD, segment_ids, positions)
        return y, {"state": state.astype(self.acc)}

    def extend(self, x_BCD, cache, positions_BC):
        """C tokens of one document per row continuing ``cache`` (RoPE at ``positions_BC``)."""
        cache = reset_rows(cache, positions_BC[:, 0])
        y, state = self._run(x_BCD, None, positions_BC, cache["state"])
        return y, {"state": state.astype(self.acc)}

    def decode(self, x_B1D, cache, positions_B):
        cache = reset_rows(cache, positions_B)
        x = x_B1D.astype(self.dtype)
        q, k, v, lam = self._op_inputs(x, positions_B[:, None])
        o, state = pallas_kernels.delta_rule_step(q[:, 0], k[:, 0], v[:, 0], log_decay=lam[:, 0],
                                                  state=cache["state"])
        return self._output(o[:, None], x), {"state": state.astype(self.acc)}
