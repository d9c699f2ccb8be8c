#!/usr/bin/env bash
# The device calls that made this directory (2026-12-05, one NVIDIA H100 80GB HBM3, the tree of commit c9446bf;
# the runs' configs are in */config.yaml). Corpus: the device subset of tools/build_lm_corpus.py in two parts of
# 40M tokens (79,999,962 training tokens with EOS), built with `--device_subset 40000000 --device_parts 2`.
# The sweep's 500-step runs at 3e-4/6e-4/1e-3 (Transformer) and 7.5e-4/1.5e-3/3e-3 (GDN-2) are the earlier
# session's (../lm_budget_h100_2026-12-05/sweep, same code and corpus), reused by SWEEP_FROM; the runs at
# 1.7e-3, 3e-3 (Transformer) and 6e-3 (GDN-2) were made here, so that each model's best LR has a worse one on
# both sides. Device time: 1,533 s held in all.
# Call 1, carry [".whl", "data/lm_corpus/device"]:
SWEEP_FROM=docs/benchmarks/raw/lm_budget_h100_2026-12-05/sweep EXTEND_ROUNDS=0 EVAL=1 \
  bash tools/gpu_lm_budget.sh start runs/budget transformer=3e-4/6e-4/1e-3/1.7e-3/3e-3,gdn2=7.5e-4/1.5e-3/3e-3/6e-3 15
# Call 2, carry ["data/lm_corpus/device_parts/part-00001.parquet"] (joined to train/ before the long runs start):
bash tools/gpu_lm_budget.sh wait runs/budget 560
# Calls 3 and 4 (the pipeline ended in call 4, evaluations included):
bash tools/gpu_lm_budget.sh wait runs/budget 585
bash tools/gpu_lm_budget.sh wait runs/budget 420
# Here, from the budget.tgz the last call returned (metrics, configs, evaluations, log tails copied in):
python tools/plot_lm_budget.py docs/benchmarks/raw/lm_budget_h100_2026-12-05b --train_tokens 79999962 \
  --out docs/benchmarks/raw/lm_budget_h100_2026-12-05b \
  --title "LM comparison at 10x the tokens, each model at its own LR (one H100)"
mv docs/benchmarks/raw/lm_budget_h100_2026-12-05b/budget.png docs/images/lm_budget_h100.png
