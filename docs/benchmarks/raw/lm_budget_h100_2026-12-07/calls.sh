#!/usr/bin/env bash
# The device calls that made this directory (2026-12-07, one NVIDIA H100 80GB HBM3, the tree of commit 0046b63;
# the runs' configs are in */config.yaml). Corpus: the device subset of tools/build_lm_corpus.py in two parts of
# 40M tokens (79,999,962 training tokens with EOS), built with `--device_subset 40000000 --device_parts 2` (the
# same corpus, byte for byte in its token counts, as ../lm_budget_h100_2026-12-05b). Muir with gamma = dynamic
# (configs/lm_compare/muir.yaml) got its sweep, long runs and evaluations; Muir with gamma = none
# (muir_no_gamma.yaml) its sweep and LR pick only (LONG_MODELS), for a later pipeline's SWEEP_FROM.
# Device time: 1,526 s held in all (machine start included).
# Call 1, carry [".whl", "data/lm_corpus/device"]:
LONG_MODELS=muir EVAL=1 bash tools/gpu_lm_budget.sh start runs/muir \
  muir=1.5e-3/3e-3/6e-3,muir_no_gamma=1.5e-3/3e-3/6e-3 5
# Call 2, carry ["data/lm_corpus/device_parts/part-00001.parquet"] (joined to train/ before the long runs start):
bash tools/gpu_lm_budget.sh wait runs/muir 560
# Calls 3 and 4 (the pipeline ended in call 4, evaluations included):
bash tools/gpu_lm_budget.sh wait runs/muir 570
bash tools/gpu_lm_budget.sh wait runs/muir 480
# Here, from the muir.tgz the last call returned (metrics, configs, evaluations; train.log heads and tails):
python tools/plot_lm_budget.py docs/benchmarks/raw/lm_budget_h100_2026-12-05b docs/benchmarks/raw/lm_budget_h100_2026-12-07 \
  --train_tokens 79999962 --out docs/benchmarks/raw/lm_budget_h100_2026-12-07 \
  --title "LM comparison at 10x the tokens, each model at its own LR (one H100)"
mv docs/benchmarks/raw/lm_budget_h100_2026-12-07/budget.png docs/images/lm_budget_h100.png
