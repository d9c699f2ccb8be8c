"""Sufficient statistics of lagged retrieval from one delta-rule head with fixed gates (JAX, float32).

The head runs S_t = (I − k_tᵀ(b ⊙ k_t)) Diag(α) S_{t−1} + k_tᵀ v̂_t in the pseudo-value form
(S̃ = Diag(α) S, u = v̂ − (b ⊙ k) S̃, S = S̃ + kᵀu; docs/math/delta_rule.md), for several erase gates b at once
(one per erase strength μ) on the same key/value streams, so that the μ sweep compares like with like.

After a burn-in, every ``every`` tokens the state S_t is probed with queries q = k_{t−ℓ} whose targets are the
written values v̂_{t−ℓ}, for lags ℓ drawn per query. A readout with per-row gain γ returns o = (γ ⊙ q) S_t, which
is linear in γ, so everything any γ needs is accumulated once, per lag distribution:

    a_j  = Σ q_j ⟨S_{t,j,:}, v̂_{t−ℓ}⟩          (γ·a = Σ ⟨o, v̂⟩)
    B_ij = Σ q_i q_j ⟨S_{t,i,:}, S_{t,j,:}⟩      (γᵀBγ = Σ ‖o‖²)
    V    = Σ ‖v̂_{t−ℓ}‖²

summed over queries, separately for two halves of the chains (so that a fitted γ can be scored on the half it
was not fitted on). The row energies Σ ‖S_{t,j,:}‖² are accumulated too. The recurrence is written here (a
plain scan is much cheaper than storing the state for every probe); it is tested against
``pallas_kernels.delta_rule``.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

GROUPS = 2  # chain halves for cross-fitting


@dataclasses.dataclass(frozen=True)
class RetrievalStats:
    """Sums over queries (float64 numpy). D = lag distributions, G = chain halves, M = erase gates."""
    signal: np.ndarray  # a [D, G, M, d_k]
    gram: np.ndarray  # B [D, G, M, d_k, d_k]
    target_energy: np.ndarray  # V [D, G]
    row_energy: np.ndarray  # Σ_t ‖S_{t,j,:}‖² / number of probes, [M, d_k]
    queries: int  # queries per (distribution, half)

    def pooled(self) -> "RetrievalStats":
        """Both halves summed (keeps a G axis of length 1)."""
        return RetrievalStats(self.signal.sum(1, keepdims=True), self.gram.sum(1, keepdims=True),
                              self.target_energy.sum(1, keepdims=True), self.row_energy, 2 * self.queries)


def step(state, key, value, log_alpha, erase):
    """One token for every erase gate: state [M, C, d_k, d_v], key [C, d_k], value [C, d_v], erase [M, d_k]."""
    decayed = jnp.exp(log_alpha)[None, None, :, None] * state
    read = jnp.einsum("mck,mckv->mcv", erase[:, None, :] * key[None], decayed)
    return decayed + key[None, :, :, None] * (value[None] - read)[:, :, None, :]


def run(keys, values, log_alpha, erase, initial_state=None):
    """The state after every token of ``keys`` [C, T, d_k], ``values`` [C, T, d_v]: final state [M, C, d_k, d_v]."""
    m, (c, _, dk), dv = erase.shape[0], keys.shape, values.shape[-1]
    state = jnp.zeros((m, c, dk, dv), keys.dtype) if initial_state is None else initial_state

    def body(s, kv):
        return step(s, kv[0], kv[1], log_alpha, erase), None

    final, _ = jax.lax.scan(body, state, (jnp.moveaxis(keys, 1, 0), jnp.moveaxis(values, 1, 0)))
    return final


@functools.partial(jax.jit, static_argnames=("burn_in", "every"))
def _accumulate(keys, values, log_alpha, erase, lags, group, *, burn_in, every):
    """keys [C, T, d_k], values [C, T, d_v], erase [M, d_k], lags [N, D, R, C] (int, ≤ burn_in), group [C, G]."""
    c, t, dk = keys.shape
    n, d, r, _ = lags.shape
    m = erase.shape[0]
    state = run(keys[:, :burn_in], values[:, :burn_in], log_alpha, erase)
    blocks = lambda x: jnp.moveaxis(x[:, burn_in:].reshape(c, n, every, -1), 0, 2)  # noqa: E731  [N, every, C, .]
    chains = jnp.arange(c)

    def probe(carry, xs):
        s, acc = carry
        key_block, value_block, lag, index = xs
        s = run(jnp.moveaxis(key_block, 1, 0), jnp.moveaxis(value_block, 1, 0), log_alpha, erase, s)
        now = burn_in + (index + 1) * every - 1
        rows = jnp.einsum("mckv,mcjv->mckj", s, s)  # ⟨S_i, S_j⟩ per gate and chain
        q = keys[chains, now - lag]  # [D, R, C, d_k]
        target = values[chains, now - lag]  # [D, R, C, d_v]
        read = jnp.einsum("mckv,drcv->drmck", s, target)  # ⟨S_j, v̂⟩
        signal = jnp.einsum("cg,drck,drmck->dgmk", group, q, read)
        gram = jnp.einsum("cg,drck,drcj,mckj->dgmkj", group, q, q, rows)
        energy = jnp.einsum("cg,drcv->dg", group, target * target)
        diag = jnp.einsum("mckk->mk", rows)
        acc = (acc[0] + signal, acc[1] + gram, acc[2] + energy, acc[3] + diag)
        return (s, acc), None

    g = group.shape[1]
    zeros = (jnp.zeros((d, g, m, dk)), jnp.zeros((d, g, m, dk, dk)), jnp.zeros((d, g)), jnp.zeros((m, dk)))
    xs = (blocks(keys), blocks(values), lags, jnp.arange(n))
    (_, acc), _ = jax.lax.scan(probe, (state, zeros), xs)
    return acc


def retrieval_stats(keys, values, log_alpha, erase, lags, *, burn_in: int, every: int) -> RetrievalStats:
    """Accumulates the statistics of the module docstring.

    keys [C, T, d_k] and values [C, T, d_v] (the written v̂) are the streams of C independent chains;
    T = burn_in + N·every; probe n reads S after token burn_in + (n+1)·every − 1; lags [N, D, R, C] holds R lags
    per probe, chain and lag distribution, each in [0, burn_in]. erase [M, d_k]; log_alpha [d_k].
    """
    keys, values = jnp.asarray(keys, jnp.float32), jnp.asarray(values, jnp.float32)
    c, t, _ = keys.shape
    lags = np.asarray(lags)
    if lags.ndim != 4 or lags.shape[3] != c:
        raise ValueError(f"retrieval_stats: lags must be [probes, distributions, draws, chains={c}], "
                         f"got shape {lags.shape}")
    if c < GROUPS or c % GROUPS:
        raise ValueError(f"retrieval_stats: chains={c} must be a positive multiple of {GROUPS} (cross-fitting halves)")
    if t != burn_in + lags.shape[0] * every:
        raise ValueError(f"retrieval_stats: T={t} tokens, expected burn_in + probes·every = "
                         f"{burn_in} + {lags.shape[0]}·{every}")
    if lags.min() < 0 or lags.max() > burn_in:
        raise ValueError(f"retrieval_stats: lags must lie in [0, burn_in={burn_in}], got [{lags.min()}, {lags.max()}]")
    group = np.zeros((c, GROUPS), np.float32)
    group[np.arange(c), np.arange(c) * GROUPS // c] = 1.0
    acc = _accumulate(keys, values, jnp.asarray(log_alpha, jnp.float32), jnp.asarray(erase, jnp.float32),
                      jnp.asarray(lags, jnp.int32), jnp.asarray(group), burn_in=burn_in, every=every)
    signal, gram, energy, rows = (np.asarray(x, np.float64) for x in acc)
    n, _, r, _ = lags.shape
    return RetrievalStats(signal, gram, energy, rows / (n * c), n * r * c // GROUPS)
