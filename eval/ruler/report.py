"""Aggregates of scored RULER records, and their outputs: markdown tables, JSON, heatmap PNG.

Every task-level number is RULER's task score (``scoring.CORPUS_METRICS[metric]`` over the group's samples:
percent, 2 decimals); numbers over several tasks are the plain mean of the task scores (RULER's "Avg.").
JSON keys for lengths and depths are strings: ``"1024"``, ``"0.25"``.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable, Sequence

from mixerlab.eval import report
from mixerlab.eval.ruler import scoring

DEPTH_WARNING = 0.1  # a (task, length) whose needles land further than this from the asked depth is flagged


def depth_key(depth: float) -> str:
    return f"{depth:g}"


def _ordered(values: Iterable) -> list:
    out = []
    for v in values:
        if v not in out:
            out.append(v)
    return out


def _task_score(records: Sequence[dict]) -> float:
    metric = records[0]["metric"]
    return scoring.CORPUS_METRICS[metric]([r["prediction"] for r in records], [r["answers"] for r in records])


def _mean(values: Sequence[float]) -> float:
    return round(sum(values) / len(values), 2)


def aggregate(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    if not records:
        raise ValueError("records: nothing to aggregate (no samples were scored)")
    task_names = _ordered(r["task"] for r in records)
    lengths = sorted(_ordered(r["length"] for r in records))
    depths = sorted(_ordered(r["depth"] for r in records))
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["task"], r["length"], r["depth"]), []).append(r)

    def pick(task=None, length=None, depth=None):
        return [r for (t, l, d), rs in groups.items() for r in rs
                if (task is None or t == task) and (length is None or l == length) and (depth is None or d == depth)]

    by_task = {t: _task_score(pick(t)) for t in task_names}
    by_task_length = {t: {str(l): _task_score(pick(t, l)) for l in lengths if pick(t, l)} for t in task_names}
    by_task_length_depth = {t: {str(l): {depth_key(d): _task_score(pick(t, l, d)) for d in depths if pick(t, l, d)}
                                for l in lengths if pick(t, l)} for t in task_names}
    avg_length = {str(l): _mean([by_task_length[t][str(l)] for t in task_names if str(l) in by_task_length[t]])
                  for l in lengths}
    cell = lambda t, l, d: by_task_length_depth[t].get(str(l), {}).get(depth_key(d))
    avg_length_depth = {str(l): {depth_key(d): _mean([cell(t, l, d) for t in task_names if cell(t, l, d) is not None])
                                 for d in depths if any(cell(t, l, d) is not None for t in task_names)}
                        for l in lengths}
    depth_error = {t: {str(l): round(max(abs(nd - r["depth"]) for r in pick(t, l) for nd in r["needle_depths"]), 4)
                       for l in lengths if pick(t, l)} for t in task_names}
    return dict(tasks=task_names, lengths=lengths, depths=depths, num_records=len(records),
                average=_mean(list(by_task.values())), by_task=by_task, by_task_length=by_task_length,
                by_task_length_depth=by_task_length_depth, average_by_length=avg_length,
                average_by_length_depth=avg_length_depth, max_depth_error=depth_error)


# ------------------------------------------------------------------------------------------------ tables
def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _fmt(x: float) -> str:
    return f"{x:.1f}"


def task_length_table(summary: dict) -> str:
    lengths = [str(l) for l in summary["lengths"]]
    rows = [[t] + [_fmt(summary["by_task_length"][t][l]) if l in summary["by_task_length"][t] else "-"
                   for l in lengths] + [_fmt(summary["by_task"][t])] for t in summary["tasks"]]
    rows.append(["**average**"] + [_fmt(summary["average_by_length"][l]) for l in lengths]
                + [_fmt(summary["average"])])
    return _table(["task"] + lengths + ["all"], rows)


def length_depth_table(summary: dict, task: str | None = None) -> str:
    cells = summary["average_by_length_depth"] if task is None else summary["by_task_length_depth"][task]
    depths = [depth_key(d) for d in summary["depths"]]
    rows = [[l] + [_fmt(cells[l][d]) if d in cells.get(l, {}) else "-" for d in depths]
            for l in (str(x) for x in summary["lengths"]) if l in cells]
    return _table(["length \\ depth"] + depths, rows)


def depth_warnings(summary: dict) -> list[str]:
    return [f"{t} at length {l}: needles up to {err:.2f} from the asked depth (haystack too short to place them)"
            for t, per in summary["max_depth_error"].items() for l, err in per.items() if err > DEPTH_WARNING]


def markdown(summary: dict, title: str = "RULER") -> str:
    parts = [f"# {title}", "", "Scores: RULER string_match_all, percent (mean over depths and samples).", "",
             "## Task x length", "", task_length_table(summary), "",
             "## Length x depth (average over tasks)", "", length_depth_table(summary), ""]
    for t in summary["tasks"]:
        parts += [f"### {t}: length x depth", "", length_depth_table(summary, t), ""]
    warnings = depth_warnings(summary)
    if warnings:
        parts += ["## Depth placement warnings", ""] + [f"- {w}" for w in warnings] + [""]
    return "\n".join(parts)


# ------------------------------------------------------------------------------------------------ files
def plot_heatmap(summary: dict, path: str) -> None:
    """One panel per task (and the average): rows = lengths, columns = depths, colour = score 0..100."""
    import numpy as np

    plt = report.pyplot()
    lengths = [str(l) for l in summary["lengths"]]
    depths = [depth_key(d) for d in summary["depths"]]
    panels = [(t, summary["by_task_length_depth"][t]) for t in summary["tasks"]]
    panels.append(("average", summary["average_by_length_depth"]))
    cols = min(4, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.0 * cols + 1.2, (0.4 * len(lengths) + 1.3) * rows),
                             squeeze=False, layout="constrained")
    image = None
    for idx, (ax, (name, cells)) in enumerate(zip(axes.flat, panels)):
        grid = np.array([[cells.get(l, {}).get(d, np.nan) for d in depths] for l in lengths], dtype=float)
        image = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        ax.set_title(name, fontsize=10)
        ax.set_xticks(range(len(depths)), depths, fontsize=8)
        ax.set_yticks(range(len(lengths)), lengths, fontsize=8)
        if idx % cols == 0:
            ax.set_ylabel("length (tokens)", fontsize=8)
        if idx + cols >= len(panels):
            ax.set_xlabel("needle depth", fontsize=8)
        for i in range(len(lengths)):
            for j in range(len(depths)):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.colorbar(image, ax=axes, shrink=0.8, label="score (%)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(results: dict[str, Any], out_dir: str) -> dict[str, str]:
    """results.json (config + summary), samples.jsonl (one record per sample), summary.md, heatmap.png."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, name)
             for name in ("results.json", "samples.jsonl", "summary.md", "heatmap.png")}
    with open(paths["results.json"], "w") as f:
        json.dump({k: v for k, v in results.items() if k != "records"}, f, indent=2)
        f.write("\n")
    with open(paths["samples.jsonl"], "w") as f:
        for r in results["records"]:
            f.write(json.dumps(r) + "\n")
    with open(paths["summary.md"], "w") as f:
        f.write(markdown(results["summary"], title=results.get("config", {}).get("title", "RULER")))
    plot_heatmap(results["summary"], paths["heatmap.png"])
    return paths
