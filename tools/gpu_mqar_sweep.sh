#!/usr/bin/env bash
# The MQAR capacity sweep of docs/evaluation.md on the GPU machine — one process per mixer, all at
# once on the one GPU (the models are tiny: the GPU is mostly idle between kernel launches, and the 16 CPU
# cores compile the per-n train steps in parallel). Each process writes OUT_DIR/<mixer>/results.json after every
# run (a process stopped by the time limit keeps what it finished); at the end `python -m mixerlab.eval.mqar --merge`
# draws the combined table and capacity plot in OUT_DIR, and OUT_DIR.tgz packs everything in one file (the
# device tool returns only a few files per call).
#   usage: [MQAR_OVERRIDES="train.steps=500 ..."] bash tools/gpu_mqar_sweep.sh OUT_DIR [MIXERS] [NS] [SEEDS] [SECONDS]
#   e.g. (device call, `carry: [".whl"]`): bash tools/gpu_mqar_sweep.sh runs/mqar_vla && cp runs/mqar_vla.tgz $OUT/
set -euo pipefail
out=${1:?output directory}
mixers=${2:-softmax,linear_attention,deltanet,gdn2,muir,vla}
ns=${3:-4,8,16,24,32,48}
seeds=${4:-42}
seconds=${5:-520}
if ! python3 -c "import grain" 2>/dev/null; then  # the GPU machine lacks these; wheels carried in .whl/
  pip install -q --no-deps --target /tmp/site .whl/grain-*.whl .whl/array_record-*.whl .whl/portpicker-*.whl \
      .whl/tensorboardx-*.whl
fi
export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
mkdir -p "$out"
pids=()
for mixer in ${mixers//,/ }; do
  timeout -s INT "$seconds" python3 -m mixerlab.eval.mqar --config configs/eval/mqar_vla.yaml --mixers "$mixer" \
      --n "$ns" --seeds "$seeds" --out "$out/$mixer" ${MQAR_OVERRIDES:-} >"$out/$mixer.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
tail -n 12 "$out"/*.log
files=()  # in the order of MIXERS; a mixer that finished no run has no file
for mixer in ${mixers//,/ }; do [ -f "$out/$mixer/results.json" ] && files+=("$out/$mixer/results.json"); done
python3 -m mixerlab.eval.mqar --merge "${files[@]}" --out "$out" || status=$?
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")"
exit $status
