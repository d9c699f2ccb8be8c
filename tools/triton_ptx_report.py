"""Registers, spills and shared memory of the Pallas-Triton kernels (delta rule, short convolution, interdomain,
VLA A-pass), without a GPU.

Lowers forward+backward for CUDA on the CPU (as the CI lowering test does), captures the Triton IR that
Pallas hands to XLA, compiles it with a local Triton for sm_90a and runs ``ptxas -v`` on the PTX. Triton and
ptxas are not project dependencies: ``pip install triton==3.6.0`` (the GPU machine's version) into the venv
and have ``ptxas`` (CUDA ≥ 12.3) on the PATH. XLA's own Triton may schedule slightly differently; use this
for relative comparisons (did a change add spills?), then time on the GPU.

    python tools/triton_ptx_report.py [--chunk 64 --leaf 16] [--overrides '{"block_k": 16}'] [--kernels intra,key_grads]
        (stages of the sequential kernels: --overrides '{"stages_scan": 1, "stages_scan_output": 2}')
    python tools/triton_ptx_report.py --op short_conv [--overrides '{"bwd_block_t": 32}']   # at 32x4096x1024 bf16
    python tools/triton_ptx_report.py --op vla [--overrides '{"warps_forward": 2}']          # at 8x4096x12x64
    python tools/triton_ptx_report.py --op interdomain [--overrides '{"block_m_backward": 32}']  # the 125M shape
    python tools/triton_ptx_report.py --op ssd [--chunk 64 --overrides '{"warps_backward": 8}']   # Mamba-2 166M
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _capture_triton_modules(trace):
    """{kernel name: Triton IR text} of every Pallas-Triton call that ``trace()`` lowers."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    captured = {}
    lower = registration.lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = lower(*args, **kwargs)
        text = result.module.operation.get_asm(enable_debug_info=False)
        captured[re.search(r"tt.func (?:public )?@(\w+)", text).group(1)] = text
        return result

    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        trace()
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    return captured


def short_conv_modules(overrides, shape=(32, 4096, 1024, 4)):
    """The short-conv forward and backward kernels (bf16 x, f32 W, packed documents, SiLU) and their warps."""
    import jax
    import jax.numpy as jnp

    from mixerlab.pallas_kernels.short_conv import pallas_triton

    b, t, c, k = shape
    s = jax.ShapeDtypeStruct
    specs = (s((b, t, c), jnp.bfloat16), s((k, c), jnp.float32), s((b, t), jnp.int32))

    def loss(x, w, seg):
        return jnp.sum(pallas_triton.run(x, w, seg, True, jnp.bfloat16, **overrides).astype(jnp.float32))

    trace = lambda: jax.jit(jax.grad(loss, argnums=(0, 1))).trace(*specs).lower(lowering_platforms=("cuda",))  # noqa
    cfg = pallas_triton.make_config(t, c, **overrides)
    return _capture_triton_modules(trace), {"fwd": cfg.warps, "bwd_act": cfg.warps, "bwd_conv": cfg.bwd_warps}


