"""Single-head lagged retrieval with a per-row readout gain γ (Muir Table 6, middle and bottom blocks; Fig. 2(a,b)).

    python -m mixerlab.eval.diagnostics.muir_retrieval --seeds 20 --out runs/eval/muir_retrieval

Task (reconstructed where the paper's text is missing; every choice is a flag):
* One head, d_k = d_v = 64, gates fixed in time. Keys, decays α and write gate w come from the row-energy input
  model (``muir_row_energy.make_problem``, same seed → same draw): k = (s ⊙ g)/‖s ⊙ g‖ with s_j = j^−0.43
  permuted, 1 − α_j log-uniform in [0.01, 0.3], w_j ~ U(0.2, 1); values v ~ N(0, I), written as v̂ = w ⊙ v.
  --key_law token puts the key profile on a random channel permutation per key instead (same concentration,
  uniform mean channel energy); --head_seed keeps one head for every seed.
* Erase strength μ: an isotropic erase gate b = μ·1, so ⟨k, b ⊙ k⟩ = μ for every unit key. (The row-energy
  model's drawn profile b_j ∝ U(0.2, 1) cannot reach μ ≈ 0.9 with b_j < 1.)
* Query q = k_{t−ℓ} (the key written ℓ tokens ago), target v̂_{t−ℓ}, readout o = c (γ ⊙ q) S_t. Lags: geometric
  on ℓ ≥ 1 with mean H (truncated at --max_lag and renormalised), or fixed ℓ (short 2, long 80) and their 50/50
  mixture.
* Normalised MSE = E‖o − v̂‖² / E‖v̂‖². A static readout (one γ for every query) gets one scale c, fitted by least
  squares over its lag distribution, so MSE = 1 − (γ·a)²/(γᵀBγ V) ≤ 1 (a, B, V: ``retrieval_stats``); the
  scale of γ is free anyway (the block's RMSNorm removes it). A lag-aware readout gets its γ and c per lag.

Readouts (γ per state row j; m*_j = ρ_j² the stationary row energy of ``row_energy_law``; r_j = α_j(1 − b_j κ_j)
the expected per-token retention of a written value in row j, κ_j = E[k_j²], so that the signal in row j after
ℓ tokens is E[q_j ⟨S_{t,j,:}, v̂_{t−ℓ}⟩] = κ_j r_j^ℓ E‖v̂‖² exactly):
* unit gain γ = 1 (GDN-2); full whitening γ ∝ ρ^−1 (p = 1); half power γ ∝ ρ^−1/2 (p = 1/2);
* "Prop. 3.6 filter" (reconstructed): the per-row matched filter for a known lag, γ_j = r_j^ℓ / m*_j (signal
  amplitude over row noise power; lag-aware);
* "Cor. 3.8 filter" (reconstructed): its average over the lag distribution, γ_j = E_ℓ[r_j^ℓ] / m*_j (static);
* static oracle: γ = B⁻¹a over the lag distribution (the best static per-row gain); lag-matched oracle: B⁻¹a
  per lag. Oracles are fitted on one half of the chains and scored on the other (then the halves swap).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from mixerlab.eval import report
from mixerlab.eval.diagnostics.muir_row_energy import make_problem
from mixerlab.eval.diagnostics.retrieval_stats import RetrievalStats, retrieval_stats
from mixerlab.eval.diagnostics.row_energy_law import (KeyMoments, normalized_gaussian_key_moments,
                                                      stationary_row_energy)

# Muir Table 6 (middle block), mean ± SD over 20 seeds: MSE at μ* and μ* per horizon H = 10, 27, 81.
PAPER_GEOMETRIC = {
    "unit": {"mse": [(0.3599, 0.0019), (0.6389, 0.0017), (0.8607, 0.0017)], "mu_star": [0.90, 0.60, 0.30]},
    "whiten": {"mse": [(0.4068, 0.0025), (0.6802, 0.0021), (0.8817, 0.0016)], "mu_star": [0.80, 0.50, 0.20]},
}
PAPER_HORIZONS = (10, 27, 81)
STATIC_READOUTS = {"unit": "unit gain γ = 1 (GDN-2)", "whiten": "full whitening γ ∝ ρ^-1 (p = 1)",
                   "half": "half power γ ∝ ρ^-1/2 (p = 1/2)", "cor38": "Cor. 3.8 filter E[r^ℓ]/ρ²",
                   "static_oracle": "static oracle B⁻¹a"}
BIMODAL_READOUTS = {"unit": "unit gain γ = 1", "cor38": "Cor. 3.8 filter (static)",
                    "static_oracle": "static oracle (static)", "lag_oracle": "lag-matched oracle (per lag)",
                    "prop36": "Prop. 3.6 filter r^ℓ/ρ² (per lag)"}


# ------------------------------------------------------------------------------------------- lags


def geometric_pmf(mean: float, max_lag: int) -> np.ndarray:
    """P(ℓ) ∝ (1/H)(1 − 1/H)^(ℓ−1) on 1..max_lag (index = lag), renormalised after the truncation."""
    if mean < 1 or max_lag < 1:
        raise ValueError(f"geometric_pmf: mean H={mean} must be >= 1 and max_lag={max_lag} >= 1")
    lags = np.arange(max_lag + 1)
    p = 1.0 / mean
    pmf = np.where(lags >= 1, p * (1.0 - p) ** np.maximum(lags - 1, 0), 0.0)
    return pmf / pmf.sum()


def fixed_pmf(lag: int, max_lag: int) -> np.ndarray:
    if not 0 <= lag <= max_lag:
        raise ValueError(f"fixed lag {lag} must lie in [0, max_lag={max_lag}]")
    pmf = np.zeros(max_lag + 1)
    pmf[lag] = 1.0
    return pmf


def draw_lags(pmfs, probes: int, draws: int, chains: int, rng) -> np.ndarray:
    """[probes, len(pmfs), draws, chains] lags, each distribution's drawn from its pmf."""
    return np.stack([rng.choice(len(p), size=(probes, draws, chains), p=p) for p in pmfs], axis=1)


