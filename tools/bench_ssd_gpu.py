"""The SSD op on the GPU (docs/benchmarks/baselines_h200.md): correctness of the compiled kernels against the
float64 oracle at a small packed shape, then forward and forward+backward times (medians of warm runs) of the
SSD kernels against the delta-rule kernels on the same call (q, k repeated per head, the path Mamba-2 took before),
at Mamba-2's 166M shape (32 heads of P = 64, N = 128, one group) and a GDN-2 delta-rule call of the same tokens
beside it (8 heads of 128 with erase) as the anchor.

    python tools/bench_ssd_gpu.py [--batch 32 --seq 4096] [--reps 10] [--out ssd.json] \
        [--variants "chunk=64;chunk=128;chunk=64,warps_backward=8;split_forward=1"]

``--variants``: SSD kernel configurations timed beside the default (each ``chunk=C`` plus any
``pallas_triton.Config`` fields, comma-separated; variants separated by ';'), same inputs, same call.

Prints one JSON line per row and a table at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from tools.benchlib import max_rel_err, record, timed, weighted_sum  # noqa: E402


def ssd_inputs(b, t, g, h, n, p, dtype, seed=0):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.normal(size=(b, t, g, n)) / np.sqrt(n), dtype)
    k = jnp.asarray(r.normal(size=(b, t, g, n)) / np.sqrt(n), dtype)
    v = jnp.asarray(r.normal(size=(b, t, h, p)), dtype)
    log_decay = jnp.asarray(-np.exp(r.normal(size=(b, t, h)) - 2.0), jnp.float32)
    seg = np.repeat(np.arange(t // 512 + 1), 512)[:t]  # documents of 512 tokens
    return q, k, v, log_decay, jnp.asarray(np.tile(seg, (b, 1)), jnp.int32)


def correctness(row):
    """Compiled kernels (bf16 and f32) against the float64 oracle: outputs, final state, every gradient."""
    from mixerlab.pallas_kernels import ssd
    b, t, g, h, n, p = 2, 300, 2, 4, 128, 64
    for dtype, name in ((jnp.float32, "f32"), (jnp.bfloat16, "bf16")):
        q, k, v, lam, seg = ssd_inputs(b, t, g, h, n, p, dtype, seed=1)
        state = jnp.asarray(np.random.default_rng(2).normal(size=(b, h, n, p)) * 0.1, jnp.float32)

        def loss(impl, q, k, v, lam, state):
            out, final = ssd(q, k, v, log_decay=lam, initial_state=state, segment_ids=seg, implementation=impl)
            return weighted_sum(out) + jnp.sum(final * 0.5)

        got = jax.jit(jax.value_and_grad(lambda *a: loss("pallas_triton", *a), argnums=tuple(range(5))))(
            q, k, v, lam, state)
        with jax.enable_x64(True):
            cast = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, lam, state)]
            want = jax.jit(jax.value_and_grad(lambda *a: loss("reference", *a), argnums=tuple(range(5))))(*cast)
        row[name] = {label: max_rel_err(x, y) for label, x, y in
                     zip(("loss", "dq", "dk", "dv", "dλ", "dS0"), (got[0], *got[1]), (want[0], *want[1]))}


def time_ssd(row, b, t, impl, reps):
    from mixerlab.pallas_kernels import ssd
    q, k, v, lam, seg = ssd_inputs(b, t, 1, 32, 128, 64, jnp.bfloat16)

    def fwd(q, k, v, lam):
        return ssd(q, k, v, log_decay=lam, segment_ids=seg, implementation=impl)[0]

    row["forward_ms"] = timed(jax.jit(fwd), (q, k, v, lam), reps)[0]
    step = jax.jit(jax.grad(lambda *a: weighted_sum(fwd(*a)), argnums=(0, 1, 2, 3)))
    row["fwd_bwd_ms"] = timed(step, (q, k, v, lam), reps)[0]


TUNABLE = {"warps_forward": int, "warps_backward": int, "stages": int, "split_forward": bool}  # Config fields


def parse_variant(text):
    """'chunk=128,stages=2' -> (128, {'stages': 2}); chunk 0 = the op's default."""
    chunk, overrides = 0, {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if key == "chunk":
            chunk = int(value)
        elif key in TUNABLE:
            overrides[key] = value.lower() in ("1", "true", "yes") if TUNABLE[key] is bool else int(value)
        else:
            raise SystemExit(f"bench_ssd_gpu: --variants: unknown key {key!r} in {text!r}; valid: chunk, "
                             f"{', '.join(TUNABLE)}")
    return chunk, overrides


def time_ssd_variant(row, b, t, chunk, overrides, reps):
    """The SSD kernels called directly with a Config override (the op's ``ssd`` takes only the chunk)."""
    from mixerlab.pallas_kernels.ssd import pallas_triton
    q, k, v, lam, seg = ssd_inputs(b, t, 1, 32, 128, 64, jnp.bfloat16)
    chunk = chunk or 64
    state = jnp.zeros((b, 32, 128, 64), jnp.float32)

    def fwd(q, k, v, lam):
        return pallas_triton.run(q, k, v, lam, state, seg, chunk_size=chunk, **overrides)[0]

    row["forward_ms"] = timed(jax.jit(fwd), (q, k, v, lam), reps)[0]
    step = jax.jit(jax.grad(lambda *a: weighted_sum(fwd(*a)), argnums=(0, 1, 2, 3)))
    row["fwd_bwd_ms"] = timed(step, (q, k, v, lam), reps)[0]
    if overrides:  # the same gradients as the default kernels (at the variant's chunk)?
        def default(q, k, v, lam):
            return pallas_triton.run(q, k, v, lam, state, seg, chunk_size=chunk)[0]
        want = jax.jit(jax.grad(lambda *a: weighted_sum(default(*a)), argnums=(0, 1, 2, 3)))(q, k, v, lam)
        got = step(q, k, v, lam)
        row["max_rel_diff_vs_default"] = max(max_rel_err(g.astype(jnp.float32), w.astype(jnp.float32))
                                             for g, w in zip(got, want))


def time_gdn2_anchor(row, b, t, reps):
    from mixerlab.pallas_kernels import delta_rule
    r = np.random.default_rng(3)
    q, k, e = (jnp.asarray(r.normal(size=(b, t, 8, 128)) / np.sqrt(128), jnp.bfloat16) for _ in range(3))
    v = jnp.asarray(r.normal(size=(b, t, 8, 128)), jnp.bfloat16)
    lam = jnp.asarray(-np.exp(r.normal(size=(b, t, 8, 128)) - 2.0), jnp.float32)
    seg = jnp.asarray(np.tile(np.repeat(np.arange(t // 512 + 1), 512)[:t], (b, 1)), jnp.int32)

    def fwd(q, k, e, v, lam):
        return delta_rule(q, k, v, erase_key=e, log_decay=lam, segment_ids=seg)[0]

    row["forward_ms"] = timed(jax.jit(fwd), (q, k, e, v, lam), reps)[0]
    step = jax.jit(jax.grad(lambda *a: weighted_sum(fwd(*a)), argnums=(0, 1, 2, 3, 4)))
    row["fwd_bwd_ms"] = timed(step, (q, k, e, v, lam), reps)[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", default="", help="SSD kernel configurations timed beside the default, "
                    "';'-separated, each 'chunk=C,FIELD=VALUE,...' (FIELD: " + ", ".join(TUNABLE) + ")")
    ap.add_argument("--skip", default="", help="comma-separated: correctness, delta_rule_triton, anchor")
    args = ap.parse_args(argv)
    variants = [(text, *parse_variant(text)) for text in args.variants.split(";") if text.strip()]
    skip = set(filter(None, args.skip.split(",")))
    print(json.dumps({"device": str(jax.devices()[0].device_kind), "jax": jax.__version__}), flush=True)
    rows = []
    if "correctness" not in skip:
        record(rows, {"row": "correctness (compiled vs float64 oracle, max rel. err.)"}, correctness)
    shape = f"{args.batch}x{args.seq}, 32 heads, N 128, P 64, G 1"
    for impl in ("pallas_triton", "delta_rule_triton"):
        if impl not in skip:
            record(rows, {"row": f"ssd {impl}", "shape": shape},
                   lambda row, impl=impl: time_ssd(row, args.batch, args.seq, impl, args.reps))
    for text, chunk, overrides in variants:
        record(rows, {"row": f"ssd pallas_triton {text}", "shape": shape},
               lambda row, c=chunk, o=overrides: time_ssd_variant(row, args.batch, args.seq, c, o, args.reps))
    if "anchor" not in skip:
        record(rows, {"row": "delta_rule (GDN-2 call)", "shape": f"{args.batch}x{args.seq}, 8 heads of 128, erase"},
               lambda row: time_gdn2_anchor(row, args.batch, args.seq, args.reps))
    print("\n| row | shape | forward ms | fwd+bwd ms | gradients vs the default kernels (max rel. diff) |\n"
          "|---|---|---|---|---|")
    for row in rows:
        if "forward_ms" not in row and "error" not in row:
            continue
        ms = lambda key: f"{row[key]:.3f}" if isinstance(row.get(key), float) else row.get(key, "")  # noqa: E731
        forward = ms("forward_ms") or row.get("error", "")
        diff = f"{row['max_rel_diff_vs_default']:.1e}" if "max_rel_diff_vs_default" in row else ""
        print(f"| {row['row']} | {row.get('shape', '')} | {forward} | {ms('fwd_bwd_ms')} | {diff} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
