"""Figures and tables of the synthetic paper checks in docs/results.md, from the results.json files the GPU
scripts write (tools/gpu_mqar_paper.sh parts ``longctx`` and ``copy``, tools/gpu_muir_mqar.sh).

    python tools/plot_paper_checks.py longctx DIR --out docs/images/mqar_vla_longctx_h200.png
    python tools/plot_paper_checks.py copy DIR --out docs/images/copy_vla_paper_h200.png
    python tools/plot_paper_checks.py table7 DIR --out docs/images/muir_table7_mqar_h200.png

DIR holds one sub-directory per job (each with a results.json). Every command also prints a Markdown table:
``longctx`` accuracy per mixer and T (the VLA paper's Fig. 6), ``copy`` final and step-150 accuracy per mixer
(its Table 7), ``table7`` mean ± sample std over seeds of the overall and per-lag accuracy per gate
configuration (the Muir paper's Table 7).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import textwrap

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mixerlab.eval.synthetic.report import mean_std  # noqa: E402


def load(directory: str) -> list[dict]:
    """Every run record of every DIR/*/results.json (merged directories skipped: they repeat the runs)."""
    runs = []
    for path in sorted(glob.glob(os.path.join(directory, "*", "results.json"))):
        payload = json.load(open(path))
        if "merged_from" in payload:
            continue
        runs.extend(payload["results"])
    if not runs:
        raise SystemExit(f"error: no results.json with runs under {directory}/*/")
    return runs


def _mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return "{:.3f} ± {:.3f}".format(*mean_std(values))


def _accuracy_curve(run: dict) -> tuple[list[int], list[float]]:
    points = [(h["step"], h["accuracy"]) for h in run["history"] if "accuracy" in h]
    return [s for s, _ in points], [a for _, a in points]


def longctx(runs: list[dict], out: str | None) -> str:
    """Accuracy at n = 8 against T, one line per mixer (labels are 'MIXER, T = N')."""
    table: dict[str, dict[int, float]] = {}
    for r in runs:
        m = re.fullmatch(r"(.+), T = (\d+)", r["mixer"])
        if not m:
            raise SystemExit(f"error: longctx: run label {r['mixer']!r} is not 'MIXER, T = N'")
        table.setdefault(m.group(1), {})[int(m.group(2))] = r["accuracy"]
    lengths = sorted({t for row in table.values() for t in row})
    lines = ["| mixer | " + " | ".join(f"T = {t}" for t in lengths) + " |", "|---" * (len(lengths) + 1) + "|"]
    for mixer, row in sorted(table.items()):
        lines.append(f"| {mixer} | " + " | ".join(f"{row[t]:.3f}" if t in row else "–" for t in lengths) + " |")
    if out:
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(6, 4))
        for mixer, row in sorted(table.items()):
            ts = sorted(row)
            ax.plot(ts, [row[t] for t in ts], marker="o", label=mixer)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(t) for t in lengths])
        _accuracy_axes(ax, "sequence length T", "held-out accuracy (n = 8)",
                       "MQAR against the sequence length (VLA paper Fig. 6 setup)")
        _save(fig, out)
    return "\n".join(lines) + "\n"


def copy(runs: list[dict], out: str | None) -> str:
    """Final accuracy and the accuracy at step 150 (where the paper has every model at 1.000), per mixer."""
    lines = ["| mixer | accuracy at step 150 | final accuracy (step) | final loss |", "|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: r["mixer"]):
        steps, accs = _accuracy_curve(r)
        at150 = dict(zip(steps, accs)).get(150)
        lines.append(f"| {r['mixer']} | {at150:.3f} | {r['accuracy']:.3f} ({r['steps']}) | {r['final_loss']:.3f} |"
                     if at150 is not None else
                     f"| {r['mixer']} | – | {r['accuracy']:.3f} ({r['steps']}) | {r['final_loss']:.3f} |")
    if out:
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in sorted(runs, key=lambda r: r["mixer"]):
            ax.plot(*_accuracy_curve(r), label=r["mixer"])
        ax.axvline(150, color="grey", lw=0.8, ls=":")
        _accuracy_axes(ax, "training step", "held-out accuracy (copied half)",
                       "Copy task, T = 64 (VLA paper Table 7 setup)")
        _save(fig, out)
    return "\n".join(lines) + "\n"


_LAGS = (("lag_8_32", "short [8, 32)"), ("lag_32_128", "medium [32, 128)"), ("lag_128_256", "long [128, 256)"))


def table7(runs: list[dict], out: str | None) -> str:
    """Mean ± sample std over seeds of the overall and per-lag accuracy, per configuration; dots per seed."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(r["mixer"], []).append(r)
    lines = ["| configuration | seeds | overall | " + " | ".join(name for _, name in _LAGS) + " |",
             "|---|---|---|" + "---|" * len(_LAGS)]
    for label, rs in groups.items():
        seeds = ",".join(str(r["seed"]) for r in sorted(rs, key=lambda r: r["seed"]))
        cells = [_mean_std([r["accuracy"] for r in rs])]
        cells += [_mean_std([r["held_out"][key] for r in rs]) for key, _ in _LAGS]
        lines.append(f"| {label} | {seeds} | " + " | ".join(cells) + " |")
    if out:
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(8, 4))
        labels = list(groups)
        for i, label in enumerate(labels):
            accs = [r["accuracy"] for r in groups[label]]
            ax.scatter([i] * len(accs), accs, color="tab:blue", alpha=0.7, zorder=3)
            mean, std = mean_std(accs)
            ax.errorbar(i + 0.15, mean, yerr=std, fmt="s", color="black", capsize=4)
        ax.set_xticks(range(len(labels)), [textwrap.fill(lb, 20) for lb in labels], fontsize=7)
        ax.set_ylabel("held-out accuracy (dots: seeds; square: mean ± std)")
        ax.set_ylim(-0.02, 1.05)
        ax.grid(alpha=0.3, axis="y")
        ax.set_title("Learned MQAR, T = 256, n = 16 (Muir paper Table 7 setup)")
        _save(fig, out)
    return "\n".join(lines) + "\n"


def _accuracy_axes(ax, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(-0.02, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("what", choices=["longctx", "copy", "table7"])
    p.add_argument("directory", help="one sub-directory per job, each with a results.json")
    p.add_argument("--out", help="PNG path of the figure (the table is printed either way)")
    args = p.parse_args(argv)
    runs = load(args.directory)
    if args.what == "longctx":
        runs = [r for r in runs if ", T = " in r["mixer"]]
    elif args.what == "copy":
        runs = [r for r in runs if r.get("task", {}).get("kind") == "copy"]
    print({"longctx": longctx, "copy": copy, "table7": table7}[args.what](runs, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
