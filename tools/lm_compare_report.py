"""Table and figure of the small language-model comparison (configs/lm_compare/, tools/gpu_lm_compare.sh).

    python tools/lm_compare_report.py RUNS_DIR [RUNS_DIR ...] [--labels A,B] [--out DIR] [--title TITLE]

RUNS_DIR holds one run directory per model (each with metrics.jsonl and config.yaml, as train.py writes them).
A model whose run directory did not come back but whose terminal log RUNS_DIR/<name>.log did (the progress bar
prints the training loss every train.log_every steps and a line per evaluation) is read from that log, with its
config from configs/lm_compare/<name>.yaml.
Writes DIR/table.md (default RUNS_DIR) and DIR/val_loss.png: validation loss against training tokens for every
model on one axis, and the training loss (mean over each logging window) beside it. A run stopped early (time
limit) is kept: its row says how many steps it finished.
Several RUNS_DIRs (e.g. the same models with another seed) go into one table and one figure: each run is named
LABEL/model (LABEL from --labels, default the directory's name), one colour per model, one line style per
directory; --out is then required.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

_BAR = re.compile(r"\| (\d+)/\d+ \[[^\]]*loss=([0-9.]+), mfu=[0-9.]+%, tok_s=([0-9,]+)\]")
_VAL = re.compile(r"step (\d+): validation loss ([0-9.]+), perplexity ([0-9.]+)")


def load_run(run_dir: str) -> dict | None:
    """The rows of run_dir/metrics.jsonl split by kind, and the run's config; None without metrics."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # a run killed mid-write leaves a partial last line
                    pass
    train = [r for r in rows if r.get("split") == "train" and "loss" in r]
    val = [r for r in rows if r.get("split") == "val" and "loss" in r]
    cfg = {}
    cfg_path = os.path.join(run_dir, "config.yaml")
    if os.path.exists(cfg_path):
        import yaml

        with open(cfg_path) as f:
            cfg = yaml.safe_load(f) or {}
    return {"name": os.path.basename(run_dir.rstrip("/")), "train": train, "val": val, "config": cfg}


def load_log(log_path: str, config_path: str) -> dict | None:
    """The same rows from a train.py terminal log (progress-bar postfix and evaluation lines)."""
    with open(log_path, errors="replace") as f:
        text = f.read()
    train = {}
    for step, loss, tok_s in _BAR.findall(text):  # the postfix repeats on every bar refresh: keep one per step
        train[int(step)] = {"step": int(step), "split": "train", "loss": float(loss),
                            "tokens_per_s": float(tok_s.replace(",", ""))}
    val = [{"step": int(st), "split": "val", "loss": float(lo), "perplexity": float(pp)}
           for st, lo, pp in _VAL.findall(text)]
    if not train and not val:
        return None
    cfg = {}
    if os.path.exists(config_path):
        from mixerlab.training.config import load_config

        cfg = load_config(config_path).to_dict()
    # the bar shows the loss logged at the last multiple of train.log_every; its last refresh at such a step
    # (the dict keeps the last) carries that step's own loss
    every = int(cfg.get("train", {}).get("log_every", 1) or 1)
    logged = [train[k] for k in sorted(train) if k % every == 0]
    return {"name": os.path.basename(log_path)[:-4], "train": logged, "val": val, "config": cfg}


def load_dir(runs_dir: str) -> list[dict]:
    """Every run of runs_dir: run directories with metrics, then terminal logs of models without one."""
    runs = [r for d in sorted(os.listdir(runs_dir))
            if os.path.isdir(os.path.join(runs_dir, d)) and (r := load_run(os.path.join(runs_dir, d)))]
    have = {r["name"] for r in runs}
    for f in sorted(os.listdir(runs_dir)):
        name = f[:-4]
        if f.endswith(".log") and name not in have:
            run = load_log(os.path.join(runs_dir, f), os.path.join("configs", "lm_compare", name + ".yaml"))
            if run is not None:
                runs.append(run)
    return runs


def tokens_per_step(cfg: dict) -> int:
    # train.batch_size is the global batch in sequences (micro-batches split it, they do not multiply it)
    return int(cfg.get("train", {}).get("batch_size", 0)) * int(cfg.get("data", {}).get("seq_len", 0))


