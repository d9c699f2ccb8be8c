"""Scoped VMEM of each Pallas TPU interdomain kernel per TPU generation, compiled through libtpu (no TPU needed);
prints the VMEM table of docs/kernels.md ('TPU: interdomain attention').

    JAX_PLATFORMS=cpu TPU_ACCELERATOR_TYPE=v5litepod-4 TPU_WORKER_HOSTNAMES=localhost \\
        .venv/bin/python tools/interdomain_tpu_vmem.py [--gens v5e v6e v5p]

Each kernel is compiled alone on the [B·H, T, D] layout it sees (B·H = 2, T = 512), first under the
generation's default scoped limit (must work), then under a too-small limit: Mosaic's E1001 refusal
"Scoped allocation with size N" names what it needed; the limit is raised to N + 4 KiB until the kernel
compiles, and the last N is the kernel's scoped VMEM (the probe of tools/tpu_compile_report.py); "< 1": it
compiled under the first limit tried, 1 MiB.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from mixerlab.pallas_kernels.interdomain import pallas_tpu, pallas_tpu_bwd  # noqa: E402

TOPOLOGIES = {"v5e": "v5e:2x2", "v6e": "v6e:2x2", "v5p": "v5p:2x2x1"}
# (chunk, R = Dv, M, operand dtype)
CONFIGS = [(64, 64, 64, "bfloat16"), (64, 64, 64, "float32"), (128, 128, 128, "bfloat16"),
           (128, 128, 128, "float32")]
KERNELS = ("query", "output", "query_bwd", "output_bwd")
BATCH, HEADS, LENGTH = 1, 2, 512
_OOM = re.compile(r"Scoped allocation with size ([0-9.]+)([KMG])")


def kernel_program(gen, chunk, d, m, dtype, kernel, vmem_limit):
    """Compile ONE kernel's pallas_call (``kernel`` in KERNELS) for ``gen`` under ``vmem_limit`` (None: default)."""
    topo = topologies.get_topology_desc(TOPOLOGIES[gen], "tpu")
    rep = NamedSharding(Mesh(np.array(topo.devices[:1]), ("x",)), P())
    sd = lambda s, dt=jnp.float32: jax.ShapeDtypeStruct(s, dt, sharding=rep)  # noqa: E731
    bh, t, n = BATCH * HEADS, LENGTH, LENGTH // chunk
    cfg = pallas_tpu.KernelConfig(chunk, d, d, m, HEADS, dtype, False, vmem_limit)
    cdt = jnp.dtype(dtype)
    tok, modes = sd((bh, t, d), cdt), sd((bh, t, m))
    params, state = sd((HEADS, 3, m)), sd((bh, n, 2 * m, d))
    docs = [sd((BATCH, t, 1), jnp.int32), sd((BATCH, n, 1, chunk), jnp.int32)]
    pairs = sd((bh, n, chunk, chunk), cdt)
    calls = {
        "query": (lambda *a: pallas_tpu._query_call(cfg, *a, save_scores=True),
                  [tok, tok, modes, params, state, *docs]),
        "output": (lambda *a: pallas_tpu._output_call(cfg, *a, save_pairs=True),
                   [modes, modes, tok, modes, params, state, *docs]),
        "query_bwd": (lambda *a: pallas_tpu_bwd.query_bwd_call(cfg, *a),
                      [tok, tok, modes, params, state, *docs, pairs, modes, modes]),
        "output_bwd": (lambda *a: pallas_tpu_bwd.output_bwd_call(cfg, *a),
                       [modes, modes, tok, modes, params, state, *docs, pairs, tok]),
    }
    fn, specs = calls[kernel]
    return jax.jit(fn).lower(*specs).compile()


def scoped_vmem_bytes(gen, chunk, d, m, dtype, kernel):
    limit, last = 1 << 20, None
    for _ in range(12):
        try:
            kernel_program(gen, chunk, d, m, dtype, kernel, limit)
            return last  # None: it compiled under the first limit (1 MiB)
        except Exception as err:  # noqa: BLE001 - the OOM is the measurement
            found = _OOM.search(str(err))
            if not found:
                raise
            last = float(found.group(1)) * {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}[found.group(2)]
            limit = max(int(last) + 4096, 2 * limit if last <= limit else 0)
    raise RuntimeError("scoped VMEM probe did not converge")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gens", nargs="+", default=list(TOPOLOGIES), choices=list(TOPOLOGIES))
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}; B·H = {BATCH * HEADS}, T = {LENGTH}; scoped VMEM in MiB per kernel "
          f"({' / '.join(KERNELS)}); every kernel also compiles under the default limit")
    print("| C | R = Dv | M | operands | " + " | ".join(args.gens) + " |")
    print("|---|---|---|---|" + "---|" * len(args.gens))
    for chunk, d, m, dtype in CONFIGS:
        cells = []
        for gen in args.gens:
            sizes = []
            for kernel in KERNELS:
                kernel_program(gen, chunk, d, m, dtype, kernel, None)  # the default limit must be enough
                sizes.append(scoped_vmem_bytes(gen, chunk, d, m, dtype, kernel))
            cells.append(" / ".join("< 1" if s is None else f"{s / 2 ** 20:.2f}" for s in sizes))
        print(f"| {chunk} | {d} | {m} | {dtype} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
