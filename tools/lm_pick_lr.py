"""Each model's peak learning rate from a short sweep (tools/gpu_lm_budget.sh runs it before the long runs).

    python tools/lm_pick_lr.py SWEEP_DIR [--out FILE] [--extend]

SWEEP_DIR holds one run per (model, LR), named CONFIG_lrVALUE (e.g. gdn2_lr1.5e-3), as tools/gpu_lm_compare.sh
writes them. For every CONFIG the LR whose run ends with the lowest validation loss wins; only runs that finished
their planned steps and were evaluated at the last one compete (a run cut short, or one that diverged to a
non-finite loss, does not win). A winner at either end of its grid is marked: the optimum may lie outside it.
Prints one line per model, `CONFIG LR` (what the long runs read), and writes the table (every LR's loss) to
SWEEP_DIR/lr_choice.md or --out. With --extend it prints instead, for every model whose winner is at an end of
its grid, `CONFIG NEXT_LR`: one step further out, by the ratio of the two LRs at that end (nothing when every
optimum is inside its grid), which tools/gpu_lm_budget.sh runs before it picks again.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lm_compare_report import load_dir, summarize  # noqa: E402

_NAME = re.compile(r"^(?P<config>.+)_lr(?P<lr>[0-9.]+(?:e-?[0-9]+)?)$")


def pick(runs: list[dict]) -> dict[str, dict]:
    """{config: {"lr": best LR or None, "edge": bool, "losses": {lr: final val loss or None}}}."""
    grid: dict[str, dict[float, float | None]] = {}
    for run in runs:
        m = _NAME.match(run["name"])
        if not m:
            continue
        s = summarize(run)
        done = s["planned"] and s["steps"] >= s["planned"] and s["val_step"] == s["planned"]
        loss = s["val_loss"] if done and s["val_loss"] is not None and math.isfinite(s["val_loss"]) else None
        grid.setdefault(m["config"], {})[float(m["lr"])] = loss
    choice = {}
    for config, losses in sorted(grid.items()):
        finished = {lr: v for lr, v in losses.items() if v is not None}
        best = min(finished, key=lambda lr: (finished[lr], lr)) if finished else None
        lrs = sorted(losses)
        choice[config] = {"lr": best, "edge": best is not None and len(lrs) > 1 and best in (lrs[0], lrs[-1]),
                          "losses": dict(sorted(losses.items()))}
    return choice


def beyond_edges(choice: dict[str, dict]) -> dict[str, float]:
    """{config: the next LR to try} for the winners at an end of their grid: the top LR × (top / the one below),
    the bottom LR ÷ (the one above / bottom)."""
    out = {}
    for config, c in choice.items():
        lrs = sorted(c["losses"])
        if not c["edge"]:
            continue
        if c["lr"] == lrs[-1]:
            out[config] = lrs[-1] * lrs[-1] / lrs[-2]
        else:
            out[config] = lrs[0] * lrs[0] / lrs[1]
    return out


def table(choice: dict[str, dict]) -> str:
    lines = ["| model | peak LR → final validation loss (– : not finished) | chosen |", "|---|---|---|"]
    for config, c in choice.items():
        cells = ", ".join(f"{lr:g} → {'–' if v is None else f'{v:.4f}'}" for lr, v in c["losses"].items())
        chosen = "none finished" if c["lr"] is None else f"{c['lr']:g}" + (" (grid edge)" if c["edge"] else "")
        lines.append(f"| {config} | {cells} | {chosen} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sweep_dir")
    p.add_argument("--out", help="the table's file (default SWEEP_DIR/lr_choice.md)")
    p.add_argument("--extend", action="store_true",
                   help="print CONFIG NEXT_LR for each winner at an end of its grid instead of the choice")
    args = p.parse_args(argv)
    if not os.path.isdir(args.sweep_dir):
        print(f"error: {args.sweep_dir} is not a directory of runs", file=sys.stderr)
        return 2
    choice = pick(load_dir(args.sweep_dir))
    if not choice:
        print(f"error: no run named CONFIG_lrVALUE with metrics under {args.sweep_dir}", file=sys.stderr)
        return 2
    text = table(choice)
    with open(args.out or os.path.join(args.sweep_dir, "lr_choice.md"), "w") as f:
        f.write(text)
    print(text, file=sys.stderr)
    if args.extend:
        for config, lr in beyond_edges(choice).items():
            print(f"{config} {lr:.3g}")
        return 0
    missing = [config for config, c in choice.items() if c["lr"] is None]
    for config, c in choice.items():
        if c["lr"] is not None:
            print(f"{config} {c['lr']:g}")
    if missing:
        print(f"error: no finished sweep run for {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
