"""Variational Linear Attention (Pandey & Singh, arXiv 2605.11196) and the paper's "DeltaNet".

``vla`` (math: docs/math/vla.md), per head h, with φ = ELU+1:
    q, k, v = x W_q, x W_k, x W_v                           (no biases; optional short conv, no activation)
    q_feat  = φ(q) | q,   optionally unit-normalised (``normalize_query``)        o_t = q_feat S_t
    k_feat  = φ(k) | k                                      the op uses k̂ = k_feat / max(‖k_feat‖, ε)
    p       = k_feat W_u^h  (W_u^h ∈ R^{d_h×d_h}, init I)  | none (u = k̂)     the op uses u = p / max(‖p‖, ε)
    o, (S, A) = pallas_kernels.vla(q_feat, k_feat, v, penalty_key=p, ...)   (recurrence: docs/vla.md)
    out     = concat_heads(o) W_o        (optional per-head RMSNorm before W_o)
Decode cache: ``{"S": [B,H,d_k,d_v], "A": [B,H,d_k,d_k]}`` float32 (+ conv caches); a row resets to
(0, I/λ₀) when its position is 0; the refresh phase comes from the position.

``paper_deltanet`` (VLA paper §2.3, for replication only — NOT standard DeltaNet, see ``deltanet``):
    S_t = β_t S_{t−1} + (v_t − S_{t−1} k_t) k_tᵀ   (value-major),  β_t = σ(x_t W_β + b) ∈ (0,1) a decay gate
    o_t = S_t q_t
run through ``pallas_kernels.delta_rule`` with write key k, erase key k/β, per-head log-decay log β
(key-major: (I − kᵀ(k/β)) β S = βS − kᵀkS).
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from mixerlab.pallas_kernels.delta_rule.api import delta_rule, delta_rule_step
from mixerlab.mixers.base import DynamicsParam, MixerSpec, reset_rows
from mixerlab.mixers.gated_norm import GatedRMSNorm
from mixerlab.mixers.gates import build_qkv, dense, split_heads
from mixerlab.mixers.registry import register

from mixerlab.pallas_kernels.vla import api as vla_api

REFRESH_OFFSET = {"after_write": 0, "before_update": 1, "none": 0}


def elu_plus_one(x):
    return jax.nn.elu(x) + 1.0


@dataclasses.dataclass(frozen=True)
class VLAOptions:
    """VLA options (config keys ``mixers.vla.<field>``). Tags: [S] sourced from the VLA paper, [R] ours.

    key_feature_map: "elu_plus_one"   φ on the key before k̂ = φ(k)/‖φ(k)‖ [S:VLA §2.2 "ELU+1 throughout";
                                      φ inside k̂ is R]; "identity": k̂ = k/‖k‖ (zero-mean keys, more capacity:
                                      docs/math/vla.md) [R].
    query_feature_map: "elu_plus_one" o = S φ(q) [S:VLA Tab.8 caption]; "identity": o = S q [R].
    normalize_query: bool = False     o = S q̂ with q̂ = q_feat/max(‖q_feat‖, eps) (scale-consistent with the
                                      unit write key) [R].
    penalty_map: "linear"             f_θ(k) = φ(k) W_u per head, W_u init I (so u = k̂ at init) [R];
                                      "none": u = k̂ (classical RLS penalty, zero parameters) [R].
    lambda0: float = 0.1              A₀ = I/λ₀ [S:VLA Tab.3/6].
    refresh_period: int = 20          P, in tokens of the document [S:VLA Tab.3/6].
    refresh_magnitude: float = 1e-3   ρ of A ← A + ρI [S:VLA Tab.3/6].
    refresh_placement: "after_write"  after the write of tokens P, 2P, … [R]; "before_update":
                                      before the Sherman–Morrison update of those tokens [R]; "none": no
                                      refresh [R].
    eps: float = 1e-4                 floor of every denominator [S:VLA Tab.3/6].
    normalize_key: bool = True        k̂ = k_feat/max(‖k_feat‖, eps) [S: VLA §1.2]; False: write and read with the
                                      raw k_feat (the paper's "no k̂ norm" ablation, Table 4) [ablation].
    normalize_write_direction: bool = True   α̂ = k̂A/max(‖k̂A‖, eps) [S: VLA §1.2, App. A.1]; False: write
                                      along α = k̂A itself (the unnormalised "VLAv2" of Table 2: with u = k̂ this
                                      is the classical RLS gain) [ablation].
    penalty_update: "sherman_morrison"   A_t by the Sherman–Morrison update and the refresh [S: VLA §3.3];
                                      "fixed": A stays I/λ₀ (= 10 I), no update and no refresh (Table 4's
                                      "A_t = 10I fixed" row; α̂ = k̂, i.e. a delta rule with β = 1). W_u is then
                                      not created [ablation].
    use_short_conv: bool = False      causal depthwise conv (K=conv_size, no activation) on q, k, v; the paper
                                      has none; Zoology-style baselines do [R].
    conv_size: int = 4                its kernel width [R].
    use_output_norm: bool = False     per-head RMSNorm before W_o (the paper has none) [R].
    norm_eps: float = 1e-5            eps of that RMSNorm [R].
    init_scheme: "normal"             N(0, spec.init_std) input projections | "xavier_uniform" [R].
    implementation: str = "auto"      which implementation of the op (auto | reference | xla | pallas_triton |
                                      pallas_triton_split: its A-pass as chains and replays, opt-in |
                                      pallas_tpu); auto: the kernel of the backend, else xla.
    chunk_size: int = 0               A-pass chunk length; 0 = the op's default (min(64, P − offset)).
    """

    key_feature_map: Literal["elu_plus_one", "identity"] = "elu_plus_one"
    query_feature_map: Literal["elu_plus_one", "identity"] = "elu_plus_one"
    normalize_query: bool = False
    penalty_map: Literal["linear", "none"] = "linear"
    lambda0: float = 0.1
    refresh_period: int = 20
    refresh_magnitude: float = 1e-3
    refresh_placement: Literal["after_write", "before_update", "none"] = "after_write"
    eps: float = 1e-4
    normalize_key: bool = True
    normalize_write_direction: bool = True
    penalty_update: Literal["sherman_morrison", "fixed"] = "sherman_morrison"
    use_short_conv: bool = False
    conv_size: int = 4
    use_output_norm: bool = False
    norm_eps: float = 1e-5
    init_scheme: Literal["normal", "xavier_uniform"] = "normal"
    implementation: str = "auto"
    chunk_size: int = 0

    def __post_init__(self):
        if not self.lambda0 > 0:
            raise ValueError(f"mixers.vla.lambda0 must be > 0, got {self.lambda0!r}")
        if self.refresh_period < 0:
            raise ValueError(f"mixers.vla.refresh_period must be >= 0, got {self.refresh_period!r}")
        if self.refresh_placement == "before_update" and self.refresh_period < 2:
            raise ValueError("mixers.vla.refresh_placement='before_update' needs refresh_period >= 2, "
                             f"got {self.refresh_period!r}")
        if self.refresh_magnitude < 0 or not self.eps > 0:
            raise ValueError("mixers.vla.refresh_magnitude must be >= 0 and mixers.vla.eps > 0")
        if self.penalty_update not in ("sherman_morrison", "fixed"):
            raise ValueError(f"mixers.vla.penalty_update must be 'sherman_morrison' (the paper's method) or "
                             f"'fixed' (A stays I/lambda0), got {self.penalty_update!r}")

    @property
    def op_kwargs(self) -> dict:
        period = 0 if self.refresh_placement == "none" else self.refresh_period
        return dict(refresh_period=period, refresh_magnitude=self.refresh_magnitude,
                    refresh_offset=REFRESH_OFFSET[self.refresh_placement] if period else 0, eps=self.eps,
                    **self.op_ablation)

    @property
    def op_ablation(self) -> dict:
        return dict(normalize_key=self.normalize_key, normalize_write_direction=self.normalize_write_direction,
                    penalty_update=self.penalty_update)

    @property
    def learns_penalty_map(self) -> bool:
        return self.penalty_map == "linear" and self.penalty_update == "sherman_morrison"


class _Projections(nnx.Module):
    """q, k, v projections (+ optional short convs without activation) shared by both mixers."""

    def _build_projections(self, spec: MixerSpec, options, rngs):
        d, H, Dk, Dv = spec.d_model, spec.num_heads, spec.head_dim, spec.value_head_dim
        self.spec, self.options = spec, options
        self.num_heads, self.head_dim, self.value_head_dim = H, Dk, Dv
        self.dtype = spec.dtype
        build_qkv(self, spec, options, rngs, conv_activation=False)
        self.o_proj = dense(H * Dv, d, init_scheme="normal", std=spec.out_init_std, dtype=spec.dtype, rngs=rngs)

    def _qkv(self, x, segment_ids):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.options.use_short_conv:
            q, k, v = self.q_conv(q, segment_ids), self.k_conv(k, segment_ids), self.v_conv(v, segment_ids)
        H = self.num_heads
        return split_heads(q, H), split_heads(k, H), split_heads(v, H)

    def _qkv_step(self, x_BD, cache, new_cache):
        q, k, v = self.q_proj(x_BD), self.k_proj(x_BD), self.v_proj(x_BD)
        if self.options.use_short_conv:
            q, new_cache["conv_q"] = self.q_conv.step(q, cache["conv_q"])
            k, new_cache["conv_k"] = self.k_conv.step(k, cache["conv_k"])
            v, new_cache["conv_v"] = self.v_conv.step(v, cache["conv_v"])
        H = self.num_heads
        return split_heads(q, H), split_heads(k, H), split_heads(v, H)

    def _conv_cache(self, batch_size):
        if not self.options.use_short_conv:
            return {}
        return {"conv_q": self.q_conv.init_cache(batch_size), "conv_k": self.k_conv.init_cache(batch_size),
                "conv_v": self.v_conv.init_cache(batch_size)}

    def _conv_cache_from_sequence(self, x, segment_ids):
        if not self.options.use_short_conv:
            return {}
        return {"conv_q": self.q_conv.cache_from_sequence(self.q_proj(x), segment_ids),
                "conv_k": self.k_conv.cache_from_sequence(self.k_proj(x), segment_ids),
                "conv_v": self.v_conv.cache_from_sequence(self.v_proj(x), segment_ids)}


@register("vla", VLAOptions)
class VLA(_Projections):
    def __init__(self, spec: MixerSpec, options: VLAOptions, *, rngs: nnx.Rngs):
        self._build_projections(spec, options, rngs)
        if options.learns_penalty_map:  # a fixed penalty never reads u: no W_u to train
            # f_θ: identity-initialised per-head map; dynamics-like (defines the penalty geometry): no decay
            self.penalty_map = DynamicsParam(jnp.broadcast_to(jnp.eye(self.head_dim, dtype=jnp.float32),
                                                              (self.num_heads, self.head_dim, self.head_dim)))
        if options.use_output_norm:
            self.o_norm = GatedRMSNorm(self.value_head_dim, eps=options.norm_eps, dtype=spec.dtype)

    def _features(self, q, k, v):
        """Per-head streams -> (q_feat, k_feat, v, penalty_key) in the compute dtype (maps in float32)."""
        o = self.options
        q, k = q.astype(jnp.float32), k.astype(jnp.float32)
        qf = elu_plus_one(q) if o.query_feature_map == "elu_plus_one" else q
        if o.normalize_query:
            qf = vla_api.normalize(qf, o.eps)
        kf = elu_plus_one(k) if o.key_feature_map == "elu_plus_one" else k
        p = None
        if o.learns_penalty_map:
            p = jnp.einsum("...hk,hkj->...hj", kf, self.penalty_map[...],
                           precision=jax.lax.Precision.HIGHEST).astype(self.dtype)
        return qf.astype(self.dtype), kf.astype(self.dtype), v.astype(self.dtype), p

    def _output(self, o_BTHV):
        y = self.o_norm(o_BTHV) if self.options.use_output_norm else o_BTHV.astype(self.dtype)
        return self.o_proj(y.reshape(*y.shape[:-2], -1)).astype(self.dtype)

    def _run(self, x_BTD, segment_ids):
        x = x_BTD.astype(self.dtype)
        q, k, v, p = self._features(*self._qkv(x, segment_ids))
        o, state = vla_api.vla(
            q, k, v, penalty_key=p, segment_ids=segment_ids, lambda0=self.options.lambda0,
            chunk_size=self.options.chunk_size or None, implementation=self.options.implementation,
            **self.options.op_kwargs)
        return self._output(o), state

    def __call__(self, x_BTD, *, segment_ids=None, positions=None):
        del positions  # document positions (refresh phase) are derived from segment_ids by the op
        return self._run(x_BTD, segment_ids)[0]

    def _fresh_state(self, batch_size):
        return vla_api.initial_state(batch_size, self.num_heads, self.head_dim, self.value_head_dim,
                                     lambda0=self.options.lambda0, dtype=jnp.float32)

    def init_cache(self, batch_size: int, max_length: int = 0) -> dict:
        del max_length  # constant-size state
        S, A = self._fresh_state(batch_size)
        return {"S": S, "A": A, **self._conv_cache(batch_size)}

    def prefill(self, x_BTD, *, segment_ids=None, positions=None):
        """Parallel forward that also returns the decode cache continuing each row's last document."""
        del positions
        y, (S, A) = self._run(x_BTD, segment_ids)
        cache = {"S": S.astype(jnp.float32), "A": A.astype(jnp.float32)}
        cache.update(self._conv_cache_from_sequence(x_BTD.astype(self.dtype), segment_ids))
        return y, cache

    def decode(self, x_B1D, cache, positions_B):
        b = x_B1D.shape[0]
        reset = (positions_B == 0).reshape(b, 1, 1, 1)
        S0, A0 = self._fresh_state(b)
        cache = dict(cache)
        cache["S"] = jnp.where(reset, S0, cache["S"])
        cache["A"] = jnp.where(reset, A0, cache["A"])
        for name in ("conv_q", "conv_k", "conv_v"):
            if name in cache:
                cache[name] = jnp.where(reset[:, :, :, 0], jnp.zeros_like(cache[name]), cache[name])
        x = x_B1D.astype(self.dtype)
        new_cache = {}
        q, k, v, p = self._features(*self._qkv_step(x[:, 0], cache, new_cache))
        o, (S, A) = vla_api.vla_step(q, k, v, penalty_key=p, state=(cache["S"], cache["A"]),
                                                position=positions_B.astype(jnp.int32), **self.options.op_kwargs)
        new_cache["S"], new_cache["A"] = S.astype(jnp.float32), A.astype(jnp.float32)
        return self._output(o[:, None]), new_cache


@dataclasses.dataclass(frozen=True)
class PaperDeltaNetOptions:
    """The VLA paper's "DeltaNet" baseline, for replication. Tags: [S] VLA paper §2.3, [R] ours.

    feature_map: "identity"        q, k used raw as in the §2.3 formula [S formula; R: the paper says "ELU+1
                                   throughout" only for linear attention]; "elu_plus_one": φ(q), φ(k) [R].
    normalize_keys: bool = False   False = the formula as written (unnormalised k, unstable when ‖k‖² > 2:
                                   ‖βI − kᵀk‖ = |β − ‖k‖²|) [S]; True: k/‖k‖ (L2, eps 1e-6) [R].
    beta_bias_init: float = 0.0    β_t = σ(x W_β + b), b initialised to this (σ(0) = 0.5 decay per token) [R].
    use_short_conv: bool = False   causal depthwise conv (no activation) on q, k, v [R].
    conv_size: int = 4             its kernel width [R].
    init_scheme: "normal"          input-projection init [R].
    implementation: str = "auto"   delta-rule implementation.
    chunk_size: int = 0            delta-rule chunk length; 0 = the op's default.
    leaf_size: int = 0             delta-rule leaf size; 0 = the op's default.
    """

    feature_map: Literal["identity", "elu_plus_one"] = "identity"
    normalize_keys: bool = False
    beta_bias_init: float = 0.0
    use_short_conv: bool = False
    conv_size: int = 4
    init_scheme: Literal["normal", "xavier_uniform"] = "normal"
    implementation: str = "auto"
    chunk_size: int = 0
    leaf_size: int = 0


@register("paper_deltanet", PaperDeltaNetOptions)
class PaperDeltaNet(_Projections):
    def __init__(self, spec: MixerSpec, options: PaperDeltaNetOptions, *, rngs: nnx.Rngs):
        self._build_projections(spec, options, rngs)
        self.b_proj = dense(spec.d_model, self.num_heads, init_scheme=options.init_scheme, std=spec.init_std,
                            dtype=spec.dtype, rngs=rngs)
        self.b_bias = DynamicsParam(jnp.full((self.num_heads,), options.beta_bias_init, jnp.float32))

    def _inputs(self, x, q, k, v):
        """-> (q, write key k, erase key k/β, v, log β [.., H]) for the delta-rule core."""
        o = self.options
        q, k = q.astype(jnp.float32), k.astype(jnp.float32)
        if o.feature_map == "elu_plus_one":
            q, k = elu_plus_one(q), elu_plus_one(k)
        if o.normalize_keys:
            k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=-1, keepdims=True) + 1e-6)
        z = self.b_proj(x).astype(jnp.float32) + self.b_bias[...]
        log_beta = jax.nn.log_sigmoid(z)
        erase = k * (1.0 + jnp.exp(-z))[..., None]  # k / β
        cast = lambda a: a.astype(self.dtype)  # noqa: E731
        return cast(q), cast(k), cast(erase), cast(v), log_beta

    def _output(self, o_BTHV):
        return self.o_proj(o_BTHV.astype(self.dtype).reshape(*o_BTHV.shape[:-2], -1)).astype(self.dtype)

    def _run(self, x_BTD, segment_ids):
        x = x_BTD.astype(self.dtype)
        q, k, erase, v, log_beta = self._inputs(x, *self._qkv(x, segment_ids))
        o, state = delta_rule(
            q, k, v, erase_key=erase, log_decay=log_beta, segment_ids=segment_ids,
            chunk_size=self.options.chunk_size or None, leaf_size=self.options.leaf_size or None,
            implementation=self.options.implementation)
        return self._output(o), state

    def __call__(self, x_BTD, *, segment_ids=None, positions=None):
        del positions
        return self._run(x_BTD, segment_ids)[0]

    def init_cache(self, batch_size: int, max_length: int = 0) -> dict:
        del max_length
        H, Dk, Dv = self.num_heads, self.head_dim, self.value_head_dim
        return {"state": jnp.zeros((batch_size, H, Dk, Dv), jnp.float32), **self._conv_cache(batch_size)}

    def prefill(self, x_BTD, *, segment_ids=None, positions=None):
        del positions
        y, state = self._run(x_BTD, segment_ids)
        cache = {"state": state.astype(jnp.float32)}
        cache.update(self._conv_cache_from_sequence(x_BTD.astype(self.dtype), segment_ids))
        return y, cache

    def decode(self, x_B1D, cache, positions_B):
        cache = reset_rows(cache, positions_B)
        x = x_B1D.astype(self.dtype)[:, 0]
        new_cache = {}
        q, k, v = self._qkv_step(x, cache, new_cache)
        q, k, erase, v, log_beta = self._inputs(x, q, k, v)
        o, state = delta_rule_step(q, k, v, erase_key=erase, log_decay=log_beta,
                                                  state=cache["state"])
        new_cache["state"] = state.astype(jnp.float32)
        return self._output(o[:, None]), new_cache