# ------------------------------------------------------------------------------------------- readouts


def retention(alpha, erase, kappa):
    """r_j = α_j (1 − b_j κ_j): E[S_{t,j,:} component of a value written along q] shrinks by r_j per token."""
    return np.asarray(alpha, np.float64) * (1.0 - np.asarray(erase, np.float64) * np.asarray(kappa, np.float64))


def matched_filter(pmf, r, m_star):
    """γ_j = E_ℓ[r_j^ℓ] / m*_j (a point mass gives the per-lag filter r^ℓ/m*)."""
    lags = np.arange(len(pmf))
    return (pmf[:, None] * r[None, :] ** lags[:, None]).sum(0) / m_star


def fitted_scale_mse(a, B, V, gamma):
    """1 − (γ·a)²/(γᵀBγ V): normalised MSE with the least-squares output scale."""
    ga, gbg = gamma @ a, gamma @ B @ gamma
    return 1.0 - ga * ga / (gbg * V)


def raw_mse(a, B, V, gamma):
    """(V − 2γ·a + γᵀBγ)/V: normalised MSE of the readout with gain γ as it is."""
    return (V - 2.0 * gamma @ a + gamma @ B @ gamma) / V


def scaled(a, B, gamma):
    """γ times its least-squares scale (γ·a)/(γᵀBγ)."""
    return gamma * (gamma @ a) / (gamma @ B @ gamma)


def oracle(a, B):
    return np.linalg.solve(B, a)


def cross_fit(stats_fit, stats_eval, d_fit, d_eval, m):
    """Mean over the two halves of raw_mse on half g' of the oracle fitted on half g (γ = B⁻¹a)."""
    out = []
    for g in range(2):
        gamma = oracle(stats_fit.signal[d_fit, g, m], stats_fit.gram[d_fit, g, m])
        h = 1 - g
        out.append(raw_mse(stats_eval.signal[d_eval, h, m], stats_eval.gram[d_eval, h, m],
                           stats_eval.target_energy[d_eval, h], gamma))
    return float(np.mean(out)), gamma


