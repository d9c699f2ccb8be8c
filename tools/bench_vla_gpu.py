#!/usr/bin/env python3
"""GPU benchmark of the VLA op: "xla" (chunked Woodbury–Cholesky A-pass) vs "pallas_triton" (token-level
Sherman–Morrison kernel), the A-pass alone, and the delta rule beside it.

One process, bf16 inputs, median of ``--reps`` (default 10) warm runs after a compile + warm-up call:
  0. ``--check`` (first): max errors of pallas_triton vs xla at B 2, T 1024 (packed documents, defaults
     λ₀ 0.1, P 20, ρ 1e-3): o, S, A and the gradients of q, k, v and the penalty key (on the GPU), both
     relative to the largest |xla| entry;
  1. training shapes, B·T = 32K tokens at T = 4K / 16K, H 12, Dk = Dv 64 (the 125M paper shape), packed
     documents of mean length ~1500: forward and forward+backward (``jax.grad`` of a weighted output sum
     w.r.t. q, k, v, penalty key) of
       - ``vla/<impl>``: the op (A-pass, then the delta-rule S-pass) for impl in xla, pallas_triton;
       - ``vla_a_pass/<impl>``: the A-pass alone (α̂ from k̂, u; grads w.r.t. both);
       - ``delta_rule/auto``: the delta rule as VLA's S-pass calls it (write key α̂, erase key k̂, no decay);
  2. ``--sweep-warps``: the Triton A-pass alone at T = 4K for num_warps (forward, backward) pairs;
  3. ``--forwards``: the Triton A-pass alone at T = 4K with each forward kernel (token by token; by chunks,
     16 or 32 rows, 4 or 8 warps) and its α̂ and gradients against the token form's;
  4. ``--backwards``: the same with each backward (one kernel; split: the Ā scan on 2, 4 or 8 warps, then the
     replay per anchor block; and both split kernels, the forward's g read out per anchor block) and its
     gradients against the one-kernel backward's.
Prints Markdown tables; writes every number to ``--out`` (JSON). A failing row keeps its error; the run goes on.

    python tools/bench_vla_gpu.py --check --sweep-warps --out $OUT/vla_h200.json
    JAX_PLATFORMS=cpu python tools/bench_vla_gpu.py --smoke --check --out /tmp/vla_smoke.json   # tiny sizes

Off the GPU (``--smoke``) the Triton kernels run in interpret mode, and forward+backward is timed only for the
A-pass rows: the delta rule's xla backward can crash XLA:CPU at tiny shapes (tools/bench_interdomain_gpu.py).
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
from benchlib import max_rel_err, record, timed, with_grad  # noqa: E402  (tools/benchlib.py)

FULL = dict(tokens=32768, lengths=(4096, 16384), heads=12, key_dim=64, value_dim=64, document=1500,
            check=(2, 1024), sweep=((1, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16)))
SMOKE = dict(tokens=64, lengths=(32,), heads=2, key_dim=16, value_dim=16, document=12, check=(2, 32), sweep=((4, 8),))
IMPLS = ("xla", "pallas_triton")
CPU_BACKWARD = "not timed off the GPU: the delta rule's xla backward can crash XLA:CPU at tiny shapes"


def on_gpu():
    return jax.default_backend() == "gpu"


# ---------------------------------------------------------------------------------------------------------
# inputs and functions


def segments(b, t, mean_length, seed):
    """[B, T] int32 packed documents with geometric lengths of mean ``mean_length``."""
    rng = np.random.default_rng(seed)
    starts = rng.random((b, t)) < 1.0 / mean_length
    starts[:, 0] = True
    return jnp.asarray(np.cumsum(starts, axis=1).astype(np.int32))


def vla_case(b, t, sz, seed):
    ks = jax.random.split(jax.random.key(seed), 4)
    h, dk, dv = sz["heads"], sz["key_dim"], sz["value_dim"]
    q = jax.nn.elu(jax.random.normal(ks[0], (b, t, h, dk))) + 1.0
    k = jax.nn.elu(jax.random.normal(ks[1], (b, t, h, dk))) + 1.0
    v = jax.random.normal(ks[2], (b, t, h, dv))
    p = jax.random.normal(ks[3], (b, t, h, dk)) + 0.5
    return tuple(x.astype(jnp.bfloat16) for x in (q, k, v, p)) + (segments(b, t, sz["document"], seed),)


def vla_full(impl):
    """(q, k, v, p, segments) -> (o, S, A) of the op; off the GPU "pallas_triton" runs its kernels in interpret
    mode through the api's own steps (the api refuses the kernel there)."""
    from mixerlab.pallas_kernels.vla import api

    def fn(q, k, v, p, seg):
        if impl == "pallas_triton" and not on_gpu():
            args = api._prepare(q, k, v, p, None, seg, 0, api.DEFAULT_LAMBDA0, api.DEFAULT_REFRESH_PERIOD, 0,
                                api.DEFAULT_EPS)
            o, (s, a) = api._run_pallas_triton(*args, chunk_size=None, lambda0=api.DEFAULT_LAMBDA0,
                                               refresh_magnitude=api.DEFAULT_REFRESH_MAGNITUDE, eps=api.DEFAULT_EPS,
                                               operand_dtype=q.dtype, interpret=True)
            return o.astype(v.dtype), s, a
        o, (s, a) = api.vla(q, k, v, penalty_key=p, segment_ids=seg, implementation=impl)
        return o, s, a

    return fn


