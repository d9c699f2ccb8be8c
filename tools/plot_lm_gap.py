"""The Transformer-gap figure of docs/results.md: what a short convolution does to the small LM comparison.

    python tools/plot_lm_gap.py RUNS_ROOT [--out PNG]

RUNS_ROOT holds call folders (as tools/gpu_lm_compare.sh writes them), each with one run folder per run
(metrics.jsonl, config.yaml). A run is grouped by what its config says: the mixer (softmax or gdn2), whether it
has the short convolution (`mixers.softmax.use_short_conv`, `mixers.gdn2.use_short_conv`) and its SiLU, its peak LR
and its seed. Left: validation loss against tokens at the peak LR 1.5e-3, one line per seed. Right: validation
loss at the last step against the peak LR. Prints the table behind both.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
from collections import defaultdict

import yaml


def load(runs_root: str) -> list[dict]:
    """One record per run folder under RUNS_ROOT/*/: its group, lr, seed and validation curve."""
    runs = []
    for metrics in sorted(glob.glob(os.path.join(runs_root, "*", "*", "metrics.jsonl"))):
        folder = os.path.dirname(metrics)
        with open(os.path.join(folder, "config.yaml")) as f:
            cfg = yaml.safe_load(f)
        mixer = cfg["model"]["mixer"]
        options = cfg.get("mixers", {}).get(mixer, {})
        conv = options.get("use_short_conv", mixer != "softmax")
        name = {"softmax": "Transformer", "gdn2": "GDN-2"}.get(mixer, mixer)
        if mixer == "softmax" and conv:
            name += " + short conv" + (" (SiLU)" if options.get("conv_activation") else "")
        elif mixer != "softmax" and not conv:
            name += " without short convs"
        tokens_per_step = cfg["train"]["batch_size"] * cfg["data"]["seq_len"]
        with open(metrics) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        val = sorted((r["step"] * tokens_per_step, r["loss"]) for r in rows if r.get("split") == "val")
        runs.append({"group": name, "lr": float(cfg["optim"]["lr"]), "seed": cfg["train"]["seed"], "val": val,
                     "path": os.path.relpath(folder, runs_root)})
    if not runs:
        raise SystemExit(f"plot_lm_gap: no */*/metrics.jsonl under {runs_root}")
    return runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs_root")
    p.add_argument("--out", default=None, help="PNG to write (default: RUNS_ROOT/gap.png)")
    args = p.parse_args(argv)
    runs = load(args.runs_root)
    print("| run | group | peak LR | seed | validation loss at the last step |\n|---|---|---|---|---|")
    for r in sorted(runs, key=lambda r: (r["group"], r["lr"], r["seed"])):
        print(f"| {r['path']} | {r['group']} | {r['lr']:g} | {r['seed']} | {r['val'][-1][1]:.4f} |")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({r["group"] for r in runs})
    colour = {g: f"C{i}" for i, g in enumerate(groups)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for r in runs:
        if r["lr"] == 1.5e-3:
            x, y = zip(*r["val"])
            left.plot([t / 1e6 for t in x], y, color=colour[r["group"]], marker="o", ms=3,
                      ls="-" if r["seed"] == 0 else "--", label=f"{r['group']}, seed {r['seed']}")
    left.set(xlabel="training tokens (M)", ylabel="validation loss (nats)", title="peak LR 1.5e-3 (solid: seed 0)")
    left.legend(fontsize=7)
    by_lr = defaultdict(list)
    for r in runs:
        by_lr[(r["group"], r["lr"])].append(r["val"][-1][1])
    for g in groups:
        points = sorted((lr, sum(v) / len(v)) for (group, lr), v in by_lr.items() if group == g)
        right.plot(*zip(*points), color=colour[g], marker="o", label=g)
        for (group, lr), v in by_lr.items():
            if group == g:
                right.scatter([lr] * len(v), v, color=colour[g], s=10, alpha=0.5)
    right.set(xscale="log", xlabel="peak LR", ylabel="validation loss at 16.4M tokens",
              title="last validation loss against peak LR (line: mean over seeds)")
    right.legend(fontsize=7)
    fig.tight_layout()
    out = args.out or os.path.join(args.runs_root, "gap.png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
