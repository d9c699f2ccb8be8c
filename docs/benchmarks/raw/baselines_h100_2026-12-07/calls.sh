#!/usr/bin/env bash
# The device calls that made this directory (2026-12-07, one NVIDIA H100 80GB HBM3, JAX 0.11.2; the tree of commit
# b48610a without the SSD precision fix, which came after the first call; carry [".whl"] from an earlier call).
# Call 1: the SSD kernels' GPU tests (pytest_ssd_first.log: bf16 passed, float32 failed in tracing: the config's
# 'tf32' reached dot_general, which takes no such string), then Mamba-2 on the SSD kernels and GDN-2:
source tools/gpu_env.sh ssd
python3 -m pytest tests/pallas_kernels/test_ssd.py -m gpu -q -n 0 -p no:cacheprovider
BASELINES_BUDGET=355 BASELINES_RUN_LIMIT=175 bash tools/h200_baselines.sh $OUT/bl mamba2+mixers.mamba2.implementation=pallas_triton gdn2
# Calls 2-4, with the fix (pallas_kernels/ssd/pallas_triton.py maps 'tf32'/'highest' to lax.Precision):
python3 -m pytest tests/pallas_kernels/test_ssd.py -m gpu -q -n 0 -p no:cacheprovider        # f32 failed: out 6.6e-4 > 1e-4 (TF32)
JAX_DEFAULT_MATMUL_PRECISION=highest python3 -m pytest tests/pallas_kernels/test_ssd.py -m gpu -q -n 0 -p no:cacheprovider  # 2 passed
