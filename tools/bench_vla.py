"""CPU benchmark of the VLA op: reference scan vs chunkwise xla, forward and forward+backward.

    JAX_PLATFORMS=cpu python tools/bench_vla.py [--lengths 1024 4096] [--repeats 3] [--out docs/benchmarks/vla_cpu.md]

Inputs: B=1, H=2, d_k=d_v=32, q, k = ELU+1 of N(0,1), v ~ N(0,1), u = k̂ (no penalty key), float32, default
hyper-parameters (λ₀=0.1, P=20, ρ=1e-3, ε=1e-4; A-pass chunk 20). Median wall time of ``repeats`` runs after
one warm-up (compile time reported separately). "xla, no remat" is the xla form with the per-chunk
``jax.checkpoint`` of the A-pass switched off, to price that choice.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mixerlab.pallas_kernels.delta_rule.api import delta_rule  # noqa: E402
from mixerlab.pallas_kernels.vla import api, xla  # noqa: E402


def _xla_no_remat(q, k, v):
    """The xla implementation with checkpoint=False in the A-pass (otherwise identical to api._run_xla)."""
    q, k_hat, u, v, S0, A0, doc, refresh = api._prepare(q, k, v, None, None, None, 0, 0.1, 20, 0, 1e-4)
    alpha, A = xla.penalty_pass(k_hat, u, A0, doc, refresh, chunk_size=20, lambda0=0.1, refresh_magnitude=1e-3,
                                eps=1e-4, checkpoint=False)
    o, S = delta_rule(q, alpha, v, erase_key=k_hat, initial_state=S0, segment_ids=doc, implementation="xla")
    return o, (S, A)


def _variants():
    return {
        "reference": lambda q, k, v: api.vla(q, k, v, implementation="reference"),
        "xla": lambda q, k, v: api.vla(q, k, v, implementation="xla"),
        "xla, no remat": _xla_no_remat,
    }


def _time(fn, args, repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return compile_s, statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="docs/benchmarks/vla_cpu.md")
    a = ap.parse_args()
    rows = []
    for t in a.lengths:
        rng = np.random.default_rng(0)
        q = jnp.asarray(jax.nn.elu(rng.normal(size=(1, t, 2, 32))) + 1, jnp.float32)
        k = jnp.asarray(jax.nn.elu(rng.normal(size=(1, t, 2, 32))) + 1, jnp.float32)
        v = jnp.asarray(rng.normal(size=(1, t, 2, 32)), jnp.float32)
        w = jnp.asarray(rng.normal(size=(1, t, 2, 32)), jnp.float32)
        for name, f in _variants().items():
            fwd = jax.jit(f)
            loss = lambda q, k, v, f=f: jnp.sum(f(q, k, v)[0] * w)  # noqa: E731
            bwd = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
            for mode, fn in (("fwd", fwd), ("fwd+bwd", bwd)):
                if name == "xla, no remat" and mode == "fwd":
                    continue  # identical forward
                c, m = _time(fn, (q, k, v), a.repeats)
                rows.append((t, name, mode, m * 1e3, c))
                print(f"T={t} {name:14s} {mode:8s} {m * 1e3:10.1f} ms  (compile+first {c:.1f} s)", flush=True)
    load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",)
    lines = [
        "# VLA op on CPU: reference scan vs chunkwise xla",
        "",
        f"Command: `JAX_PLATFORMS=cpu python tools/bench_vla.py --lengths {' '.join(map(str, a.lengths))} "
        f"--repeats {a.repeats}`",
        f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores visible, {platform.python_version()}, "
        f"jax {jax.__version__}, backend {jax.default_backend()}; load average at the end "
        f"{', '.join(f'{x:.1f}' if isinstance(x, float) else x for x in load)}. **Other processes shared the CPU "
        "during the run (several test workers on 2 cores), so absolute numbers are noisy; compare rows of one "
        "run only.**",
        "",
        "Shapes: B=1, H=2, d_k=d_v=32, float32 inputs, u = k̂, default hyper-parameters (A-pass chunk 20, "
        "S-pass = delta_rule xla, chunk 64). Median of the timed runs after one warm-up; \"compile\" is the "
        "first call (compile + run).",
        "",
        "| T | implementation | pass | median ms | compile + first call s |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {t} | {n} | {m} | {ms:.1f} | {c:.1f} |" for t, n, m, ms, c in rows]
    lines += ["", "\"xla, no remat\": the A-pass without the per-chunk `jax.checkpoint` (the cost of the "
              "checkpoint is the difference between it and \"xla\" fwd+bwd; its benefit is memory: only the "
              "d×d chunk-boundary states of A are kept for the backward pass).", ""]
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        fh.write("\n".join(lines))
    print("wrote", a.out)


if __name__ == "__main__":
    main()
