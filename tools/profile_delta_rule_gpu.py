"""Where the time goes inside the Pallas-Triton delta-rule kernels (H200, no hardware counters needed):
time K1 ``intra`` and B2 ``grads`` at B8·T4096·H16·D128 (bf16) with one stage left out or one knob changed,
and print the differences. The variants that leave a stage out compute wrong numbers on purpose; only
their time is read.

    python3 tools/profile_delta_rule_gpu.py [--variants base,no_levels,...] [--reps 10]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

_TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_TOOLS), _TOOLS]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mixerlab.pallas_kernels import common  # noqa: E402
from mixerlab.pallas_kernels.delta_rule import pallas_triton as ptr  # noqa: E402
from mixerlab.pallas_kernels.delta_rule import pallas_triton_kernels, pallas_triton_tiles  # noqa: E402
from bench_delta_rule_gpu import gdn2_numpy, time_jax  # noqa: E402


@contextlib.contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def patched_in(modules, name, value):
    with contextlib.ExitStack() as stack:
        for module in modules:
            stack.enter_context(patched(module, name, value))
        yield


VARIANTS = {  # name: (context-manager factory, Config overrides)
    "base": (contextlib.nullcontext, {}),
    # no pair products at all (neither the exact levels nor the factored pairs)
    "no_levels": (lambda: patched(ptr.Config, "levels", property(lambda self: 0)), {"bounded_span": None}),
    # a helper is patched where its caller looks it up: the kernel bodies call _inverse and _bounded_cut
    "no_inverse": (lambda: patched(pallas_triton_kernels, "_inverse", lambda a, cfg: a), {}),
    "tree": (contextlib.nullcontext, {"bounded_span": None}),  # every pair through the exact pivot tree
    # the factored pairs with no cut search and no exact levels compiled beside them (wrong numbers where a
    # key block needs the tree; what a kernel specialised to the factored path could gain)
    "factored_only": (lambda: patched_in((pallas_triton_kernels, pallas_triton_tiles), "_bounded_cut",
                                         lambda parts, cfg, keep_sums: (
        cfg.levels, ptr._cut_sums(cfg.levels, parts, cfg) if keep_sums else None)), {}),
    "sums_tf32x2": (contextlib.nullcontext, {"decay_sums": "tf32x2"}),
    "end_difference": (contextlib.nullcontext, {"end_decays": "difference"}),  # E's exponent: total − π's
    "pair_grads_f32": (contextlib.nullcontext, {"pair_grads_f32": True}),
    "block_k16": (contextlib.nullcontext, {"block_k": 16}),
    "block_k64": (contextlib.nullcontext, {"block_k": 64}),
    "block_k128": (contextlib.nullcontext, {"block_k": 128}),
    "intra_warps8": (contextlib.nullcontext, {"warps_intra": 8}),
    "key_grads_warps4": (contextlib.nullcontext, {"warps_key_grads": 4}),
    "key_grads_warps8": (contextlib.nullcontext, {"warps_key_grads": 8}),
    "cotangents_warps4": (contextlib.nullcontext, {"warps_cotangents": 4}),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--leaf", type=int, default=16)
    ap.add_argument("--smoke", action="store_true", help="interpret mode, tiny shape (script check on CPU)")
    args = ap.parse_args()
    b, t, h, dk, dv = (1, 128, 2, 32, 32) if args.smoke else (8, 4096, 16, 128, 128)
    c = args.chunk
    x = gdn2_numpy(4, b, t, h, dk, dv)
    bf = jnp.bfloat16
    q, k, e, v = (jnp.asarray(a).astype(bf) for a in (x["q"] * dk ** -0.5, x["k"], x["b"] * x["k"], x["w"] * x["v"]))
    lam = jnp.asarray(x["g"])
    doc = jnp.zeros((b, t), jnp.int32)
    _, carry = common.chunk_documents(doc, c)
    rng = np.random.default_rng(0)
    n = t // c
    rnd = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32) * 0.1).astype(bf)  # noqa: E731
    s0s, dsc, dut, d_out = rnd(b, h, n, dk, dv), rnd(b, h, n, dk, dv), rnd(b, h, n, c, dv), rnd(b, t, h, dv)
    print("| variant | K1 intra ms | B2a cotangents ms | B2b key grads ms | compile s |")
    print("|---|---|---|---|---|")
    for name in args.variants.split(","):
        ctx, overrides = VARIANTS[name]
        overrides = {**overrides, "interpret": args.smoke}
        if overrides.get("block_k", 0) > dk:
            continue
        cfg = ptr.make_config(c, args.leaf, dk, dv, bf, batch_heads=b * h, **overrides)
        try:
            with ctx():
                t0 = time.time()
                intra = jax.jit(lambda *a: ptr._intra(cfg, *a, with_inverse=True))
                m, u, y, qpi, keff, pic, p = jax.block_until_ready(intra(q, k, e, v, lam, doc, carry))
                cot = jax.jit(lambda *a: ptr._cotangents(cfg, *a, bf))
                cot_args = (doc, carry, p, u, y, s0s, d_out, dut)
                ut, d_m, d_a, _ = jax.block_until_ready(cot(*cot_args))
                key = jax.jit(lambda *a: ptr._key_grads(cfg, *a, (bf, bf, bf, jnp.float32)))
                key_args = (q, k, e, lam, doc, carry, p, s0s, dsc, d_out, dut, ut, d_m, d_a)
                jax.block_until_ready(key(*key_args))
                compile_s = time.time() - t0
                k1 = time_jax(intra, (q, k, e, v, lam, doc, carry), args.reps)[0]
                b2a = time_jax(cot, cot_args, args.reps)[0]
                b2b = time_jax(key, key_args, args.reps)[0]
            print(f"| {name} | {k1:.3f} | {b2a:.3f} | {b2b:.3f} | {compile_s:.1f} |", flush=True)
        except Exception as err:  # noqa: BLE001 - one failing variant must not stop the table
            print(f"| {name} | failed: {type(err).__name__}: {str(err)[:200]} | | |", flush=True)


if __name__ == "__main__":
    main()
