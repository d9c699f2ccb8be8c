"""Decode latency: one token at a time, at batch 1 and 64.

1. The delta-rule step op (H heads, Dk = Dv = D, bf16 inputs, float32 state): XLA's fused step against the
   Pallas-Triton kernel, per token inside a jitted loop of ``--loop`` steps (as generation runs it) and per
   call from Python (dispatch included).
2. Whole models (paper configs, random weights): one generated token per row, inside a jitted loop of
   ``--loop`` steps, at a prefix length ``--prefix`` (the softmax KV cache holds prefix + loop positions;
   recurrent mixers keep a constant-size state), with the decode step's implementation on ``auto``.

Medians over ``--reps`` warm repetitions. Prints Markdown tables; ``--out`` writes JSON.

    python tools/bench_decode_gpu.py --batches 1,64 \
        --configs configs/paper/gdn2_166m.yaml,configs/paper/transformer_166m.yaml
    python tools/bench_decode_gpu.py --impls "" --batches 1,8 --prefix 512,2048,8192,16384 \
        --configs configs/paper/ia_interdomain_125m.yaml,configs/paper/ia_softmax_125m.yaml+model.mixer=vla
    python tools/bench_decode_gpu.py --smoke      # CPU: tiny sizes, interpret mode (checks the script)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def _median_s(fn, reps):
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def op_latency(batch, heads, dim, impl, loop, reps, interpret=False):
    from mixerlab.pallas_kernels import delta_rule_step
    from mixerlab.pallas_kernels.delta_rule import decode_pallas_triton

    rng = np.random.default_rng(0)
    mk = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32) * 0.1, jnp.bfloat16)  # noqa: E731
    q, k, e = mk(batch, heads, dim), mk(batch, heads, dim), mk(batch, heads, dim)
    v = mk(batch, heads, dim)
    lam = -jnp.abs(jnp.asarray(rng.standard_normal((batch, heads, dim), dtype=np.float32)))
    state = jnp.zeros((batch, heads, dim, dim), jnp.float32)
    if interpret:  # CPU check of the script: the kernel in interpret mode
        step = lambda s: decode_pallas_triton.step(q, k, e, v, lam, s, interpret=True)  # noqa: E731
    else:
        step = lambda s: delta_rule_step(q, k, v, erase_key=e, log_decay=lam, state=s,  # noqa: E731
                                         implementation=impl)

    @jax.jit
    def looped(s):
        return jax.lax.fori_loop(0, loop, lambda i, s: step(s)[1], s)

    single = jax.jit(step)
    per_token = _median_s(lambda: looped(state), reps) / loop
    per_call = _median_s(lambda: single(state), reps)
    return {"batch": batch, "heads": heads, "dim": dim, "impl": impl, "per_token_us": per_token * 1e6,
            "per_call_us": per_call * 1e6,
            "state_GBps": 2 * 4 * batch * heads * dim * dim / per_token / 1e9}


def model_latencies(config, batch, prefixes, loop, reps, overrides=()):
    """One row per prefix length. The model is built and the decode loop jitted once per (config, batch); the
    start position is an argument, so a constant-size cache (the recurrent mixers) compiles once for every
    prefix, and only a cache that grows with the prefix (the softmax KV cache) compiles per prefix."""
    from flax import nnx
    from mixerlab.models.decoder import build_model
    from mixerlab.training import config as config_lib

    cfg = config_lib.load_config(config, list(overrides))
    vocab = cfg.model.vocab_size or 32000
    model = build_model(cfg, vocab)
    graphdef, params = nnx.split(model)

    @jax.jit
    def looped(params, cache, start):
        m = nnx.merge(graphdef, params)

        def body(i, carry):
            tokens, cache = carry
            logits, cache = m.decode(tokens, cache, jnp.full((batch,), start, jnp.int32) + i)
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

        return jax.lax.fori_loop(0, loop, body, (jnp.zeros((batch, 1), jnp.int32), cache))

    for prefix in prefixes:
        cache = model.init_cache(batch, prefix + loop)
        start = jnp.int32(prefix)
        per_token = _median_s(lambda: looped(params, cache, start), reps) / loop  # noqa: B023  (called at once)
        yield {"config": os.path.basename(config), "overrides": list(overrides), "mixer": cfg.model.mixer,
               "batch": batch, "prefix": prefix, "per_token_ms": per_token * 1e3, "tokens_per_s": batch / per_token}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--impls", default="xla,pallas_triton")
    p.add_argument("--configs", default="")
    p.add_argument("--prefix", default="4096", help="prefix length(s), comma list (e.g. 512,2048,8192,16384)")
    p.add_argument("--loop", type=int, default=64)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    batches = [int(b) for b in a.batches.split(",")]
    if a.smoke:
        batches, a.heads, a.dim, a.loop, a.reps, a.prefix = [2], 2, 16, 4, 2, "8,16"
    prefixes = [int(n) for n in a.prefix.split(",")]
    print(f"# decode latency on {jax.devices()[0].device_kind}, jax {jax.__version__}")
    ops = []
    for b in batches:
        for impl in filter(None, a.impls.split(",")):
            if a.smoke and impl != "xla":
                ops.append(op_latency(b, a.heads, a.dim, impl, a.loop, a.reps, interpret=True))
            else:
                ops.append(op_latency(b, a.heads, a.dim, impl, a.loop, a.reps))
    print("\n| batch | H | D | implementation | µs per token (in a jitted loop) | µs per call | state GB/s |")
    print("|---|---|---|---|---|---|---|")
    for r in ops:
        print(f"| {r['batch']} | {r['heads']} | {r['dim']} | {r['impl']} | {r['per_token_us']:.1f} | "
              f"{r['per_call_us']:.1f} | {r['state_GBps']:.0f} |")
    models = []
    for entry in filter(None, a.configs.split(",")):
        config, *over = entry.split("+")  # "path+key=value+key=value": config overrides (e.g. model.mixer=vla)
        if a.smoke:
            over += ["model.num_layers=1", "model.d_model=64", "model.num_heads=2", "model.ffn_dim=64"]
        for b in batches:
            for row in model_latencies(config, b, prefixes, a.loop, a.reps, over):
                models.append(row)
                print(json.dumps(row), flush=True)
    if models:
        print("\n| config | mixer | batch | prefix | ms per token | tokens/s |")
        print("|---|---|---|---|---|---|")
        for r in models:
            print(f"| {r['config']} | {r['mixer']} | {r['batch']} | {r['prefix']} | {r['per_token_ms']:.3f} | "
                  f"{r['tokens_per_s']:.0f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "ops": ops, "models": models},
                      f, indent=1)


if __name__ == "__main__":
    main()
