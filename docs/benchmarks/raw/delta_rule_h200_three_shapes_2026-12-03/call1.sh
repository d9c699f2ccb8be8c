#!/bin/bash
# call 1: the two-pass kernels at the three shapes, ours and jla in one process; then ours vs fla chunk_gdn2
source tools/gpu_env.sh s19
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm,temperature.gpu,power.draw --format=csv
timeout 280 python3 tools/bench_delta_rule_gpu.py --skip probe,correctness,fla_compare,fla,cudnn,breakdown --no-gdn2-variant \
  --shapes 8x4096,2x16384,1x32768 --budget 260 --out $OUT/bench_3shapes.json > $OUT/bench_3shapes.log 2>&1
echo "bench rc=$?"; grep -a "^|\|^\[" $OUT/bench_3shapes.log | cut -c1-250 | tail -40
timeout 290 python3 tools/bench_delta_rule_gpu.py --correctness-shape 2,512,4,128,128 \
  --skip probe,correctness,fla,jla,cudnn,breakdown --no-gdn2-variant --fla-dtypes bf16 --shapes 8x4096 --budget 280 \
  --out $OUT/bench_fla.json > $OUT/bench_fla.log 2>&1
echo "fla rc=$?"; grep -a "^|\|^\[" $OUT/bench_fla.log | cut -c1-300 | tail -20
