"""Where a chip's memory goes: AOT-compile the real train step for a TPU topology (no TPU needed) and list the
largest buffer shapes of the per-chip program, next to the compiler's temporary-memory total.

    .venv/bin/python tools/aot_buffers.py --config configs/paper/muir_1p34b.yaml --topology v5e:4x4 \\
        model.num_layers=2 model.d_model=1024 model.num_heads=8 model.ffn_dim=3072 data.seq_len=2048 \\
        train.batch_size=16 mesh.data=1 mesh.fsdp=-1

A per-chip program should hold [B/(data·fsdp), T, ·] activations; a [B, T, ·] buffer means XLA replicated
the batch (what models/sharding.py prevents). Shapes are read from the compiled HLO text; one shape may stand
for several buffers, and the list is not a liveness analysis.
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

import numpy as np  # noqa: E402

BYTES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2, "pred": 1, "s8": 1, "u8": 1}


def largest_shapes(hlo_text: str, top: int) -> list[tuple[int, str]]:
    """(bytes, 'dtype[dims]') of the distinct array shapes in an HLO text, largest first."""
    sizes = {}
    for dtype, dims in re.findall(r"\b(" + "|".join(BYTES) + r")\[([\d,]+)\]", hlo_text):
        shape = f"{dtype}[{dims}]"
        sizes[shape] = int(np.prod([int(d) for d in dims.split(",")])) * BYTES[dtype]
    return sorted(((b, s) for s, b in sizes.items()), reverse=True)[:top]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--topology", required=True, help="TPU topology string, e.g. v5e:4x4, v6e:8x8, v5p:2x2x1")
    p.add_argument("--top", type=int, default=20, help="how many shapes to list (default 20)")
    p.add_argument("overrides", nargs="*", help="section.key=value config overrides, as in train.py")
    args = p.parse_args(argv)

    from mixerlab.training import config as config_lib
    from mixerlab.training.aot import compile_train_step
    from mixerlab.training.tokenizer import load_tokenizer

    cfg = config_lib.load_config(args.config, args.overrides)
    vocab = cfg.model.vocab_size or load_tokenizer(cfg.data.tokenizer.kind, cfg.data.tokenizer.path).vocab_size
    compiled, trainer, _ = compile_train_step(cfg, args.topology, vocab)
    mem = compiled.memory_analysis()
    print(f"{args.topology}, mesh {dict(trainer.mesh.shape)}, batch {cfg.train.batch_size} x {cfg.data.seq_len}: "
          f"temporaries {mem.temp_size_in_bytes / 2**30:.3f} GiB per chip")
    print("| MiB | shape |\n|---:|---|")
    for size, shape in largest_shapes(compiled.as_text(), args.top):
        print(f"| {size / 2**20:.1f} | `{shape}` |")


if __name__ == "__main__":
    main()
