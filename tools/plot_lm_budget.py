"""Table and figure of a tools/gpu_lm_budget.sh run: the LR sweep and the long runs with their seed bands.

    python tools/plot_lm_budget.py BUDGET_DIR [BUDGET_DIR ...] --train_tokens N --out DIR [--title TITLE]

BUDGET_DIR is what gpu_lm_budget.sh leaves (sweep/CONFIG_lrLR/, long/CONFIG_sSEED/); several (e.g. one per
device session, each with other models) go into one table and figure. N is the size of the training corpus the
runs read, in tokens, so that the table can say how many epochs each run saw. Writes DIR/budget.md (the sweep:
every LR's final validation loss and the chosen one; the long runs: each seed's final loss, their mean and
spread, tokens and epochs; where gpu_lm_budget.sh's EVAL stage ran, the evaluation suite on the final checkpoints:
held-out loss and bits per byte, loss at 1, 2 and 3.5x the training context) and DIR/budget.png (left: validation
loss against training tokens, the mean of the seeds as a line, their range as a band; middle, with evaluations:
held-out loss by position in the document at 3.5x the context; right: the sweep's final loss against the peak LR).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lm_compare_report import load_dir, load_run, save_figure, summarize, tokens_per_step  # noqa: E402
from lm_pick_lr import pick  # noqa: E402

_SEED = re.compile(r"^(?P<config>.+)_s(?P<seed>\d+)$")


def _seeded(budget_dirs: list[str]):
    """(config, seed, run directory) of every long run (named CONFIG_sSEED) under BUDGET_DIR/long/."""
    for d in budget_dirs:
        path = os.path.join(d, "long")
        for name in sorted(os.listdir(path)) if os.path.isdir(path) else []:
            m = _SEED.match(name)
            if m and os.path.isdir(os.path.join(path, name)):
                yield m["config"], int(m["seed"]), os.path.join(path, name)


def long_runs(budget_dirs: list[str]) -> dict[str, list[dict]]:
    """{config: [run, ...]} of the long runs, seeds in order."""
    models: dict[str, list[dict]] = {}
    for config, seed, path in _seeded(budget_dirs):
        run = load_run(path)
        if run is not None:
            models.setdefault(config, []).append(dict(run, seed=seed))
    return {k: sorted(v, key=lambda r: r["seed"]) for k, v in sorted(models.items())}


def evaluations(budget_dirs: list[str]) -> dict[str, list[dict]]:
    """{config: [perplexity.json of each seed, ...]} of the long runs whose final checkpoint was evaluated."""
    out: dict[str, list[dict]] = {}
    for config, seed, path in _seeded(budget_dirs):
        f = os.path.join(path, "eval", "perplexity.json")
        if os.path.isfile(f):
            with open(f) as fh:
                out.setdefault(config, []).append(dict(json.load(fh), seed=seed))
    return {k: sorted(v, key=lambda e: e["seed"]) for k, v in sorted(out.items())}


def _mean_spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    return f"{mean:.4f} ± {(max(values) - min(values)) / 2:.4f}" if len(values) > 1 else f"{mean:.4f}"


def eval_table(evals: dict[str, list[dict]]) -> str:
    """Per model, mean ± half the seeds' range: held-out loss and bits per byte (whole documents in windows of the
    training context) and the loss of documents read at 1, 2 and 3.5x that context (the extrapolation subset)."""
    mults = sorted({x["multiplier"] for es in evals.values() for e in es
                    for x in e.get("length_extrapolation", {}).get("lengths", [])})
    lines = ["| model | seeds | step | held-out documents | held-out loss | bits per byte | "
             + " | ".join(f"loss at {m:g}x context" for m in mults) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(mults)]
    for config, es in evals.items():
        cells = []
        for m in mults:
            v = [x["nll"] for e in es for x in e.get("length_extrapolation", {}).get("lengths", [])
                 if x["multiplier"] == m]
            cells.append(_mean_spread(v) if v else "–")
        lines.append(f"| {config} | {', '.join(str(e['seed']) for e in es)} | "
                     f"{', '.join(sorted({str(e.get('step')) for e in es}))} | {es[0]['validation']['documents']} | "
                     f"{_mean_spread([e['validation']['loss'] for e in es])} | "
                     f"{_mean_spread([e['validation']['bits_per_byte'] for e in es])} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def sweeps(budget_dirs: list[str]) -> dict[str, dict]:
    choice: dict[str, dict] = {}
    for d in budget_dirs:
        path = os.path.join(d, "sweep")
        if os.path.isdir(path):
            choice.update(pick(load_dir(path)))
    return choice


def _val_at(run: dict, step: int) -> float | None:
    return next((v["loss"] for v in run["val"] if v["step"] == step), None)


def _last_common_step(runs: list[dict]) -> int:
    """The last evaluation step every run reached (0 if one has none): runs cut at different steps compare there."""
    return min((max((v["step"] for v in r["val"]), default=0) for r in runs), default=0)


def long_table(models: dict[str, list[dict]], train_tokens: float) -> str:
    """Per model: its seeds' validation loss at the last step all of them reached, mean and spread, and every
    model's mean at the last step all models reached (runs cut by a time limit end at different steps)."""
    everyone = _last_common_step([r for runs in models.values() for r in runs])
    lines = ["| model | peak LR | seeds | steps done / planned | validation loss per seed at step S | S | mean | "
             f"spread | tokens at S | epochs at S | mean at step {everyone} (all models) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for config, runs in models.items():
        s = [summarize(r) for r in runs]
        step = _last_common_step(runs)
        losses = [_val_at(r, step) for r in runs]
        finals = [v for v in losses if v is not None]
        mean = statistics.fmean(finals) if finals else None
        at_all = [v for r in runs if (v := _val_at(r, everyone)) is not None]
        lrs = sorted({r["config"].get("optim", {}).get("lr") for r in runs} - {None})
        tokens = step * tokens_per_step(runs[0]["config"])
        rows.append((statistics.fmean(at_all) if at_all else float("inf"),
                     f"| {config} | {', '.join(f'{lr:g}' for lr in lrs)} | {', '.join(str(r['seed']) for r in runs)} | "
                     f"{', '.join(str(x['steps']) for x in s)} / {s[0]['planned']} | "
                     f"{', '.join('–' if v is None else f'{v:.4f}' for v in losses)} | {step} | "
                     f"{'–' if mean is None else f'{mean:.4f}'} | "
                     f"{(max(finals) - min(finals)) if len(finals) > 1 else float('nan'):.4f} | "
                     f"{tokens / 1e6:.1f}M | {tokens / train_tokens:.2f} | "
                     f"{f'{statistics.fmean(at_all):.4f}' if at_all else '–'} |"))
    lines += [r for _, r in sorted(rows)]
    return "\n".join(lines) + "\n"


def plot(models: dict[str, list[dict]], choice: dict[str, dict], path: str, title: str,
         evals: dict[str, list[dict]] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    evals = {k: v for k, v in (evals or {}).items() if all("length_extrapolation" in e for e in v)}
    if evals:
        fig, (ax_val, ax_pos, ax_lr) = plt.subplots(1, 3, figsize=(17, 4.5), gridspec_kw={"width_ratios": [3, 2.5, 2]})
    else:
        fig, (ax_val, ax_lr) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    names = sorted(set(models) | set(choice) | set(evals))
    colours = {m: f"C{i % 10}" for i, m in enumerate(names)}
    zoom = ax_val.inset_axes((0.42, 0.38, 0.55, 0.5))
    x_zoom, y_zoom = 0.0, (float("inf"), -float("inf"))
    for config, runs in models.items():
        steps = sorted(set.intersection(*[{v["step"] for v in r["val"]} for r in runs])) if runs else []
        if not steps:
            continue
        tps = tokens_per_step(runs[0]["config"]) / 1e6
        losses = np.array([[{v["step"]: v["loss"] for v in r["val"]}[s] for s in steps] for r in runs])
        x = np.array(steps) * tps
        for ax in (ax_val, zoom):
            ax.plot(x, losses.mean(0), color=colours[config], label=f"{config} ({len(runs)} seeds)")
            if len(runs) > 1:
                ax.fill_between(x, losses.min(0), losses.max(0), color=colours[config], alpha=0.25, lw=0)
        if len(steps) >= 8:  # the zoom: the last 40 % of the tokens, where the models' ranking is decided
            x_zoom = max(x_zoom, x[-1])
            tail = x >= 0.6 * x[-1]
            y_zoom = (min(y_zoom[0], losses[:, tail].min()), max(y_zoom[1], losses[:, tail].max()))
    if x_zoom:
        pad = 0.1 * (y_zoom[1] - y_zoom[0]) + 1e-3
        zoom.set_xlim(0.6 * x_zoom, x_zoom * 1.01)
        zoom.set_ylim(y_zoom[0] - pad, y_zoom[1] + pad)
        zoom.tick_params(labelsize=7)
        zoom.grid(alpha=0.3)
    else:
        zoom.remove()
    ax_val.set_xlabel("training tokens (M)")
    ax_val.set_ylabel("validation loss (mean of seeds, band: their range)")
    if ax_val.get_ylim()[0] < 6.0:  # the first evaluations (loss 7-9) would flatten the part that ranks models
        ax_val.set_ylim(top=min(6.0, ax_val.get_ylim()[1]))
    if evals:
        seq_len = 0
        for config, es in evals.items():
            ext = [e["length_extrapolation"] for e in es]
            width, seq_len = ext[0]["bucket_tokens"], ext[0]["seq_len"]
            x = np.array(ext[0]["bucket_start"]) + width / 2
            nll = np.array([x_["nll_full_context"] for x_ in ext])
            ax_pos.plot(x, nll.mean(0), marker=".", color=colours[config],
                        label=f"{config} ({len(es)} seeds, {ext[0]['documents']} documents)")
            if len(es) > 1:
                ax_pos.fill_between(x, nll.min(0), nll.max(0), color=colours[config], alpha=0.25, lw=0)
        ax_pos.axvline(seq_len, color="grey", ls="--", lw=1)
        ax_pos.set_xlabel(f"position in the document (tokens; dashed: the training context, {seq_len})")
        ax_pos.set_ylabel("held-out loss per token (final checkpoint)")
    for config, c in choice.items():
        lrs = [lr for lr, v in c["losses"].items() if v is not None]
        ax_lr.plot(lrs, [c["losses"][lr] for lr in lrs], marker="o", color=colours[config], label=config)
        if c["lr"] is not None:
            ax_lr.plot([c["lr"]], [c["losses"][c["lr"]]], marker="*", markersize=14, color=colours[config])
    ax_lr.set_xscale("log")
    ticks = sorted({lr for c in choice.values() for lr in c["losses"]})
    if ticks:  # the swept values as the ticks, plainly written
        ax_lr.set_xticks(ticks, [f"{lr:g}" for lr in ticks], rotation=45, fontsize=7)
        ax_lr.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax_lr.set_xlabel("peak learning rate (sweep; ★ chosen)")
    ax_lr.set_ylabel("final validation loss of the sweep run")
    for ax in [a for a in (ax_val, ax_lr, ax_pos if evals else None) if a is not None]:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower left" if ax is ax_val else "best")
    save_figure(fig, title, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("budget_dirs", nargs="+", metavar="BUDGET_DIR")
    p.add_argument("--train_tokens", type=float, required=True, help="tokens in the training corpus the runs read")
    p.add_argument("--out", required=True, help="where budget.md and budget.png go")
    p.add_argument("--title", default="Language-model comparison: LR sweep and long runs")
    args = p.parse_args(argv)
    for d in args.budget_dirs:
        if not (os.path.isdir(os.path.join(d, "sweep")) or os.path.isdir(os.path.join(d, "long"))):
            print(f"error: {d} has neither sweep/ nor long/ (a tools/gpu_lm_budget.sh OUT_DIR)", file=sys.stderr)
            return 2
    if args.train_tokens <= 0:
        print(f"error: --train_tokens must be positive, got {args.train_tokens:g}", file=sys.stderr)
        return 2
    models, choice, evals = long_runs(args.budget_dirs), sweeps(args.budget_dirs), evaluations(args.budget_dirs)
    from lm_pick_lr import table as sweep_table

    text = "## LR sweep\n\n" + sweep_table(choice) + "\n## Long runs\n\n" + long_table(models, args.train_tokens)
    if evals:
        text += "\n## Evaluation of the final checkpoints (mean ± half the seeds' range)\n\n" + eval_table(evals)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "budget.md"), "w") as f:
        f.write(text)
    plot(models, choice, os.path.join(args.out, "budget.png"), args.title, evals)
    print(text)
    print(f"wrote {os.path.join(args.out, 'budget.md')}, {os.path.join(args.out, 'budget.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
