#!/usr/bin/env bash
# The recurrent baselines on the GPU machine (docs/benchmarks/baselines_h200.md), one call, from the repo root with
# `carry: [".whl"]`:  bash tools/h200_baselines.sh OUT_DIR [MODEL[+KEY=VALUE...] ...]
#   1. the 166M paper configs at 32×4096 on the embedded corpus (tools/bench_train.py), each in its own process and
#      JSON file, so a call cut short keeps what finished; `model.remat=none` for the models in BASELINES_REMAT_NONE
#      (the policy `auto` picks for them on an H200; setting it skips auto's extra compile; on a card with less than
#      120 GB, unless BASELINES_REMAT_NONE is given, none of them), the others as shipped;
#   2. with the time left: the kernels under the baselines against the float64 reference on the GPU (tests marked
#      gpu: the no-erase delta-rule kernels, the SSD kernels, RWKV-7's token pairs), and
#      the delta core against the no-erase core at 8·4096·16·128, bf16, medians of warm runs, cuDNN attention beside;
#   3. OUT_DIR.tgz: everything in one file (the device tool returns only a few files per call).
# BASELINES_BUDGET (s, default 575) bounds the whole script, BASELINES_RUN_LIMIT (s, default 170) each training run
# (GDN-2 took 95 s on a cold machine: compile 47 s, init, data and three timings).
set -u
out=${1:?output directory}; shift; models=${*:-gdn2 mamba2 gla hgrn2 retnet rwkv7}
source tools/gpu_env.sh baselines
mkdir -p "$out"; t0=$(date +%s); budget=${BASELINES_BUDGET:-575}; run_limit=${BASELINES_RUN_LIMIT:-170}
remat_none=" ${BASELINES_REMAT_NONE:-gdn2 mamba2 gla hgrn2 retnet} "
# `none` fits those at 32×4096 on an H200 (GDN-2 peaks at 106.9 GiB); on a smaller card (an H100's 80 GB) every
# model keeps its config's `auto` unless BASELINES_REMAT_NONE says otherwise
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
if [ -z "${BASELINES_REMAT_NONE+set}" ] && [ "${gpu_mib:-0}" -lt 120000 ]; then
  remat_none=" "; echo "GPU memory ${gpu_mib:-unknown} MiB: model.remat as configured (auto) for every model" >> "$out/notes.txt"
fi
elapsed() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( budget - $(elapsed) )); }
data="--set data.train_path=data/embedded/train --set data.val_path=data/embedded/val --set data.tokenizer.kind=hf
      --set data.tokenizer.path=data/embedded/tokenizer.json"
for row in $models; do  # MODEL or MODEL+KEY=VALUE+...: the config's overrides for that row (e.g.
  # mamba2+mixers.mamba2.implementation=pallas_triton), its files named after the whole row
  m=${row%%+*}; extra=${row#"$m"}; extra=${extra//+/,}; label=$(tr -c 'A-Za-z0-9_\n-' '_' <<< "$row")
  l=$(left); [ "$l" -lt 60 ] && { echo "$row: not run (time, at $(elapsed) s)" >> "$out/skipped.txt"; continue; }
  remat=""; [[ $remat_none == *" $m "* ]] && remat=",model.remat=none"
  echo "start $row at $(elapsed) s" > "$out/train_$label.log"
  timeout $(( l < run_limit ? l : run_limit )) python3 tools/bench_train.py --steps 10 --warmup 2 \
    --out "$out/train_$label.json" $data "${label}_166m=configs/paper/${m}_166m.yaml,train.batch_size=32$remat$extra" \
    >> "$out/train_$label.log" 2>&1
  echo "rc $? at $(elapsed) s" >> "$out/train_$label.log"
done
if [ "$(left)" -gt 90 ]; then  # the kernels under the baselines: no-erase, SSD (Mamba-2), token pairs (RWKV-7)
  timeout 90 python3 -m pytest tests/pallas_kernels/test_delta_rule_no_erase.py tests/pallas_kernels/test_ssd.py \
    tests/pallas_kernels/test_dplr_delta_pairs.py -m gpu -q -n 0 -p no:cacheprovider \
    > "$out/pytest_gpu.log" 2>&1; echo "rc $? at $(elapsed) s" >> "$out/pytest_gpu.log"
fi
l=$(left)
if [ "$l" -gt 120 ]; then
  timeout $(( l - 10 )) python3 tools/bench_delta_rule_gpu.py --shapes 8x4096 --skip correctness,fla_compare,fla,jla,breakdown \
    --budget $(( l - 20 )) --out "$out/delta_rule_no_erase.json" > "$out/delta_rule_no_erase.log" 2>&1
  echo "rc $? at $(elapsed) s" >> "$out/delta_rule_no_erase.log"
fi
tail -n 4 "$out"/*.log
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")"
