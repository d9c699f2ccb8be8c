"""Where a profiled XLA fusion comes from: its shape, its fused ops and the JAX source lines they were traced at.

A profile (tools/summarize_profile.py) names XLA's fusions (``input_convert_reduce_fusion_40``); this tool finds
them in an XLA dump of the same program and prints the fusion's result shape and the ``op_name`` / source
metadata of the ops fused into it, so a slow fusion can be traced to a line of the model.

    XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text" python train.py ...   # any run of the program
    python tools/hlo_origin.py /tmp/dump input_convert_reduce_fusion_40 loop_add_fusion_7 [--module jit__train_step]
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys

_META = re.compile(r'op_name="([^"]*)"(?:.*?source_file="([^"]*)")?(?:.*?source_line=(\d+))?'
                   r'(?:.*?stack_frame_id=(\d+))?')


def frame_table(text: str) -> dict[int, str]:
    """{stack_frame_id: "file:line (function)"} from the module's FileNames / FunctionNames / FileLocations /
    StackFrames tables (newer XLA writes these instead of source_file/source_line on each op)."""
    tables, current = collections.defaultdict(dict), None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = line
            continue
        row = re.match(r"^(\d+) (.*)$", line)
        if current is None or row is None:
            current = None if not line.strip() or line.startswith(("HloModule", "ENTRY", "%")) else current
            continue
        tables[current][int(row.group(1))] = row.group(2).strip('"')
    frames = {}
    for fid, body in tables["StackFrames"].items():
        loc = re.search(r"file_location_id=(\d+)", body)
        where = tables["FileLocations"].get(int(loc.group(1)), "") if loc else ""
        f = re.search(r"file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", where)
        if f:
            name = os.path.relpath(tables["FileNames"].get(int(f.group(1)), "?"))
            frames[fid] = f"{name}:{f.group(3)} ({tables['FunctionNames'].get(int(f.group(2)), '?')})"
    return frames


def newest_module(dump_dir: str, module: str) -> str:
    files = glob.glob(os.path.join(dump_dir, f"*{module}*after_optimizations.txt"))
    if not files:
        raise SystemExit(f"no '*{module}*after_optimizations.txt' in {dump_dir!r}: dump with "
                         "XLA_FLAGS='--xla_dump_to=DIR --xla_dump_hlo_as_text'")
    return max(files, key=os.path.getsize)  # the train step is the largest module of that name


def computations(text: str) -> dict[str, list[str]]:
    """{computation name: its lines} of an HLO module's text."""
    comps, name = {}, None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            name = head.group(1)
            comps[name] = []
        elif name is not None:
            comps[name].append(line)
    return comps


def describe(fusion: str, text: str, comps: dict[str, list[str]], top: int = 8, frames=None) -> str:
    dotted = re.sub(r"_(\d+)$", r".\1", fusion)  # profiles write 'gemm_fusion_dot_12' for HLO's 'gemm_fusion_dot.12'
    pat = re.compile(rf"%({re.escape(fusion)}|{re.escape(dotted)}) = (\S+ )?(.*?) fusion\(.*calls=%?([\w.\-]+)")
    match = next((m for m in map(pat.search, text.splitlines()) if m), None)
    if match is None:
        return f"{fusion}: not found"
    shape, called = match.group(3), match.group(4)
    origins = collections.Counter()
    ops = collections.Counter()
    for line in comps.get(called, []):
        op = re.search(r"= \S+ ([a-z\-]+)\(", line)
        if op:
            ops[op.group(1)] += 1
        meta = _META.search(line)
        if meta:
            where = f"{meta.group(2)}:{meta.group(3)}" if meta.group(2) else (frames or {}).get(
                int(meta.group(4) or 0), "?")
            origins[f"{meta.group(1).split('/')[-1]}  @ {where}"] += 1
    lines = [f"{fusion}  ->  {shape}", "  ops: " + ", ".join(f"{k}×{v}" for k, v in ops.most_common(12))]
    lines += [f"  {n:3d}  {o}" for o, n in origins.most_common(top)]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dump_dir")
    p.add_argument("fusions", nargs="+")
    p.add_argument("--module", default="jit__train_step")
    p.add_argument("--top", type=int, default=8)
    a = p.parse_args(argv)
    text = open(newest_module(a.dump_dir, a.module)).read()
    comps, frames = computations(text), frame_table(text)
    for fusion in a.fusions:
        print(describe(fusion, text, comps, a.top, frames))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
