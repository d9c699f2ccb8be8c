"""Compile the Pallas TPU delta-rule kernels for real TPU generations through libtpu (no TPU needed) and print
the compile / VMEM / cost table of docs/benchmarks/tpu_compile.md.

    JAX_PLATFORMS=cpu TPU_ACCELERATOR_TYPE=v5litepod-4 TPU_WORKER_HOSTNAMES=localhost \
        .venv/bin/python tools/tpu_compile_report.py [--quick] [--gens v5e v6e v5p]

For every (generation, config) and program ("fwd" = pallas_tpu.run; "grad" = jax.value_and_grad of a loss of
both outputs, i.e. forward kernel + backward kernel):
  * compile the program through libtpu at the kernel's own vmem_limit_bytes (pallas_tpu.VMEM_LIMIT_BYTES) —
    this is what must work;
  * the scoped VMEM of the program's kernel (fwd: the forward kernel; grad: the backward kernel), measured
    from Mosaic's E1001 refusals under a too-small limit (see scoped_vmem_bytes);
  * whether that kernel also compiles under the generation's DEFAULT scoped limit (no vmem_limit_bytes);
  * cost_analysis() of the compiled program (for a Pallas kernel it reports the declared pl.CostEstimate;
    the grad program holds both kernels).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes on the box may hold libtpu's lock
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from mixerlab.pallas_kernels.delta_rule import pallas_tpu  # noqa: E402

TOPOLOGIES = {"v5e": "v5e:2x2", "v6e": "v6e:2x2", "v5p": "v5p:2x2x1"}
# (chunk, leaf, d_k, d_v, dtype)
CONFIGS = [
    (256, 8, 128, 128, "bfloat16"),  # Muir default
    (256, 8, 128, 128, "float32"),
    (256, 8, 256, 256, "bfloat16"),
    (128, 8, 64, 64, "bfloat16"),
    (128, 16, 128, 128, "bfloat16"),
    (64, 8, 128, 128, "bfloat16"),
    (64, 8, 256, 256, "bfloat16"),
]
QUICK = CONFIGS[:1] + CONFIGS[3:4]
SHAPE = dict(batch=1, length=1024, heads=2)
_OOM = re.compile(r"Scoped allocation with size ([0-9.]+)([KMG])")


def _mesh(gen):
    topo = topologies.get_topology_desc(TOPOLOGIES[gen], "tpu")
    return NamedSharding(Mesh(np.array(topo.devices[:1]), ("x",)), P())


def make_fn(chunk, leaf, backward, vmem_limit):
    def fwd(q, k, e, v, lam, s0, doc):
        return pallas_tpu.run(q, k, e, v, lam, s0, doc, chunk_size=chunk, leaf_size=leaf,
                              vmem_limit_bytes=vmem_limit)

    if not backward:
        return fwd

    def loss(q, k, e, v, lam, s0, doc):
        o, s = fwd(q, k, e, v, lam, s0, doc)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(s ** 2)

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5))


def arg_specs(dk, dv, dtype, sharding, batch, length, heads):
    sd = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
    x = (batch, length, heads)
    return [sd(x + (dk,), dtype), sd(x + (dk,), dtype), sd(x + (dk,), dtype), sd(x + (dv,), dtype),
            sd(x + (dk,), jnp.float32), sd((batch, heads, dk, dv), jnp.float32), sd((batch, length), jnp.int32)]


def compile_one(gen, chunk, leaf, dk, dv, dtype, backward, vmem_limit, shape=SHAPE):
    specs = arg_specs(dk, dv, jnp.dtype(dtype), _mesh(gen), **shape)
    return jax.jit(make_fn(chunk, leaf, backward, vmem_limit)).lower(*specs).compile()


def kernel_program(gen, chunk, leaf, dk, dv, dtype, which, vmem_limit, shape=SHAPE):
    """A program holding ONE kernel: the forward (``which="fwd"``) or the backward pallas_call, on the
    [B·H, T, D] layout the kernels see."""
    from mixerlab.pallas_kernels.delta_rule import pallas_tpu_bwd

    sharding = _mesh(gen)
    bh, t = shape["batch"] * shape["heads"], shape["length"]
    n = t // chunk
    cfg = pallas_tpu.KernelConfig(pallas_tpu.Geometry(chunk, leaf, dk, dv), shape["heads"],
                                  pallas_tpu.operand_dtype(dtype), False, vmem_limit)
    sd = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=sharding)  # noqa: E731
    dt = jnp.dtype(dtype)
    common = [sd((bh, t, dk), dt), sd((bh, t, dk), dt), sd((bh, t, dk), dt), sd((bh, t, dv), dt),
              sd((bh, t, dk), jnp.float32), sd((shape["batch"], t, 1), jnp.int32),
              sd((shape["batch"], n, 1, chunk), jnp.int32)]
    if which == "fwd":
        fn = lambda q, k, e, v, lam, dcol, drow, s0: pallas_tpu.forward_call(cfg, q, k, e, v, lam, dcol, drow, s0)  # noqa: E731
        specs = common + [sd((bh, dk, dv), jnp.float32)]
    else:
        fn = lambda *a: pallas_tpu_bwd.backward_call(cfg, *a)  # noqa: E731
        specs = common + [sd((bh, n, dk, dv), jnp.float32), sd((bh, t, dv), dt), sd((bh, dk, dv), jnp.float32)]
    return jax.jit(fn).lower(*specs).compile()


def scoped_vmem_bytes(gen, chunk, leaf, dk, dv, dtype, which):
    """Scoped VMEM of one kernel, from Mosaic's own refusals. Compiled under a limit that is too small, Mosaic
    fails with E1001 CompileTimeScopedVmemOom "Scoped allocation with size N and limit L"; N is the allocation
    that did not fit, which is not always the whole need (a first, smaller allocation can fail first). So the
    probe raises the limit to N + 4 KiB and compiles again until the kernel compiles; the last N is the
    kernel's scoped VMEM (checked by bisection on v5e C=256 d=128 bf16 fwd: 5.11 MiB both ways)."""
    limit, last = 1 << 20, None
    for _ in range(12):
        try:
            kernel_program(gen, chunk, leaf, dk, dv, dtype, which, vmem_limit=limit)
            return last if last is not None else float("nan")
        except Exception as err:  # noqa: BLE001 - the OOM is the measurement
            m = _OOM.search(str(err))
            if not m:
                raise
            size = float(m.group(1)) * {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}[m.group(2)]
            last = size
            limit = max(int(size) + 4096, 2 * limit if size <= limit else 0)
    raise RuntimeError("scoped VMEM probe did not converge")


