# call 4: GPU tests and the benchmark with jla in the same process (shipped config)
source tools/gpu_env.sh dr
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/smi.txt
JAX_PLATFORMS=cuda timeout 120 python3 -m pytest -q -m gpu tests/pallas_kernels/test_delta_rule_pallas_triton.py 2>&1 | grep -a "passed\|failed\|Error\|assert" | tail -8 > $OUT/pytest.log; cat $OUT/pytest.log
timeout 330 python3 tools/bench_delta_rule_gpu.py --skip probe,correctness,fla_compare,fla,cudnn --no-gdn2-variant \
  --shapes 8x4096,2x16384,1x32768 --budget 300 --out $OUT/stash.json > $OUT/stash.log 2>&1; grep -a "^|" $OUT/stash.log
