"""Short convolution forward+backward: the custom VJP of mixers/short_conv.py against autodiff of the same
forward, bf16 activations, packed documents, median of ``--reps`` warm runs.

    python tools/bench_short_conv.py --shape 32x4096x1024 [--reps 20]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mixerlab.mixers import short_conv  # noqa: E402


def _median_ms(fn, args, reps):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="32x4096x1024")
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args(argv)
    b, t, c = (int(n) for n in a.shape.split("x"))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((b, t, c), dtype=np.float32), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4, c), dtype=np.float32) * 0.5)
    seg = jnp.asarray(np.cumsum(rng.random((b, t)) < 1 / 512, axis=1), jnp.int32)
    dy = jnp.asarray(rng.standard_normal((b, t, c), dtype=np.float32), jnp.bfloat16)

    def autodiff(x, w):
        return jax.nn.silu(short_conv._pre_activation(x, w, seg)).astype(jnp.bfloat16)

    def custom(x, w):
        return short_conv.causal_conv(x, w, seg, True, jnp.dtype(jnp.bfloat16))

    print(f"| {a.shape} bf16 | forward ms | forward+backward ms |")
    print("|---|---|---|")
    for name, fn in (("autodiff", autodiff), ("custom VJP", custom)):
        fwd = jax.jit(fn)
        both = jax.jit(lambda x, w, fn=fn: jax.vjp(fn, x, w)[1](dy))
        print(f"| {name} | {_median_ms(fwd, (x, w), a.reps):.3f} | {_median_ms(both, (x, w), a.reps):.3f} |")


if __name__ == "__main__":
    main()
