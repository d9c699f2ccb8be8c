#!/usr/bin/env python3
"""Peak device memory of a prefill: the full parallel forward (every position's logits, as a plain forward
pass computes them) against the chunked prefill (``models.decoder.prefill``: the cache built chunk by chunk,
only the last token's logits) — the Interdomain Attention paper's Table 21 (Appendix F.2), for any config.

    python3 tools/bench_prefill_memory.py --configs configs/paper/ia_interdomain_1p3b.yaml --batch 8 \\
        --lengths 4096,16384 --chunk 2048 --out $OUT/prefill_ia.json
    python3 tools/bench_prefill_memory.py --configs configs/paper/ia_softmax_1p3b.yaml --modes full --batch 8 \\
        --lengths 4096,16384 --out $OUT/prefill_softmax.json
    JAX_PLATFORMS=cpu python tools/bench_prefill_memory.py --smoke --out /tmp/prefill.json   # tiny, checks the script

Random weights, ``model.dtype`` from the config (bf16 for the paper configs), random tokens. Each (config, mode)
runs in a process of its own, because a device's peak-memory counter cannot be reset: the lengths run in
ascending order inside it, and the peak after each length is the largest footprint up to that length (the
footprint grows with the length, so it is that length's). A length that runs out of memory is recorded as
"OOM" and ends that process's lengths. Off the GPU/TPU (``--smoke``) the backend reports no peak, and the
table shows the time only. Prints a Markdown table; ``--out`` writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("full", "chunked")
SMOKE_OVERRIDES = ["model.num_layers=2", "model.d_model=64", "model.num_heads=2", "model.ffn_dim=96",
                   "model.vocab_size=97"]


def _peak_gib():
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2 ** 30


def child(config: str, mode: str, batch: int, lengths: list[int], chunk: int, overrides: list[str]) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from mixerlab.models.decoder import build_model, prefill
    from mixerlab.training import config as config_lib

    cfg = config_lib.load_config(config, overrides)
    vocab = cfg.model.vocab_size or 32000
    model = build_model(cfg, vocab)
    forward = nnx.jit(lambda m, x: m(x))
    rows = []
    for t in lengths:
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, vocab, (batch, t)), jnp.int32)
        row = {"config": os.path.basename(config), "mixer": cfg.model.mixer, "mode": mode, "batch": batch, "T": t,
               "chunk": chunk if mode == "chunked" else None}
        try:
            start = time.perf_counter()
            out = forward(model, tokens) if mode == "full" else prefill(model, tokens, chunk=chunk)
            jax.block_until_ready(out)
            row["seconds_first_call"] = time.perf_counter() - start  # compile included
            row["peak_gib"] = _peak_gib()
            del out
        except Exception as exc:  # noqa: BLE001  (out of memory is a result here)
            text = f"{type(exc).__name__}: {exc}"
            oom = "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
            row["error"] = "OOM" if oom else text[:300]
            row["message"] = text[:600]  # for an OOM: the allocation that failed
        rows.append(row)
        print(json.dumps(row), flush=True)
        if "error" in row:
            break
    return rows


def run_child(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """One (config, mode) process. SIGTERM on this process (``timeout`` around the benchmark) becomes SystemExit,
    on which ``subprocess.run`` kills the child: a cut benchmark leaves nothing holding the device."""
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="configs/paper/ia_interdomain_1p3b.yaml,configs/paper/ia_softmax_1p3b.yaml",
                   help="comma-separated config paths")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lengths", default="4096,8192,16384")
    p.add_argument("--chunk", type=int, default=2048, help="chunk of the chunked prefill (the IA paper: 2048)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per (config, mode) process")
    p.add_argument("--smoke", action="store_true", help="tiny models and lengths (CPU)")
    p.add_argument("--out", default="")
    p.add_argument("--child", nargs=2, metavar=("CONFIG", "MODE"), help=argparse.SUPPRESS)
    p.add_argument("--set", action="append", default=[], help="section.key=value for every config (repeatable)")
    a = p.parse_args(argv)
    modes = a.modes.split(",")
    if not set(modes) <= set(MODES):
        p.error(f"--modes: unknown {sorted(set(modes) - set(MODES))}; valid: {list(MODES)}")
    try:
        lengths = sorted(int(x) for x in a.lengths.split(","))
    except ValueError:
        p.error(f"--lengths must be comma-separated integers, got {a.lengths!r}")
    overrides = list(a.set) + (SMOKE_OVERRIDES if a.smoke else [])
    if a.smoke:
        lengths, a.batch, a.chunk = [16, 40], 2, 16
    if a.child:
        child(a.child[0], a.child[1], a.batch, lengths, a.chunk, overrides)
        return 0
    rows = []
    for config in filter(None, a.configs.split(",")):
        for mode in modes:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", config, mode, "--batch", str(a.batch),
                   "--lengths", ",".join(map(str, lengths)), "--chunk", str(a.chunk)]
            cmd += [x for kv in overrides for x in ("--set", kv)]
            try:
                done = run_child(cmd, a.timeout)
                lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
                if done.returncode and not lines:
                    lines = [{"config": os.path.basename(config), "mode": mode, "error": done.stderr[-300:]}]
            except subprocess.TimeoutExpired:
                lines = [{"config": os.path.basename(config), "mode": mode, "error": f"timeout after {a.timeout} s"}]
            for row in lines:
                print(json.dumps(row), flush=True)
            rows += lines
    print("\n| config | mode | batch | T | peak GiB | first call s (compile included) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        peak = r.get("error") or (f"{r['peak_gib']:.2f}" if r.get("peak_gib") is not None else "n/a")
        secs = f"{r['seconds_first_call']:.1f}" if "seconds_first_call" in r else "–"
        print(f"| {r['config']} | {r['mode']}{' ' + str(r['chunk']) if r.get('chunk') else ''} | "
              f"{r.get('batch', '–')} | {r.get('T', '–')} | {peak} | {secs} |")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
