#!/bin/bash
# call 3: GPU tests of the two-pass K1 and B2b; A/B of B2b's two passes (jla in the rotation); 8·4096 bench with jla and
# fla-core in the same process, on the faster B2b form
source tools/gpu_env.sh s18
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm,temperature.gpu,power.draw --format=csv
JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -m gpu tests/pallas_kernels/test_delta_rule_pallas_triton.py \
  -p no:cacheprovider > $OUT/gpu_tests.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/gpu_tests.log
timeout 150 python3 tools/ab_delta_rule_gpu.py '{"two": {}, "k1_only": {"two_pass_key_grads": false}}' --jla \
  --rounds 5 --calls 10 --out $OUT/ab.json > $OUT/ab.log 2>&1; echo "ab rc=$?"; grep -a "^|" $OUT/ab.log
OV=$(python3 -c "
import json; r = json.load(open('$OUT/ab.json'))
print('{}' if r['two fwd+bwd'][0] <= r['k1_only fwd+bwd'][0] else '{\"two_pass_key_grads\": false}')" 2>/dev/null || echo '{}')
echo "bench overrides: $OV"
timeout 320 python3 tools/bench_delta_rule_gpu.py --skip probe,correctness,fla_compare,cudnn,breakdown --no-gdn2-variant \
  --shapes 8x4096 --budget 300 --overrides "$OV" --out $OUT/bench_8x4096.json > $OUT/bench_8x4096.log 2>&1
echo "bench rc=$?"; grep -a "^|\|^\[" $OUT/bench_8x4096.log | cut -c1-250 | tail -30
