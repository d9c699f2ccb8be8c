#!/usr/bin/env bash
# The device calls behind this directory and ../short_conv_ssd_h100_2026-12-07 and ../ia_vla_h100_2026-12-07
# (2026-12-07 evening, one NVIDIA H100 80GB HBM3, JAX 0.11.2, triton 3.6; carry [".whl"]).
# Call 1, commit 65db72b as committed (short conv one-pass backward and SSD (B, H) grid by default):
source tools/gpu_env.sh baselines
python3 tools/bench_short_conv.py --sweep two_pass --check                       # -> short_conv_ssd_*/sc.log
python3 tools/bench_ssd_gpu.py --skip correctness,anchor --out ssd.json \
    --variants "chunk=64;heads_fastest=1;chunk=128;chunk=128,heads_fastest=1"  # -> short_conv_ssd_*/ssd.log
BASELINES_REMAT_NONE="" BASELINES_BUDGET=250 BASELINES_RUN_LIMIT=200 bash tools/h200_baselines.sh OUT rwkv7 \
    gdn2+model.remat=kernels                                                     # -> first_call_train_rwkv7_auto.log
# Call 2, 65db72b with Config.heads_fastest=True (SSD) and bwd_two_pass=True, bwd_block_t=16, bwd_block_c=128,
# bwd_warps=8 (short conv) as defaults: the kernels committed as 06f768d, which deleted the other paths:
BASELINES_BUDGET=560 BASELINES_RUN_LIMIT=185 bash tools/h200_baselines.sh OUT \
    mamba2+mixers.mamba2.implementation=pallas_triton gdn2 rwkv7+model.remat=block   # -> this directory
# Call 3, the same tree:
bash tools/h200_train.sh bench125_ratios OUT                                     # -> ia_vla_h100_2026-12-07/
