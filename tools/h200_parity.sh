#!/usr/bin/env bash
# The parity and mixed-precision measurements of docs/benchmarks/parity_h200.md and
# docs/benchmarks/mixed_precision_h200.md, on the GPU machine (one H200, JAX 0.11.2, torch, transformers), from the
# repo root with `carry: [".whl"]` (grain and its dependencies, flash-linear-attention and fla-core as wheels):
#   bash tools/h200_parity.sh parity MIXER RUNS OUT_DIR [--set section.key=value ...]
#   bash tools/h200_parity.sh pair MIXER OUT_DIR [--set section.key=value ...]
#   bash tools/h200_parity.sh mp_speed OUT_DIR [MODEL ...]
set -euo pipefail
what=${1:?parity, pair or mp_speed}
source tools/gpu_env.sh parity
case $what in
  parity)  # mixerlab vs the PyTorch implementation, 300 steps from the same weights and batches (tools/parity_torch.py)
    mixer=${2:?mixer}; runs=${3:-ours_f32,ours_bf16,ours_bf16_res16,ours_f32_seed1,torch_f32,torch_autocast}
    out=${4:?output directory}; mkdir -p "$out"; shift 4
    timeout ${PARITY_TIMEOUT:-540} python3 tools/parity_torch.py --mixer "$mixer" --steps 300 --runs "$runs" --out "/tmp/parity_$mixer" "$@" 2>&1 \
      | grep -v -i "warn" | tee "$out/parity_$mixer.log" || true
    cp /tmp/parity_$mixer/parity*.json /tmp/parity_$mixer/parity.png "$out/" 2>/dev/null || cp /tmp/parity_$mixer/parity_partial.json "$out/" ;;
  pair)  # the float32-accurate pair in one call: three processes on the GPU at once (times are shares of it) —
    # torch (f32 with its Triton dots at TF32x3, autocast; autotune limited to one candidate), ours seed 0 (f32, bf16),
    # ours seed 1 (the spread) — joined by --merge into OUT_DIR/parity.json, parity.png and the summary
    # PAIR_JAX_MEM (a fraction of the GPU's memory) caps each of the two JAX processes: on an 80 GB H100 they
    # grew to 38 and 35 GiB and torch's process ran out of memory (2026-12-05); the 141 GB H200 had room
    mixer=${2:?mixer}; out=${3:?output directory}; mkdir -p "$out"; shift 3
    [ -n "${PAIR_JAX_MEM:-}" ] && export XLA_PYTHON_CLIENT_MEM_FRACTION=$PAIR_JAX_MEM
    run() { timeout ${PARITY_TIMEOUT:-540} python3 tools/parity_torch.py --mixer "$mixer" --steps 300 --out "/tmp/pair_$1" \
              --runs "$2" "${@:3}" 2>&1 | grep -v -i "warn" > "$out/$1.log"; }
    run torch torch_f32,torch_autocast --torch-autotune 1 --torch-f32-dots tf32x3 "$@" &
    run ours ours_f32,ours_bf16 "$@" &
    run seed1 ours_f32_seed1,ours_bf16_seed1 "$@" &
    wait || true
    parts=(); for d in torch ours seed1; do
      f=/tmp/pair_$d/parity.json; [ -f "$f" ] || f=/tmp/pair_$d/parity_partial.json
      [ -f "$f" ] && { cp "$f" "$out/parity_$d.json"; parts+=("$out/parity_$d.json"); }
    done
    python3 tools/parity_torch.py --mixer "$mixer" --steps 300 --out "$out" --merge "${parts[@]}" | tee "$out/summary.log"
    tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")" ;;
  mp_speed)  # the step time of a float32 against a bfloat16 residual stream, paper 166M configs at 32x4096
    out=${2:?output directory}; mkdir -p "$out"; shift 2; models=${*:-transformer gdn2}
    data="data.train_path=data/embedded/train data.val_path=data/embedded/val data.tokenizer.kind=hf
          data.tokenizer.path=data/embedded/tokenizer.json"
    sets=$(for kv in $data; do printf -- "--set %s " "$kv"; done)
    for m in $models; do
      python3 tools/bench_train.py --steps 10 --warmup 3 --out "$out/mp_speed_$m.json" $sets \
        ${m}_res32=configs/paper/${m}_166m.yaml,train.batch_size=32 \
        ${m}_res16=configs/paper/${m}_166m.yaml,train.batch_size=32,model.residual_dtype=null 2>&1 \
        | grep -v -i "warn" | tee "$out/mp_speed_$m.log"
    done ;;
  *) echo "unknown: $what" >&2; exit 2 ;;
esac
