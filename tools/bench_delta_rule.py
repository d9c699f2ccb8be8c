"""CPU benchmark of the delta_rule op: "xla" (chunkwise) vs "reference" (token scan), forward and
forward+backward, float32, GDN-2-style inputs. Prints a markdown table and writes it, with the command,
date, JAX version and machine, to docs/benchmarks/delta_rule_cpu.md.

    JAX_PLATFORMS=cpu .venv/bin/python tools/bench_delta_rule.py
    JAX_PLATFORMS=cpu .venv/bin/python tools/bench_delta_rule.py --lengths 1024 --runs 3 --out /dev/null
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from mixerlab.pallas_kernels import delta_rule  # noqa: E402


def make_inputs(batch, length, heads, dim, seed=0):
    """q, v ~ N(0,1); k L2-normalised; λ = log σ(N(0,1)) per channel; k̂ = b⊙k with b ~ U(0,1)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    shape = (batch, length, heads, dim)
    q = jax.random.normal(keys[0], shape, jnp.float32)
    k = jax.random.normal(keys[1], shape, jnp.float32)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(keys[2], shape, jnp.float32)
    log_decay = jax.nn.log_sigmoid(jax.random.normal(keys[3], shape, jnp.float32))
    erase = jax.random.uniform(keys[4], shape, jnp.float32) * k
    return dict(q=q, k=k, v=v, erase_key=erase, log_decay=log_decay)


def build(implementation, mode):
    def forward(inputs):
        return delta_rule(**inputs, implementation=implementation)

    def loss(inputs):
        return jnp.sum(delta_rule(**inputs, implementation=implementation)[0])

    return jax.jit(forward if mode == "fwd" else jax.grad(loss))


def measure(fn, inputs, runs):
    start = time.perf_counter()
    jax.block_until_ready(fn(inputs))  # compile + first run
    first = time.perf_counter() - start
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(inputs))
        times.append(time.perf_counter() - start)
    return first, statistics.median(times), min(times)


def git_commit():
    """Short commit of the working tree (read-only), '+dirty' when tracked files changed."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "none (no commit yet)"


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--slow-runs", type=int, default=3,
                        help="runs for the reference forward+backward at T >= 4096 (seconds per run)")
    parser.add_argument("--out", default="docs/benchmarks/delta_rule_cpu.md")
    args = parser.parse_args(argv)

    load_before = os.getloadavg()
    rows = []
    for length in args.lengths:
        inputs = make_inputs(args.batch, length, args.heads, args.dim)
        for mode in ("fwd", "fwd+bwd"):
            for implementation in ("xla", "reference"):
                runs = args.slow_runs if (implementation == "reference" and mode == "fwd+bwd" and length >= 4096) \
                    else args.runs
                first, median, best = measure(build(implementation, mode), inputs, runs)
                rows.append((length, mode, implementation, runs, median * 1e3, best * 1e3, first))
                print(f"T={length} {mode:8s} {implementation:9s} median {median * 1e3:9.1f} ms  "
                      f"min {best * 1e3:9.1f} ms  (first call {first:.1f} s, {runs} runs)", flush=True)
    load_after = os.getloadavg()

    table = ["| B·T·H·D | pass | implementation | runs | median ms | min ms | first call s (incl. compile) "
             "| xla speed-up (median) |",
             "|---|---|---|---|---|---|---|---|"]
    medians = {(r[0], r[1], r[2]): r[4] for r in rows}
    for length, mode, implementation, runs, median, best, first in rows:
        speedup = medians[(length, mode, "reference")] / medians[(length, mode, "xla")]
        table.append(f"| {args.batch}·{length}·{args.heads}·{args.dim} | {mode} | {implementation} | {runs} | "
                     f"{median:.1f} | {best:.1f} | {first:.1f} | "
                     f"{f'{speedup:.2f}×' if implementation == 'xla' else ''} |")
    table_text = "\n".join(table)
    print("\n" + table_text)

    command = "JAX_PLATFORMS=cpu .venv/bin/python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *sys.argv[1:]])
    report = f"""# delta_rule on CPU: "xla" (chunkwise) vs "reference" (token scan)

- command: `{command}`
- commit: {git_commit()}
- date: {datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
- jax {jax.__version__}, backend {jax.default_backend()}, Python {platform.python_version()}
- machine: `nproc` = {os.cpu_count()}, {cpu_model()}
- load average (1, 5, 15 min) before: {", ".join(f"{x:.2f}" for x in load_before)}; after: \
{", ".join(f"{x:.2f}" for x in load_after)}. Other processes share this CPU, so absolute times are noisy
  (this table is from one run); the median and the min are both given.
- inputs: float32, GDN-2 style (q, v ~ N(0,1); k L2-normalised; channel-wise λ = log σ(N(0,1)); k̂ = b⊙k,
  b ~ U(0,1)); no initial state, no segments. Default tiling (chunk 64, leaf 8 on CPU).
- fwd = `jax.jit(delta_rule)`; fwd+bwd = `jax.jit(jax.grad(lambda x: delta_rule(**x)[0].sum()))` w.r.t. all
  five inputs. Warm timings (one untimed call first), `jax.block_until_ready`. The reference fwd+bwd at
  T ≥ 4096 uses {args.slow_runs} runs (each takes seconds).

{table_text}

Reading: on CPU the token scan's forward is cheaper than the chunkwise form, which spends ~3× the FLOPs of
the recurrence in small batched matmuls (it is shaped for MXU / tensor cores); with the backward, the
custom VJP (recompute from saved chunk-start states) beats autodiff through the scan by ~2.7×. "First call"
is dominated by XLA:CPU compilation.
"""
    if args.out and args.out != "/dev/null":
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(report)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
