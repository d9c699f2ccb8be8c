"""Decode-state size per layer of a model config: what one sequence carries from token to token.

    python tools/state_size.py configs/paper/ia_interdomain_1p3b.yaml configs/paper/ia_s4d_1p3b.yaml \
        configs/paper/ia_softmax_1p3b.yaml --lengths 4096,16384

Builds each config's model abstractly (no parameters in memory) and its decode cache for batch 1 with
``jax.eval_shape``, and counts the cache's real entries (a complex entry stored as its real and imaginary parts
counts two, as the Interdomain Attention paper's Table 11 counts degrees of freedom). The recurrent memory
(the mixer's state) and the short-convolution caches are listed apart; a KV cache grows with the sequence
length, so it is given per length in --lengths.
"""
from __future__ import annotations

import argparse
import sys

import jax
import numpy as np

_CONV = "conv"  # cache entries of the short convolutions are named conv_* by every mixer


def _entries(tree) -> tuple[int, int]:
    """(memory entries, short-conv entries) of one layer's cache, batch 1."""
    memory = conv = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        n = int(np.prod(leaf.shape)) * (2 if np.issubdtype(leaf.dtype, np.complexfloating) else 1)
        if any(_CONV in str(getattr(k, "key", k)) for k in path):
            conv += n
        else:
            memory += n
    return memory, conv


def layer_state(config_path: str, length: int) -> dict:
    from mixerlab.models.decoder import abstract_model
    from mixerlab.training.config import load_config

    cfg = load_config(config_path)
    model = abstract_model(cfg, cfg.model.vocab_size or 32000)
    caches = jax.eval_shape(lambda: model.init_cache(1, length))
    per_layer = [_entries(c) for c in caches]
    return {"config": config_path, "mixer": cfg.model.mixer, "layers": len(per_layer), "length": length,
            "memory_per_layer": per_layer[0][0], "conv_per_layer": per_layer[0][1],
            "memory_total": sum(m for m, _ in per_layer), "conv_total": sum(c for _, c in per_layer)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("configs", nargs="+", help="model configs (YAML)")
    p.add_argument("--lengths", default="4096", help="comma-separated sequence lengths (for KV caches)")
    args = p.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        p.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    print("| config | mixer | length | memory per layer | short-conv cache per layer | whole model (memory + conv) |")
    print("|---|---|---|---:|---:|---:|")
    for path in args.configs:
        for length in lengths:
            r = layer_state(path, length)
            print(f"| {path} | {r['mixer']} | {length} | {r['memory_per_layer']:,} | {r['conv_per_layer']:,} | "
                  f"{r['memory_total'] + r['conv_total']:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
