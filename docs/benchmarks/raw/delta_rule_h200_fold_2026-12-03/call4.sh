# call 4: fla's chunk_gdn2 forward in the same process as ours (8·4096)
source tools/gpu_env.sh dr
timeout 280 python3 tools/bench_delta_rule_gpu.py --skip probe,correctness,fla_compare,jla,cudnn,breakdown --no-gdn2-variant \
  --shapes 8x4096 --budget 270 --out $OUT/bench_fla.json > $OUT/bench_fla.log 2>&1; grep -a "^|\|^\[" $OUT/bench_fla.log | cut -c1-250