_FORWARDS = {}


def vla_forward(impl):
    """One jit'd forward per implementation, shared by --check and the timed rows (one compile each)."""
    if impl not in _FORWARDS:
        _FORWARDS[impl] = jax.jit(vla_full(impl))
    return _FORWARDS[impl]


def vla_fn(impl):
    full = vla_full(impl)
    return lambda q, k, v, p, seg: full(q, k, v, p, seg)[0]


def a_pass_case(b, t, sz, seed):
    from mixerlab.pallas_kernels.vla import api

    q, k, v, p, seg = vla_case(b, t, sz, seed)
    document = api.document_index(seg, b, t)
    refresh = api.refresh_mask(api.document_positions(document), api.DEFAULT_REFRESH_PERIOD, 0)
    k_hat, u = (api.normalize(x.astype(jnp.float32), api.DEFAULT_EPS) for x in (k, p))
    a0 = api.initial_state(b, sz["heads"], sz["key_dim"], 1)[1]
    return k_hat, u, a0, document, refresh


def a_pass_fn(impl, **overrides):
    from mixerlab.pallas_kernels.vla import api, pallas_triton, xla

    hyper = dict(lambda0=api.DEFAULT_LAMBDA0, refresh_magnitude=api.DEFAULT_REFRESH_MAGNITUDE, eps=api.DEFAULT_EPS)

    def fn(k_hat, u, a0, document, refresh):
        if impl == "xla":
            return xla.penalty_pass(k_hat, u, a0, document, refresh, chunk_size=api.DEFAULT_REFRESH_PERIOD,
                                    **hyper)[0]
        return pallas_triton.penalty_pass(k_hat, u, a0, document, refresh, interpret=not on_gpu(), **hyper,
                                          **overrides)[0]

    return fn


def delta_rule_case(b, t, sz, seed):
    q, k, v, p, seg = vla_case(b, t, sz, seed)
    unit = lambda x: (x / jnp.linalg.norm(x.astype(jnp.float32), axis=-1, keepdims=True)).astype(x.dtype)  # noqa
    return q, unit(p), v, unit(k), seg


def delta_rule_fn(q, alpha, v, k_hat, seg):
    from mixerlab.pallas_kernels.delta_rule.api import delta_rule

    return delta_rule(q, alpha, v, erase_key=k_hat, segment_ids=seg, implementation="auto")[0]


# ---------------------------------------------------------------------------------------------------------
# rows


def check(sz):
    """Max |pallas_triton − xla| / max |xla| of o, S, A (and on the GPU the input gradients)."""
    b, t = sz["check"]
    args = vla_case(b, t, sz, 0)

    def compare(result):
        got = vla_forward("pallas_triton")(*args)
        want = vla_forward("xla")(*args)
        pairs = list(zip(("o", "S", "A"), got, want))
        if on_gpu():
            argnums = (0, 1, 2, 3)
            pairs += list(zip(("dq", "dk", "dv", "dpenalty_key"), with_grad(vla_fn("pallas_triton"), argnums)(*args),
                              with_grad(vla_fn("xla"), argnums)(*args)))
        result.update((name, max_rel_err(g, w)) for name, g, w in pairs)

    print("check pallas_triton vs xla:", flush=True)
    return record([], dict(batch=b, length=t), compare)


