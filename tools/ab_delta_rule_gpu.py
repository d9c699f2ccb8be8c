"""Interleaved A/B timing of the GPU delta-rule kernel under pallas_triton.Config variants, in one process.

    python3 tools/ab_delta_rule_gpu.py '{"fused": {}, "apart": {"fuse_output": false}}' [--shape 8x4096]
        [--rounds 4] [--calls 10] [--jla] [--out ab.json]

(On the CPU, for a check of the script: '{"a": {"interpret": true}}' --shape 1,128,2,32 --rounds 1 --calls 1.)

For each variant: the forward, forward + backward (the op's core, bf16, as tools/bench_delta_rule_gpu.py
times it) and the forward's K1 alone (K1_intra_alone with ``fold_solve``). Every function is compiled first;
then ``--rounds`` rounds run ``--calls`` timed calls of each function in turn, so that clock and thermal
drift hit every variant alike (one variant after another, the same code has differed by 0.1–0.2 ms between
runs). ``--jla``: jax-linear-attention's GDN-2 forward and forward + backward join the rotation (the anchor
in the same process). Prints median and min per function, in ms; ``--out`` is rewritten after every round (a
run cut short keeps its rounds), progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    import jax
    import jax.numpy as jnp

    import bench_delta_rule_gpu as bench
    from mixerlab.pallas_kernels import common
    from mixerlab.pallas_kernels.delta_rule import pallas_triton as ptr

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", help='JSON {name: Config overrides}, e.g. \'{"a": {}, "b": {"fuse_output": false}}\'')
    ap.add_argument("--shape", default="8x4096", help=f"one of {sorted(bench.SHAPES)} or B,T,H,D")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--leaf", type=int, default=16)
    ap.add_argument("--jla", action="store_true", help="time jax-linear-attention's GDN-2 in the same rotation")
    ap.add_argument("--out", help="write {function: [median, min]} to this JSON file")
    a = ap.parse_args()
    if a.rounds < 1 or a.calls < 1:
        ap.error(f"--rounds {a.rounds} --calls {a.calls}: both must be ≥ 1")
    variants = json.loads(a.variants)
    if a.shape in bench.SHAPES:
        b, t, h, dk, dv = bench.SHAPES[a.shape]
    else:
        try:
            b, t, h, dk = (int(v) for v in a.shape.split(","))
        except ValueError:
            ap.error(f"--shape {a.shape!r}: expected one of {sorted(bench.SHAPES)} or B,T,H,D (e.g. 1,128,2,32)")
        dv = dk
    bf = jnp.bfloat16
    core, d_out = bench.core_inputs((b, t, h, dk, dv))  # the inputs bench_delta_rule_gpu.py times
    _, carried = common.chunk_documents(core[6], a.chunk)
    calls = {}  # name: (jitted function, arguments)
    for name, overrides in variants.items():
        run = lambda *z, o=overrides: ptr.run(*z, chunk_size=a.chunk, leaf_size=a.leaf, **o)  # noqa: E731
        calls[f"{name} fwd"] = (jax.jit(run), core)
        calls[f"{name} fwd+bwd"] = (jax.jit(lambda *z, run=run: jax.vjp(lambda *y: run(*y, z[6])[0], *z[:6])[1](d_out)),
                                    core)
        cfg = ptr.make_config(a.chunk, a.leaf, dk, dv, bf, batch_heads=b * h, **overrides)
        if cfg.fuse_output and cfg.fold_solve:  # the forward's K1 (the training forward runs _intra)
            calls[f"{name} K1"] = (jax.jit(lambda *z, cfg=cfg: ptr._intra_alone(cfg, *z)),
                                   (*core[:3], core[4], core[6], carried))
        else:
            calls[f"{name} K1"] = (jax.jit(lambda *z, cfg=cfg: ptr._intra(cfg, *z, with_inverse=False)),
                                   (*core[:5], core[6], carried))
    if a.jla:
        jla_fwd, jla_fwd_bwd, jla_args = bench.jla_functions((b, t, h, dk, dv))
        calls["jla fwd"], calls["jla fwd+bwd"] = (jla_fwd, jla_args), (jla_fwd_bwd, jla_args)
    t0 = time.perf_counter()
    for name, (fn, args) in calls.items():  # compile and warm
        jax.block_until_ready(fn(*args))
        jax.block_until_ready(fn(*args))
        print(f"[{time.perf_counter() - t0:6.1f}s] compiled {name}", file=sys.stderr, flush=True)
    times = {name: [] for name in calls}
    for r in range(a.rounds):
        for name, (fn, args) in calls.items():
            for _ in range(a.calls):
                start = time.perf_counter()
                jax.block_until_ready(fn(*args))
                times[name].append((time.perf_counter() - start) * 1e3)
        result = {name: [statistics.median(v), min(v)] for name, v in times.items()}
        if a.out:  # after every round, so that a run cut short keeps what it measured
            with open(a.out, "w") as f:
                json.dump({"rounds": r + 1, **result}, f, indent=1)
        print(f"[{time.perf_counter() - t0:6.1f}s] round {r + 1}/{a.rounds}", file=sys.stderr, flush=True)
    print(f"| function ({a.shape}, bf16, {a.rounds}×{a.calls} interleaved calls) | median ms | min ms |")
    print("|---|---|---|")
    for name, (median, fastest) in result.items():
        print(f"| {name} | {median:.3f} | {fastest:.3f} |")


if __name__ == "__main__":
    main()
