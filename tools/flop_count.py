"""Model FLOPs per step of configs (training/flop_model.py, docs/flops.md): per token, per attention pair, and per
step on the configured data (the mean over ``--batches`` batches of the data pipeline) against whole rows (one
document per row, what ``--compile_only`` assumes). No device work: the model is built abstractly.

    python tools/flop_count.py configs/paper/transformer_166m.yaml configs/paper/gdn2_166m.yaml \\
        --shape 4x32768 --shape 32x4096 --set data.train_path=data/embedded/train \\
        --set data.tokenizer.kind=hf --set data.tokenizer.path=data/embedded/tokenizer.json
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def count(config: str, overrides: list[str], batches: int) -> dict:
    import numpy as np
    from flax import nnx

    from mixerlab.models.decoder import Decoder
    from mixerlab.training import config as config_lib
    from mixerlab.training import data as data_lib
    from mixerlab.training import flop_model
    from mixerlab.training.tokenizer import load_tokenizer

    cfg = config_lib.load_config(config, overrides)
    tok = load_tokenizer(cfg.data.tokenizer.kind, cfg.data.tokenizer.path)
    vocab = cfg.model.vocab_size or tok.vocab_size
    abstract = nnx.eval_shape(lambda: Decoder(cfg.model, vocab, mixer_options=cfg.mixers, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(nnx.split(abstract, nnx.Param, ...)[1])
    flops = flop_model.training_flops(cfg, params, vocab)
    b, t = cfg.train.batch_size, cfg.data.seq_len
    it = data_lib.train_iterator(cfg.data, tok, global_batch_size=b, seed=cfg.train.seed)
    pairs, pieces = [], []
    try:
        for _ in range(batches):
            seg = np.asarray(next(it)["segment_ids"])
            pairs.append(float(flop_model.causal_pairs(seg)))
            pieces.append(int(np.sum(seg[:, 1:] != seg[:, :-1]) + b))
    finally:
        if hasattr(it, "close"):
            it.close()
    data_pairs, full = float(np.mean(pairs)), flop_model.full_row_pairs(b, t)
    return {"config": config, "shape": f"{b}x{t}", "per_token": flops.per_token, "core_per_token": flops.core_per_token,
            "per_attention_pair": flops.per_attention_pair, "pairs_data": data_pairs, "pairs_full_rows": full,
            "pieces_per_row": float(np.mean(pieces)) / b, "step_data": flops.step_flops(b * t, data_pairs),
            "step_full_rows": flops.step_flops(b * t, full), "notes": list(flops.notes)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="+")
    p.add_argument("--shape", action="append", default=[], metavar="BxT", help="batch x seq_len (default: the config)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every config")
    p.add_argument("--batches", type=int, default=8, help="data batches averaged (default 8)")
    args = p.parse_args(argv)
    shapes = [s.lower().split("x") for s in args.shape] or [None]
    print("| config | batch | per token | per attention pair | pairs / step (data) | document pieces / row "
          "| model FLOPs / step (data) | one document per row | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for config in args.configs:
        for shape in shapes:
            extra = [] if shape is None else [f"train.batch_size={shape[0]}", f"data.seq_len={shape[1]}"]
            r = count(config, args.set + extra, args.batches)
            print(f"| {r['config']} | {r['shape']} | {r['per_token']:.4e} | {r['per_attention_pair']:,.0f} | "
                  f"{r['pairs_data']:.4e} | {r['pieces_per_row']:.1f} | {r['step_data']:.4e} | "
                  f"{r['step_full_rows']:.4e} | {r['step_full_rows'] / r['step_data']:.3f} |")


if __name__ == "__main__":
    main()
