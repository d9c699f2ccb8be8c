"""What the benchmark tools share: warm timing, a fixed-weight loss for forward+backward timings, relative
errors, and recording one row of a table without letting a failing row end the run."""
from __future__ import annotations

import json
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np


def timed(fn, args, reps, warm=1):
    """(median ms, min ms) of ``reps`` calls of ``fn(*args)`` after ``warm`` untimed calls (the first compiles)."""
    for _ in range(warm):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times)


def weighted_sum(out):
    """Σ out·w with fixed, non-uniform float32 weights: a loss whose gradient reaches every output entry."""
    out = out.astype(jnp.float32)
    return jnp.sum(out * jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape)))


def with_grad(fn, argnums):
    """fn(*args) -> output; a jit'd forward+backward of :func:`weighted_sum` of the output."""
    return jax.jit(jax.grad(lambda *args: weighted_sum(fn(*args)), argnums=argnums))


def max_rel_err(got, want) -> float:
    """max |got − want| / max |want| (float64)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def record(rows: list, row: dict, work) -> dict:
    """Run ``work(row)`` (it fills the row); an exception is written into the row instead of ending the run.
    The row is appended to ``rows`` and printed as one JSON line as soon as it is done."""
    try:
        work(row)
    except Exception as exc:  # noqa: BLE001  (a failing row is recorded, the run goes on)
        row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        traceback.print_exc()
    rows.append(row)
    print(json.dumps(row), flush=True)
    return row
