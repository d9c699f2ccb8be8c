"""Ablation timing of the forward-alone kernels (K1_intra_alone, scan_output): pieces removed (wrong numbers, timing
only) to see where the time goes. Each variant is traced and compiled with its patch active; then interleaved."""
import contextlib, json, os, statistics, sys, time
sys.path.insert(0, "tools"); sys.path.insert(0, ".")
import dataclasses
import jax, jax.numpy as jnp
import bench_delta_rule_gpu as bench
from mixerlab.pallas_kernels import common
from mixerlab.pallas_kernels.delta_rule import pallas_triton as ptr

SHAPE = os.environ.get("SHAPE", "8x4096")
INTERP = os.environ.get("INTERP") == "1"
CHECK = os.environ.get("CHECK") == "1"  # lower every variant for CUDA on the CPU, run nothing


def build(f, args):
    if CHECK:
        jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
        return None
    return jax.jit(f).lower(*args).compile()
b, t, h, dk, dv = bench.SHAPES[SHAPE] if not INTERP else (1, 128, 2, 32, 32)
core, _ = bench.core_inputs((b, t, h, dk, dv))
q, k, e, v, lam, s0, doc = core
_, carried = common.chunk_documents(doc, 64)
orig = {n: getattr(ptr, n) for n in ("_inverse", "_decay_sums", "_bounded_cut", "_dot", "_chunk_matrices",
                                      "_pivot_factors", "_edge_decays")}


@contextlib.contextmanager
def patch(**kw):
    old = {n: getattr(ptr, n) for n in kw}
    for n, f in kw.items():
        setattr(ptr, n, f)
    try:
        yield
    finally:
        for n, f in old.items():
            setattr(ptr, n, f)


def no_exact_loop():
    real = jax.lax.fori_loop
    def fl(lo, hi, body, init):
        if not isinstance(lo, int) and hi == 6:  # the exact-tree loop from the cut: skipped
            return init
        return real(lo, hi, body, init)
    return fl


def fixed_cut(parts, cfg, keep_sums, top_sums=None):
    return jnp.int32(cfg.levels), ptr._cut_sums(jnp.int32(cfg.levels), parts, cfg)


K1_VARIANTS = {
    "base": {},
    "no_solve": dict(_inverse=lambda a, cfg: a),
    "no_decay_sums": dict(_decay_sums=lambda w, parts, cfg: parts[0]),
    "no_cut_search": dict(_bounded_cut=fixed_cut),
    "no_exact_loop": "fori",
    "no_edges": dict(_edge_decays=lambda lam_, parts, masks, cfg: (lam_, lam_, jnp.sum(lam_, axis=0))),
    "edge_scan": "cfg",
}
calls = {}
cfg = ptr.make_config(64, 16, dk, dv, jnp.bfloat16, batch_heads=b * h, interpret=INTERP)
args1 = (q, k, e, lam, doc, carried)
t0 = time.perf_counter()
for name, p in K1_VARIANTS.items():
    if p == "cfg":
        cfg_s = dataclasses.replace(cfg, edge_sums="scan")
        fn = build(lambda *z: ptr._intra_alone(cfg_s, *z), args1)
    elif p == "fori":
        real = jax.lax.fori_loop
        jax.lax.fori_loop = no_exact_loop()
        try:
            fn = build(lambda *z: ptr._intra_alone(cfg, *z), args1)
        finally:
            jax.lax.fori_loop = real
    else:
        with patch(**p):
            fn = build(lambda *z: ptr._intra_alone(cfg, *z), args1)
    calls[f"K1 {name}"] = (fn, args1)
    print(f"[{time.perf_counter() - t0:6.1f}s] compiled K1 {name}", file=sys.stderr, flush=True)
outs = jax.eval_shape(lambda *z: ptr._intra_alone(cfg, *z), *args1) if CHECK else jax.jit(
    lambda *z: ptr._intra_alone(cfg, *z))(*args1)
mp, kpi, qpi, gk, pic = outs
args2 = (kpi, v, gk, pic, qpi, mp, s0)


def chain_only_kernel(cfg, n_chunks):
    c = cfg.chunk
    def kernel(state_reads_ref, pseudo_values_ref, key_eff_ref, chunk_decay_ref, query_start_ref, readout_ref,
               s_init_ref, o_out, s_final_out):
        def body(n, state):
            values = pseudo_values_ref[pl.ds(n * c, c), :]
            w = values.astype(jnp.float32) - ptr._dot(state_reads_ref[n], state, cfg)
            o_out[pl.ds(n * c, c), :] = w.astype(o_out.dtype)
            return chunk_decay_ref[n][:, None] * state + ptr._dot(key_eff_ref[n], w, cfg, trans_a=True)
        s_final_out[...] = jax.lax.fori_loop(0, n_chunks, body, s_init_ref[...].astype(jnp.float32))
    return kernel


from jax.experimental import pallas as pl
import dataclasses
SCAN_VARIANTS = {"base": (cfg, {}), "chain_only": (cfg, dict(_scan_output_kernel=chain_only_kernel)),
                 "warps8": (dataclasses.replace(cfg, warps_scan=8), {}),
                 "stages2": (dataclasses.replace(cfg, stages_scan_output=2), {}),
                 "bv32": (dataclasses.replace(cfg, scan_block_v=32), {}),
                 "bv32_st2": (dataclasses.replace(cfg, scan_block_v=32, stages_scan_output=2), {})}
for name, (c2, p) in SCAN_VARIANTS.items():
    with patch(**p):
        fn = build(lambda *z, c2=c2: ptr._scan_output(c2, *z, jnp.bfloat16), args2)
    calls[f"scan {name}"] = (fn, args2)
    print(f"[{time.perf_counter() - t0:6.1f}s] compiled scan {name}", file=sys.stderr, flush=True)
if CHECK:
    build(lambda *z: ptr.run(*z, chunk_size=64, leaf_size=16), core)
    build(lambda *z: ptr.run(*z, chunk_size=64, leaf_size=16, edge_sums="scan"), core)
    print("all variants lower for CUDA"); sys.exit(0)
if os.environ.get("JLA") == "1":
    f1, f2, ja = bench.jla_functions((b, t, h, dk, dv))
    calls["jla fwd"] = (f1, ja)
fwd = jax.jit(lambda *z: ptr.run(*z, chunk_size=64, leaf_size=16, interpret=INTERP))
calls["ours fwd"] = (fwd, core)
calls["ours fwd edge_scan"] = (jax.jit(lambda *z: ptr.run(*z, chunk_size=64, leaf_size=16, interpret=INTERP,
                                                           edge_sums="scan")), core)
for name, (fn, a) in calls.items():
    jax.block_until_ready(fn(*a)); jax.block_until_ready(fn(*a))
rounds, ncalls = (1, 1) if INTERP else (5, 10)
times = {n: [] for n in calls}
for r in range(rounds):
    for name, (fn, a) in calls.items():
        for _ in range(ncalls):
            st = time.perf_counter(); jax.block_until_ready(fn(*a)); times[name].append((time.perf_counter() - st) * 1e3)
    res = {n: [statistics.median(v_), min(v_)] for n, v_ in times.items()}
    json.dump(res, open(os.environ.get("OUT", "/tmp") + "/abl.json", "w"), indent=1)
    print(f"[{time.perf_counter() - t0:6.1f}s] round {r + 1}", file=sys.stderr, flush=True)
print(f"| function ({SHAPE}) | median ms | min ms |\n|---|---|---|")
for n, (m, mn) in res.items():
    print(f"| {n} | {m:.3f} | {mn:.3f} |")
