# call 2: the solve folded into the forward-alone K1 / scan_output; K1 prefetch; with jla; GPU tests
source tools/gpu_env.sh dr
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $OUT/smi.txt
timeout 320 python3 tools/ab_delta_rule_gpu.py '{"before": {"fold_solve": false}, "fold": {}, "fold_prefetch": {"prefetch_keys": true}, "fold_prefetch_bk16": {"prefetch_keys": true, "block_k": 16}, "fold_stages2": {"stages_scan_output": 2}}' --jla \
  --rounds 5 --calls 10 --out $OUT/ab_fold.json > $OUT/ab_fold.log 2>&1; grep -a "^|" $OUT/ab_fold.log
JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -m gpu tests/pallas_kernels/test_delta_rule_pallas_triton.py > $OUT/pytest.log 2>&1; tail -3 $OUT/pytest.log
timeout 100 python3 tools/ab_delta_rule_gpu.py '{"rule": {}, "one_stage": {"stages_scan_output": 1}}' --shape 1x32768 \
  --rounds 3 --calls 10 --out $OUT/ab_stages32k.json > $OUT/ab_stages32k.log 2>&1; grep -a "^|" $OUT/ab_stages32k.log
