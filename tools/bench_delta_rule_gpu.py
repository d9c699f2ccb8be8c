#!/usr/bin/env python3
"""H200 check and benchmark of the Pallas-Triton delta-rule kernel (pallas_kernels/delta_rule/pallas_triton.py).

One script, one device call (see docs/benchmarks/delta_rule_h200.md for the command):
  1. correctness in float32 against our token-by-token reference (outputs, final state, gradients of all
     six inputs; relative RMS), also bf16 inputs and packed documents;
  2. against fla-core 0.6.0 ``fla.ops.gdn2.chunk_gdn2`` on the same GDN-2 inputs (mapping q̂ = scale·q,
     k̂ = b⊙k, v̂ = w⊙v, λ = g), outputs, final state and the gradients of q, k, v, g, b, w;
  3. timing, bf16, forward and forward+backward (median of warm runs): ours (core with precomputed gated
     vectors, and with the GDN-2 gates applied inside the same jit), fla ``chunk_gdn2``, jax-linear-attention
     ``gdn2`` (Mosaic GPU) and cuDNN flash attention, at B·T·H·D = 8·4096·16·128, 2·16384·16·128,
     1·32768·16·128; plus a per-kernel breakdown of ours.
Prints a table last; writes everything to $OUT/delta_rule_h200.json (or --out).
Every section is guarded: a failure is printed and the script moves on. ``--budget`` seconds bound the run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to torch as well

import numpy as np  # noqa: E402

T0 = time.time()
RESULTS: dict = {"sections": {}}
OVERRIDES: dict = {}  # pallas_triton.Config fields for every call of ours (--overrides)
TILING = {"chunk": 64, "leaf": 16}  # chunk and leaf of every call of ours (--chunk, --leaf)
GDN2_VARIANT = [True]
DEADLINE = [float("inf")]
# wall-clock time after which optional parts are skipped  # also time ours with the GDN-2 gates applied in the jit


def log(*args):
    print(f"[{time.time() - T0:7.1f}s]", *args, flush=True)


def save(path):
    with open(path, "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def rel_rms(x, ref):
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.sqrt(np.sum((x - ref) ** 2) / max(np.sum(ref ** 2), 1e-300)))


# ---------------------------------------------------------------------------------------------------------
# inputs (numpy f32): q, v ~ N(0,1); k L2-normalised; g = log σ(N(0,1)) per channel; b, w ~ U(0,1)


def gdn2_numpy(seed, b, t, h, dk, dv, initial_state=False):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, h, dk), dtype=np.float32)
    k = rng.standard_normal((b, t, h, dk), dtype=np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((b, t, h, dv), dtype=np.float32)
    g = -np.logaddexp(np.float32(0), -rng.standard_normal((b, t, h, dk), dtype=np.float32)).astype(np.float32)
    bb = rng.random((b, t, h, dk), dtype=np.float32)
    w = rng.random((b, t, h, dv), dtype=np.float32)
    s0 = (0.1 * rng.standard_normal((b, h, dk, dv), dtype=np.float32)) if initial_state else None
    return dict(q=q, k=k, v=v, g=g, b=bb, w=w, s0=s0)


# ---------------------------------------------------------------------------------------------------------
# ours


def ours_gdn2_fn(chunk, leaf, **overrides):
    """GDN-2 through our core: (q, k, v, g, b, w, s0, documents) -> (o, S_T); gates applied in the jit."""
    import jax.numpy as jnp
    from mixerlab.pallas_kernels.delta_rule import pallas_triton

    def fn(q, k, v, g, b, w, s0, doc):
        scale = q.shape[-1] ** -0.5
        dt = q.dtype
        qh = (q.astype(jnp.float32) * scale).astype(dt)
        kh = (b.astype(jnp.float32) * k.astype(jnp.float32)).astype(dt)
        vh = (w.astype(jnp.float32) * v.astype(jnp.float32)).astype(dt)
        return pallas_triton.run(qh, k, kh, vh, g.astype(jnp.float32), s0, doc, chunk_size=chunk, leaf_size=leaf,
                                 **{**OVERRIDES, **overrides})

    return fn


def time_jax(f, args, reps, warm=3):
    from benchlib import timed  # tools/benchlib.py

    return timed(f, args, reps, warm=warm)


def time_torch(f, reps, warm=3):
    import torch
    for _ in range(warm):
        f()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        f()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), min(times)


# ---------------------------------------------------------------------------------------------------------
# sections


def section_env():
    import jax
    info = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()], "python": sys.version.split()[0]}
    try:
        import jaxlib
        info["jaxlib"] = jaxlib.__version__
    except Exception:  # noqa: BLE001
        pass
    for name in ("torch", "triton", "fla", "jla"):
        try:
            mod = __import__(name)
            info[name] = getattr(mod, "__version__", "?")
        except Exception as exc:  # noqa: BLE001
            info[name] = f"unavailable: {exc!r}"[:200]
    try:
        import subprocess
        info["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm",
                                             "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    except Exception:  # noqa: BLE001
        pass
    return info


def section_compile_probe(shape):
    """Compile and run every kernel once on its own (bf16 and f32), so a Triton failure names its kernel."""
    import jax
    import jax.numpy as jnp
    from mixerlab.pallas_kernels import common
    from mixerlab.pallas_kernels.delta_rule import pallas_triton as ptr

    b, t, h, dk, dv = shape
    x = gdn2_numpy(7, b, t, h, dk, dv)
    out = {}
    for label, dt, prec in (("bf16", jnp.bfloat16, "tf32"),):
        cfg = ptr.make_config(TILING["chunk"], TILING["leaf"], dk, dv, dt, batch_heads=b * h, **{**OVERRIDES,
                              "inverse_precision": prec})
        q, k, e, v = (jnp.asarray(x[n]).astype(dt) for n in ("q", "k", "b", "v"))
        lam = jnp.asarray(x["g"])
        doc = jnp.zeros((b, t), jnp.int32)
        _, carry = common.chunk_documents(doc, 64)
        s0 = jnp.zeros((b, h, dk, dv), jnp.float32)
        steps = {}
        try:
            tt = time.time()
            m, u, y, qpi, keff, pic, p = jax.block_until_ready(
                jax.jit(lambda *a: ptr._intra(cfg, *a, with_inverse=True))(q, k, e, v, lam, doc, carry))
            steps["intra"] = round(time.time() - tt, 1)
            tt = time.time()
            s0s, ut, fin = jax.block_until_ready(jax.jit(lambda *a: ptr._scan(cfg, *a))(y, u, keff, pic, s0))
            steps["scan"] = round(time.time() - tt, 1)
            tt = time.time()
            o = jax.block_until_ready(jax.jit(lambda *a: ptr._output(cfg, *a, dt))(qpi, s0s, m, ut))
            steps["output"] = round(time.time() - tt, 1)
            tt = time.time()
            dsc, dut, dsi = jax.block_until_ready(jax.jit(lambda *a: ptr._scan_bwd(cfg, *a))(
                m, o, keff, qpi, y, pic, s0))
            steps["scan_bwd"] = round(time.time() - tt, 1)
            tt = time.time()
            jax.block_until_ready(jax.jit(lambda *a: ptr._grads(cfg, *a, (dt, dt, dt, dt, jnp.float32)))(
                q, k, e, lam, doc, carry, p, u, y, s0s, dsc, o, dut))
            steps["grads"] = round(time.time() - tt, 1)
        except Exception as exc:  # noqa: BLE001
            steps["error"] = repr(exc)[:3000]
            traceback.print_exc()
        out[label] = steps
        log("compile probe (seconds to compile+run)", label, steps)
    return out


def section_correctness_reference(shape):
    """Ours vs our token-by-token reference (f32 HIGHEST einsums) on the same inputs, with documents."""
    import jax
    import jax.numpy as jnp
    from mixerlab.pallas_kernels.delta_rule import pallas_triton, reference

    b, t, h, dk, dv = shape
    x = gdn2_numpy(0, b, t, h, dk, dv, initial_state=True)
    scale = dk ** -0.5
    core = dict(q=x["q"] * scale, k=x["k"], e=x["b"] * x["k"], v=x["w"] * x["v"], lam=x["g"], s0=x["s0"])
    bounds = np.zeros((b, t), np.int32)
    bounds[:, [t // 5 + 3, t // 2, (3 * t) // 4 + 7]] = 1  # boundaries inside chunks and one on a chunk edge
    doc = jnp.asarray(np.cumsum(bounds, axis=1).astype(np.int32))
    rng = np.random.default_rng(1)
    w_out = jnp.asarray(rng.standard_normal((b, t, h, dv), dtype=np.float32))
    w_state = jnp.asarray(rng.standard_normal((b, h, dk, dv), dtype=np.float32))
    names = ("q", "k", "e", "v", "lam", "s0")

    def loss_of(fn):
        def loss(*a):
            out, state = fn(*a)
            return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(state * w_state), (out, state)
        return jax.jit(jax.grad(loss, argnums=tuple(range(6)), has_aux=True))

    ref_args = [jnp.asarray(core[n]) for n in names]
    ref_grads, (ref_out, ref_state) = loss_of(lambda *a: reference.delta_rule_reference(*a, doc))(*ref_args)
    out = {}
    for label, dtype, precision in CORRECTNESS_MODES:
        dtype = jnp.dtype(dtype)
        args = [jnp.asarray(core[n]).astype(dtype) if n in ("q", "k", "e", "v") else jnp.asarray(core[n])
                for n in names]
        # reference on exactly the (rounded) inputs the kernel sees
        r_grads, (r_out, r_state) = (ref_grads, (ref_out, ref_state)) if dtype == jnp.float32 else loss_of(
            lambda *a: reference.delta_rule_reference(*[z.astype(jnp.float32) for z in a], doc))(*args)
        fn = lambda *a, p=precision: pallas_triton.run(*a, doc, chunk_size=TILING["chunk"], leaf_size=TILING["leaf"],
        # noqa: E731
                                                       **{**OVERRIDES, "inverse_precision": p})
        grads, (o, s) = loss_of(fn)(*args)
        # a forward alone (its own K1 and scan: another association of the same products) twice: against the
        # reference, and bit for bit against itself (a kernel that read an unwritten output block would differ)
        forward_alone = jax.jit(fn)
        o_alone = forward_alone(*args)[0]
        row = {"out": rel_rms(o, r_out), "state": rel_rms(s, r_state), "alone_out": rel_rms(o_alone, r_out),
               "finite": bool(np.all(np.isfinite(np.asarray(o, np.float32)))),
               "repeat_identical": bool(np.array_equal(np.asarray(forward_alone(*args)[0], np.float32),
                                                       np.asarray(o_alone, np.float32)))}
        for n, g, r in zip(names, grads, r_grads):
            row["d" + n] = rel_rms(g, r)
        out[label] = row
        log("ours vs reference", label, {k_: (f"{v_:.2e}" if isinstance(v_, float) else v_) for k_, v_ in row.items()})
    return out


def section_fla_compare(shape, dtype_name):
    """Ours vs fla chunk_gdn2 (and both vs our reference in f32) on the same GDN-2 inputs."""
    import jax
    import jax.numpy as jnp
    import torch
    from fla.ops.gdn2 import chunk_gdn2
    from mixerlab.pallas_kernels.delta_rule import reference

    b, t, h, dk, dv = shape
    x = gdn2_numpy(2, b, t, h, dk, dv, initial_state=True)
    rng = np.random.default_rng(3)
    w_out = rng.standard_normal((b, t, h, dv), dtype=np.float32)
    w_state = rng.standard_normal((b, h, dk, dv), dtype=np.float32)
    tdt = {"bf16": torch.bfloat16, "f32": torch.float32}[dtype_name]
    jdt = {"bf16": jnp.bfloat16, "f32": jnp.float32}[dtype_name]
    names = ("q", "k", "v", "g", "b", "w")

    # fla (torch)
    dev = "cuda"
    tin = {n: torch.tensor(x[n], device=dev).to(tdt if n != "g" else torch.float32).requires_grad_(True)
           for n in names}
    s0_t = torch.tensor(x["s0"], device=dev).requires_grad_(True)
    o_f, s_f = chunk_gdn2(tin["q"], tin["k"], tin["v"], tin["g"], tin["b"], tin["w"], scale=dk ** -0.5,
                          initial_state=s0_t, output_final_state=True)
    torch.autograd.backward([o_f, s_f], [torch.tensor(w_out, device=dev).to(o_f.dtype),
                                         torch.tensor(w_state, device=dev)])
    fla_out = o_f.detach().float().cpu().numpy()
    fla_state = s_f.detach().float().cpu().numpy()
    fla_grads = {n: tin[n].grad.float().cpu().numpy() for n in names}
    fla_grads["s0"] = s0_t.grad.float().cpu().numpy()

    # rounded inputs as both kernels see them
    rounded = {n: tin[n].detach().float().cpu().numpy() for n in names}
    w_o, w_s = jnp.asarray(w_out), jnp.asarray(w_state)
    doc = jnp.zeros((b, t), jnp.int32)

    def loss_of(fn):
        def loss(q, k, v, g, bb, w, s0):
            out, state = fn(q, k, v, g, bb, w, s0, doc)
            return jnp.sum(out.astype(jnp.float32) * w_o) + jnp.sum(state * w_s), (out, state)
        return jax.jit(jax.grad(loss, argnums=tuple(range(7)), has_aux=True))

    def ref_fn(q, k, v, g, bb, w, s0, d):
        f = lambda z: z.astype(jnp.float32)  # noqa: E731
        return reference.delta_rule_reference(f(q) * dk ** -0.5, f(k), f(bb) * f(k), f(w) * f(v), f(g), s0, d)

    jargs = [jnp.asarray(rounded[n]).astype(jdt if n != "g" else jnp.float32) for n in names] + [jnp.asarray(x["s0"])]
    ours_grads, (o_o, s_o) = loss_of(ours_gdn2_fn(TILING["chunk"], TILING["leaf"], **OVERRIDES))(*jargs)
    ref_args = [jnp.asarray(rounded[n]) for n in names] + [jnp.asarray(x["s0"])]
    ref_grads, (o_r, s_r) = loss_of(ref_fn)(*ref_args)
    all_names = names + ("s0",)
    table = {}
    for label, (o, s, grads) in {"ours": (o_o, s_o, ours_grads), "fla": (fla_out, fla_state, None)}.items():
        row = {"out_vs_ref": rel_rms(o, o_r), "state_vs_ref": rel_rms(s, s_r)}
        for i, n in enumerate(all_names):
            g = grads[i] if grads is not None else fla_grads[n]
            row["d" + n + "_vs_ref"] = rel_rms(g, ref_grads[i])
        table[label] = row
    cross = {"out": rel_rms(o_o, fla_out), "state": rel_rms(s_o, fla_state)}
    for i, n in enumerate(all_names):
        cross["d" + n] = rel_rms(ours_grads[i], fla_grads[n])
    table["ours_vs_fla"] = cross
    for k_, v_ in table.items():
        log(f"fla compare {dtype_name} {k_}", {a: f"{b_:.2e}" for a, b_ in v_.items()})
    return table


def core_inputs(shape, x=None):
    """([q̂, k, k̂, v̂, λ, S₀, documents], dO) in bf16 (λ, S₀ f32): the gated vectors precomputed, which is what
    the op's impl.run receives, from :func:`gdn2_numpy`'s draw (``x``, drawn here when None)."""
    import jax.numpy as jnp

    b, t, h, dk, dv = shape
    x = gdn2_numpy(4, b, t, h, dk, dv) if x is None else x
    bf = jnp.bfloat16
    core = [jnp.asarray(x["q"] * dk ** -0.5).astype(bf), jnp.asarray(x["k"]).astype(bf),
            jnp.asarray(x["b"] * x["k"]).astype(bf), jnp.asarray(x["w"] * x["v"]).astype(bf), jnp.asarray(x["g"]),
            jnp.zeros((b, h, dk, dv), jnp.float32), jnp.zeros((b, t), jnp.int32)]
    d_out = jnp.asarray(np.random.default_rng(5).standard_normal((b, t, h, dv), dtype=np.float32)).astype(bf)
    return core, d_out


def section_time_ours(shape, reps, breakdown=False, **overrides):
    chunk, leaf = TILING["chunk"], TILING["leaf"]
    overrides = {**OVERRIDES, **overrides}
    import jax
    import jax.numpy as jnp
    from mixerlab.pallas_kernels import common
    from mixerlab.pallas_kernels.delta_rule import pallas_triton as ptr

    b, t, h, dk, dv = shape
    x = gdn2_numpy(4, b, t, h, dk, dv)
    bf = jnp.bfloat16
    res = {}
    core, d_out = core_inputs(shape, x)

    def core_fn(*a):
        return ptr.run(*a, chunk_size=chunk, leaf_size=leaf, **overrides)

    fwd = jax.jit(core_fn)
    fwd_bwd = jax.jit(lambda *a: jax.vjp(lambda *z: core_fn(*z, a[6])[0], *a[:6])[1](d_out))
    res["core_fwd"] = time_jax(fwd, core, reps)
    log("ours core fwd", shape, res["core_fwd"])
    res["core_fwd_bwd"] = time_jax(fwd_bwd, core, reps)
    log("ours core fwd+bwd", shape, res["core_fwd_bwd"])
    # the no-erase specialisation (erase_key=None: no A, no inverse, no solve) on the same q̂, k, v̂, λ
    plain_fn = lambda q, k, v, lam, s0, doc: core_fn(q, k, None, v, lam, s0, doc)  # noqa: E731
    plain = [core[0], core[1], *core[3:]]
    res["core_no_erase_fwd"] = time_jax(jax.jit(plain_fn), plain, reps)
    res["core_no_erase_fwd_bwd"] = time_jax(
        jax.jit(lambda *a: jax.vjp(lambda *z: plain_fn(*z, a[5])[0], *a[:5])[1](d_out)), plain, reps)
    log("ours core no erase fwd / fwd+bwd", shape, res["core_no_erase_fwd"], res["core_no_erase_fwd_bwd"])
    if GDN2_VARIANT[0]:  # GDN-2 with the gates applied inside the same jit
        gd = [jnp.asarray(x[n]).astype(bf if n != "g" else jnp.float32) for n in ("q", "k", "v", "g", "b", "w")]
        gd += [jnp.zeros((b, h, dk, dv), jnp.float32), jnp.zeros((b, t), jnp.int32)]
        gfn = ours_gdn2_fn(chunk, leaf, **overrides)
        res["gdn2_fwd"] = time_jax(jax.jit(gfn), gd, reps)
        res["gdn2_fwd_bwd"] = time_jax(
            jax.jit(lambda *a: jax.vjp(lambda *z: gfn(*z, a[6], a[7])[0], *a[:6])[1](d_out)), gd, reps)
        log("ours gdn2 fwd / fwd+bwd", shape, res["gdn2_fwd"], res["gdn2_fwd_bwd"])
    if breakdown and DEADLINE[0] - time.time() > 40:
        cfg = ptr.make_config(chunk, leaf, dk, dv, bf, batch_heads=b * h, **overrides)
        q, k, e, v, lam, s0, doc = core
        _, carry = common.chunk_documents(doc, chunk)
        intra = jax.jit(lambda *a: ptr._intra(cfg, *a, with_inverse=False))
        intra_p = jax.jit(lambda *a: ptr._intra(cfg, *a, with_inverse=True))
        m, u, y, qpi, keff, pic, p = intra_p(q, k, e, v, lam, doc, carry)
        scan = jax.jit(lambda *a: ptr._scan(cfg, *a))
        s0s, ut, fin = scan(y, u, keff, pic, s0)
        output = jax.jit(lambda *a: ptr._output(cfg, *a, bf))
        scan_output = jax.jit(lambda *a: ptr._scan_output(cfg, *a, bf))  # K2 + K3 of a forward alone
        alone_parts = {}  # the kernels of a forward alone (none apart from training's without fuse_output)
        if cfg.fuse_output and cfg.fold_solve:  # its K1 and what its scan reads (V̂ by token, M P, Pᵀ(K⊙E))
            intra_alone = jax.jit(lambda *a: ptr._intra_alone(cfg, *a))
            mp, kpi, qpi_, gk, pic_ = intra_alone(q, k, e, lam, doc, carry)
            alone_parts = {"K1_intra_alone": (intra_alone, (q, k, e, lam, doc, carry)),
                           "K2_scan_output": (scan_output, (kpi, v, gk, pic_, qpi_, mp, s0))}
        elif cfg.fuse_output:
            alone_parts = {"K2_scan_output": (scan_output, (y, u, keff, pic, qpi, m, s0))}
        scan_bwd = jax.jit(lambda *a: ptr._scan_bwd(cfg, *a))
        dsc, dut, dsi = scan_bwd(m, d_out, keff, qpi, y, pic, s0)
        rhs = jax.jit(lambda *a: ptr._rhs(cfg, *a))
        cot = jax.jit(lambda *a: ptr._cotangents(cfg, *a, bf))
        cot_args = (doc, carry, p, u, y, s0s, d_out, dut)
        ut_, d_m, d_a, _ = cot(*cot_args)
        key = jax.jit(lambda *a: ptr._key_grads(cfg, *a, (bf, bf, bf, jnp.float32)))
        parts = {
            "K1_intra": (intra, (q, k, e, v, lam, doc, carry)),
            "K1_intra_with_P": (intra_p, (q, k, e, v, lam, doc, carry)),
            "K2_scan": (scan, (y, u, keff, pic, s0)),
            "K3_output": (output, (qpi, s0s, m, ut)),
            **alone_parts,
            "B0_rhs": (rhs, (q, k, e, v, lam, doc, carry, p)),
            "B1_scan_bwd": (scan_bwd, (m, d_out, keff, qpi, y, pic, s0)),
            "B2a_cotangents": (cot, cot_args),
            "B2b_key_grads": (key, (q, k, e, lam, doc, carry, p, s0s, dsc, d_out, dut, ut_, d_m, d_a)),
        }
        res["breakdown"] = {}
        for name, (f, a) in parts.items():
            res["breakdown"][name] = time_jax(f, a, reps)
            log("  kernel", name, res["breakdown"][name])
    return res


def section_time_fla(shape, reps):
    import torch
    from fla.ops.gdn2 import chunk_gdn2

    b, t, h, dk, dv = shape
    x = gdn2_numpy(4, b, t, h, dk, dv)
    dev = "cuda"
    tin = {n: torch.tensor(x[n], device=dev).to(torch.bfloat16 if n != "g" else torch.float32)
           for n in ("q", "k", "v", "g", "b", "w")}
    d_out = torch.randn(b, t, h, dv, device=dev, dtype=torch.bfloat16)
    res = {}
    with torch.no_grad():
        res["fwd"] = time_torch(lambda: chunk_gdn2(tin["q"], tin["k"], tin["v"], tin["g"], tin["b"], tin["w"]), reps)
    leaves = [tin[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "b", "w")]

    def fb():
        o, _ = chunk_gdn2(*leaves)
        torch.autograd.grad(o, leaves, d_out)

    res["fwd_bwd"] = time_torch(fb, reps)
    log("fla chunk_gdn2", shape, res)
    tin.clear()  # free the GPU buffers before the next section
    leaves.clear()
    torch.cuda.empty_cache()
    return res


def jla_functions(shape):
    """(jitted forward, jitted forward + backward, arguments) of jax-linear-attention's GDN-2 (Mosaic GPU) on the
    inputs of this benchmark (also timed by tools/ab_delta_rule_gpu.py --jla)."""
    import jax
    import jax.numpy as jnp
    from jla.ops import linear_attention

    b, t, h, dk, dv = shape
    x = gdn2_numpy(4, b, t, h, dk, dv)
    bf = jnp.bfloat16
    args = [jnp.asarray(x[n]).astype(bf if n != "g" else jnp.float32) for n in ("q", "k", "v", "g", "b", "w")]
    d_out = jnp.asarray(np.random.default_rng(5).standard_normal((b, t, h, dv), dtype=np.float32)).astype(bf)

    def fn(q, k, v, g, bb, w):
        return linear_attention("gdn2", q, k, v, impl="mosaic_gpu", g=g, b=bb, w=w, scale=dk ** -0.5)[0]

    return jax.jit(fn), jax.jit(lambda *a: jax.vjp(fn, *a)[1](d_out)), args


def section_time_jla(shape, reps):
    fwd, fwd_bwd, args = jla_functions(shape)
    res = {"fwd": time_jax(fwd, args, reps), "fwd_bwd": time_jax(fwd_bwd, args, reps)}
    log("jla gdn2 mosaic_gpu", shape, res)
    return res


def section_time_cudnn(shape, reps):
    import jax
    import jax.numpy as jnp

    b, t, h, dk, dv = shape
    rng = np.random.default_rng(6)
    args = [jnp.asarray(rng.standard_normal((b, t, h, dk), dtype=np.float32)).astype(jnp.bfloat16) for _ in range(3)]
    d_out = args[0]

    def fn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", is_causal=True)

    res = {"fwd": time_jax(jax.jit(fn), args, reps),
           "fwd_bwd": time_jax(jax.jit(lambda *a: jax.vjp(fn, *a)[1](d_out)), args, reps)}
    log("cudnn attention", shape, res)
    return res


def guarded(name, fn, *args, **kw):
    t = time.time()
    try:
        out = fn(*args, **kw)
    except Exception as exc:  # noqa: BLE001
        log(f"SECTION {name} FAILED: {exc!r}"[:2000])
        traceback.print_exc()
        out = {"error": repr(exc)[:4000]}
    RESULTS["sections"][name] = out
    RESULTS["sections"][name + "_seconds"] = round(time.time() - t, 1)
    return out


CORRECTNESS_MODES = [("f32_highest", "float32", "highest"), ("f32_tf32", "float32", "tf32"),
                     ("bf16", "bfloat16", "tf32")]
SHAPES = {"8x4096": (8, 4096, 16, 128, 128), "2x16384": (2, 16384, 16, 128, 128), "1x32768": (1, 32768, 16, 128, 128)}
ANCHORS = {"8x4096": {"fla": 11.56, "jla": 6.59, "cudnn": 4.28}, "2x16384": {"fla": 12.68, "jla": 6.59, "cudnn": 14.87},
           "1x32768": {"fla": 14.44, "jla": 7.30, "cudnn": 28.42}}


def fmt(x):
    if isinstance(x, (tuple, list)) and x and isinstance(x[0], (int, float)):
        return f"{x[0]:.2f}"
    return "—"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "delta_rule_h200.json"))
    ap.add_argument("--budget", type=float, default=520.0, help="seconds; later sections are skipped past it")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--shapes", default="8x4096,2x16384,1x32768")
    ap.add_argument("--skip", default="", help="comma list: correctness,fla_compare,fla,jla,cudnn,breakdown")
    ap.add_argument("--overrides", default="{}", help="JSON dict of pallas_triton.Config overrides")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--leaf", type=int, default=16)
    ap.add_argument("--correctness-shape", default="2,1024,4,128,128")
    ap.add_argument("--modes", default="f32_highest,f32_tf32,bf16", help="correctness modes to run")
    ap.add_argument("--no-gdn2-variant", action="store_true")
    ap.add_argument("--fla-dtypes", default="bf16", help="dtypes of the fla comparison (bf16,f32); each costs "
                    "minutes of fla autotuning on a fresh machine")
    ap.add_argument("--cpu-smoke", action="store_true", help="interpret mode, tiny shapes, no torch (script check)")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    OVERRIDES.update(json.loads(args.overrides))
    TILING.update(chunk=args.chunk, leaf=args.leaf)
    corr_shape = tuple(int(v) for v in args.correctness_shape.split(","))
    CORRECTNESS_MODES[:] = [m for m in CORRECTNESS_MODES if m[0] in args.modes.split(",")]
    GDN2_VARIANT[0] = not args.no_gdn2_variant
    DEADLINE[0] = T0 + args.budget
    if args.cpu_smoke:
        OVERRIDES["interpret"] = True
        SHAPES.clear()
        SHAPES["smoke"] = (1, 128, 2, 32, 32)
        args.shapes, corr_shape = "smoke", (1, 128, 2, 32, 32)
        skip |= {"fla_compare", "fla", "jla", "cudnn"}
    left = lambda: args.budget - (time.time() - T0)  # noqa: E731

    RESULTS["env"] = guarded("env", section_env)
    log("env", RESULTS["env"])
    if "probe" not in skip:
        guarded("compile_probe", section_compile_probe, (1, 256, 2) + corr_shape[3:])
    if "correctness" not in skip:
        guarded("correctness_vs_reference", section_correctness_reference, corr_shape)
        save(args.out)
    if "fla_compare" not in skip:
        for dt in args.fla_dtypes.split(","):
            guarded(f"fla_compare_{dt}", section_fla_compare, corr_shape, dt)
        save(args.out)
    timings = {}
    for key in args.shapes.split(","):
        shape = SHAPES[key]
        timings[key] = {}
        if left() < 60:
            log("budget: skipping timing of", key)
            continue
        timings[key]["ours"] = guarded(f"time_ours_{key}", section_time_ours, shape, args.reps,
                                       breakdown=("breakdown" not in skip and key in ("8x4096", "smoke")))
        save(args.out)
        for name, fn in (("fla", section_time_fla), ("jla", section_time_jla), ("cudnn", section_time_cudnn)):
            if name in skip or left() < 30:
                continue
            timings[key][name] = guarded(f"time_{name}_{key}", fn, shape, args.reps)
            save(args.out)
    RESULTS["timings"] = timings
    save(args.out)

    print("\n=== bf16 timings, median ms (fwd / fwd+bwd); anchors from docs: fla, jla, cudnn fwd+bwd ===")
    print("| B·T·H·D | ours core | ours core, no erase | ours GDN-2 (gates in jit) | fla chunk_gdn2 "
          "| jla gdn2 (Mosaic GPU) | cuDNN attention |")
    print("|---|---|---|---|---|---|---|")
    for key, row in timings.items():
        o = row.get("ours", {})
        cell = lambda r, a="fwd", b="fwd_bwd": f"{fmt(r.get(a))} / {fmt(r.get(b))}" if isinstance(r, dict) else "—"
        # noqa
        print(f"| {key}·16·128 | {cell(o, 'core_fwd', 'core_fwd_bwd')} | "
              f"{cell(o, 'core_no_erase_fwd', 'core_no_erase_fwd_bwd')} | {cell(o, 'gdn2_fwd', 'gdn2_fwd_bwd')} | "
              f"{cell(row.get('fla', {}))} | {cell(row.get('jla', {}))} | {cell(row.get('cudnn', {}))} |")
    first = next(iter(timings.values()), {})
    bd = first.get("ours", {}).get("breakdown") if isinstance(first.get("ours"), dict) else None
    if bd:
        print("breakdown 8x4096 (ms):", {k: f"{v[0]:.3f}" for k, v in bd.items()})
    c = RESULTS["sections"].get("correctness_vs_reference", {})
    for label, row in c.items() if isinstance(c, dict) else ():
        if isinstance(row, dict):
            print("vs reference", label, {k: (f"{v:.1e}" if isinstance(v, float) else v) for k, v in row.items()})
    log("done; results in", args.out)


if __name__ == "__main__":
    main()
