#!/usr/bin/env bash
# The device calls that made this directory (2026-12-07, one NVIDIA H100 80GB HBM3; the tree of commit e999773 with
# uncommitted changes to the RWKV-7 op path only, which these runs do not use; the runs' configs are in
# */config.yaml). Corpus: the device subset of tools/build_lm_corpus.py in two parts of 40M tokens (79,999,962
# training tokens with EOS), `--device_subset 40000000 --device_parts 2`, as in ../lm_budget_h100_2026-12-07b.
# Interdomain Attention's long runs at the LR its sweep in ../lm_budget_h100_2026-12-07b/sweep picked (3e-3): the
# four sweep runs are copied in, not run again. The two long runs ran at once, each in 45 % of the GPU
# (`model.remat: auto` chose 'none': 21.1 GiB of 32.1). About 1,030 s of device time for the three calls.
# Call 1, carry [".whl", "data/lm_corpus/device"] (starts the machine):
nvidia-smi --query-gpu=name,memory.total --format=csv
# Call 2, carry ["data/lm_corpus/device_parts/part-00001.parquet"] (joined to train/ before the long runs start):
XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 SWEEP_FROM=docs/benchmarks/raw/lm_budget_h100_2026-12-07b/sweep \
  LONG_MODELS=interdomain EVAL=1 bash tools/gpu_lm_budget.sh start runs/ia interdomain=7.5e-4/1.5e-3/3e-3/6e-3 540
# Call 3 (the long runs and both evaluations ended in it):
bash tools/gpu_lm_budget.sh wait runs/ia 575
# Here, from the ia.tgz the call returned (metrics, configs, evaluations, log lines without progress bars):
python tools/plot_lm_budget.py docs/benchmarks/raw/lm_budget_h100_2026-12-05b docs/benchmarks/raw/lm_budget_h100_2026-12-07 \
  docs/benchmarks/raw/lm_budget_h100_2026-12-07b docs/benchmarks/raw/lm_budget_h100_2026-12-07c --train_tokens 79999962 \
  --out docs/benchmarks/raw/lm_budget_h100_2026-12-07c --title "LM comparison at 10x the tokens, each model at its own LR (one H100)"
mv docs/benchmarks/raw/lm_budget_h100_2026-12-07c/budget.png docs/images/lm_budget_h100.png
