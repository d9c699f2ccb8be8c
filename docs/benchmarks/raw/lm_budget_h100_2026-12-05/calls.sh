#!/usr/bin/env bash
# The device calls that made this directory (2026-12-05, one NVIDIA H100 80GB HBM3, the tree of commit 3777a55;
# the runs' configs are in */config.yaml). Corpus: the device subset of tools/build_lm_corpus.py in two parts of
# 40M tokens (79,999,962 training tokens with EOS), built with `--device_subset 40000000 --device_parts 2`.
# Call 1, carry [".whl", "data/lm_corpus/device"] (the script had no extension round yet: EXTEND_ROUNDS=0 today):
bash tools/gpu_lm_budget.sh start runs/budget transformer=3e-4/6e-4/1e-3,gdn2=7.5e-4/1.5e-3/3e-3 40
# Call 2, carry ["data/lm_corpus/device_parts/part-00001.parquet"] (joined to train/ before the long runs start):
bash tools/gpu_lm_budget.sh wait runs/budget 520
# Call 3 (the session's device time ran out during it; the long runs were cut at steps 1620-3540 of 5000):
bash tools/gpu_lm_budget.sh wait runs/budget 300
# Here, from the budget.tgz the last call returned (metrics, configs, log tails copied into this directory):
python tools/plot_lm_budget.py docs/benchmarks/raw/lm_budget_h100_2026-12-05 --train_tokens 79999962 \
  --out docs/benchmarks/raw/lm_budget_h100_2026-12-05 --title "LM comparison, 10x-token runs cut by device time (one H100)"
# (its figure, budget.png, is left there; docs/images/lm_budget_h100.png now shows the complete runs of
# ../lm_budget_h100_2026-12-05b/)