def triton_modules(chunk, leaf, overrides, shape=(8, 4096, 16, 128, 128), dtype="bfloat16"):
    """({kernel name: Triton IR text} of forward + backward and of a forward alone (its fused scan_output),
    captured from the Pallas lowering; {kernel: warps}; {kernel: pipeline stages}), warps and stages as the
    kernels' Config chose them at this shape."""
    import jax
    import jax.numpy as jnp

    from mixerlab.pallas_kernels.delta_rule import pallas_triton

    b, t, h, dk, dv = shape
    s = jax.ShapeDtypeStruct
    specs = [s((b, t, h, dk), dtype)] * 3 + [s((b, t, h, dv), dtype), s((b, t, h, dk), jnp.float32),
                                                   s((b, h, dk, dv), jnp.float32), s((b, t), jnp.int32)]

    def loss(*a):
        out, state = pallas_triton.run(*a, chunk_size=chunk, leaf_size=leaf, **overrides)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(state)

    captured = _capture_triton_modules(
        lambda: jax.jit(jax.grad(loss, argnums=tuple(range(6)))).trace(*specs).lower(lowering_platforms=("cuda",)))
    alone = _capture_triton_modules(lambda: jax.jit(loss).trace(*specs).lower(lowering_platforms=("cuda",)))
    captured.update({name: text for name, text in alone.items() if name not in captured})
    cfg = pallas_triton.make_config(chunk, leaf, dk, dv, dtype, batch_heads=b * h, **overrides)
    warps = {name: getattr(cfg, f"warps_{name}", 4) for name in ("intra", "rhs", "scan", "output", "cotangents",
                                                                  "key_grads")}
    warps["scan_bwd"] = warps["scan_output"] = cfg.warps_scan
    warps["intra_alone"] = cfg.warps_intra
    stages = {"scan": cfg.stages_scan, "scan_bwd": cfg.stages_scan, "scan_output": cfg.stages_scan_output}
    return captured, warps, stages


def interdomain_modules(chunk, overrides, shape=(8, 4096, 12, 64, 64, 64)):
    """The interdomain kernels (forward + backward, bf16, the 125M shape by default) and their warps."""
    import jax
    import jax.numpy as jnp

    from mixerlab.pallas_kernels.interdomain import pallas_triton

    b, t, h, r, dv, m = shape
    s = jax.ShapeDtypeStruct
    f32 = jnp.float32
    specs = [s((b, t, h, r), jnp.bfloat16)] * 2 + [
        s((b, t, h, dv), jnp.bfloat16), s((b, t, h, m), f32), s((h, m), f32), s((h, 2 * m), f32),
        s((h, 2 * m, 2 * m), f32), s((b, h, 2 * m, r), f32), s((b, h, 2 * m, dv), f32), s((b, t), jnp.int32)]

    def loss(*a):
        o, key, value = pallas_triton.run(*a, chunk_size=chunk, **overrides)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(key) + jnp.sum(value)

    captured = _capture_triton_modules(
        lambda: jax.jit(jax.grad(loss, argnums=tuple(range(9)))).trace(*specs).lower(lowering_platforms=("cuda",)))
    cfg = pallas_triton.make_config(chunk, r, dv, m, jnp.bfloat16, **overrides)
    warps = {name.removeprefix("interdomain_"): cfg.warps_backward if name.endswith("_bwd") else cfg.warps_forward
             for name in captured}
    return captured, warps


def vla_modules(overrides, shape=(8, 4096, 12, 64)):
    """The VLA A-pass forward and backward kernels (f32 k̂, u; the 125M paper shape) and their warps."""
    import jax
    import jax.numpy as jnp

    from mixerlab.pallas_kernels.vla import pallas_triton

    b, t, h, d = shape
    s = jax.ShapeDtypeStruct
    specs = [s((b, t, h, d), jnp.float32)] * 2 + [s((b, h, d, d), jnp.float32), s((b, t), jnp.int32),
                                                  s((b, t), jnp.bool_)]

    def loss(*a):
        alpha, penalty = pallas_triton.penalty_pass(*a, lambda0=0.1, refresh_magnitude=1e-3, eps=1e-4, **overrides)
        return jnp.sum(alpha) + jnp.sum(penalty)

    trace = lambda: jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*specs).lower(lowering_platforms=("cuda",))  # noqa
    cfg = pallas_triton.make_config(d, lambda0=0.1, refresh_magnitude=1e-3, **overrides)
    return _capture_triton_modules(trace), {"forward": cfg.warps_forward, "forward_readout": cfg.warps_forward,
                                            "backward": cfg.warps_backward, "backward_adjoint": cfg.warps_backward,
                                            "backward_replay": cfg.warps_forward}


