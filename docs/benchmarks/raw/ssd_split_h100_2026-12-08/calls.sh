#!/usr/bin/env bash
# The device calls behind this directory and ../ia_vla_profile_h100_2026-12-08 (2026-12-08, one NVIDIA H100 80GB
# HBM3, JAX 0.11.2, triton 3.6; carry [".whl"]), the tree of commit 0ad4220 (the SSD kernels' two-kernel backward
# still the flag split_backward, off; warps_backward 8).
# Call 1:
source tools/gpu_env.sh baselines
python3 tools/bench_ssd_gpu.py --skip correctness,anchor,delta_rule_triton \
    --variants "split_backward=1;chunk=32,split_backward=1;split_backward=1,warps_backward=4"   # -> ssd.log
sed -i 's/split_backward: bool = False/split_backward: bool = True/' pallas_kernels/ssd/pallas_triton.py
python3 -m pytest tests/pallas_kernels/test_ssd.py -m gpu -q -n 0 -p no:cacheprovider               # 3 passed
BASELINES_BUDGET=330 bash tools/h200_baselines.sh OUT mamba2 gdn2   # -> call1_train_mamba2_split8.json,
                                                                    #    call1_train_gdn2_timed_out.log
# Call 2, the same tree with split_backward=True and warps_backward=4 as defaults (the code of the next commit):
sed -i 's/split_backward: bool = False/split_backward: bool = True/; s/warps_backward: int = 8/warps_backward: int = 4/' \
    pallas_kernels/ssd/pallas_triton.py
python3 -m pytest tests/pallas_kernels/test_ssd.py -m gpu -q -n 0 -p no:cacheprovider               # 3 passed
BASELINES_BUDGET=330 BASELINES_RUN_LIMIT=200 bash tools/h200_baselines.sh OUT mamba2 gdn2+model.remat=kernels
                                                                    # -> train_*.json, pytest_gpu.log, delta_rule_no_erase.*
bash tools/h200_train.sh losses_mamba2 OUT                          # -> losses.txt
# Calls 3 and 4 (the same tree as call 1): profiles
bash tools/h200_train.sh profile_ia125 OUT                          # -> ../ia_vla_profile_h100_2026-12-08/ia_*
bash tools/h200_train.sh profile_vla125 OUT                         # -> ../ia_vla_profile_h100_2026-12-08/vla_*
