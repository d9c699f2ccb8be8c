"""``mixerlab-import HF_DIR RUN_DIR [--step N]``: an HF model directory (as ``mixerlab-export`` writes, or a
Llama / fla checkpoint whose settings mixerlab can hold) -> a mixerlab run directory (config.yaml + an orbax
checkpoint) that evaluation, generation and the trainer (train.resume) read. Exit 2: a field mixerlab cannot
hold (one line naming it); 1: a run-time failure."""
from __future__ import annotations

import argparse
import sys

from mixerlab.interop.cli import run
from mixerlab.training.cli_errors import entry_point


@entry_point("mixerlab-import")
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="mixerlab-import", description=__doc__.split("\n\n")[0])
    p.add_argument("hf_dir", help="HF model directory (config.json + model.safetensors)")
    p.add_argument("run_dir", help="run directory to write (its checkpoints/ must be empty or absent)")
    p.add_argument("--step", type=int, default=0, help="step number of the written checkpoint (default 0)")
    args = p.parse_args(argv)

    def action():
        from mixerlab.interop.run_dir import import_run

        mixer = import_run(args.hf_dir, args.run_dir, args.step)
        yield f"wrote {args.run_dir}: {mixer} model, checkpoint step {args.step}"

    return run(action)


if __name__ == "__main__":
    sys.exit(main())