def spearman(x, y) -> float:
    rank = lambda z: np.argsort(np.argsort(z)).astype(np.float64)  # noqa: E731
    return float(np.corrcoef(rank(x), rank(y))[0, 1])


# ------------------------------------------------------------------------------------------- one seed


def key_moments(scales, key_law: str) -> KeyMoments:
    """κ and C of the key law: the channel law's, or (token law) their average over channel permutations."""
    m = normalized_gaussian_key_moments(scales)
    if key_law == "channel":
        return m
    d = len(scales)
    diag = np.trace(m.fourth) / d
    off = (m.fourth.sum() - np.trace(m.fourth)) / (d * (d - 1))
    return KeyMoments(np.full(d, 1.0 / d), np.full((d, d), off) + np.eye(d) * (diag - off))


def head(seed: int, d_k: int, d_v: int, key_power: float, decay_gap):
    """Channel scales, decays and write gate of the row-energy input model (its erase draw is not used)."""
    problem = make_problem(d_k, d_v, mu=0.1, key_power=key_power, decay_gap=decay_gap, seed=seed)
    return problem.scales, problem.alpha, problem.write


KEY_LAWS = ("channel", "token")


def streams(seed: int, scales, write, chains: int, tokens: int, key_law: str = "channel"):
    """Unit keys k = (s ⊙ g)/‖s ⊙ g‖ and written values v̂ = w ⊙ v, [C, T, d]. key_law "channel": the scale
    profile s sits on fixed channels; "token": each key puts it on its own random permutation of the channels
    (keys as concentrated, E[η_eff] unchanged, but every channel gets the same mean energy κ_j = 1/d_k)."""
    if key_law not in KEY_LAWS:
        raise ValueError(f"key_law={key_law!r}: expected one of {KEY_LAWS}")
    kg, kv, kp = jax.random.split(jax.random.key(seed), 3)
    s = jnp.asarray(scales, jnp.float32)
    if key_law == "token":
        s = s[jnp.argsort(jax.random.uniform(kp, (chains, tokens, len(scales))), axis=-1)]
    g = jax.random.normal(kg, (chains, tokens, len(scales)), jnp.float32) * s
    keys = g / jnp.linalg.norm(g, axis=-1, keepdims=True)
    values = jax.random.normal(kv, (chains, tokens, len(write)), jnp.float32) * jnp.asarray(write, jnp.float32)
    return keys, values


