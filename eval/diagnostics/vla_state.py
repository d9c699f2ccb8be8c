"""VLA state-norm and Jacobian diagnostics on random inputs, against linear attention and DeltaNet
(the VLA paper, §4.1–§4.2 and §6.2; the Jacobian closed form in docs/math/vla.md, 'Jacobian norm').

    python -m mixerlab.eval.diagnostics.vla_state --T 1000 --dk 32 --seeds 0,1,2 --inputs gaussian \
        --out runs/eval/vla_state

Input model (one head, d_k = d_v = d, one sequence per seed; printed and stored with the results):
  gaussian: k_t, v_t ~ N(0, I_d) i.i.d.        uniform: k_t ~ N(0, I_d), v_t ~ U[0, 1]^d i.i.d.
Keys go through the feature map φ (ELU+1 by default, as the VLA paper "throughout"; ``--key_map identity``):
  linear attention  S_t = S_{t−1} + φ(k_t)ᵀ v_t                          J_t = I
  DeltaNet          S_t = (I − β k̂_tᵀk̂_t) S_{t−1} + β k̂_tᵀ v_t,  k̂ = φ(k)/‖φ(k)‖   J_t = I − β k̂ k̂ᵀ
  VLA               the op's recurrence with u = k̂ (no f_θ), λ₀ = 0.1, P = 20, ρ = 1e-3    J_t = I − α̂_t k̂_tᵀ
β = 1 by default: DeltaNet is then VLA with a fixed isotropic A (docs/math/vla.md, 'Useful identities').
Everything is computed by the ops: VLA by ``pallas_kernels.vla.vla_diagnostics`` (‖S_t‖_F, ‖A_t‖_F, c_t and
the closed-form ‖J_t‖₂) and ``jacobian_window_norm`` (‖J_t⋯J_{t−24}‖₂, the product, not ‖J‖²⁵); linear
attention and DeltaNet by ``pallas_kernels.delta_rule`` token by token (``trajectory.state_trajectory``).
Positions are 1-based: t = 1 is the state after the first token.

The paper's unnormalised "VLAv2" (its Table 2): ``--no_normalize_key`` (write and read with φ(k) itself) and/or
``--no_normalize_write_direction`` (write along α = A k̂, not α̂). Then J_t = I − α_t k_tᵀ has no closed form in
c_t: ‖J_t‖₂ is computed by SVD, and the 25-step product in log10 (it reaches 10^30 and more, past float32),
renormalising the running product at every step.
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from mixerlab.eval import report
from mixerlab.eval.diagnostics.trajectory import state_trajectory
from mixerlab.pallas_kernels.vla import jacobian_window_norm, vla_diagnostics
from mixerlab.pallas_kernels.vla.api import DEFAULT_EPS, normalize

INPUTS = {
    "gaussian": "k_t, v_t ~ N(0, I_d) i.i.d.",
    "uniform": "k_t ~ N(0, I_d), v_t ~ U[0, 1]^d i.i.d. (non-zero value mean)",
}
KEY_MAPS = ("elu_plus_one", "identity")
REPORT_POSITIONS = (1, 10, 100, 250, 1000, 4000)
# An earlier, independent numpy simulation of the VLA paper's setup (d = 32, u = k̂, k, v ~ N(0, I), ELU+1
# keys; Jacobians on the same trajectories; T = 1000); the comparison is in docs/evaluation.md.
SPEC_GAUSSIAN_D32 = {
    "la_state_norm_t1000": (1272.0, 1555.0),
    "vla_state_norm_t1000": 36.0,
    "vla_penalty_norm": {1: 55.7, 10: 47.8, 100: 8.2, 1000: 0.68},
    "vla_jacobian_norm_range": (1.0, 1.44),
    "vla_alignment_range": (0.37, 1.0),
    "vla_window25_max_range": (3.3, 3.9),
}


def make_inputs(seeds, length: int, dim: int, inputs: str = "gaussian"):
    """k, v [S, T, 1, d] float32, one sequence per seed (``jax.random.key(seed)``)."""
    if inputs not in INPUTS:
        raise ValueError(f"--inputs={inputs!r}; expected one of {sorted(INPUTS)}")
    ks, vs = [], []
    for seed in seeds:
        key_k, key_v = jax.random.split(jax.random.key(seed))
        ks.append(jax.random.normal(key_k, (length, 1, dim), jnp.float32))
        if inputs == "gaussian":
            vs.append(jax.random.normal(key_v, (length, 1, dim), jnp.float32))
        else:
            vs.append(jax.random.uniform(key_v, (length, 1, dim), jnp.float32))
    return jnp.stack(ks), jnp.stack(vs)


def feature_map(k, key_map: str):
    if key_map == "elu_plus_one":
        return jax.nn.elu(k) + 1.0
    if key_map == "identity":
        return k
    raise ValueError(f"--key_map={key_map!r}; expected one of {KEY_MAPS}")


def vla_state_diagnostics(k, v, *, key_map: str = "elu_plus_one", beta: float = 1.0, window: int = 25,
                          eps: float = DEFAULT_EPS, normalize_key: bool = True,
                          normalize_write_direction: bool = True) -> dict:
    """Per-token diagnostics of VLA, linear attention and DeltaNet on the same k, v [B, T, 1, d].

    Returns numpy arrays [B, T] (or [B, T − window + 1] for window products, whose entry i is the product
    ending at token i + window, 1-based): ``vla/state_norm``, ``vla/penalty_norm``, ``vla/alignment``,
    ``vla/jacobian_norm``, ``vla/window_norm``, ``la/state_norm``, ``deltanet/state_norm``,
    ``deltanet/jacobian_norm``, ``deltanet/window_norm``; plus ``vla/alpha`` and ``k_hat`` [B, T, 1, d], and
    ``vla/log10_window_norm`` (log10 of ``vla/window_norm``, computed without overflow).
    With ``normalize_key`` or ``normalize_write_direction`` off (the paper's unnormalised VLAv2), VLA's
    ``jacobian_norm`` is the SVD norm of I − α_t k_tᵀ with the key and write direction the op used, and
    ``window_norm`` is 10 ** ``log10_window_norm`` (inf past the float32 range).
    """
    phi_k = feature_map(k, key_map)
    k_hat = normalize(phi_k, eps)  # the op's own k̂ (same ε floor)
    q = jnp.zeros_like(k)  # the readout does not enter any of these statistics
    diag = vla_diagnostics(q, phi_k, v, eps=eps, normalize_key=normalize_key,
                           normalize_write_direction=normalize_write_direction)
    out = {f"vla/{name}": diag[name][..., 0] for name in ("state_norm", "penalty_norm", "alignment",
                                                            "jacobian_norm")}
    key = k_hat if normalize_key else phi_k  # the key the recurrence erases along
    if normalize_key and normalize_write_direction:
        out["vla/window_norm"] = jacobian_window_norm(k_hat, diag["alpha"], window)[..., 0]
        out["vla/log10_window_norm"] = jnp.log10(out["vla/window_norm"])
    else:  # the closed form needs unit α̂ and k̂
        eye = jnp.eye(key.shape[-1], dtype=jnp.float32)
        J = eye - diag["alpha"][..., 0, :, None] * key[..., 0, None, :]
        out["vla/jacobian_norm"] = jnp.linalg.norm(J, ord=2, axis=(-2, -1))
        out["vla/log10_window_norm"] = jacobian_window_norm(key, diag["alpha"], window, log10=True)[..., 0]
        out["vla/window_norm"] = 10.0 ** out["vla/log10_window_norm"]
    out["vla/alpha"], out["k_hat"] = diag["alpha"], k_hat
    la_norm, _ = state_trajectory(q, phi_k, v)
    out["la/state_norm"] = jnp.moveaxis(la_norm, 0, 1)[..., 0]
    dn_norm, _ = state_trajectory(q, k_hat, beta * v, erase_key=beta * k_hat)
    out["deltanet/state_norm"] = jnp.moveaxis(dn_norm, 0, 1)[..., 0]
    out["deltanet/jacobian_norm"] = jacobian_window_norm(k_hat, beta * k_hat, 1)[..., 0]
    out["deltanet/window_norm"] = jacobian_window_norm(k_hat, beta * k_hat, window)[..., 0]
    return {name: np.asarray(x) for name, x in out.items()}


def _stats(x) -> dict:
    x = np.asarray(x, np.float64)
    return {"mean": float(x.mean()), "min": float(x.min()), "max": float(x.max())}


def summarize(diag: dict, window: int) -> dict:
    """Norms at the report positions (over seeds) and Jacobian statistics (over seeds and tokens)."""
    length = diag["vla/state_norm"].shape[1]
    positions = [t for t in REPORT_POSITIONS if t <= length] + ([length] if length not in REPORT_POSITIONS else [])
    norms = {}
    for name in ("la/state_norm", "deltanet/state_norm", "vla/state_norm", "vla/penalty_norm"):
        norms[name] = {t: _stats(diag[name][:, t - 1]) for t in positions}
    jac = {
        "la": {"jacobian_norm": {"mean": 1.0, "min": 1.0, "max": 1.0},
               f"window{window}_norm": {"mean": 1.0, "min": 1.0, "max": 1.0}},
        "deltanet": {"jacobian_norm": _stats(diag["deltanet/jacobian_norm"]),
                     f"window{window}_norm": _stats(diag["deltanet/window_norm"])},
        "vla": {"jacobian_norm": _stats(diag["vla/jacobian_norm"]),
                f"window{window}_norm": _stats(diag["vla/window_norm"]),
                f"log10_window{window}_norm": _stats(diag["vla/log10_window_norm"]),
                "alignment": _stats(diag["vla/alignment"])},
    }
    return {"positions": positions, "norms": norms, "jacobians": jac,
            "vla_window_max_per_seed": [float(x) for x in diag["vla/window_norm"].max(axis=1)]}


def spec_comparison(summary: dict, window: int) -> list[list]:
    """Rows (quantity, earlier simulation, measured) for the d = 32 Gaussian setup."""
    s, norms, jac = SPEC_GAUSSIAN_D32, summary["norms"], summary["jacobians"]
    fmt_range = lambda st: f"{st['min']:.4g}–{st['max']:.4g}"  # noqa: E731
    rows = []
    if 1000 in norms["la/state_norm"]:
        rows.append(["LA ‖S‖_F at t=1000", "1272–1555", fmt_range(norms["la/state_norm"][1000])])
        rows.append(["VLA ‖S‖_F at t=1000", "≈36 (max 37)", fmt_range(norms["vla/state_norm"][1000])])
    for t, ref in s["vla_penalty_norm"].items():
        if t in norms["vla/penalty_norm"]:
            rows.append([f"VLA ‖A‖_F at t={t}", f"{ref}", fmt_range(norms["vla/penalty_norm"][t])])
    rows.append(["VLA ‖J_t‖₂ range", "1–1.44", fmt_range(jac["vla"]["jacobian_norm"])])
    rows.append(["VLA c_t = α̂·k̂ range", "0.37–1", fmt_range(jac["vla"]["alignment"])])
    if window == 25:
        per_seed = summary["vla_window_max_per_seed"]
        rows.append(["VLA max_t ‖∏₂₅J‖₂ (range over seeds)", "3.3–3.9", f"{min(per_seed):.4g}–{max(per_seed):.4g}"])
    return rows


def plot(diag: dict, window: int, path: str, title: str) -> str:
    fig, (ax_norm, ax_jac) = report.new_figure(2)
    t = np.arange(1, diag["vla/state_norm"].shape[1] + 1)
    for name, label in (("la/state_norm", "linear attention ‖S‖_F"), ("deltanet/state_norm", "DeltaNet ‖S‖_F"),
                        ("vla/state_norm", "VLA ‖S‖_F"), ("vla/penalty_norm", "VLA ‖A‖_F")):
        x = diag[name]
        line, = ax_norm.plot(t, x.mean(0), label=label)
        ax_norm.fill_between(t, x.min(0), x.max(0), color=line.get_color(), alpha=0.2)
    ax_norm.set(xscale="log", yscale="log", xlabel="position t", ylabel="norm", title="state norms (band: seeds)")
    ax_norm.legend(fontsize=8)
    ax_jac.plot(t, diag["vla/jacobian_norm"][0], lw=0.5, alpha=0.6, label="VLA ‖J_t‖₂ (seed 0)")
    tw = np.arange(window, t[-1] + 1)
    for name, label in (("vla/window_norm", f"VLA ‖∏_{window} J‖₂"),
                        ("deltanet/window_norm", f"DeltaNet ‖∏_{window} J‖₂")):
        x = diag[name]
        line, = ax_jac.plot(tw, x.mean(0), label=label + " (seed mean)")
        ax_jac.fill_between(tw, x.min(0), x.max(0), color=line.get_color(), alpha=0.2)
    ax_jac.axhline(1.0, color="k", lw=0.8, ls="--", label="linear attention (J = I)")
    ax_jac.set(xlabel="position t", ylabel="operator 2-norm", title="Jacobians of S_{t−1} ↦ S_t")
    if np.nanmax(diag["vla/window_norm"]) > 100:  # the unnormalised variants span tens of decades
        ax_jac.set_yscale("log")
    ax_jac.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    return report.save_figure(fig, path)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, default=1000, help="sequence length")
    p.add_argument("--dk", type=int, default=32, help="head dimension d = d_k = d_v")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, one sequence each")
    p.add_argument("--inputs", default="gaussian", choices=sorted(INPUTS))
    p.add_argument("--key_map", default="elu_plus_one", choices=KEY_MAPS)
    p.add_argument("--beta", type=float, default=1.0, help="DeltaNet write strength β")
    p.add_argument("--window", type=int, default=25, help="Jacobian product window")
    p.add_argument("--no_normalize_key", action="store_true", help="VLA writes and reads with φ(k) (paper's VLAv2)")
    p.add_argument("--no_normalize_write_direction", action="store_true",
                   help="VLA writes along α = A k̂, not α̂ (paper's VLAv2)")
    p.add_argument("--out", default="runs/eval/vla_state", help="output directory")
    p.add_argument("--png", default=None, help="plot path (default <out>/vla_state.png)")
    a = p.parse_args(argv)
    seeds = report.parse_int_list(a.seeds, "--seeds")
    if a.T < a.window:
        raise ValueError(f"--T={a.T} must be >= --window={a.window}")
    k, v = make_inputs(seeds, a.T, a.dk, a.inputs)
    normalized = not (a.no_normalize_key or a.no_normalize_write_direction)
    diag = vla_state_diagnostics(k, v, key_map=a.key_map, beta=a.beta, window=a.window,
                                 normalize_key=not a.no_normalize_key,
                                 normalize_write_direction=not a.no_normalize_write_direction)
    summary = summarize(diag, a.window)
    setup = {"T": a.T, "d_k": a.dk, "d_v": a.dk, "seeds": seeds, "inputs": INPUTS[a.inputs],
             "key_map": a.key_map, "deltanet_beta": a.beta, "window": a.window,
             "normalize_key": not a.no_normalize_key, "normalize_write_direction": not a.no_normalize_write_direction,
             "vla": "u = k̂ (no f_θ), λ₀ = 0.1, P = 20, ρ = 1e-3, ε = 1e-4 (op defaults), float32 reference scan"}
    print(f"inputs: {setup['inputs']}; keys φ = {a.key_map}; d = {a.dk}; T = {a.T}; seeds {seeds}; "
          f"DeltaNet β = {a.beta}")
    rows = []
    for name, label in (("la/state_norm", "LA ‖S‖_F"), ("deltanet/state_norm", "DeltaNet ‖S‖_F"),
                        ("vla/state_norm", "VLA ‖S‖_F"), ("vla/penalty_norm", "VLA ‖A‖_F")):
        rows.append([label] + [f"{st['mean']:.4g} [{st['min']:.4g}, {st['max']:.4g}]"
                               for st in summary["norms"][name].values()])
    print(report.table(["quantity (mean [min, max] over seeds)"] + [f"t={t}" for t in summary["positions"]], rows,
                       "State norms vs position"))
    jrows = []
    for model in ("la", "deltanet", "vla"):
        j = summary["jacobians"][model]
        w = j[f"window{a.window}_norm"]
        jrows.append([model, j["jacobian_norm"]["mean"], j["jacobian_norm"]["min"], j["jacobian_norm"]["max"],
                      w["mean"], w["max"]])
    print()
    print(report.table(["mixer", "‖J_t‖₂ mean", "min", "max", f"‖∏_{a.window}J‖₂ mean", "max"], jrows,
                       "Jacobians (over seeds and tokens; LA exact: J = I)"))
    window_max = summary["vla_window_max_per_seed"]
    print(f"VLA max_t ‖∏_{a.window}J‖₂ per seed: " + ", ".join(f"{x:.4g}" for x in window_max))
    lw = summary["jacobians"]["vla"][f"log10_window{a.window}_norm"]
    print(f"VLA log10 ‖∏_{a.window}J‖₂ mean {lw['mean']:.2f}, min {lw['min']:.2f}, max {lw['max']:.2f}"
          f" (VLA key normalised: {not a.no_normalize_key}; write direction normalised: "
          f"{not a.no_normalize_write_direction})")
    comparison = []
    if a.inputs == "gaussian" and a.dk == 32 and a.key_map == "elu_plus_one" and normalized:
        comparison = spec_comparison(summary, a.window)
        print()
        print(report.table(["quantity", "earlier numpy simulation", "measured (seed range)"], comparison,
                           "Comparison with the earlier simulation (d = 32, Gaussian inputs, ELU+1 keys)"))
    out_json = os.path.join(a.out, "vla_state.json")
    png = a.png or os.path.join(a.out, "vla_state.png")
    payload = {"setup": setup, "summary": summary, "spec_comparison": comparison,
               "per_token_seed_mean": {name: x.mean(0) for name, x in diag.items()
                                       if name not in ("vla/alpha", "k_hat")}}
    report.write_json(out_json, payload)
    plot(diag, a.window, png, f"{setup['inputs']}; φ = {a.key_map}; d = {a.dk}; seeds {seeds}")
    print(f"\nwrote {out_json} and {png}")
    return payload


if __name__ == "__main__":
    main(sys.argv[1:])