def training_rows(sz, reps, impls=IMPLS):
    # (name, inputs, jit'd forward, function to differentiate, argnums)
    ops = [(f"vla/{impl}", vla_case, vla_forward(impl), vla_fn(impl), (0, 1, 2, 3)) for impl in impls]
    ops += [(f"vla_a_pass/{impl}", a_pass_case, jax.jit(a_pass_fn(impl)), a_pass_fn(impl), (0, 1)) for impl in impls]
    ops += [("delta_rule/auto", delta_rule_case, jax.jit(delta_rule_fn), delta_rule_fn, (0, 1, 2, 3))]
    rows = []
    for t in sz["lengths"]:
        b = max(sz["tokens"] // t, 1)
        for name, case, forward, fn, argnums in ops:
            row = dict(op=name, batch=b, length=t, heads=sz["heads"], key_dim=sz["key_dim"], value_dim=sz["value_dim"])

            def measure(row, name=name, case=case, forward=forward, fn=fn, argnums=argnums):
                args = case(b, t, sz, t)
                row["fwd_ms"], row["fwd_min_ms"] = timed(forward, args, reps)
                if not on_gpu() and not name.startswith("vla_a_pass"):
                    row["fwd_bwd_skipped"] = CPU_BACKWARD
                else:
                    row["fwd_bwd_ms"], row["fwd_bwd_min_ms"] = timed(with_grad(fn, argnums), args, reps)

            record(rows, row, measure)
    return rows


FORWARDS = (dict(forward="token"), dict(forward="chunked", chunk_rows=16),
            dict(forward="chunked", chunk_rows=16, warps_forward=8),
            dict(forward="chunked", chunk_rows=32, warps_forward=8))


BACKWARDS = (dict(backward="token"), dict(backward="split"), dict(backward="split", warps_backward=8),
             dict(backward="split", warps_backward=2), dict(forward="split", backward="split"))


def a_pass_rows(sz, reps, configs, compare=False):
    """The Triton A-pass alone at T = 4K, one row per ``pallas_triton.Config`` override dict, timed forward and
    forward+backward; ``compare``: also α̂ and the gradients against the first configuration's
    (max |error| / max |first|), from the same compiled functions the timing uses."""
    t = sz["lengths"][0]
    b = max(sz["tokens"] // t, 1)
    args = a_pass_case(b, t, sz, 1)
    rows, first = [], []

    for overrides in configs:

        def measure(row, overrides=overrides):
            fn = a_pass_fn("pallas_triton", **overrides)
            forward, grads = jax.jit(fn), with_grad(fn, (0, 1))
            if compare:
                got = (forward(*args), *grads(*args))
                first.extend([] if first else got)
                row.update((f"err_{name}", max_rel_err(g, w)) for name, g, w in zip(("alpha", "dk", "du"), got, first))
            row["fwd_ms"], _ = timed(forward, args, reps)
            row["fwd_bwd_ms"], _ = timed(grads, args, reps)

        record(rows, dict(batch=b, length=t, **overrides), measure)
    return rows


# ---------------------------------------------------------------------------------------------------------
# report


def _cell(row, key):
    if key in row:
        return f"{row[key]:.3f}"
    return "skipped" if key == "fwd_bwd_ms" and "fwd_bwd_skipped" in row else "error"


def markdown(result):
    lines = [f"Device: {result['device']}; jax {result['jax']}; bf16 inputs; median of {result['reps']} warm runs "
             "(ms).", "", "| op | B | T | fwd ms | fwd+bwd ms |", "|---|---|---|---|---|"]
    lines += [f"| {r['op']} | {r['batch']} | {r['length']} | {_cell(r, 'fwd_ms')} | {_cell(r, 'fwd_bwd_ms')} |"
              for r in result["training"]]
    if result.get("sweep"):
        lines += ["", "Triton A-pass alone, num_warps (forward, backward):", "",
                  "| warps fwd | warps bwd | fwd ms | fwd+bwd ms |", "|---|---|---|---|"]
        lines += [f"| {r['warps_forward']} | {r['warps_backward']} | {_cell(r, 'fwd_ms')} | {_cell(r, 'fwd_bwd_ms')} |"
                  for r in result["sweep"]]
    if result.get("forwards"):
        lines += ["", "Triton A-pass alone, forward kernel (errors vs the token form, max |error| / max |token|):", "",
                  "| forward | chunk rows | warps fwd | fwd ms | fwd+bwd ms | α̂ err | dk̂ err | du err |",
                  "|---|---|---|---|---|---|---|---|"]
        err = lambda r, k: f"{r[k]:.1e}" if k in r else "error"  # noqa: E731
        lines += [f"| {r['forward']} | {r.get('chunk_rows', '–')} | {r.get('warps_forward', 4)} | "
                  f"{_cell(r, 'fwd_ms')} | {_cell(r, 'fwd_bwd_ms')} | {err(r, 'err_alpha')} | {err(r, 'err_dk')} | "
                  f"{err(r, 'err_du')} |" for r in result["forwards"]]
    if result.get("backwards"):
        lines += ["", "Triton A-pass alone, split kernels (errors vs the token forward and one-kernel backward, "
                  "max |error| / max |first|):",
                  "", "| forward | backward | warps bwd | fwd ms | fwd+bwd ms | α̂ err | dk̂ err | du err |",
                  "|---|---|---|---|---|---|---|---|"]
        err = lambda r, k: f"{r[k]:.1e}" if k in r else "error"  # noqa: E731
        lines += [f"| {r.get('forward', 'token')} | {r['backward']} | {r.get('warps_backward', 4)} | "
                  f"{_cell(r, 'fwd_ms')} | {_cell(r, 'fwd_bwd_ms')} | {err(r, 'err_alpha')} | {err(r, 'err_dk')} | "
                  f"{err(r, 'err_du')} |" for r in result["backwards"]]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (runs on CPU, kernels in interpret mode)")
    p.add_argument("--check", action="store_true", help="first print max errors of pallas_triton vs xla")
    p.add_argument("--sweep-warps", action="store_true", help="time the Triton A-pass for several num_warps")
    p.add_argument("--forwards", action="store_true", help="time the Triton A-pass with each forward kernel "
                   "(token by token, by chunks) and compare them")
    p.add_argument("--backwards", action="store_true", help="time the Triton A-pass with each backward (one kernel, "
                   "split) and compare them")
    p.add_argument("--reps", type=int, default=None, help="timed runs per row (default 10; smoke 2)")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated subset of {IMPLS} for the timed rows")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="sequence lengths of the timed rows "
                   "(default 4096 16384; B = 32K / T)")
    a = p.parse_args(argv)
    impls = tuple(filter(None, a.impls.split(",")))
    if not set(impls) <= set(IMPLS):
        p.error(f"--impls {a.impls!r}: expected a comma-separated subset of {IMPLS}")
    sz = dict(SMOKE if a.smoke else FULL)
    if a.lengths:
        sz["lengths"] = tuple(a.lengths)
    reps = a.reps if a.reps is not None else (2 if a.smoke else 10)
    result = dict(device=str(jax.devices()[0]), backend=jax.default_backend(), jax=jax.__version__, reps=reps,
                  sizes={k: list(v) if isinstance(v, tuple) else v for k, v in sz.items()}, smoke=a.smoke)
    if a.check:
        result["check"] = check(sz)
    result["training"] = training_rows(sz, reps, impls) if impls else []
    if a.sweep_warps:
        result["sweep"] = a_pass_rows(sz, reps, [dict(warps_forward=f, warps_backward=b) for f, b in sz["sweep"]])
    if a.forwards:
        result["forwards"] = a_pass_rows(sz, reps, FORWARDS, compare=True)  # FORWARDS[0]: the token form
    if a.backwards:
        result["backwards"] = a_pass_rows(sz, reps, BACKWARDS, compare=True)  # BACKWARDS[0]: the one-kernel form
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
