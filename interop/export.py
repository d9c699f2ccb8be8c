"""``mixerlab-export RUN OUT_DIR [--step N]``: a mixerlab run (config.yaml + orbax checkpoints) -> an HF model
directory (config.json, model.safetensors, tokenizer files) that HF transformers (softmax -> Llama) or
flash-linear-attention (deltanet, gated_deltanet, kda, gdn2) load. Exit 2: a setting the target cannot hold
(one line naming it); 1: a run-time failure."""
from __future__ import annotations

import argparse
import sys

from mixerlab.interop.cli import run
from mixerlab.training.cli_errors import entry_point


@entry_point("mixerlab-export")
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="mixerlab-export", description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="run directory (train.output_dir) or its checkpoints/ directory")
    p.add_argument("out_dir", help="HF model directory to write")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    args = p.parse_args(argv)

    def action():
        from mixerlab.interop.run_dir import export_run

        notes = []
        model_type, step = export_run(args.run, args.out_dir, args.step, notes=notes)
        yield f"wrote {args.out_dir}: model_type {model_type}, checkpoint step {step}"
        yield from notes

    return run(action)


if __name__ == "__main__":
    sys.exit(main())
