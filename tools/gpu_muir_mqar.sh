#!/usr/bin/env bash
# Muir paper Table 7 (learned MQAR, configs/eval/muir_table7_mqar.yaml) on the GPU machine: one process per gate
# configuration and seed group, all at once on the one GPU (2-layer d = 128 models leave it mostly idle), each
# stopped after SECONDS (SIGINT: eval.mqar rewrites results.json after every run, so a stopped process keeps the
# seeds it finished). The merged table (mean ± sample std over seeds, lag buckets) and OUT_DIR.tgz come last:
# the device tool returns only a few files per call, so copy the one file out.
#
#   usage: bash tools/gpu_muir_mqar.sh OUT_DIR [SEEDS_A] [SEEDS_B] [SECONDS]
#   SEEDS_A, SEEDS_B  two comma-separated seed lists, one process each per configuration (default 0..4, 5..9)
#   e.g. (device call, carry [".whl"]): bash tools/gpu_muir_mqar.sh runs/muir_t7; cp runs/muir_t7.tgz $OUT/
#   DRY_RUN=1 prints the jobs (NAME: command) instead of running them.
# Configurations (Table 7's rows; r_f = r_g = 64 = N_h d_k, our reading of "dense gates"):
#   gdn2            GDN-2, dense (b, w)
#   muir_rb1        Muir, gamma = 1 (none), erase rank r_b = 1, r_w = 64
#   muir_rb4        Muir, gamma = 1, r_b = 4, r_w = 64
#   muir_static     Muir, static gamma, r_b = r_w = 4
#   muir_dynamic    Muir, dynamic gamma, r_b = r_w = 4, r_q = 8
set -euo pipefail
out=${1:?output directory}
seeds_a=${2:-0,1,2,3,4}
seeds_b=${3-5,6,7,8,9}
seconds=${4:-480}
config=configs/eval/muir_table7_mqar.yaml
dry=${DRY_RUN:-}
[ -n "$dry" ] || source tools/gpu_env.sh muir_mqar
[ -n "$dry" ] || mkdir -p "$out"
pids=()
job() {  # job NAME LABEL MIXER OVERRIDES...: one process per seed list
  local name=$1 label=$2 mixer=$3 part seeds
  shift 3
  for part in a b; do
    seeds=$seeds_a; [ $part = b ] && seeds=$seeds_b
    [ -n "$seeds" ] || continue
    if [ -n "$dry" ]; then
      printf '%s:' "${name}_$part"
      printf ' %q' python3 -m mixerlab.eval.mqar --config "$config" --out "$out/${name}_$part" --mixers "$mixer" \
          --label "$label" --seeds "$seeds" "$@"
      echo
      continue
    fi
    timeout -s INT "$seconds" python3 -m mixerlab.eval.mqar --config "$config" --out "$out/${name}_$part" \
        --mixers "$mixer" --label "$label" --seeds "$seeds" "$@" >"$out/${name}_$part.log" 2>&1 &
    pids+=($!)
  done
}
job gdn2 "GDN-2, dense (b, w)" gdn2
job muir_rb1 "Muir, gamma 1, r_b = 1" muir mixers.muir.gamma=none "mixers.muir.ranks=[64,1,64,64,0]"
job muir_rb4 "Muir, gamma 1, r_b = 4" muir mixers.muir.gamma=none "mixers.muir.ranks=[64,4,64,64,0]"
job muir_static "Muir, static gamma, r_b = r_w = 4" muir mixers.muir.gamma=static "mixers.muir.ranks=[64,4,64,4,0]"
job muir_dynamic "Muir, dynamic gamma, r_b = r_w = 4, r_q = 8" muir mixers.muir.gamma=dynamic \
    "mixers.muir.ranks=[64,4,64,4,8]"
[ -n "$dry" ] && exit 0
status=0
wait_all "${pids[@]}" || status=$?
tail -n 4 "$out"/*.log
files=()
for f in "$out"/*/results.json; do [ -f "$f" ] && files+=("$f"); done
if [ ${#files[@]} -gt 0 ]; then
  python3 -m mixerlab.eval.mqar --merge "${files[@]}" --out "$out/merged" \
      --title "Learned MQAR (Muir paper Table 7), T = 256, n = 16" || status=$?
fi
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")"
exit $status
