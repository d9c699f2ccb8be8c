"""Plot the H200 delta-rule benchmark (docs/benchmarks/delta_rule_h200.md) from its raw JSON files:
left, fwd+bwd (or, with --metric fwd, forward) time per shape for ours, fla, jax-linear-attention and cuDNN
attention (fla: measured in its own calls, one per file of --fla; a shape none of them measured shows the
guide's anchor, hatched); right, each of our kernels at 8·4096 against its roofline from
pallas_kernels/delta_rule/flops_gpu.py — or, for a bench JSON without the per-kernel breakdown, the other time
(forward beside forward + backward).

    python tools/plot_delta_rule_h200.py [--metric fwd_bwd|fwd] [--out docs/images/delta_rule_h200.png]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mixerlab.pallas_kernels.delta_rule import flops_gpu  # noqa: E402

RAW = "docs/benchmarks/raw"
FLA_ANCHORS = {"fwd_bwd": {"8x4096": 11.56, "2x16384": 12.68, "1x32768": 14.44},
               "fwd": {"8x4096": 1.88, "2x16384": 2.27, "1x32768": 2.86}}
# fla ms, earlier H200 runs (delta_rule_h200.md)


def _median(section, key):
    """The median ms of ``section[key]`` ([median, ...] in the bench JSON), or None when it was not measured."""
    value = section.get(key) if isinstance(section, dict) else None
    return value[0] if isinstance(value, list) and value and value[0] is not None else None


def _times_panel(ax, timings, fla_run, shapes, metric, ours_key, same_process):
    """Bars of ``metric`` per shape: ours, fla (its own file or the anchor, hatched), jla, cuDNN attention."""
    series = [("ours (Pallas→Triton)", "tab:blue", lambda s: _median(timings[s]["ours"], ours_key), None),
              ("fla-core 0.6.0 chunk_gdn2", "tab:orange",
               lambda s: fla_run.get(s, {}).get("fla", {}).get(metric, [FLA_ANCHORS[metric][s]])[0],
               lambda s: s not in fla_run),
              ("jax-linear-attention gdn2", "tab:green", lambda s: _median(timings[s].get("jla", {}), metric),
               None),
              ("cuDNN flash attention", "tab:gray", lambda s: _median(timings[s].get("cudnn", {}), metric), None)]
    top = max((v for _, _, value, _ in series for s in shapes if (v := value(s)) is not None), default=1.0)
    width = 0.2
    for i, (label, color, value, is_anchor) in enumerate(series):
        for j, s in enumerate(shapes):
            v = value(s)
            if v is None:  # not measured in this file (a skipped section)
                continue
            hatch = "//" if is_anchor and is_anchor(s) else None
            ax.bar(j + (i - 1.5) * width, v, width, color=color, hatch=hatch, edgecolor="white",
                   label=label if j == 0 else None)
            ax.text(j + (i - 1.5) * width, v + 0.025 * top, f"{v:.2f}" if metric == "fwd" else f"{v:.1f}",
                    ha="center", fontsize=7)
    ax.set_xticks(range(len(shapes)), [s.replace("x", "·") + "·16·128" for s in shapes])
    ax.set_ylabel({"fwd_bwd": "fwd+bwd", "fwd": "forward"}[metric] + ", median ms (bf16)")
    anchored = any(s not in fla_run for s in shapes)
    ax.set_title("H200, B·T·H·D" + (" (hatched: anchor, not re-measured)" if anchored else "")
                 + ("\nfla and jla in the same process" if same_process else "\nfla timed in its own device calls"))
    ax.legend(fontsize=8)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", default=f"{RAW}/delta_rule_h200_2026-11-30.json")
    ap.add_argument("--fla", default=f"{RAW}/delta_rule_h200_fla_2026-11-30.json,"
                    f"{RAW}/delta_rule_h200_fla_16k32k_2026-11-30.json", help="comma list of fla-phase JSON files")
    ap.add_argument("--out", default="docs/images/delta_rule_h200.png")
    ap.add_argument("--metric", default="fwd_bwd", choices=("fwd_bwd", "fwd"), help="left panel: which time")
    a = ap.parse_args()
    metric, ours_key = a.metric, {"fwd_bwd": "core_fwd_bwd", "fwd": "core_fwd"}[a.metric]
    with open(a.ours) as f:
        timings = json.load(f)["timings"]
    fla_run = {}
    for path in a.fla.split(","):
        with open(path) as f:
            fla_run.update(json.load(f)["timings"])
    shapes = [s for s in timings if _median(timings[s].get("ours", {}), ours_key) is not None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [1.1, 1]})

    same = a.fla == a.ours  # fla timed by the same bench call as ours
    _times_panel(left, timings, fla_run, shapes, metric, ours_key, same)
    if "breakdown" not in timings["8x4096"]["ours"]:  # no per-kernel times: the other metric on the right
        other = "fwd" if metric == "fwd_bwd" else "fwd_bwd"
        _times_panel(right, timings, fla_run, shapes, other, {"fwd_bwd": "core_fwd_bwd", "fwd": "core_fwd"}[other],
                     same)
        fig.tight_layout()
        fig.savefig(a.out, dpi=120)
        print("wrote", a.out)
        return
    measured = {k: v[0] for k, v in timings["8x4096"]["ours"]["breakdown"].items()}
    roof = flops_gpu.roofline_ms(flops_gpu.kernel_counts(), 8 * 4096 * 16, 64)
    names = [n for n in roof if n in measured]
    ys = range(len(names))
    right.barh([y + 0.2 for y in ys], [measured[n] for n in names], 0.4, color="tab:blue", label="measured")
    right.barh([y - 0.2 for y in ys], [max(roof[n]) for n in names], 0.4, color="lightgray",
               label="roofline (max of FLOP and byte time)")
    right.set_yticks(list(ys), names)
    right.invert_yaxis()
    right.set_xlabel("ms at 8·4096·16·128")
    right.set_title("our kernels vs their own roofline")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
