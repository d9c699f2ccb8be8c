"""Summarise a jax.profiler trace into a table: top ops by time, time in our kernels, matmul vs the rest.

    python tools/summarize_profile.py runs/base/profile [--top 20]     # or gs://bucket/runs/base/profile

Reads the newest ``*.trace.json.gz`` under the directory (written by ``profile.start_step`` in a config).
Python-frame events (names starting with ``$``) are left out; what remains is the device/runtime work.
Classes: ``kernel`` = our Pallas kernels (names with delta_rule / pallas / mosaic / triton);
``matmul`` = dot / gemm / matmul / convolution / cublas / cutlass ops; ``other`` = fusions, copies, ...
The TPU MXU utilisation is not in this file: open the trace in TensorBoard's profile plugin (xprof overview).
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mixerlab.training import storage  # noqa: E402

KERNEL_WORDS = ("delta_rule", "pallas", "mosaic", "triton")
MATMUL_WORDS = ("dot", "gemm", "matmul", "convolution", "cublas", "cutlass", "einsum")


def classify(name: str) -> str:
    low = name.lower()
    if any(w in low for w in KERNEL_WORDS):
        return "kernel"
    if any(w in low for w in MATMUL_WORDS):
        return "matmul"
    return "other"


def newest_trace(path: str) -> str:
    """The trace file itself, or the newest trace under a directory (a local path or a gs:// / s3:// URL: trace
    folders are named by their start time, so the newest is the greatest path)."""
    if storage.isfile(path, "profile path"):
        return path
    files = storage.glob(storage.join(path, "**", "*.trace.json.gz"), "profile path")
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {path!r} (set profile.start_step in the config)")
    if storage.is_url(path):
        return max(files)
    return max(files, key=os.path.getmtime)


def summarize(trace_path: str) -> dict:
    with storage.open_file(trace_path, "rb", "profile path") as raw, gzip.open(raw) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: e.get("args", {}).get("name", str(e["pid"]))
             for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    by_op = collections.Counter()
    by_class = collections.Counter()
    count = collections.Counter()
    for e in events:
        if e.get("ph") != "X" or str(e.get("name", "")).startswith("$"):
            continue
        key = (names.get(e["pid"], str(e["pid"])), e["name"])
        by_op[key] += float(e.get("dur", 0.0))
        count[key] += 1
        by_class[(key[0], classify(e["name"]))] += float(e.get("dur", 0.0))
    return {"ops": by_op, "count": count, "classes": by_class}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="a profile directory (or one .trace.json.gz file)")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args(argv)
    trace = newest_trace(args.path)
    s = summarize(trace)
    print(f"trace: {trace}")
    devices = sorted({d for d, _ in s["classes"]})
    for device in devices:
        total = sum(v for (d, _), v in s["classes"].items() if d == device)
        if total <= 0:
            continue
        print(f"\n{device}: {total / 1e3:.2f} ms of non-Python events")
        print(" | ".join(f"{c} {s['classes'][(device, c)] / total:6.1%}" for c in ("kernel", "matmul", "other")))
        print(f"{'ms':>10} {'share':>7} {'calls':>6}  op")
        ops = [(v, op) for (d, op), v in s["ops"].items() if d == device]
        for v, op in sorted(ops, reverse=True)[: args.top]:
            print(f"{v / 1e3:10.3f} {v / total:7.1%} {s['count'][(device, op)]:6d}  {op[:100]}")
    print("\nTPU MXU utilisation: TensorBoard > Profile > overview page (xprof); it is not in the trace JSON.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
