# call 1: knob sweep (interleaved), GPU tests, ncu on K1/scan_output, 32K row with jla
source tools/gpu_env.sh dr
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/smi.txt
timeout 230 python3 tools/ab_delta_rule_gpu.py '{"base": {}, "v128w8": {"scan_block_v": 128, "warps_scan": 8}, "wi8": {"warps_intra": 8}, "both": {"scan_block_v": 128, "warps_scan": 8, "warps_intra": 8}}' \
  --rounds 4 --calls 10 --out $OUT/ab.json > $OUT/ab.log 2>&1; grep -a "^|" $OUT/ab.log
JAX_PLATFORMS=cuda timeout 120 python3 -m pytest -q -m gpu tests/pallas_kernels/test_delta_rule_pallas_triton.py 2>&1 | tail -3 > $OUT/pytest.log; cat $OUT/pytest.log
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1); echo "ncu: $NCU"
timeout 120 $NCU --clock-control none --kernel-name regex:"delta_rule_intra|delta_rule_scan_output" --launch-skip 2 \
  --launch-count 2 --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats \
  --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SpeedOfLight \
  python3 scratch/ncu_k1.py > $OUT/ncu_k1.txt 2>&1
grep -a -i "stall\|occupancy\|registers\|Duration\|Throughput\|Issue\|Eligible\|Active Warps\|Block Limit\|==PROF==\|error" $OUT/ncu_k1.txt | head -80
timeout 130 python3 tools/bench_delta_rule_gpu.py --skip probe,correctness,fla_compare,fla,cudnn,breakdown --no-gdn2-variant \
  --shapes 1x32768 --budget 120 --out $OUT/dr32k.json > $OUT/dr32k.log 2>&1; grep -a "^|" $OUT/dr32k.log
