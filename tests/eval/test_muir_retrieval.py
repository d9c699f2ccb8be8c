"""eval/diagnostics/muir_retrieval + retrieval_stats: the recurrence against the delta-rule op, the accumulated
statistics against a float64 brute force, an exactly solvable retrieval case, the closed-form signal decay,
the inequalities every readout must obey, and the CLI on tiny sizes."""
from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from mixerlab.eval.diagnostics import muir_retrieval as mr
from mixerlab.eval.diagnostics import retrieval_stats as rs
from mixerlab.eval.diagnostics.row_energy_law import normalized_gaussian_key_moments
from mixerlab.pallas_kernels import delta_rule


def _random_streams(seed, chains, tokens, d_k, d_v):
    rng = np.random.default_rng(seed)
    g = rng.normal(size=(chains, tokens, d_k)) * np.arange(1, d_k + 1) ** -0.5
    keys = g / np.linalg.norm(g, axis=-1, keepdims=True)
    return keys, rng.normal(size=(chains, tokens, d_v)), rng.uniform(0.7, 0.98, d_k)


def _numpy_states(keys, values, alpha, erase):
    """float64 S_t after every token, [M, C, T, d_k, d_v], straight from the recurrence's definition."""
    m, (c, t, dk), dv = len(erase), keys.shape, values.shape[-1]
    out = np.zeros((m, c, t, dk, dv))
    for i, b in enumerate(erase):
        for ch in range(c):
            s = np.zeros((dk, dv))
            for tt in range(t):
                k = keys[ch, tt]
                s = (np.eye(dk) - np.outer(k, b * k)) @ np.diag(alpha) @ s + np.outer(k, values[ch, tt])
                out[i, ch, tt] = s
    return out


def test_recurrence_matches_the_delta_rule_op():
    keys, values, alpha = _random_streams(0, 2, 24, 6, 5)
    erase = np.array([[0.3] * 6, np.linspace(0.1, 0.9, 6)])
    final = np.asarray(rs.run(jnp.asarray(keys, jnp.float32), jnp.asarray(values, jnp.float32),
                              jnp.asarray(np.log(alpha), jnp.float32), jnp.asarray(erase, jnp.float32)))
    for i, b in enumerate(erase):
        k = jnp.asarray(keys[:, :, None], jnp.float32)
        _, op_state = delta_rule(jnp.zeros_like(k), k, jnp.asarray(values[:, :, None], jnp.float32),
                                 erase_key=k * jnp.asarray(b, jnp.float32),
                                 log_decay=jnp.broadcast_to(jnp.asarray(np.log(alpha), jnp.float32), k.shape),
                                 implementation="reference")
        np.testing.assert_allclose(final[i], np.asarray(op_state)[:, 0], rtol=2e-5, atol=2e-5)


