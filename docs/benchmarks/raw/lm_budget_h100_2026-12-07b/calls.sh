#!/usr/bin/env bash
# The device calls that made this directory (2026-12-07, one NVIDIA H100 80GB HBM3, the tree of commit 8106c8e;
# the runs' configs are in */config.yaml). Corpus: the device subset of tools/build_lm_corpus.py in two parts of
# 40M tokens (79,999,962 training tokens with EOS), `--device_subset 40000000 --device_parts 2`, as in
# ../lm_budget_h100_2026-12-07. Two pipelines at once on the one GPU: Interdomain Attention's LR sweep (4 runs, its
# own pipeline, stopped after the sweep), and Muir with gamma = none's long runs at the LR its sweep in
# ../lm_budget_h100_2026-12-07/sweep picked (3e-3). The machine was held about 1,170 s, its start included; the
# device time ran out while gamma none's final checkpoints were being evaluated, so they have no eval/.
# Call 1, carry [".whl", "data/lm_corpus/device"]:
EVAL=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.14 bash tools/gpu_lm_budget.sh start runs/ia interdomain=7.5e-4/1.5e-3/3e-3/6e-3 5
# Call 2, carry ["data/lm_corpus/device_parts/part-00001.parquet"] (joined to train/ before the long runs start):
XLA_PYTHON_CLIENT_MEM_FRACTION=0.18 SWEEP_FROM=docs/benchmarks/raw/lm_budget_h100_2026-12-07/sweep \
  LONG_MODELS=muir_no_gamma EVAL=1 bash tools/gpu_lm_budget.sh start runs/mng muir_no_gamma=1.5e-3/3e-3/6e-3 10
bash tools/gpu_lm_budget.sh wait runs/ia 420
# Call 3: the IA pipeline's own process was ended (pkill) before its long runs, which the device time left could
# not hold; its four sweep runs went on to step 500 (`bash tools/gpu_lm_budget.sh sweep-only runs/ia` does this
# since). Then
bash tools/gpu_lm_budget.sh wait runs/mng 550
bash tools/gpu_lm_budget.sh wait runs/ia 1
# Call 4 (the long runs ended; the evaluations had started when the device time ran out):
bash tools/gpu_lm_budget.sh wait runs/mng 78
# Here, from the ia.tgz and mng.tgz the calls returned (metrics, configs, log heads and tails copied in):
python tools/lm_pick_lr.py docs/benchmarks/raw/lm_budget_h100_2026-12-07b/sweep > docs/benchmarks/raw/lm_budget_h100_2026-12-07b/lr_ia.txt
python tools/plot_lm_budget.py docs/benchmarks/raw/lm_budget_h100_2026-12-05b docs/benchmarks/raw/lm_budget_h100_2026-12-07 \
  docs/benchmarks/raw/lm_budget_h100_2026-12-07b --train_tokens 79999962 --out docs/benchmarks/raw/lm_budget_h100_2026-12-07b \
  --title "LM comparison at 10x the tokens, each model at its own LR (one H100)"
mv docs/benchmarks/raw/lm_budget_h100_2026-12-07b/budget.png docs/images/lm_budget_h100.png