def summarize(run: dict) -> dict:
    cfg, train, val = run["config"], run["train"], run["val"]
    tps = tokens_per_step(cfg)
    steps_done = max((r["step"] for r in train), default=0)
    speeds = [r["tokens_per_s"] for r in train if r.get("tokens_per_s") and r["step"] > 20]
    last_val = val[-1] if val else None
    return {
        "name": run["name"],
        "mixer": cfg.get("model", {}).get("mixer", "?"),
        "steps": steps_done,
        "planned": cfg.get("train", {}).get("steps"),
        "tokens_M": steps_done * tps / 1e6,
        "val_loss": last_val["loss"] if last_val else None,
        "val_step": last_val["step"] if last_val else None,
        "val_ppl": last_val.get("perplexity") if last_val else None,
        "tokens_per_s": statistics.median(speeds) if speeds else None,
    }


def table(rows: list[dict]) -> str:
    head = ("| run | mixer | steps done / planned | training tokens | final val loss (at step) | val perplexity | "
            "tokens/s (median, shared GPU) |\n|---|---|---|---|---|---|---|")
    lines = [head]
    for r in sorted(rows, key=lambda r: (r["val_loss"] is None, r["val_loss"] or 0.0)):
        vl = f"{r['val_loss']:.4f} ({r['val_step']})" if r["val_loss"] is not None else "–"
        ppl = f"{r['val_ppl']:.2f}" if r["val_ppl"] is not None else "–"
        tps = f"{r['tokens_per_s'] / 1e3:.0f}K" if r["tokens_per_s"] else "–"
        lines.append(f"| {r['name']} | {r['mixer']} | {r['steps']} / {r['planned']} | {r['tokens_M']:.1f}M | {vl} | "
                     f"{ppl} | {tps} |")
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_val, ax_train) = plt.subplots(1, 2, figsize=(12, 4.5))
    models = sorted({run["name"].split("/")[-1] for run in runs})
    colours = {m: f"C{i % 10}" for i, m in enumerate(models)}
    styles = ["-", "--", ":", "-."]
    for run in sorted(runs, key=lambda r: r["name"]):
        tps = tokens_per_step(run["config"]) / 1e6
        look = {"color": colours[run["name"].split("/")[-1]], "ls": styles[run.get("group", 0) % len(styles)]}
        if run["val"]:
            ax_val.plot([r["step"] * tps for r in run["val"]], [r["loss"] for r in run["val"]], marker="o",
                        markersize=3, label=run["name"], **look)
        if run["train"]:
            ax_train.plot([r["step"] * tps for r in run["train"]], [r["loss"] for r in run["train"]], lw=1,
                          label=run["name"], **look)
    for ax, what in ((ax_val, "validation loss (held-out split)"), (ax_train, "training loss")):
        ax.set_xlabel("training tokens (M)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    ax_train.set_ylim(top=min(8.0, ax_train.get_ylim()[1]))
    ax_val.set_ylim(top=min(8.0, ax_val.get_ylim()[1]))
    ax_val.legend(fontsize=8)
    save_figure(fig, title, path)


def save_figure(fig, title: str, path: str) -> None:
    """Title, layout, PNG at 120 dpi, and the figure closed (the report tools' common ending)."""
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs_dirs", nargs="+", metavar="RUNS_DIR")
    p.add_argument("--labels", help="comma-separated names of the RUNS_DIRs (default: their directory names)")
    p.add_argument("--out", help="where table.md and val_loss.png go (default: RUNS_DIR when there is one)")
    p.add_argument("--title", default="Small language-model comparison")
    args = p.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [os.path.basename(os.path.normpath(d)) for d in args.runs_dirs]
    if len(labels) != len(args.runs_dirs):
        print(f"error: --labels names {len(labels)} directories, {len(args.runs_dirs)} were given", file=sys.stderr)
        return 2
    if len(args.runs_dirs) > 1 and not args.out:
        print("error: --out is required with several RUNS_DIRs", file=sys.stderr)
        return 2
    runs = []
    for group, (runs_dir, label) in enumerate(zip(args.runs_dirs, labels)):
        if not os.path.isdir(runs_dir):
            print(f"error: {runs_dir} is not a directory of runs", file=sys.stderr)
            return 2
        found = load_dir(runs_dir)
        if not found:
            print(f"error: no run directory with a metrics.jsonl (or train.py log) under {runs_dir}", file=sys.stderr)
            return 2
        for run in found:
            run["group"] = group
            if len(args.runs_dirs) > 1:
                run["name"] = f"{label}/{run['name']}"
        runs.extend(found)
    out = args.out or args.runs_dirs[0]
    os.makedirs(out, exist_ok=True)
    text = table([summarize(r) for r in runs])
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text)
    plot(runs, os.path.join(out, "val_loss.png"), args.title)
    print(text)
    print(f"wrote {os.path.join(out, 'table.md')}, {os.path.join(out, 'val_loss.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