def fits_default(gen, chunk, leaf, dk, dv, dtype, which):
    """Does the kernel compile WITHOUT vmem_limit_bytes (the generation's default scoped limit)? Returns
    ("yes", None) or ("no", the default limit Mosaic quotes in its refusal)."""
    try:
        kernel_program(gen, chunk, leaf, dk, dv, dtype, which, vmem_limit=None)
        return "yes", None
    except Exception as err:  # noqa: BLE001
        m = re.search(r"Scoped allocation with size ([0-9.]+[KMG]) and limit ([0-9.]+[KMG])", str(err))
        if m:
            return "no", m.group(2)
        raise


def report(gens, configs, out=sys.stdout):
    rows = []
    print(f"shape B={SHAPE['batch']} T={SHAPE['length']} H={SHAPE['heads']}; jax {jax.__version__}; "
          f"vmem_limit_bytes={pallas_tpu.VMEM_LIMIT_BYTES // 2 ** 20} MiB", file=out)
    print("| gen | C | n0 | d_k | d_v | dtype | program | compiles | compile s | scoped VMEM of its kernel (MiB) | "
          "fits default limit | cost flops (G) | cost transc. (M) | cost bytes (MB) |", file=out)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", file=out)
    for gen in gens:
        for chunk, leaf, dk, dv, dtype in configs:
            for backward in (False, True):
                t0 = time.time()
                try:
                    compiled = compile_one(gen, chunk, leaf, dk, dv, dtype, backward, pallas_tpu.VMEM_LIMIT_BYTES)
                except Exception as err:  # noqa: BLE001 - report and go on
                    row = (gen, chunk, leaf, dk, dv, dtype, "grad" if backward else "fwd",
                           "NO: " + str(err).splitlines()[0][:120])
                    rows.append(row)
                    print("| " + " | ".join(str(x) for x in row) + " |", file=out, flush=True)
                    continue
                dt = time.time() - t0
                cost = compiled.cost_analysis()
                cost = cost[0] if isinstance(cost, (list, tuple)) else cost
                vmem = scoped_vmem_bytes(gen, chunk, leaf, dk, dv, dtype, "bwd" if backward else "fwd")
                default_ok, default_limit = fits_default(gen, chunk, leaf, dk, dv, dtype,
                                                         "bwd" if backward else "fwd")
                row = (gen, chunk, leaf, dk, dv, dtype, "grad" if backward else "fwd", "yes", f"{dt:.1f}",
                       f"{vmem / 2 ** 20:.2f}", default_ok if default_limit is None else f"no (limit {default_limit})",
                       f"{cost.get('flops', 0) / 1e9:.2f}", f"{cost.get('transcendentals', 0) / 1e6:.2f}",
                       f"{cost.get('bytes accessed', 0) / 1e6:.1f}")
                rows.append(row)
                print("| " + " | ".join(str(x) for x in row) + " |", file=out, flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gens", nargs="+", default=list(TOPOLOGIES))
    p.add_argument("--quick", action="store_true", help="two configs only")
    a = p.parse_args(argv)
    rows = report(a.gens, QUICK if a.quick else CONFIGS)
    return 1 if any(str(r[7]).startswith("NO") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
