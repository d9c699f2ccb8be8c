#!/usr/bin/env bash
# The recurrent baselines on the GPU machine (docs/benchmarks/baselines_h200.md), one call, from the repo root with
# `carry: [".whl"]`:  bash tools/h200_baselines.sh OUT_DIR [MODEL ...]
#   1. the no-erase Triton kernels against the reference on the GPU (tests marked gpu);
#   2. the delta core against the no-erase core at 8·4096·16·128, bf16, medians of warm runs, cuDNN attention beside;
#   3. the 166M paper configs at 32×4096 on the embedded corpus (tools/bench_train.py), each in its own process and
#      JSON file, so a call cut short keeps what finished.
set -u
out=${1:?output directory}; shift; models=${*:-gdn2 mamba2 gla retnet hgrn2 rwkv7}
source tools/gpu_env.sh baselines
mkdir -p "$out"; t0=$(date +%s); budget=${BASELINES_BUDGET:-560}
# per run: compile + remat choice + three timings; 95 s cut GDN-2 and Mamba-2 short on a cold machine
run_limit=${BASELINES_RUN_LIMIT:-150}
elapsed() { echo $(( $(date +%s) - t0 )); }
timeout 100 python3 -m pytest tests/pallas_kernels/test_delta_rule_no_erase.py -m gpu -q -n 0 -p no:cacheprovider \
  > "$out/pytest_no_erase_gpu.log" 2>&1; echo "rc $? at $(elapsed) s" >> "$out/pytest_no_erase_gpu.log"
timeout 120 python3 tools/bench_delta_rule_gpu.py --shapes 8x4096 --skip correctness,fla_compare,fla,jla,breakdown \
  --budget 110 --out "$out/delta_rule_no_erase.json" > "$out/delta_rule_no_erase.log" 2>&1
echo "rc $? at $(elapsed) s" >> "$out/delta_rule_no_erase.log"
data="--set data.train_path=data/embedded/train --set data.val_path=data/embedded/val --set data.tokenizer.kind=hf
      --set data.tokenizer.path=data/embedded/tokenizer.json"
for m in $models; do
  left=$(( budget - $(elapsed) )); [ $left -lt 30 ] && { echo "$m: not run (time)" >> "$out/skipped.txt"; continue; }
  timeout $(( left < run_limit ? left : run_limit )) python3 tools/bench_train.py --steps 10 --warmup 2 --out "$out/train_$m.json" \
    $data ${m}_166m=configs/paper/${m}_166m.yaml,train.batch_size=32 > "$out/train_$m.log" 2>&1
  echo "rc $? at $(elapsed) s" >> "$out/train_$m.log"
done
tail -n 4 "$out"/*.log
