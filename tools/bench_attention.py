"""Attention op benchmark: forward and forward+backward medians of each implementation at the shapes given,
bf16, packed documents (every row split into documents of random lengths), with the error against the
float32 dense reference at a small shape first.

    python tools/bench_attention.py --shapes 8x4096x16x128,2x16384x16x128 --impls "pallas_triton;cudnn;xla"

Also times cuDNN's causal attention without documents (``cudnn_causal``: one document per row), the anchor
for what a fused kernel reaches on this GPU. Prints a table; ``--out`` writes the numbers as JSON.
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
from benchlib import timed  # noqa: E402  (tools/benchlib.py)


def _inputs(b, t, h, d, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v, g = (jax.random.normal(kk, (b, t, h, d), jnp.bfloat16) for kk in keys)
    rng = np.random.default_rng(seed)
    seg = np.concatenate([np.repeat(np.arange(1, 64), rng.integers(t // 16, t // 2, 63))[:t][None]] * b)
    return q, k, v, g, jnp.asarray(seg, jnp.int32)


def _median_ms(fn, args, reps):
    return timed(fn, args, reps)[0]


def _fns(impl):
    from mixerlab.pallas_kernels.attention import attention, pallas_triton
    from mixerlab.pallas_kernels.common import document_index

    if impl.startswith("triton:"):  # triton:bq,bk,bq_dkv,bkv_dkv,bq_dq,bkv_dq,warps — a block-size variant
        bq, bk, *bwd, warps = (int(x) for x in impl.split(":")[1].split(","))

        def fwd(q, k, v, seg):
            return pallas_triton.run(q, k, v, document_index(seg, *seg.shape), scale=q.shape[-1] ** -0.5,
                                     block_q=bq, block_k=bk, backward_blocks=tuple(bwd), num_warps=warps or None)
    elif impl == "cudnn_causal":
        fwd = lambda q, k, v, seg: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    else:
        fwd = lambda q, k, v, seg: attention(q, k, v, segment_ids=seg, implementation=impl)

    def fwd_bwd(q, k, v, seg, g):
        out, vjp = jax.vjp(lambda *x: fwd(*x, seg), q, k, v)
        return out, vjp(g)

    return jax.jit(fwd), jax.jit(fwd_bwd)


def check(impls):
    from mixerlab.pallas_kernels.attention import attention

    q, k, v, g, seg = _inputs(2, 1000, 4, 128, seed=1)
    ref = attention(*(x.astype(jnp.float32) for x in (q, k, v)), segment_ids=seg, implementation="xla")
    rows = {}
    for impl in impls:
        if impl == "cudnn_causal" or impl.startswith("triton:"):
            continue
        got = jax.jit(lambda *a: attention(*a, segment_ids=seg, implementation=impl))(q, k, v)
        rows[impl] = float(jnp.linalg.norm((got.astype(jnp.float32) - ref)) / jnp.linalg.norm(ref))
        print(f"check {impl}: relative error vs f32 dense {rows[impl]:.2e}", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="8x4096x16x128", help="BxTxHxD,... (default 8x4096x16x128)")
    p.add_argument("--impls", default="pallas_triton;cudnn;cudnn_causal",
                   help="';'-separated implementations, or triton:bq,bk,bq_dkv,bkv_dkv,bq_dq,bkv_dq,warps variants")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out")
    args = p.parse_args(argv)
    impls = args.impls.split(";")
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "check": check(impls), "timings": {}}
    for shape in args.shapes.split(","):
        b, t, h, d = (int(x) for x in shape.split("x"))
        q, k, v, g, seg = _inputs(b, t, h, d)
        for impl in impls:
            fwd, fwd_bwd = _fns(impl)
            try:
                row = [_median_ms(fwd, (q, k, v, seg), args.reps), _median_ms(fwd_bwd, (q, k, v, seg, g), args.reps)]
            except Exception as e:  # e.g. out of memory for the dense paths at long T
                row = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            result["timings"].setdefault(shape, {})[impl] = row
            print(f"{shape} {impl}: {row}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    print(f"\n| B·T·H·D | {' | '.join(impls)} |  (median ms, fwd / fwd+bwd, bf16)")
    print("|---|" + "---|" * len(impls))
    for shape, row in result["timings"].items():
        cells = [f"{v[0]:.2f} / {v[1]:.2f}" if isinstance(v, list) else "failed" for v in row.values()]
        print(f"| {shape.replace('x', '·')} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
