#!/usr/bin/env python3
"""What an op's compiled XLA program does, without an accelerator: FLOPs, bytes accessed and temporary memory
from the compiler's cost and memory analyses, and the largest intermediate buffers, for the forward and the
forward+backward of an op's implementation at a given shape (bf16 inputs, the 125M head shape by default).

    JAX_PLATFORMS=cpu python tools/op_cost.py --op interdomain --impl xla --batch 1 --length 4096
    JAX_PLATFORMS=cpu python tools/op_cost.py --op delta_rule --impl xla --batch 1 --length 4096

On a CPU the program is XLA:CPU's, whose fusions differ from a GPU's; the byte count is still the best
device-free estimate of an XLA form's HBM traffic (an H200 moves ≈ 4 TB/s), and the buffer list shows which
intermediates a fused kernel would keep on chip. Ops: interdomain (M = --modes), delta_rule (erase key and
per-head decay), vla, attention (``jax.nn.dot_product_attention`` causal, implementation --impl).
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
from bench_interdomain_gpu import (attention_case, attention_fn, delta_rule_case, delta_rule_fn,  # noqa: E402
                                   interdomain_case, interdomain_fn)
from bench_vla_gpu import vla_case, vla_fn  # noqa: E402
from benchlib import weighted_sum  # noqa: E402

_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1}
_SHAPE = re.compile(r"\s*(?:ROOT )?%?[\w.\-]+ = (\w+)\[([\d,]*)\]\{?[^ ]*\s+([\w\-]+)\(")


def case_and_fn(op, impl, b, t, sz):
    """(args, fn, argnums of the differentiable data inputs)."""
    key = jax.random.key(0)
    if op == "interdomain":
        return interdomain_case(b, t, sz, key), interdomain_fn(impl), (0, 1, 2)
    if op == "delta_rule":
        return delta_rule_case(b, t, sz, key), functools.partial(delta_rule_fn, implementation=impl), (0, 1, 2)
    if op == "vla":
        return vla_case(b, t, dict(sz, document=10 ** 9), 0), vla_fn(impl), (0, 1, 2)
    if op == "attention":
        return attention_case(b, t, sz, key), attention_fn(impl), (0, 1, 2)
    raise SystemExit(f"error: --op {op!r}: expected interdomain, delta_rule, vla or attention")


def largest_buffers(hlo_text: str, top: int, min_bytes: float):
    """[(total bytes, 'dtype[shape]', producing op)] over the instructions of an optimised HLO module."""
    sizes = collections.Counter()
    for line in hlo_text.splitlines():
        m = _SHAPE.match(line)
        if not m or m.group(1) not in _BYTES:
            continue
        n = 1
        for d in filter(None, m.group(2).split(",")):
            n *= int(d)
        nbytes = n * _BYTES[m.group(1)]
        if nbytes >= min_bytes:
            sizes[(f"{m.group(1)}[{m.group(2)}]", m.group(3))] += nbytes
    return [(v, *k) for k, v in sizes.most_common(top)]


def analyse(fn, args):
    compiled = jax.jit(fn).lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    memory = compiled.memory_analysis()
    return {"flops": float(cost.get("flops", 0.0)), "bytes": float(cost.get("bytes accessed", 0.0)),
            "temp_bytes": float(getattr(memory, "temp_size_in_bytes", 0) or 0), "hlo": compiled.as_text()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", required=True, choices=["interdomain", "delta_rule", "vla", "attention"])
    p.add_argument("--impl", default="xla", help="the op's implementation name (attention: xla, cudnn, …)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--dim", type=int, default=64, help="key and value head dimension")
    p.add_argument("--modes", type=int, default=64, help="interdomain: complex modes M")
    p.add_argument("--top", type=int, default=12, help="largest buffers listed")
    p.add_argument("--no_backward", action="store_true", help="analyse the forward only")
    a = p.parse_args(argv)
    sz = dict(heads=a.heads, key_dim=a.dim, value_dim=a.dim, modes=a.modes)
    args, fn, argnums = case_and_fn(a.op, a.impl, a.batch, a.length, sz)
    token_heads = a.batch * a.length * a.heads
    programs = [("forward", fn)]
    if not a.no_backward:
        programs.append(("forward+backward",
                         jax.grad(lambda *x: weighted_sum(fn(*x)), argnums=argnums)))
    print(f"{a.op}/{a.impl}, B {a.batch}, T {a.length}, H {a.heads}, d {a.dim}"
          + (f", M {a.modes}" if a.op == "interdomain" else "") + f", bf16, on {jax.default_backend()}")
    print("| program | GFLOP | GB accessed | bytes per token-head | temp GB |\n|---|---:|---:|---:|---:|")
    reports = []
    for name, f in programs:
        r = analyse(f, args)
        reports.append((name, r))
        print(f"| {name} | {r['flops'] / 1e9:.4g} | {r['bytes'] / 1e9:.4g} | {r['bytes'] / token_heads:,.0f} | "
              f"{r['temp_bytes'] / 1e9:.4g} |")
    for name, r in reports:
        print(f"\nlargest buffers of the {name} (summed over instructions with that shape and op):")
        for nbytes, shape, op in largest_buffers(r["hlo"], a.top, 1e6):
            print(f"  {nbytes / 1e6:9.0f} MB  {shape}  {op}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
