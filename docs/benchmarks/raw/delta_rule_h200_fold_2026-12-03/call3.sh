# call 3: M parked before the solve (A/B, jla in the rotation); GPU tests; three-shape bench with the faster
source tools/gpu_env.sh dr
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $OUT/smi.txt
timeout 190 python3 tools/ab_delta_rule_gpu.py '{"fold": {"park_readout": false}, "fold_park": {}}' --jla \
  --rounds 5 --calls 10 --out $OUT/ab_park.json > $OUT/ab_park.log 2>&1; grep -a "^|" $OUT/ab_park.log
OV=$(python3 -c "
import json; r = json.load(open('$OUT/ab_park.json'))
print('{}' if r['fold_park fwd'][0] <= r['fold fwd'][0] else '{\"park_readout\": false}')" 2>/dev/null || echo '{}')
echo "bench overrides: $OV"
JAX_PLATFORMS=cuda timeout 90 python3 -m pytest -q -m gpu tests/pallas_kernels/test_delta_rule_pallas_triton.py > $OUT/pytest.log 2>&1; tail -2 $OUT/pytest.log
timeout 270 python3 tools/bench_delta_rule_gpu.py --skip probe,correctness,fla_compare,fla,cudnn --no-gdn2-variant \
  --shapes 8x4096,2x16384,1x32768 --budget 250 --overrides "$OV" --out $OUT/bench.json > $OUT/bench.log 2>&1; grep -a "^|\|breakdown" $OUT/bench.log