def run_seed(seed: int, mus, horizons, lags, *, d_k=64, d_v=64, key_power=0.43, decay_gap=(0.01, 0.3),
             chains=16, probes=128, every=16, draws=4, max_lag=512, head_seed=None, key_law="channel") -> dict:
    """Normalised MSE of every readout for every μ (static readouts per geometric horizon; the bimodal block per
    μ), and the gains of the bimodal block. Distributions: horizons..., lags..., in that order. The head (scales,
    decays, write gate) is drawn from ``head_seed`` if given, else from ``seed``; streams and lags from ``seed``."""
    mus = np.asarray(mus, np.float64)
    scales, alpha, write = head(seed if head_seed is None else head_seed, d_k, d_v, key_power, decay_gap)
    moments = key_moments(scales, key_law)
    kappa = moments.second
    erase = mus[:, None] * np.ones(d_k)
    pmfs = [geometric_pmf(h, max_lag) for h in horizons] + [fixed_pmf(ell, max_lag) for ell in lags]
    lag_draws = draw_lags(pmfs, probes, draws, chains, np.random.default_rng([seed, 1]))
    keys, values = streams(seed, scales, write, chains, max_lag + probes * every, key_law)
    stats = retrieval_stats(keys, values, np.log(alpha), erase, lag_draws, burn_in=max_lag, every=every)
    pooled = stats.pooled()
    write_energy = float(np.sum(write ** 2))
    nh = len(horizons)
    geo = {name: np.zeros((nh, len(mus))) for name in STATIC_READOUTS}
    bimodal = {name: np.zeros((len(lags) + 1, len(mus))) for name in BIMODAL_READOUTS}
    gains = {}
    m_star_all, r_all = [], []
    idx = list(range(nh, nh + len(lags)))  # the fixed lags; their equal-count sum is the mixture
    mix_stats = _mixture(stats, idx)
    for m, b in enumerate(erase):
        m_star = stationary_row_energy(moments, alpha, b, write_energy)
        r = retention(alpha, b, kappa)
        m_star_all.append(m_star)
        r_all.append(r)
        rho = np.sqrt(m_star)
        fixed = {"unit": np.ones(d_k), "whiten": 1.0 / rho, "half": rho ** -0.5}
        for d in range(nh):
            a, B, V = pooled.signal[d, 0, m], pooled.gram[d, 0, m], pooled.target_energy[d, 0]
            for name, gamma in {**fixed, "cor38": matched_filter(pmfs[d], r, m_star)}.items():
                geo[name][d, m] = fitted_scale_mse(a, B, V, gamma)
            geo["static_oracle"][d, m] = cross_fit(stats, stats, d, d, m)[0]
        mix_a = sum(pooled.signal[d, 0, m] for d in idx)
        mix_B = sum(pooled.gram[d, 0, m] for d in idx)
        mix_pmf = sum(pmfs[d] for d in idx) / len(idx)
        static = {"unit": scaled(mix_a, mix_B, np.ones(d_k)),
                  "cor38": scaled(mix_a, mix_B, matched_filter(mix_pmf, r, m_star))}
        per_lag = {name: [] for name in BIMODAL_READOUTS}
        for i, d in enumerate(idx):
            a, B, V = pooled.signal[d, 0, m], pooled.gram[d, 0, m], pooled.target_energy[d, 0]
            for name, gamma in static.items():
                per_lag[name].append(raw_mse(a, B, V, gamma))
            per_lag["static_oracle"].append(cross_fit(mix_stats, stats, 0, d, m)[0])
            per_lag["lag_oracle"].append(cross_fit(stats, stats, d, d, m)[0])
            prop = matched_filter(pmfs[d], r, m_star)
            per_lag["prop36"].append(fitted_scale_mse(a, B, V, prop))
            gains[(m, f"lag_oracle_{lags[i]}")] = oracle(a, B)
            gains[(m, f"prop36_{lags[i]}")] = prop
        gains[(m, "static_oracle_mix")] = oracle(mix_a, mix_B)
        gains[(m, "cor38_mix")] = static["cor38"]
        for name in BIMODAL_READOUTS:
            bimodal[name][:, m] = per_lag[name] + [float(np.mean(per_lag[name]))]
    return {"seed": seed, "alpha": alpha, "kappa": kappa, "geometric": geo, "bimodal": bimodal, "gains": gains,
            "m_star": np.array(m_star_all), "m_measured": stats.row_energy, "retention": np.array(r_all),
            "queries_per_half": stats.queries}


def _mixture(stats, idx):
    """Stats with one distribution: the sum over ``idx`` (G kept)."""
    return RetrievalStats(stats.signal[idx].sum(0, keepdims=True), stats.gram[idx].sum(0, keepdims=True),
                          stats.target_energy[idx].sum(0, keepdims=True), stats.row_energy,
                          stats.queries * len(idx))


# ------------------------------------------------------------------------------------------- sweep


