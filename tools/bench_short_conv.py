"""Short convolution forward and forward+backward at one shape: autodiff of the plain forward, the XLA custom VJP
and the Pallas-Triton kernels (GPU), bf16 activations, float32 kernel, packed documents (mean length 512),
median of ``--reps`` warm runs.

    python tools/bench_short_conv.py --shape 32x4096x1024 [--reps 20] [--check] [--config block_t=64 ...]
    python tools/bench_short_conv.py --shape 32x4096x1024 --sweep     # pallas_triton only, a few block configs

``--check`` first compares pallas_triton with the xla custom VJP at the same shape and prints the max abs
difference of y, dx and dW (and the largest |value| of each, for scale). ``--config`` passes Pallas-Triton
block sizes (pallas_kernels/short_conv/pallas_triton.py, ``Config``); ``--sweep`` times pallas_triton with
each config of ``SWEEP`` on top of ``--config`` (forward blocks first, then backward ones). Off the GPU the
pallas_triton rows are skipped unless ``--interpret`` (a smoke test of this tool at a small shape, not a
timing).

The forward+backward column returns y as well as dx and dW: a jitted function returning only the gradients
lets XLA drop the forward pass, since the custom backward needs only x and W.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from benchlib import timed  # noqa: E402  (tools/benchlib.py)

from mixerlab.pallas_kernels.short_conv import pallas_triton, reference, xla  # noqa: E402

BF16 = jnp.dtype(jnp.bfloat16)
SWEEP = [  # each on top of the defaults (and of --config); forward blocks first, then the backward's pass 2
    {}, dict(block_t=16), dict(block_t=64), dict(block_c=256, warps=8), dict(block_t=64, warps=8),
    dict(bwd_block_t=8, bwd_block_c=64, bwd_warps=4), dict(bwd_block_c=64, bwd_steps=16),
    dict(bwd_block_t=32, bwd_steps=8), dict(bwd_warps=4), dict(bwd_steps=8), dict(bwd_steps=128),
]


def _median_ms(fn, args, reps):
    return timed(fn, args, reps)[0]


def _forward_and_backward(x, w, dy, fn):
    """y and (dx, dW): returning y keeps XLA from dropping the forward pass (the backward needs only x and W)."""
    y, vjp = jax.vjp(fn, x, w)
    return y, vjp(dy)


def _config(pairs):
    out = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if not value:
            raise SystemExit(f"--config {pair!r}: expected name=value (e.g. block_t=64)")
        out[name] = int(value)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="32x4096x1024", help="BxTxC")
    p.add_argument("--kernel-size", type=int, default=4)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--check", action="store_true", help="compare pallas_triton with xla before timing")
    p.add_argument("--config", nargs="*", default=[], help="pallas_triton Config fields, name=value")
    p.add_argument("--sweep", action="store_true", help="time pallas_triton with each config of SWEEP")
    p.add_argument("--interpret", action="store_true",
                   help="off the GPU: run pallas_triton in interpret mode (a smoke test of this tool, not a timing)")
    a = p.parse_args(argv)
    b, t, c = (int(n) for n in a.shape.split("x"))
    k = a.kernel_size
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((b, t, c), dtype=np.float32), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, c), dtype=np.float32) * 0.5)
    seg = jnp.asarray(np.cumsum(rng.random((b, t)) < 1 / 512, axis=1), jnp.int32)
    dy = jnp.asarray(rng.standard_normal((b, t, c), dtype=np.float32), jnp.bfloat16)
    overrides = _config(a.config)
    on_gpu = jax.default_backend() == "gpu"
    if a.interpret and not on_gpu:
        overrides["interpret"] = True

    def autodiff(x, w):
        return jax.nn.silu(reference.pre_activation(x, w, seg)).astype(jnp.bfloat16)

    def custom(x, w):
        return xla.causal_conv(x, w, seg, True, BF16)

    def triton(x, w, **extra):
        return pallas_triton.run(x, w, seg, True, BF16, **(overrides | extra))

    rows = [("autodiff", autodiff), ("xla custom VJP", custom)]
    with_triton = on_gpu or a.interpret
    if with_triton and a.sweep:
        rows = [(f"pallas_triton {extra or 'defaults'}", functools.partial(triton, **extra)) for extra in SWEEP]
    elif with_triton:
        rows.append(("pallas_triton" + ("" if on_gpu else " (interpret)"), triton))
    else:
        print(f"(backend {jax.default_backend()!r}: the pallas_triton row needs a GPU and is skipped)")

    if a.check and with_triton:
        run = lambda fn: jax.jit(functools.partial(_forward_and_backward, fn=fn))(x, w, dy)  # noqa: E731
        (y_want, (dx_want, dw_want)), (y_got, (dx_got, dw_got)) = run(custom), run(triton)
        want, got = (y_want, dx_want, dw_want), (y_got, dx_got, dw_got)
        print(f"check at {a.shape}, K={k}, bf16 x, f32 W: max |pallas_triton − xla| (max |xla|)")
        for name, g, e in zip(("y", "dx", "dW"), got, want):
            g, e = np.asarray(g, np.float32), np.asarray(e, np.float32)
            print(f"  {name}: {np.max(np.abs(g - e)):.3e}  ({np.max(np.abs(e)):.3e})")

    n_bytes = b * t * c * 2
    print(f"| {a.shape} K={k} bf16 | forward ms | forward+backward ms |")
    print("|---|---|---|")
    for name, fn in rows:
        fwd = jax.jit(fn)
        both = jax.jit(functools.partial(_forward_and_backward, fn=fn))
        print(f"| {name} | {_median_ms(fwd, (x, w), a.reps):.3f} | {_median_ms(both, (x, w, dy), a.reps):.3f} |")
    print(f"(memory-bound floor at 4 TB/s: forward {2 * n_bytes / 4e12 * 1e3:.3f} ms, "
          f"forward+backward {5 * n_bytes / 4e12 * 1e3:.3f} ms)")


if __name__ == "__main__":
    main()
