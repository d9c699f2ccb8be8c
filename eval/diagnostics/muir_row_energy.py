"""Stationary state-row energy of one GDN-2 / Muir head with fixed gates: the closed form
(``row_energy_law``) against the recurrence run by the project's delta-rule op (Muir Table 6, top block:
"single-head stationary row-energy verification", d_k = d_v = 64, μ = 0.60).

    python -m mixerlab.eval.diagnostics.muir_row_energy --dk 64 --dv 64 --mu 0.6 --out runs/eval/muir_row_energy

Input model (stored with the results): keys k_t = (s ⊙ g_t)/‖s ⊙ g_t‖, g_t ~ N(0, I), channel scales
s_j = j^(−key_power) randomly assigned to channels; values v_t ~ N(0, I); fixed gates: decays α_j = 1 − 10^{U}
with U ~ U[log10 of --decay_gap range], erase b_j ∝ U(0.2, 1) rescaled so that μ = Σ_j b_j E[k_j²] = --mu,
write w_j ~ U(0.2, 1). The recurrence S_t = (I − k_tᵀ(b⊙k_t)) Diag(α) S_{t−1} + k_tᵀ(w⊙v_t) runs through
``pallas_kernels.delta_rule`` (write key k, erase key b⊙k, value w⊙v, log-decay log α) on ``--chains``
independent chains: a burn-in of 10 relaxation times 1/(1 − ρ(G)) of the row-energy map, then ``--tokens``
tokens with ‖S_{t,j,:}‖² sampled every ``--every`` tokens. m_j = mean over chains and samples; its standard
error comes from the spread of the per-chain means (independent chains).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from mixerlab.eval import report
from mixerlab.eval.diagnostics.row_energy_law import (KeyMoments, decoupled_row_energy, erase_rate,
                                             normalized_gaussian_key_moments, stationary_row_energy,
                                             transition_matrix)
from mixerlab.eval.diagnostics.trajectory import row_energy, state_trajectory


@dataclasses.dataclass(frozen=True)
class RowEnergyProblem:
    scales: np.ndarray  # s [d_k]
    alpha: np.ndarray  # decay [d_k]
    erase: np.ndarray  # b [d_k]
    write: np.ndarray  # w [d_v]
    value_std: float = 1.0

    @property
    def write_energy(self) -> float:
        """q = σ²‖w‖² (E‖w ⊙ v‖²)."""
        return float(self.value_std ** 2 * np.sum(np.asarray(self.write, np.float64) ** 2))


def make_problem(d_k: int = 64, d_v: int = 64, *, mu: float = 0.6, key_power: float = 0.43,
                 decay_gap=(1e-2, 0.3), seed: int = 0) -> RowEnergyProblem:
    """The input model of the module docstring, drawn from ``numpy.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    scales = rng.permutation(np.arange(1, d_k + 1, dtype=np.float64) ** -key_power)
    lo, hi = np.log10(decay_gap[0]), np.log10(decay_gap[1])
    alpha = 1.0 - 10.0 ** rng.uniform(lo, hi, d_k)
    moments = normalized_gaussian_key_moments(scales)
    b = rng.uniform(0.2, 1.0, d_k)
    b = b * mu / erase_rate(moments, b)
    if np.max(b) >= 1.0:
        raise ValueError(f"mu={mu}: the erase gate needs b_j >= 1 (max {np.max(b):.3f}); choose a smaller mu")
    write = rng.uniform(0.2, 1.0, d_v)
    return RowEnergyProblem(scales, alpha, b, write)


def relaxation_time(moments: KeyMoments, problem: RowEnergyProblem) -> float:
    """1/(1 − ρ(G)): the slowest e-folding time (tokens) of the row-energy map."""
    radius = float(np.max(np.abs(np.linalg.eigvals(transition_matrix(moments, problem.alpha, problem.erase)))))
    return 1.0 / (1.0 - radius)


@functools.partial(jax.jit, static_argnames=("chains", "length", "every", "implementation"))
def _segment(state, rng, scales, log_alpha, erase, write, value_std, *, chains, length, every, implementation):
    """``length`` tokens of the recurrence for every chain; ‖S_j‖² every ``every`` tokens, and the state."""
    d_k, d_v = scales.shape[0], write.shape[0]
    key_g, key_v = jax.random.split(rng)
    g = jax.random.normal(key_g, (chains, length, 1, d_k), jnp.float32) * scales
    k = g / jnp.linalg.norm(g, axis=-1, keepdims=True)
    v = jax.random.normal(key_v, (chains, length, 1, d_v), jnp.float32) * value_std
    energy, state = state_trajectory(jnp.zeros_like(k), k, v * write, erase_key=k * erase,
                                     log_decay=jnp.broadcast_to(log_alpha, k.shape), initial_state=state,
                                     block=every, reduce=row_energy, implementation=implementation)
    participation = 1.0 / jnp.sum(k ** 4, axis=-1)  # η_eff(k_t) = 1/‖k_t‖₄⁴
    return energy[:, :, 0], state, jnp.mean(participation)


