"""Muir (Gangavarapu, Tabak, Schaefer): GDN-2's recurrence with one fused low-rank gate projection and a
matched-filter readout gain gamma. The Muir paper gives the ranks, the fused projection and the three gamma
variants; every equation below is our reconstruction (docs/math/delta_rule.md, 'Mechanisms as substitutions').

    z_t = x_t W_down                          W_down: d -> R_tot (= sum of ranks), no bias: ONE projection
    [z_f|z_b|z_g|z_w|z_q] = split(z_t, ranks)   dynamic: (64,64,128,128,128); none/static: (64,64,128,256,0)
    z^m_t = z_m W_m_up + c_m                  W_m_up: r_m -> H d_k (f, b, q) or H d_v (g, w); c_m DynamicsParam
    lambda_t = -exp(A_log_h) * softplus(z^f_t)   c_f plays dt_bias (init inv_softplus(dt)); A_log ~ log U(1,16)
    b_t = sigmoid(z^b_t)  (c_b = 0)     w_t = sigmoid(z^w_t)  (c_w = 0)     g_t = z^g_t  (c_g = 0)
    gamma_t = gamma_stat * phi(z^q_t)   (dynamic; phi(0) = 1)  |  gamma_stat (static)  |  1 (none)
    q_hat = s gamma_t * q  (after the L2 norm),  k_hat = b * k,  v_hat = w * v
    y = RMSNorm(o) * omega * act(g);  out = y W_o
gamma_stat (``ReadoutGain``, H d_k entries, init 1) is in both the static and the dynamic variant; W_q_up is
zero-initialised by default so gamma_t = gamma_stat at init (the model starts as GDN-2's unit readout).
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from mixerlab.mixers.base import DynamicsParam
from mixerlab.mixers.delta_common import DeltaMixer, DeltaOptions, Gates
from mixerlab.mixers.gates import (ReadoutGain, a_log_init, dense, dt_bias_init, log_decay, split_heads,
                          zeros_like_linear)
from mixerlab.mixers.registry import register

RANKS_DYNAMIC = (64, 64, 128, 128, 128)  # (r_f, r_b, r_g, r_w, r_q) [Muir, Fig. 3c and Table 2]
RANKS_NO_Q = (64, 64, 128, 256, 0)  # Muir (no gamma) / (static gamma) [Muir, Table 2]


def gamma_phi(name: str):
    if name == "two_sigmoid":
        return lambda z: 2.0 * jax.nn.sigmoid(z)
    if name == "exp":
        return jnp.exp
    if name == "one_plus_tanh":
        return lambda z: 1.0 + jnp.tanh(z)
    raise ValueError(f"mixers.muir.gamma_phi must be two_sigmoid|exp|one_plus_tanh, got {name!r}")


@dataclasses.dataclass(frozen=True)
class MuirOptions(DeltaOptions):
    """Muir options: the shared ``DeltaOptions`` fields plus the ones below. Tags: [Muir, …] the paper, [ours] our
    reconstruction, [open] stated in no source (our choice, a flag), [GDN2-code] NVlabs GDN-2 code, [FLA] fla-org.

    gamma: "dynamic"               readout gain variant: none | static | dynamic [Muir, Table 2; its "ours" = dynamic].
    ranks: tuple[int, ...] = ()    (r_f, r_b, r_g, r_w, r_q); () = the seed's ranks for the variant:
                                   (64,64,128,128,128) dynamic, (64,64,128,256,0) none/static [Muir, Table 2].
                                   r_q must be > 0 exactly when gamma = dynamic.
    gamma_phi: "two_sigmoid"       phi in gamma_t = gamma_stat * phi(z^q): 2 sigmoid(z) (bounded in (0,2), our
                                   default) | exp | one_plus_tanh; all have phi(0) = 1 [open].
    gamma_static_init: float = 1.0 init of gamma_stat (unit gain = GDN-2's readout [Muir, Table 6]) [ours].
    gamma_up_zero_init: bool = True  W_q_up = 0 at init so gamma_t = gamma_stat exactly (LoRA-style) [ours].
    use_gamma_bias: bool = True    whether c_q exists (init 0) [open].
    keep_a_log: bool = True        lambda = -exp(A_log) softplus(z^f) (GDN-2's form); False: -softplus(z^f) [open].
    gate_act: "silu"               output gate as the GDN-2 reference training code [GDN2-code]; sigmoid as
                                   FLA's port [open for Muir].
    """

    gamma: Literal["none", "static", "dynamic"] = "dynamic"
    ranks: tuple[int, ...] = ()
    gamma_phi: Literal["two_sigmoid", "exp", "one_plus_tanh"] = "two_sigmoid"
    gamma_static_init: float = 1.0
    gamma_up_zero_init: bool = True
    use_gamma_bias: bool = True
    keep_a_log: bool = True

    def resolved_ranks(self) -> tuple[int, int, int, int, int]:
        ranks = self.ranks or (RANKS_DYNAMIC if self.gamma == "dynamic" else RANKS_NO_Q)
        if len(ranks) != 5 or any(r < 0 for r in ranks):
            raise ValueError(f"mixers.muir.ranks must be 5 non-negative ints (r_f, r_b, r_g, r_w, r_q), got {ranks}")
        if min(ranks[:4]) == 0:
            raise ValueError(f"mixers.muir.ranks: r_f, r_b, r_g, r_w must be > 0, got {ranks}")
        if (ranks[4] > 0) != (self.gamma == "dynamic"):
            raise ValueError(f"mixers.muir.ranks: r_q must be > 0 iff gamma='dynamic' (gamma={self.gamma!r}, "
                             f"ranks={ranks})")
        return tuple(ranks)

    def __post_init__(self):
        self.resolved_ranks()
        gamma_phi(self.gamma_phi)


@register("muir", MuirOptions)
class Muir(DeltaMixer):
    def _build_gates(self, rngs):
        d, H, Dk, Dv = self.spec.d_model, self.num_heads, self.head_dim, self.value_head_dim
        o = self.options
        self.ranks = o.resolved_ranks()
        r_f, r_b, r_g, r_w, r_q = self.ranks
        kw = self._gate_kw(rngs)
        self.gate_down = dense(d, sum(self.ranks), **kw)  # the single fused down-projection
        self.f_up = dense(r_f, H * Dk, **kw)
        self.b_up = dense(r_b, H * Dk, **kw)
        self.g_up = dense(r_g, H * Dv, **kw)
        self.w_up = dense(r_w, H * Dv, **kw)
        self.f_bias = DynamicsParam(dt_bias_init(rngs.params(), (H * Dk,)))  # c_f: GDN-2's dt_bias role
        self.b_bias = DynamicsParam(jnp.zeros((H * Dk,), jnp.float32))
        self.g_bias = DynamicsParam(jnp.zeros((H * Dv,), jnp.float32))
        self.w_bias = DynamicsParam(jnp.zeros((H * Dv,), jnp.float32))
        if o.keep_a_log:
            self.A_log = DynamicsParam(a_log_init(rngs.params(), (H,), 1.0, 16.0))
        if o.gamma != "none":
            self.gamma_static = ReadoutGain(jnp.full((H * Dk,), o.gamma_static_init, jnp.float32))
        if o.gamma == "dynamic":
            self.q_up = dense(r_q, H * Dk, **kw)
            if o.gamma_up_zero_init:
                zeros_like_linear(self.q_up)
            if o.use_gamma_bias:
                self.q_bias = DynamicsParam(jnp.zeros((H * Dk,), jnp.float32))

    def _gates(self, x):
        H, o = self.num_heads, self.options
        r_f, r_b, r_g, r_w, r_q = self.ranks
        z = self.gate_down(x)
        cuts = [r_f, r_f + r_b, r_f + r_b + r_g, r_f + r_b + r_g + r_w]
        z_f, z_b, z_g, z_w, z_q = jnp.split(z, cuts, axis=-1)

        def up(layer, zm, bias):
            return split_heads(layer(zm).astype(jnp.float32) + bias[...], H)

        lam = log_decay(up(self.f_up, z_f, self.f_bias), self.A_log[...][:, None] if o.keep_a_log else None)
        b = jax.nn.sigmoid(up(self.b_up, z_b, self.b_bias))
        if o.allow_neg_eigval:
            b = 2.0 * b
        w = jax.nn.sigmoid(up(self.w_up, z_w, self.w_bias))
        g = up(self.g_up, z_g, self.g_bias)
        gamma = None
        if o.gamma != "none":
            gamma = split_heads(self.gamma_static[...], H)[None, None]  # [1,1,H,Dk]
        if o.gamma == "dynamic":
            zq = self.q_up(z_q).astype(jnp.float32)
            if o.use_gamma_bias:
                zq = zq + self.q_bias[...]
            gamma = gamma * gamma_phi(o.gamma_phi)(split_heads(zq, H))
        return Gates(erase=b, write=w, q_gain=gamma, log_decay=lam, out_gate=g)
