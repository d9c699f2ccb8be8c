# call 3: GPU tests (stash), variants on top of the stash
source tools/gpu_env.sh dr
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/smi.txt
JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -m gpu tests/pallas_kernels/test_delta_rule_pallas_triton.py 2>&1 | grep -a "passed\|failed\|Error\|assert" | tail -8 > $OUT/pytest.log; cat $OUT/pytest.log
timeout 300 python3 tools/ab_delta_rule_gpu.py '{"stash": {}, "y1": {"y_in_one_product": true}, "pivot": {"pivot_edge_decays": true}, "s1": {"stages_scan": 1}, "v32s1": {"scan_block_v": 32, "stages_scan": 1}}' \
  --rounds 5 --calls 10 --out $OUT/ab.json > $OUT/ab.log 2>&1; grep -a "^|" $OUT/ab.log
