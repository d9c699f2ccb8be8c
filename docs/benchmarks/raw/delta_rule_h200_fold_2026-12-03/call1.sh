# call 1: exponents by difference (E, top pivot sums) A/B with jla; GPU reference tests of the new rows
source tools/gpu_env.sh dr
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $OUT/smi.txt
timeout 330 python3 tools/ab_delta_rule_gpu.py '{"sums": {}, "end_diff": {"end_decays": "difference"}, "both": {"end_decays": "difference", "pivot_sums": "starts"}, "both_bk64": {"end_decays": "difference", "pivot_sums": "starts", "block_k": 64}}' --jla \
  --rounds 5 --calls 10 --out $OUT/ab_diff.json > $OUT/ab_diff.log 2>&1; grep -a "^|" $OUT/ab_diff.log
timeout 200 python3 -m pytest -q -m gpu tests/pallas_kernels/test_delta_rule_pallas_triton.py -k "matches_reference and (options5 or options6)" > $OUT/pytest.log 2>&1; tail -3 $OUT/pytest.log