def summarize(runs, mus, horizons, lags, bimodal_mu) -> dict:
    """Mean ± SD over seeds: the MSE curves, μ* (argmin of the mean curve, and per seed), the bimodal block."""
    mus = np.asarray(mus)
    geo = {}
    for name in STATIC_READOUTS:
        curves = np.stack([r["geometric"][name] for r in runs])  # [seeds, H, M]
        mean, sd = curves.mean(0), curves.std(0, ddof=1) if len(runs) > 1 else np.zeros(curves.shape[1:])
        best = mean.argmin(1)
        per_seed = mus[curves.argmin(2)]  # [seeds, H]
        geo[name] = {"mean": mean, "sd": sd, "mu_star": mus[best],
                     "mse_at_mu_star": [(float(mean[h, b]), float(sd[h, b])) for h, b in enumerate(best)],
                     "mu_star_per_seed_mean": per_seed.mean(0), "mu_star_per_seed_sd": per_seed.std(0)}
    m = int(np.argmin(np.abs(mus - bimodal_mu)))
    bim = {}
    for name in BIMODAL_READOUTS:
        x = np.stack([r["bimodal"][name][:, m] for r in runs])  # [seeds, lags + 1]
        bim[name] = {"mean": x.mean(0), "sd": x.std(0, ddof=1) if len(runs) > 1 else np.zeros(x.shape[1])}
    rank = {}
    for label in [f"{kind}_{ell}" for kind in ("lag_oracle", "prop36") for ell in lags] + \
                 ["static_oracle_mix", "cor38_mix"]:
        x = np.array([spearman(r["gains"][(m, label)], r["alpha"]) for r in runs])
        rank[label] = (float(x.mean()), float(x.std(ddof=1)) if len(x) > 1 else 0.0)
    return {"geometric": geo, "bimodal": bim, "spearman_gain_alpha": rank, "bimodal_mu": float(mus[m])}


def _pm(pair, digits=4):
    return f"{pair[0]:.{digits}f} ± {pair[1]:.{digits}f}"


def geometric_table(summary, horizons) -> str:
    head = [f"MSE H={h:g}" for h in horizons] + [f"μ* H={h:g}" for h in horizons]
    rows = []
    for name, label in STATIC_READOUTS.items():
        g = summary["geometric"][name]
        rows.append([f"{label} (ours)"] + [_pm(p) for p in g["mse_at_mu_star"]] + [f"{x:.2f}" for x in g["mu_star"]])
        if name in PAPER_GEOMETRIC and tuple(horizons) == PAPER_HORIZONS:
            paper = PAPER_GEOMETRIC[name]
            rows.append([f"{label} (paper)"] + [_pm(p) for p in paper["mse"]] + [f"{x:.2f}" for x in paper["mu_star"]])
    return report.table(["readout"] + head, rows, "Table 6 (middle): normalised retrieval MSE at μ* (mean ± SD over "
                        "seeds) and μ* = argmin of the mean curve")


def bimodal_table(summary, lags) -> str:
    cols = [f"ℓ={ell}" for ell in lags] + ["mixed"]
    rows = []
    for name, label in BIMODAL_READOUTS.items():
        b = summary["bimodal"][name]
        rows.append([label] + [_pm((b["mean"][i], b["sd"][i])) for i in range(len(cols))])
    rank = summary["spearman_gain_alpha"]
    rank_rows = [[label, _pm(v, 3)] for label, v in rank.items()]
    return (report.table(["readout"] + cols, rows, f"Table 6 (bottom): retrieval MSE at μ = {summary['bimodal_mu']:.2f}"
                         " (static readouts: one γ and scale for the 50/50 mixture; others per lag)")
            + "\n\n" + report.table(["gain", "Spearman r_s(γ, α)"], rank_rows))


