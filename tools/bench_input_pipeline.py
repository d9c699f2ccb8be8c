"""Host input pipeline: seconds per training batch as the trainer's reader produces it (no device work).

    python tools/bench_input_pipeline.py --config configs/paper/transformer_166m.yaml --batch 32 \
        --set data.train_path=data/embedded/train --set data.val_path=data/embedded/val \
        --set data.tokenizer.kind=hf --set data.tokenizer.path=data/embedded/tokenizer.json [--batches 5]

Prints the first batch's time (file opening, first tokenisation) and the mean of the next ``--batches``.
Compare the result with a training step's time: the prefetch thread hides the pipeline only while it is faster.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mixerlab.training import data as data_lib  # noqa: E402
from mixerlab.training.config import load_config  # noqa: E402
from mixerlab.training.tokenizer import load_tokenizer  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--batch", type=int, default=None, help="rows per batch (default: train.batch_size)")
    p.add_argument("--batches", type=int, default=5, help="timed batches after the first")
    a = p.parse_args(argv)
    cfg = load_config(a.config, a.set)
    batch = a.batch or cfg.train.batch_size
    tokenizer = load_tokenizer(cfg.data.tokenizer.kind, cfg.data.tokenizer.path)
    it = data_lib.train_iterator(cfg.data, tokenizer, global_batch_size=batch, seed=cfg.train.seed)
    start = time.perf_counter()
    next(it)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(a.batches):
        next(it)
    per_batch = (time.perf_counter() - start) / a.batches
    print("| config | batch × seq_len | format | first batch s | s per batch | tokens/s |")
    print("|---|---|---|---|---|---|")
    print(f"| {a.config} | {batch} × {cfg.data.seq_len} | {cfg.data.format} | {first:.2f} | {per_batch:.3f} | "
          f"{batch * cfg.data.seq_len / per_batch:,.0f} |")


if __name__ == "__main__":
    main()