def simulate_row_energy(problem: RowEnergyProblem, *, chains: int = 64, tokens: int = 16384, burn_in: int = 0,
                        every: int = 16, segment: int = 1024, seed: int = 0, implementation: str = "xla") -> dict:
    """Measured stationary m_j (mean over chains and samples), its standard error, and E[η_eff(k)]."""
    if segment % every or tokens % segment or burn_in % segment:
        raise ValueError(f"simulate_row_energy: every={every} must divide segment={segment}, which must divide "
                         f"tokens={tokens} and burn_in={burn_in}")
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    args = (f32(problem.scales), f32(np.log(problem.alpha)), f32(problem.erase), f32(problem.write),
            f32(problem.value_std))
    run = functools.partial(_segment, chains=chains, length=segment, every=every, implementation=implementation)
    state = jnp.zeros((chains, 1, len(problem.scales), len(problem.write)), jnp.float32)
    rngs = jax.random.split(jax.random.key(seed), (burn_in + tokens) // segment)
    sums = np.zeros((chains, len(problem.scales)))
    etas = []
    for i, rng in enumerate(rngs):
        energy, state, eta = run(state, rng, *args)
        if i >= burn_in // segment:
            sums += np.asarray(energy, np.float64).sum(axis=0)
            etas.append(float(eta))
    per_chain = sums / (tokens // every)
    return {"m": per_chain.mean(0), "se": per_chain.std(0, ddof=1) / math.sqrt(chains),
            "key_participation": float(np.mean(etas)), "chains": chains, "tokens": tokens, "burn_in": burn_in,
            "every": every}


def _ranks(x):
    return np.argsort(np.argsort(x)).astype(np.float64)


def fit_statistics(measured, closed) -> dict:
    """Table 6's columns: spread of m, Spearman and log-Pearson correlation with the closed form."""
    rho = np.sqrt(measured)
    p90_10 = lambda x: float(np.percentile(x, 90) / np.percentile(x, 10))  # noqa: E731
    return {"max_over_min_m": float(measured.max() / measured.min()), "p90_p10_rho": p90_10(rho),
            "p90_p10_m": p90_10(measured),
            "spearman": float(np.corrcoef(_ranks(measured), _ranks(closed))[0, 1]),
            "log_pearson": float(np.corrcoef(np.log(measured), np.log(closed))[0, 1])}


def row_groups(measured, se, closed, decoupled, group_size: int = 8) -> list[dict]:
    """Rows sorted by the closed form, in groups of ``group_size``: relative errors per group."""
    order = np.argsort(closed)
    out = []
    for start in range(0, len(order), group_size):
        idx = order[start:start + group_size]
        rel = (measured[idx] - closed[idx]) / closed[idx]
        rel_dec = (decoupled[idx] - closed[idx]) / closed[idx]
        out.append({"rows": [int(i) for i in idx], "closed_min": float(closed[idx].min()),
                    "closed_max": float(closed[idx].max()), "mean_rel_err": float(np.mean(rel)),
                    "max_abs_rel_err": float(np.max(np.abs(rel))),
                    "max_abs_z": float(np.max(np.abs(measured[idx] - closed[idx]) / se[idx])),
                    "decoupled_max_abs_rel_dev": float(np.max(np.abs(rel_dec)))})
    return out


def plot(measured, se, closed, decoupled, path: str, title: str) -> str:
    fig, (ax, ax_err) = report.new_figure(2)
    lo, hi = min(measured.min(), closed.min()) * 0.8, max(measured.max(), closed.max()) * 1.25
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="y = x")
    ax.errorbar(closed, measured, yerr=2 * se, fmt="o", ms=3, label="measured (±2 SE)")
    ax.plot(closed, decoupled, "x", ms=4, label="per-row approximation")
    ax.set(xscale="log", yscale="log", xlabel="closed form m*_j", ylabel="m_j", title="stationary row energy")
    ax.legend(fontsize=8)
    order = np.argsort(closed)
    ax_err.errorbar(np.arange(len(order)), ((measured - closed) / closed)[order], yerr=(2 * se / closed)[order],
                    fmt="o", ms=3, label="(measured − closed) / closed")
    ax_err.plot(np.arange(len(order)), ((decoupled - closed) / closed)[order], "x", ms=4,
                label="(per-row approx. − closed) / closed")
    ax_err.axhline(0.0, color="k", lw=0.8)
    ax_err.set(xlabel="row (sorted by m*_j)", ylabel="relative difference", title="relative error per row")
    ax_err.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    return report.save_figure(fig, path)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dk", type=int, default=64)
    p.add_argument("--dv", type=int, default=64)
    p.add_argument("--mu", type=float, default=0.6, help="parallel erase rate μ = Σ_j b_j E[k_j²]")
    p.add_argument("--key_power", type=float, default=0.43,
                   help="key channel scales s_j = j^-key_power (0.43: E[η_eff(k)] ≈ 12.3, Table 6: 12.24)")
    p.add_argument("--decay_gap", default="0.01,0.3", help="range of 1 − α_j (log-uniform)")
    p.add_argument("--seed", type=int, default=0, help="gates, scales (numpy) and input stream (jax)")
    p.add_argument("--chains", type=int, default=64)
    p.add_argument("--tokens", type=int, default=16384, help="measured tokens per chain (after burn-in)")
    p.add_argument("--every", type=int, default=16, help="sample the state every N tokens")
    p.add_argument("--segment", type=int, default=1024, help="tokens per jitted op call")
    p.add_argument("--implementation", default="xla", help="delta_rule implementation")
    p.add_argument("--out", default="runs/eval/muir_row_energy")
    p.add_argument("--png", default=None, help="plot path (default <out>/muir_row_energy.png)")
    a = p.parse_args(argv)
    try:
        gap = tuple(float(x) for x in a.decay_gap.split(","))
        assert len(gap) == 2 and 0 < gap[0] < gap[1] < 1
    except (ValueError, AssertionError):
        raise ValueError(f"--decay_gap={a.decay_gap!r}: expected 'lo,hi' with 0 < lo < hi < 1") from None
    problem = make_problem(a.dk, a.dv, mu=a.mu, key_power=a.key_power, decay_gap=gap, seed=a.seed)
    moments = normalized_gaussian_key_moments(problem.scales)
    closed = stationary_row_energy(moments, problem.alpha, problem.erase, problem.write_energy)
    decoupled = decoupled_row_energy(moments, problem.alpha, problem.erase, problem.write_energy)
    tau = relaxation_time(moments, problem)
    burn_in = a.segment * math.ceil(10 * tau / a.segment)
    sim = simulate_row_energy(problem, chains=a.chains, tokens=a.tokens, burn_in=burn_in, every=a.every,
                              segment=a.segment, seed=a.seed, implementation=a.implementation)
    measured, se = sim["m"], sim["se"]
    groups = row_groups(measured, se, closed, decoupled)
    fit = fit_statistics(measured, closed)
    setup = {"d_k": a.dk, "d_v": a.dv, "mu": erase_rate(moments, problem.erase), "key_power": a.key_power,
             "decay_gap": gap, "seed": a.seed,
             "inputs": "k = (s⊙g)/‖s⊙g‖, g ~ N(0, I), s_j = j^-key_power (permuted); v ~ N(0, I); fixed α, b, w",
             "relaxation_time": tau, "E_eta_eff_k": sim["key_participation"],
             "inverse_E_l4": moments.mean_inverse_l4, "chains": a.chains, "tokens": a.tokens,
             "burn_in": burn_in, "every": a.every, "implementation": a.implementation,
             "law": "exact stationary diagonal of E[S Sᵀ] (row_energy_law; derived, the paper's eq. (5) is not "
                    "in the extract)"}
    print(f"inputs: {setup['inputs']}; d_k = {a.dk}, d_v = {a.dv}, μ = {setup['mu']:.3f}, "
          f"E[η_eff(k)] = {sim['key_participation']:.2f}, 1/E‖k‖₄⁴ = {moments.mean_inverse_l4:.2f}")
    print(f"relaxation time {tau:.1f} tokens; burn-in {burn_in}; {a.chains} chains × {a.tokens} tokens, "
          f"sampled every {a.every}")
    rows = [[f"{i + 1}", f"{g['closed_min']:.4g}–{g['closed_max']:.4g}", g["mean_rel_err"], g["max_abs_rel_err"],
             g["max_abs_z"], g["decoupled_max_abs_rel_dev"]] for i, g in enumerate(groups)]
    print(report.table(["group (rows by m*)", "m* range", "mean rel. err", "max |rel. err|", "max |z|",
                        "per-row approx. max |rel. dev|"], rows,
                       "Stationary row energy: measured vs closed form (rel. err = (m − m*)/m*; z = (m − m*)/SE)"))
    print()
    print(report.table(["E[η_eff(k)]", "max/min m", "p90/p10 ρ", "p90/p10 m", "Spearman", "log-Pearson"],
                       [[sim["key_participation"], fit["max_over_min_m"], fit["p90_p10_rho"], fit["p90_p10_m"],
                         fit["spearman"], fit["log_pearson"]]],
                       "Table 6 (top) columns (paper at μ = 0.60: 12.24, 52.4×, 5.69×, 32.3×, 1.0000, 1.0000)"))
    out_json = os.path.join(a.out, "muir_row_energy.json")
    png = a.png or os.path.join(a.out, "muir_row_energy.png")
    payload = {"setup": setup, "fit": fit, "groups": groups,
               "rows": {"closed": closed, "measured": measured, "se": se, "decoupled": decoupled,
                        "alpha": problem.alpha, "erase": problem.erase, "key_second_moment": moments.second},
               "write": problem.write}
    report.write_json(out_json, payload)
    plot(measured, se, closed, decoupled, png,
         f"d_k = {a.dk}, μ = {setup['mu']:.2f}, E[η_eff] = {sim['key_participation']:.1f}, {a.chains} chains")
    print(f"\nwrote {out_json} and {png}")
    return payload


if __name__ == "__main__":
    main(sys.argv[1:])
