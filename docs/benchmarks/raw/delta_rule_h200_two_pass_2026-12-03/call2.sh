#!/bin/bash
# call 2: GPU tests of the two-pass K1, then interleaved A/B (two passes vs one) with jla
source tools/gpu_env.sh s18
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm,temperature.gpu,power.draw --format=csv
JAX_PLATFORMS=cuda timeout 250 python3 -m pytest -q -m gpu tests/pallas_kernels/test_delta_rule_pallas_triton.py \
  -p no:cacheprovider > $OUT/gpu_tests.log 2>&1; echo "tests rc=$?"; tail -5 $OUT/gpu_tests.log
timeout 300 python3 tools/ab_delta_rule_gpu.py '{"two": {}, "one": {"two_pass": false}}' --jla --rounds 5 --calls 10 \
  --out $OUT/ab.json > $OUT/ab.log 2>&1; echo "ab rc=$?"; tail -12 $OUT/ab.log
