"""Timing only: the two-pass kernels with their search passes left out (K1's, B2b's, both), interleaved with the
shipped kernels. With ordinary gates no chunk is flagged, so the outputs are the same; the difference is the cost
of the search passes' empty programs."""
import json, os, statistics, sys, time, types
sys.path.insert(0, "tools"); sys.path.insert(0, ".")
import jax, jax.numpy as jnp
import numpy as np
import bench_delta_rule_gpu as bench
from mixerlab.pallas_kernels.delta_rule import pallas_triton as ptr

SHAPE = os.environ.get("SHAPE", "8x4096")
CHECK = os.environ.get("CHECK") == "1"
INTERP = os.environ.get("INTERP") == "1"
real_pl = ptr.pl


def proxy(drop, cond=False):
    def pallas_call(kernel, **kw):
        name = kw.get("name", "")
        if name.endswith("_search") and any(name.startswith(d) for d in drop):
            n_out = len(kw["out_shape"])
            if not cond:
                return lambda *args: tuple(args[-n_out:])
            real = real_pl.pallas_call(kernel, **kw)
            # the search pass only when some chunk is flagged (XLA conditional: the predicate goes to the host)
            return lambda *args: jax.lax.cond(jnp.any(args[-n_out - 1] != 0), lambda *a: tuple(real(*a)),
                                              lambda *a: tuple(a[-n_out:]), *args)
        return real_pl.pallas_call(kernel, **kw)
    ns = types.SimpleNamespace(**{k: getattr(real_pl, k) for k in dir(real_pl) if not k.startswith("__")})
    ns.pallas_call = pallas_call
    return ns


b, t, h, dk, dv = bench.SHAPES[SHAPE] if not INTERP else (1, 128, 2, 32, 32)
core, d_out = bench.core_inputs((b, t, h, dk, dv))
kw = dict(chunk_size=64, leaf_size=16, interpret=INTERP)
def make():  # fresh functions per variant: jit caches its traces by function
    fwd = lambda *z: ptr.run(*z, **kw)
    fwdbwd = lambda *z: jax.vjp(lambda *y: ptr.run(*y, z[6], **kw)[0], *z[:6])[1](d_out)
    return fwd, fwdbwd
VARIANTS = {"base": (), "no_k1_search": ("delta_rule_intra",), "no_b2b_search": ("delta_rule_key_grads",),
            "no_search": ("delta_rule_intra", "delta_rule_key_grads"),
            "cond": ("delta_rule_intra", "delta_rule_key_grads", "cond")}
calls, t0 = {}, time.perf_counter()
for name, drop in VARIANTS.items():
    ptr.pl = proxy(drop, cond="cond" in drop)
    try:
        for fname, f in zip(("fwd", "fwd+bwd"), make()):
            if fname == "fwd" and name in ("no_b2b_search", "no_search"):  # cond: both
                continue
            if CHECK:
                jax.jit(f).trace(*core).lower(lowering_platforms=("cuda",))
                continue
            calls[f"{name} {fname}"] = jax.jit(f).lower(*core).compile()
    finally:
        ptr.pl = real_pl
    print(f"[{time.perf_counter() - t0:6.1f}s] built {name}", file=sys.stderr, flush=True)
if CHECK:
    print("all variants lower for CUDA"); sys.exit(0)
ref = {n: jax.block_until_ready(f(*core)) for n, f in calls.items()}
for n in calls:  # nothing flagged: every variant gives the shipped numbers
    base = ref["base fwd" if n.endswith(" fwd") else "base fwd+bwd"]
    same = all(bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree.leaves(ref[n]), jax.tree.leaves(base)))
    print(n, "identical to base:", same, flush=True)
if os.environ.get("JLA") == "1":
    f1, f2, ja = bench.jla_functions((b, t, h, dk, dv))
    calls["jla fwd"], calls["jla fwd+bwd"] = (lambda *_: f1(*ja)), (lambda *_: f2(*ja))
rounds, ncalls = (1, 1) if INTERP else (int(os.environ.get("ROUNDS", 5)), 10)
times = {n: [] for n in calls}
for r in range(rounds):
    for name, fn in calls.items():
        for _ in range(ncalls):
            st = time.perf_counter(); jax.block_until_ready(fn(*core)); times[name].append((time.perf_counter() - st) * 1e3)
    res = {n: [statistics.median(v_), min(v_)] for n, v_ in times.items()}
    json.dump(res, open(os.environ.get("OUT", "/tmp") + "/abl_search.json", "w"), indent=1)
    print(f"[{time.perf_counter() - t0:6.1f}s] round {r + 1}", file=sys.stderr, flush=True)
print(f"| function ({SHAPE}) | median ms | min ms |\n|---|---|---|")
for n, (m, mn) in res.items():
    print(f"| {n} | {m:.3f} | {mn:.3f} |")
