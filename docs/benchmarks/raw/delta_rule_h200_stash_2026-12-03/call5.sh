# call 5: E by difference vs its own sums, jla in the same rotation; GPU tests
source tools/gpu_env.sh dr
timeout 110 python3 tools/ab_delta_rule_gpu.py '{"difference": {}, "sums": {"end_decays": "sums"}}' --jla \
  --rounds 5 --calls 10 --out $OUT/ab.json > $OUT/ab.log 2>&1; grep -a "^|" $OUT/ab.log
JAX_PLATFORMS=cuda timeout 60 python3 -m pytest -q -m gpu tests/pallas_kernels/test_delta_rule_pallas_triton.py -k "matches_reference" 2>&1 | grep -a "passed\|failed\|Error\|assert" | tail -8 > $OUT/pytest.log; cat $OUT/pytest.log
