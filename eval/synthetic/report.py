"""Sweep outputs: the accuracy table (text), the JSON record and the PNG plots (matplotlib, Agg)."""
from __future__ import annotations

import os
import platform
import sys

import numpy as np

from mixerlab.eval import report


def column(r: dict, records: list[dict]) -> str:
    """A record's table column: its setting, plus its step count when the runs of the table differ in it
    (e.g. the VLA paper's n = 32, 48 at 1000 steps beside n ≤ 24 at 2000)."""
    steps = {x.get("train_steps") for x in records}
    return r["setting"] if len(steps) <= 1 else f"{r['setting']} ({r.get('train_steps')} steps)"


def _group(records: list[dict], key: str = "accuracy") -> dict:
    """(mixer, column) -> list of values over seeds, keeping the sweep's order (records without ``key``
    are left out)."""
    out: dict = {}
    for r in records:
        if r.get(key) is not None:
            out.setdefault((r["mixer"], column(r, records)), []).append(r[key])
    return out


def _ordered(records: list[dict], field: str) -> list:
    seen = []
    for r in records:
        if r[field] not in seen:
            seen.append(r[field])
    return seen


def mean_std(values) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof = 1, as the VLA paper's Table 9: 0.074, 0.077, 0.072 →
    0.074 ± 0.003); std 0 for one value."""
    values = np.asarray(values, np.float64)
    return float(values.mean()), float(values.std(ddof=1)) if values.size > 1 else 0.0


def accuracy_table(records: list[dict], key: str = "accuracy") -> str:
    """Rows = mixers, columns = settings; the mean of ``key`` over seeds, with "± sample std [min, max]"
    when there are several."""
    mixers = _ordered(records, "mixer")
    settings = []  # in order of n (merged sweeps may list n = 32 before n = 4), ties in order of appearance
    for r in sorted(records, key=lambda r: r.get("x", 0.0)):
        if column(r, records) not in settings:
            settings.append(column(r, records))
    groups = _group(records, key)

    def cell(values):
        if len(values) == 1:
            return f"{values[0]:.3f}"
        mean, std = mean_std(values)
        return f"{mean:.3f} ± {std:.3f} [{min(values):.3f},{max(values):.3f}]"

    rows = [[m, *(cell(groups[(m, s)]) if (m, s) in groups else "-" for s in settings)] for m in mixers]
    return report.table(["mixer", *settings], rows)


def write_json(path: str, *, records: list[dict], config: dict, task: dict, mixers: list[str], settings: list[str],
               seeds: list, total_s: float, argv: list[str] | None = None) -> None:
    import jax

    payload = {
        "command": " ".join(argv if argv is not None else sys.argv),
        "mixers": mixers, "settings": settings, "seeds": seeds,
        "config": config, "task": task,
        "timings": {"total_s": total_s, "runs": [{"mixer": r["mixer"], "setting": r["setting"], "seed": r["seed"],
                                                  "wall_s": r["wall_s"], "first_step_s": r["first_step_s"],
                                                  "train_s": r["train_s"], "eval_s": r["eval_s"]}
                                                 for r in records]},
        "environment": {"jax": jax.__version__, "backend": jax.default_backend(),
                        "devices": [str(d) for d in jax.devices()], "python": platform.python_version(),
                        "machine": platform.machine(), "cpu_count": os.cpu_count()},
        "results": records,
    }
    report.write_json(path, payload)


def plot_capacity(records: list[dict], path: str, title: str = "") -> str:
    """Held-out accuracy vs n, one line per mixer: the mean over seeds, shaded between min and max."""
    fig, ax = report.pyplot().subplots(figsize=(7, 4.2), dpi=120)
    settings = _ordered(records, "setting")
    styles = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", "-"), ("P", "--"), ("X", "-."), ("*", ":")]
    mixers = _ordered(records, "mixer")
    for index, mixer in enumerate(mixers):
        marker, dash = styles[index % len(styles)]
        size = 9 - 4 * index / max(1, len(mixers) - 1)  # later lines drawn smaller: equal curves stay visible
        points = []
        for s in settings:
            values = [r["accuracy"] for r in records if r["mixer"] == mixer and r["setting"] == s]
            if values:
                x = next(r["x"] for r in records if r["setting"] == s)
                points.append((x, np.mean(values), min(values), max(values)))
        points.sort()
        xs, mean, lo, hi = (np.array(v) for v in zip(*points))
        (line,) = ax.plot(xs, mean, marker=marker, ls=dash, ms=size, label=mixer, lw=1.5)
        if any(len([r for r in records if r["mixer"] == mixer and r["setting"] == s]) > 1 for s in settings):
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2)
    ax.set_xticks(sorted({r["x"] for r in records}))
    ax.set_xlabel("key-value pairs n")
    ax.set_ylabel("held-out per-query accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return report.save_figure(fig, path)


def plot_learning_curves(records: list[dict], path: str, title: str = "") -> str:
    """Held-out accuracy at every evaluation step, one line per run."""
    fig, ax = report.pyplot().subplots(figsize=(7, 4.2), dpi=120)
    for r in records:
        points = [(h["step"], h["accuracy"]) for h in r.get("history", ()) if "accuracy" in h]
        if points:
            ax.plot(*zip(*points), "o-", ms=3, lw=1.2, label=f"{r['mixer']} {r['setting']} seed {r['seed']}")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out per-token accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(records) <= 12:
        ax.legend(fontsize=7)
    return report.save_figure(fig, path)