def plot(summary, mus, horizons, lags, path: str, title: str) -> str:
    fig, axes = report.new_figure(len(horizons) + 1, width=4.2)
    for h, ax in enumerate(axes[:-1]):
        for name, label in STATIC_READOUTS.items():
            g = summary["geometric"][name]
            line, = ax.plot(mus, g["mean"][h], "-o", ms=2.5, label=label)
            ax.fill_between(mus, g["mean"][h] - g["sd"][h], g["mean"][h] + g["sd"][h], color=line.get_color(),
                            alpha=0.2)
            ax.axvline(g["mu_star"][h], color=line.get_color(), lw=0.6, ls=":")
        ax.set(xlabel="erase strength μ", ylabel="normalised MSE", title=f"(a) geometric lags, H = {horizons[h]:g}")
        lo = min(summary["geometric"][n]["mean"][h].min() for n in STATIC_READOUTS)
        ax.set_ylim(lo - 0.02, min(1.02, lo + 0.35))
    axes[0].legend(fontsize=7)
    ax = axes[-1]
    cols = [f"ℓ = {ell}" for ell in lags] + ["50/50 mix"]
    width = 0.8 / len(BIMODAL_READOUTS)
    for i, (name, label) in enumerate(BIMODAL_READOUTS.items()):
        b = summary["bimodal"][name]
        ax.bar(np.arange(len(cols)) + (i - len(BIMODAL_READOUTS) / 2 + 0.5) * width, b["mean"], width,
               yerr=b["sd"], label=label)
    ax.set_xticks(np.arange(len(cols)), cols)
    ax.set(ylabel="normalised MSE", title=f"(b) two lags, μ = {summary['bimodal_mu']:.2f}")
    ax.set_ylim(0, 1.45 * max(summary["bimodal"][n]["mean"].max() for n in BIMODAL_READOUTS))
    ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=9)
    return report.save_figure(fig, path)


def _floats(text: str, name: str) -> list[float]:
    try:
        values = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected comma-separated numbers, e.g. 0.01,0.3") from None
    if not values:
        raise ValueError(f"{name}={text!r}: expected at least one number")
    return values


def mu_grid(step: float, bimodal_mu: float) -> np.ndarray:
    """0, step, 2·step, …, 1 (and bimodal_mu); μ = 0 is no erase (a decayed linear-attention head)."""
    if not 0 < step <= 1:
        raise ValueError(f"--mu_step={step}: expected 0 < step <= 1")
    grid = np.round(np.arange(0, math.floor(1 / step + 1e-9) + 1) * step, 6)
    return np.unique(np.append(grid, round(bimodal_mu, 6)))


def _arrays(x):
    """JSON lists back to numpy arrays (dicts kept; lists of pairs stay lists)."""
    if isinstance(x, dict):
        return {k: (v if k == "mse_at_mu_star" else _arrays(v)) for k, v in x.items()}
    return np.asarray(x) if isinstance(x, list) else x


