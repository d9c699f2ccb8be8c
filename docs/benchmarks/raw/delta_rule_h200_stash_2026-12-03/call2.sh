# call 2: K1 variants (stash K̂⊙π, edges from the pivot factors), GPU tests
source tools/gpu_env.sh dr
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/smi.txt
timeout 260 python3 tools/ab_delta_rule_gpu.py '{"base": {"stash_key_start": false, "pivot_edge_decays": false}, "stash": {"pivot_edge_decays": false}, "pivot": {"stash_key_start": false}, "both": {}}' \
  --rounds 5 --calls 10 --out $OUT/ab.json > $OUT/ab.log 2>&1; grep -a "^|" $OUT/ab.log
JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -m gpu tests/pallas_kernels/test_delta_rule_pallas_triton.py 2>&1 | tail -4 > $OUT/pytest.log; cat $OUT/pytest.log