def ssd_modules(chunk, overrides, shape=(32, 4096, 1, 32, 128, 64)):
    """The SSD kernels (forward + backward, bf16, Mamba-2's 166M shape by default) and their warps."""
    import jax
    import jax.numpy as jnp

    from mixerlab.pallas_kernels.ssd import pallas_triton

    b, t, g, h, n, p = shape
    s = jax.ShapeDtypeStruct
    specs = (s((b, t, g, n), jnp.bfloat16), s((b, t, g, n), jnp.bfloat16), s((b, t, h, p), jnp.bfloat16),
             s((b, t, h), jnp.float32), s((b, h, n, p), jnp.float32), s((b, t), jnp.int32))

    def loss(*a):
        out, final = pallas_triton.run(*a, chunk_size=chunk, **overrides)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(final)

    trace = lambda: jax.jit(jax.grad(loss, argnums=tuple(range(5)))).trace(*specs).lower(  # noqa: E731
        lowering_platforms=("cuda",))
    cfg = pallas_triton.make_config(chunk, jnp.bfloat16, h // g, **overrides)
    return _capture_triton_modules(trace), {"forward": cfg.warps_forward, "forward_states": cfg.warps_forward,
                                            "forward_chunks": cfg.warps_forward,
                                            "backward_states": cfg.warps_forward,
                                            "backward_chunks": cfg.warps_backward}


def ptxas_report(ttir, num_warps, num_stages=3):
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ttir")
        with open(path, "w") as f:
            f.write(ttir)
        compiled = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=num_warps, num_stages=num_stages))
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        err = subprocess.run(["ptxas", "-v", "-arch=sm_90a", ptx, "-o", os.devnull], capture_output=True,
                             text=True).stderr
    number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, err)) else None  # noqa: E731
    return {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "shared_bytes": compiled.metadata.shared,
            "wgmma": compiled.asm["ptx"].count("wgmma.mma_async"), "barriers": compiled.asm["ptx"].count("bar.sync")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", default="delta_rule", choices=("delta_rule", "short_conv", "interdomain", "vla", "ssd"))
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--leaf", type=int, default=16)
    ap.add_argument("--overrides", default="{}", help="JSON dict of pallas_triton.Config fields")
    ap.add_argument("--kernels", default="", help="comma list of kernel names (default: all)")
    ap.add_argument("--dtype", default="bfloat16", help="delta rule: q, k, k̂, v̂ dtype (bfloat16, float32, float16)")
    a = ap.parse_args()
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("tools/triton_ptx_report.py needs Triton: pip install triton==3.6.0 (and ptxas on the PATH)")
    stages = {}  # delta rule: the sequential kernels' stages from its Config (others: 3, or 1 for the other ops)
    if a.op == "short_conv":
        modules, warps = short_conv_modules(json.loads(a.overrides))
    elif a.op == "vla":
        modules, warps = vla_modules(json.loads(a.overrides))
    elif a.op == "interdomain":
        modules, warps = interdomain_modules(a.chunk, json.loads(a.overrides))
    elif a.op == "ssd":
        modules, warps = ssd_modules(a.chunk, json.loads(a.overrides))
    else:
        modules, warps, stages = triton_modules(a.chunk, a.leaf, json.loads(a.overrides), dtype=a.dtype)
    wanted = set(filter(None, a.kernels.split(",")))
    print("| kernel | warps | registers | spill stores B | spill loads B | shared KB | wgmma | bar.sync |")
    print("|---|---|---|---|---|---|---|---|")
    for name, ttir in modules.items():
        short = (name.removeprefix("delta_rule_").removeprefix("short_conv_").removeprefix("vla_penalty_")
                 .removeprefix("interdomain_").removeprefix("ssd_"))
        if wanted and short not in wanted:
            continue
        w = warps.get(short, 4)
        r = ptxas_report(ttir, w, num_stages=stages.get(short, 3) if a.op == "delta_rule" else 1)
        print(f"| {short} | {w} | {r['registers']} | {r['spill_stores']} | {r['spill_loads']} | "
              f"{r['shared_bytes'] / 1024:.0f} | {r['wgmma']} | {r['barriers']} |", flush=True)


if __name__ == "__main__":
    main()