def redraw(json_path: str, png: str) -> str:
    """Tables and plot again from a saved ``muir_retrieval.json`` (no simulation)."""
    with open(json_path) as f:
        payload = json.load(f)
    setup, summary = payload["setup"], _arrays(payload["summary"])
    tables = geometric_table(summary, setup["horizons"]) + "\n\n" + bimodal_table(summary, setup["lags"])
    head_seed = setup.get("head_seed")
    heads = "a new head per seed" if head_seed is None else f"one head drawn from seed {head_seed}"
    plot(summary, np.asarray(setup["mus"]), setup["horizons"], setup["lags"], png,
         f"d_k = {setup['d_k']}, {setup['seeds']} seeds (mean ± SD), {heads}, key law "
         f"{setup.get('key_law', 'channel')}, 1 − α in {setup['decay_gap']}")
    return tables


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dk", type=int, default=64)
    p.add_argument("--dv", type=int, default=64)
    p.add_argument("--seeds", "-n", type=int, default=20, help="seeds 0..n-1 (gates, keys, values, lags)")
    p.add_argument("--mu_step", type=float, default=0.05, help="erase strengths μ = 0, step, 2·step, …, 1")
    p.add_argument("--horizons", default="10,27,81", help="means H of the geometric lag distributions")
    p.add_argument("--lags", default="2,80", help="the fixed lags of the bimodal block (short, long)")
    p.add_argument("--bimodal_mu", type=float, default=0.6, help="μ of the bimodal block")
    p.add_argument("--key_power", type=float, default=0.43, help="key channel scales s_j = j^-key_power")
    p.add_argument("--decay_gap", default="0.01,0.3", help="range of 1 − α_j (log-uniform)")
    p.add_argument("--key_law", default="channel", choices=KEY_LAWS,
                   help="channel: the scale profile on fixed channels (the row-energy model); token: on a random "
                        "channel permutation per key (same E[η_eff], uniform mean channel energy)")
    p.add_argument("--chains", type=int, default=16, help="independent chains per seed (even)")
    p.add_argument("--probes", type=int, default=128, help="state probes per chain after the burn-in")
    p.add_argument("--every", type=int, default=16, help="tokens between probes")
    p.add_argument("--draws", type=int, default=4, help="queries (lags) per probe, chain and lag distribution")
    p.add_argument("--max_lag", type=int, default=512, help="longest lag (geometric lags are truncated here); "
                   "also the burn-in")
    p.add_argument("--head_seed", type=int, default=None,
                   help="draw the head (key scales, decays, write gate) from this seed for every run, so that "
                        "only the streams and lags vary with the seed (default: a new head per seed)")
    p.add_argument("--out", default="runs/eval/muir_retrieval")
    p.add_argument("--png", default=None, help="plot path (default <out>/muir_retrieval.png)")
    p.add_argument("--redraw", default=None, metavar="JSON",
                   help="print the tables and draw the plot from a saved muir_retrieval.json; no simulation")
    a = p.parse_args(argv)
    if a.redraw:
        png = a.png or os.path.join(os.path.dirname(a.redraw), "muir_retrieval.png")
        print(redraw(a.redraw, png))
        return {"png": png}
    gap = tuple(_floats(a.decay_gap, "--decay_gap"))
    if len(gap) != 2 or not 0 < gap[0] < gap[1] < 1:
        raise ValueError(f"--decay_gap={a.decay_gap!r}: expected 'lo,hi' with 0 < lo < hi < 1")
    horizons = _floats(a.horizons, "--horizons")
    lags = report.parse_int_list(a.lags, "--lags")
    if a.seeds < 1:
        raise ValueError(f"--seeds={a.seeds}: expected >= 1")
    mus = mu_grid(a.mu_step, a.bimodal_mu)
    runs = []
    for seed in range(a.seeds):
        runs.append(run_seed(seed, mus, horizons, lags, d_k=a.dk, d_v=a.dv, key_power=a.key_power, decay_gap=gap,
                             chains=a.chains, probes=a.probes, every=a.every, draws=a.draws, max_lag=a.max_lag,
                             head_seed=a.head_seed, key_law=a.key_law))
        print(f"seed {seed} done", flush=True)
    summary = summarize(runs, mus, horizons, lags, a.bimodal_mu)
    m_err = [float(np.mean(np.abs(r["m_measured"] / r["m_star"] - 1))) for r in runs]
    setup = {"d_k": a.dk, "d_v": a.dv, "seeds": a.seeds, "mus": mus, "horizons": horizons, "lags": lags,
             "bimodal_mu": summary["bimodal_mu"], "key_power": a.key_power, "decay_gap": gap, "chains": a.chains,
             "probes": a.probes, "every": a.every, "draws": a.draws, "max_lag": a.max_lag, "head_seed": a.head_seed,
             "key_law": a.key_law,
             "queries_per_distribution_and_seed": 2 * runs[0]["queries_per_half"],
             "erase": "isotropic b = μ·1", "mean_abs_rel_err_measured_vs_closed_row_energy": float(np.mean(m_err))}
    tables = geometric_table(summary, horizons) + "\n\n" + bimodal_table(summary, lags)
    print(tables)
    out_json = os.path.join(a.out, "muir_retrieval.json")
    out_md = os.path.join(a.out, "muir_retrieval.md")
    png = a.png or os.path.join(a.out, "muir_retrieval.png")
    per_seed = [{"seed": r["seed"], "geometric": r["geometric"], "bimodal": r["bimodal"]} for r in runs]
    payload = {"setup": setup, "summary": summary, "per_seed": per_seed, "paper": PAPER_GEOMETRIC}
    report.write_json(out_json, payload)
    os.makedirs(a.out, exist_ok=True)
    with open(out_md, "w") as f:
        f.write(tables + "\n")
    redraw(out_json, png)
    print(f"\nwrote {out_json}, {out_md} and {png}")
    return payload


if __name__ == "__main__":
    main(sys.argv[1:])
