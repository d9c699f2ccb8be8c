#!/usr/bin/env python3
"""Forward latency against the sequence length, one sequence at a time: the VLA paper's Figure 3 (VLA's
sequential form, its kernel, linear attention and softmax attention against T, log-log), with our other ops
beside them. One process, bf16 inputs, batch 1 (``--batch``), H 12, d 64 (the 125M shape), median of ``--reps``
warm runs after a compile + warm-up call. ``--grad`` times forward+backward instead (``jax.grad`` of a weighted
output sum w.r.t. q, k and v), as a training step runs the op.

    python3 tools/bench_latency_vs_length.py --out $OUT/latency.json --png $OUT/latency.png
    python3 tools/bench_latency_vs_length.py --grad --lengths 4096,16384,32768,65536 \
        --ops vla/pallas_triton,interdomain/toeplitz,delta_rule,attention --out $OUT/train_latency.json
    JAX_PLATFORMS=cpu python tools/bench_latency_vs_length.py --smoke --out /tmp/lat.json   # tiny, on CPU
    python tools/bench_latency_vs_length.py --from_logs a.log b.log --device H200 --out lat.json --png lat.png
        # no timing: the table, JSON and figure from the per-cell lines of earlier runs (a later log wins for the
        # same cell), e.g. a run cut by a time limit and a second run of the rows it did not reach

Rows (every op at every T in ``--lengths`` until one call of it takes longer than ``--max_ms``):
  vla/reference      the token-by-token scan (our counterpart of the paper's "VLA-Python": sequential in T)
  vla/xla            the chunked Woodbury–Cholesky A-pass, then the delta-rule S-pass
  vla/pallas_triton  the Sherman–Morrison A-pass kernel, then the S-pass (GPU; what "auto" takes there)
  linear_attention   the delta-rule op without erase or decay (``auto``)
  delta_rule         with erase and a per-head decay (``auto``)
  interdomain/xla    M = 64 modes, the chunked form for any decay
  interdomain/toeplitz  the same inputs (a static decay, as the paper's configs) through the Toeplitz form,
                     which ``auto`` takes for them
  attention          ``jax.nn.dot_product_attention`` causal, cuDNN on the GPU, XLA elsewhere
Prints a Markdown table (ms per T), the T where each op's latency crosses below attention's (log-log
interpolation between the measured lengths; "none in range" if it does not), writes JSON and, with --png,
the log-log figure. A failing row keeps its error; the run goes on.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
from benchlib import timed, with_grad  # noqa: E402  (tools/benchlib.py)
from bench_interdomain_gpu import (attention_case, attention_fn, delta_rule_case, interdomain_case,  # noqa: E402
                                   interdomain_fn)
from bench_vla_gpu import vla_case, vla_fn  # noqa: E402

FULL = dict(lengths=(1024, 2048, 4096, 8192, 16384, 32768, 65536), heads=12, key_dim=64, value_dim=64, modes=64,
            document=10 ** 9)
SMOKE = dict(lengths=(16, 32), heads=2, key_dim=16, value_dim=16, modes=16, document=10 ** 9)


PASSES = {False: "forward", True: "forward+backward"}


def on_gpu():
    return jax.default_backend() == "gpu"


def _delta_case(b, t, sz, seed, erase):
    """The delta-rule inputs of the IA benchmark; linear attention takes them without the decay."""
    q, k, v, log_decay = delta_rule_case(b, t, sz, jax.random.key(seed))
    return (q, k, v, log_decay) if erase else (q, k, v)


def _linear_attention(q, k, v):
    from mixerlab.pallas_kernels.delta_rule.api import delta_rule

    return delta_rule(q, k, v)[0]


def _delta_rule(q, k, v, log_decay):
    from mixerlab.pallas_kernels.delta_rule.api import delta_rule

    return delta_rule(q, k, v, erase_key=k, log_decay=log_decay)[0]


def ops(sz):
    """name -> (case(b, t, seed), fn); vla/pallas_triton only on the GPU (the op refuses it elsewhere)."""
    table = {
        "vla/reference": (lambda b, t, s: vla_case(b, t, sz, s), vla_fn("reference")),
        "vla/xla": (lambda b, t, s: vla_case(b, t, sz, s), vla_fn("xla")),
        "linear_attention": (lambda b, t, s: _delta_case(b, t, sz, s, erase=False), _linear_attention),
        "delta_rule": (lambda b, t, s: _delta_case(b, t, sz, s, erase=True), _delta_rule),
        "interdomain/xla": (lambda b, t, s: interdomain_case(b, t, sz, jax.random.key(s)), interdomain_fn("xla")),
        "interdomain/toeplitz": (lambda b, t, s: interdomain_case(b, t, sz, jax.random.key(s)),
                                 interdomain_fn("toeplitz")),
        "attention": (lambda b, t, s: attention_case(b, t, sz, jax.random.key(s)),
                      attention_fn("cudnn" if on_gpu() else "xla")),
    }
    if on_gpu():
        table["vla/pallas_triton"] = (lambda b, t, s: vla_case(b, t, sz, s), vla_fn("pallas_triton"))
    return table


def measure(sz, batch, reps, max_ms, only=None, grad=False):
    """{op: {T: median ms or error string}}; an op stops at the first T whose median exceeds max_ms. ``grad``:
    forward+backward w.r.t. the first three inputs (q, k, v of every op)."""
    results = {}
    for name, (case, fn) in ops(sz).items():
        if only and name not in only:
            continue
        row = results.setdefault(name, {})
        jitted = with_grad(fn, (0, 1, 2)) if grad else jax.jit(fn)
        for t in sz["lengths"]:
            try:
                median, _ = timed(jitted, case(batch, t, 0), reps)
                row[t] = median
            except Exception as exc:  # noqa: BLE001  (a failing cell is recorded, the run goes on)
                row[t] = f"{type(exc).__name__}: {exc}"[:300]
                break
            print(json.dumps({"op": name, "T": t, "ms": median, "pass": PASSES[grad]}), flush=True)
            if median > max_ms:
                break
    return results


def crossover(row: dict, reference: dict):
    """The T where ``row`` drops below ``reference`` (log-log interpolation between adjacent measured T), or
    None if it never does inside the lengths both have; 'below throughout' if it is already below at the first."""
    common = sorted(t for t in row if t in reference and isinstance(row[t], float) and isinstance(reference[t], float))
    if not common:
        return None
    ratio = [math.log(row[t] / reference[t]) for t in common]
    if ratio[0] <= 0:
        return "below throughout"
    for (t0, r0), (t1, r1) in zip(zip(common, ratio), zip(common[1:], ratio[1:])):
        if r1 <= 0:
            frac = r0 / (r0 - r1)
            return float(math.exp(math.log(t0) + frac * (math.log(t1) - math.log(t0))))
    return None


def markdown(results: dict, lengths) -> str:
    lines = ["| op | " + " | ".join(f"T = {t}" for t in lengths) + " | crosses below attention at |",
             "|---" * (len(lengths) + 2) + "|"]
    att = results.get("attention", {})
    for name, row in results.items():
        cells = [f"{row[t]:.3f}" if isinstance(row.get(t), float) else ("error" if t in row else "–") for t in lengths]
        cross = "–" if name == "attention" else crossover(row, att)
        cross = (f"T ≈ {cross:,.0f}" if isinstance(cross, float) else (cross or "none in range"))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {cross} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: str, title: str, timed: str = "forward") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name, row in results.items():
        ts = [t for t in sorted(row) if isinstance(row[t], float)]
        if ts:
            ax.plot(ts, [row[t] for t in ts], marker="o", label=name, ls="--" if name == "attention" else "-")
    ax.set(xscale="log", yscale="log", xlabel="sequence length T", ylabel=f"{timed} latency (ms, median)", title=title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def results_from_logs(paths, grad=False):
    """{op: {T: ms}} from the JSON lines that :func:`measure` prints, of one pass (forward, or forward+backward
    with ``grad``; lines without a pass are forward); a later file wins for the same cell."""
    results = {}
    for path in paths:
        with open(path) as fh:
            for line in fh:
                if line.startswith("{"):
                    cell = json.loads(line)
                    if cell.get("pass", PASSES[False]) != PASSES[grad]:
                        continue
                    results.setdefault(cell["op"], {})[int(cell["T"])] = float(cell["ms"])
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--png", help="log-log figure path")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (runs on CPU in seconds)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=None, help="timed runs per cell (default 10; smoke 2)")
    p.add_argument("--max_ms", type=float, default=2000.0, help="stop an op after a T slower than this")
    p.add_argument("--lengths", help="comma-separated T (default 1K … 64K; smoke 16, 32)")
    p.add_argument("--ops", help="comma-separated subset of the rows (default: all)")
    p.add_argument("--grad", action="store_true", help="time forward+backward (w.r.t. q, k, v) instead of forward")
    p.add_argument("--from_logs", nargs="+", metavar="LOG", help="no timing: build the outputs from earlier logs")
    p.add_argument("--device", help="with --from_logs: the machine the logs were measured on (title, JSON)")
    a = p.parse_args(argv)
    sz = dict(SMOKE if a.smoke else FULL)
    if a.lengths:
        try:
            sz["lengths"] = tuple(int(x) for x in a.lengths.split(","))
        except ValueError:
            p.error(f"--lengths must be comma-separated integers, got {a.lengths!r}")
    only = set(a.ops.split(",")) if a.ops else None
    known = set(ops(sz))
    if only and not only <= known:
        p.error(f"--ops: unknown {sorted(only - known)}; valid on this backend: {sorted(known)}")
    reps = a.reps if a.reps is not None else (2 if a.smoke else 10)
    if a.from_logs:
        results = results_from_logs(a.from_logs, a.grad)
        sz["lengths"] = tuple(sorted({t for row in results.values() for t in row}))
    else:
        results = measure(sz, a.batch, reps, a.max_ms, only, a.grad)
    text = markdown(results, sz["lengths"])
    if a.from_logs:  # the cells were timed elsewhere: say where they came from, not where this ran
        measured_on = dict(device=a.device or "the machine of the logs", backend=None, jax=None, from_logs=a.from_logs)
    else:
        measured_on = dict(device=jax.devices()[0].device_kind, backend=jax.default_backend(), jax=jax.__version__)
    payload = dict(**measured_on, batch=a.batch, timed=PASSES[a.grad],
                   reps=reps, sizes={k: list(v) if isinstance(v, tuple) else v for k, v in sz.items()},
                   results={name: {str(t): x for t, x in row.items()} for name, row in results.items()},
                   crossover={name: crossover(row, results.get("attention", {})) for name, row in results.items()
                              if name != "attention"})
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(payload, fh, indent=1)
    if a.png:
        plot(results, a.png, f"{PASSES[a.grad]} latency, batch {a.batch}, H {sz['heads']}, d {sz['key_dim']}, "
                             f"{payload['device']}", PASSES[a.grad])
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