def test_accumulated_statistics_equal_a_float64_brute_force():
    burn_in, every, probes, d_k, d_v = 6, 3, 4, 4, 3
    keys, values, alpha = _random_streams(1, 4, burn_in + probes * every, d_k, d_v)
    erase = np.array([[0.2] * d_k, [0.9] * d_k])
    lags = np.random.default_rng(2).integers(0, burn_in + 1, size=(probes, 2, 3, 4))
    stats = rs.retrieval_stats(keys, values, np.log(alpha), erase, lags, burn_in=burn_in, every=every)
    states = _numpy_states(keys, values, alpha, erase)
    a = np.zeros_like(stats.signal)
    B = np.zeros_like(stats.gram)
    V = np.zeros_like(stats.target_energy)
    for n in range(probes):
        now = burn_in + (n + 1) * every - 1
        for d in range(2):
            for r in range(3):
                for c in range(4):
                    g, q, v = c * 2 // 4, keys[c, now - lags[n, d, r, c]], values[c, now - lags[n, d, r, c]]
                    y = q[None, :, None] * states[:, c, now]  # [M, d_k, d_v]: rows of (q ⊙ ·) S
                    a[d, g] += y @ v
                    B[d, g] += np.einsum("mkv,mjv->mkj", y, y)
                    V[d, g] += v @ v
    np.testing.assert_allclose(stats.signal, a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(stats.gram, B, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(stats.target_energy, V, rtol=1e-5)
    assert stats.queries == probes * 3 * 2


@pytest.mark.parametrize("mu", [1.0, 0.5])
def test_orthogonal_cyclic_keys_give_the_closed_form_mse(mu):
    # k_t = e_{t mod d}: row j is touched only by its own key, so a query at lag ℓ < d reads
    # α^ℓ Σ_n ((1 − μ) α^d)^n v̂_{t−ℓ−nd}: with a fitted scale, MSE = ((1 − μ) α^d)² (0 at μ = 1), any ℓ < d.
    d, alpha, chains, burn_in, every, probes = 4, 0.8, 8, 64, 4, 64
    tokens = burn_in + probes * every
    keys = np.broadcast_to(np.eye(d)[np.arange(tokens) % d], (chains, tokens, d))
    values = np.random.default_rng(3).normal(size=(chains, tokens, 16))
    lags = np.broadcast_to(np.array([0, 1, 3])[None, :, None, None], (probes, 3, 1, chains))
    stats = rs.retrieval_stats(keys, values, np.full(d, np.log(alpha)), np.full((1, d), mu), lags,
                               burn_in=burn_in, every=every).pooled()
    expected = ((1 - mu) * alpha ** d) ** 2
    for i in range(3):
        mse = mr.fitted_scale_mse(stats.signal[i, 0, 0], stats.gram[i, 0, 0], stats.target_energy[i, 0], np.ones(d))
        np.testing.assert_allclose(mse, expected, atol=2e-3 if mu < 1 else 1e-6)
    assert mu == 1.0 or expected > 0.02  # the μ < 1 case is distinguishable from 0


def test_signal_decays_as_the_closed_form_retention():
    # E[q_j ⟨S_{t,j,:}, v̂_{t−ℓ}⟩] = κ_j r_j^ℓ E‖v̂‖², r_j = α_j (1 − b_j κ_j)
    d_k, chains, burn_in, every, probes = 6, 16, 32, 8, 64
    scales = np.arange(1, d_k + 1) ** -0.6
    keys, values = mr.streams(0, scales, np.ones(32), chains, burn_in + probes * every)
    alpha = np.linspace(0.6, 0.95, d_k)
    erase = np.array([[0.5] * d_k])
    ells = [0, 2, 6]
    lags = np.broadcast_to(np.array(ells)[None, :, None, None], (probes, len(ells), 1, chains))
    stats = rs.retrieval_stats(keys, values, np.log(alpha), erase, lags, burn_in=burn_in, every=every).pooled()
    kappa = normalized_gaussian_key_moments(scales).second
    r = mr.retention(alpha, erase[0], kappa)
    for i, ell in enumerate(ells):
        measured = stats.signal[i, 0, 0] / stats.target_energy[i, 0]
        np.testing.assert_allclose(measured, kappa * r ** ell, atol=0.015)  # per row (MC noise ≈ 0.005)
        np.testing.assert_allclose(measured.sum(), np.sum(kappa * r ** ell), atol=0.01)
        if ell:  # the law without the erase factor (r → α) is told apart: it is ≥ 0.05 off in total
            assert abs(measured.sum() - np.sum(kappa * alpha ** ell)) > 0.04


def test_token_key_law_moments_match_monte_carlo():
    scales = np.arange(1, 9) ** -0.8
    keys, _ = mr.streams(0, scales, np.ones(2), 4, 8000, key_law="token")
    k2 = np.asarray(keys, np.float64).reshape(-1, 8) ** 2
    m = mr.key_moments(scales, "token")
    np.testing.assert_allclose(k2.mean(0), m.second, atol=3e-3)  # uniform 1/8
    np.testing.assert_allclose(k2.T @ k2 / len(k2), m.fourth, atol=3e-3)
    channel = mr.key_moments(scales, "channel")
    assert np.ptp(channel.second) > 0.1  # the channel law is not uniform: the test can tell them apart
    np.testing.assert_allclose(np.trace(m.fourth), np.trace(channel.fourth))  # same E‖k‖₄⁴ (E[η_eff])


@pytest.fixture(scope="module")
def small_seed():
    mus = [0.2, 0.6, 1.0]
    return mus, mr.run_seed(0, mus, (3, 12), (1, 20), d_k=8, d_v=8, chains=8, probes=48, every=4, draws=4,
                            max_lag=64)


def test_readouts_obey_their_bounds(small_seed):
    _, run = small_seed
    geo = run["geometric"]
    for name in ("unit", "whiten", "half", "cor38"):
        assert np.all(geo[name] <= 1.0) and np.all(geo[name] >= 0.0), name
    # longer horizons are harder for the unit gain at every μ
    assert np.all(geo["unit"][1] > geo["unit"][0])
    # the lag-matched oracle knows the lag: no worse than the static oracle at each lag (out of sample)
    bim = run["bimodal"]
    assert np.all(bim["lag_oracle"][-1] <= bim["static_oracle"][-1] + 0.01)
    # the mixture column is the mean of the two lags
    np.testing.assert_allclose(bim["unit"][-1], bim["unit"][:2].mean(0))
    # far lags carry no signal: MSE ≈ 1 for every static gain
    assert np.all(bim["lag_oracle"][1] > 0.9)


def test_oracle_is_the_best_static_gain_in_sample():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(200, 5))
    B, a, V = x.T @ x, x.T @ rng.normal(size=200) + 3.0, 1000.0
    best = mr.fitted_scale_mse(a, B, V, mr.oracle(a, B))
    for _ in range(20):
        gamma = rng.normal(size=5)
        assert mr.fitted_scale_mse(a, B, V, gamma) >= best - 1e-12
        np.testing.assert_allclose(mr.raw_mse(a, B, V, mr.scaled(a, B, gamma)), mr.fitted_scale_mse(a, B, V, gamma))


def test_lag_distributions():
    pmf = mr.geometric_pmf(27, 4000)
    np.testing.assert_allclose((np.arange(4001) * pmf).sum(), 27, rtol=1e-6)
    assert pmf[0] == 0
    with pytest.raises(ValueError, match="max_lag"):
        mr.fixed_pmf(80, 64)
    np.testing.assert_allclose(mr.mu_grid(0.25, 0.6), [0.0, 0.25, 0.5, 0.6, 0.75, 1.0])


def test_cli_tiny(tmp_path):
    out = tmp_path / "r"
    payload = mr.main(["-n", "2", "--dk", "8", "--dv", "8", "--chains", "2", "--probes", "8", "--draws", "2",
                       "--max_lag", "32", "--lags", "2,20", "--mu_step", "0.5", "--out", str(out)])
    assert os.path.exists(out / "muir_retrieval.png") and os.path.exists(out / "muir_retrieval.md")
    saved = json.load(open(out / "muir_retrieval.json"))
    assert saved["setup"]["mus"] == [0.0, 0.5, 0.6, 1.0]
    assert len(saved["per_seed"]) == 2 and set(saved["summary"]["geometric"]) == set(mr.STATIC_READOUTS)
    assert "(paper)" in open(out / "muir_retrieval.md").read()  # default horizons 10, 27, 81: paper rows shown
    assert payload["summary"]["geometric"]["unit"]["mean"].shape == (3, 4)
    mr.main(["--redraw", str(out / "muir_retrieval.json"), "--png", str(tmp_path / "again.png")])
    assert os.path.exists(tmp_path / "again.png")
    with pytest.raises(ValueError, match="--decay_gap"):
        mr.main(["--decay_gap", "0.3,0.1", "--out", str(out)])
