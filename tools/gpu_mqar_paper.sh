#!/usr/bin/env bash
# MQAR as the VLA paper ran it (configs/eval/mqar_vla_paper.yaml: no short convs, the paper's model and
# optimiser) on the GPU machine: one process per job, all at once on the one GPU (tiny models: the GPU idles
# between kernel launches; the CPU cores compile in parallel). Modelled on tools/gpu_mqar_sweep.sh.
#
#   usage: [MQAR_OVERRIDES="..."] [DRY_RUN=1] bash tools/gpu_mqar_paper.sh OUT_DIR PART[,PART...] [MIXERS] [SECONDS]
#   PART    jobs (each a process; per-run times from the earlier sweep: 33–88 s per 2000-step run)
#   seed42  n = 4,8,16,24 with seed 42, 2000 steps (Fig. 5, Tables 8–9), and n = 32,48 with seed 42, 1000 steps
#           (Tables 10–11 were run with 1000 steps): 2 processes per mixer, ≤ 4 runs each      (~350–450 s)
#   seeds   n = 4,8,16,24 with seeds 123 and 999, 2000 steps: 2 processes per mixer, 4 runs each (~350–450 s)
#   ablation  vla at n = 8,16,32, seed 42, 1000 steps (Table 4): the full method, the fixed penalty
#           (A = I/λ₀ = 10 I), the unnormalised write direction, the unnormalised key: 4 processes   (~250 s)
#   ood     n = 8,16,24, seed 42, 1000 steps, held-out accuracy on training keys and on keys from [64, 127)
#           (Table 13): 1 process per mixer                                                        (~250 s)
#   n24     n = 24 with seeds 42, 123 and 999, 2000 steps: one process per mixer and seed          (~400 s)
#   vla_gaps  vla at n = 16 with seeds 42 and 999 (2000 steps) and at n = 48 with seed 42 (1000 steps): the
#           runs a time-limited `seed42`/`seeds` call cut, one process each                        (~400 s)
#   longctx n = 8 at T = 64, 128, 256, 512 (Fig. 6), seed 42, 2000 steps: one process per mixer and T  (~300 s)
#   copy    the copy task (Table 7, configs/eval/copy_vla_paper.yaml: no short convs), seed 42: one process per mixer
#   merge   nothing new: merge what OUT_DIR holds and pack it
# MERGE_WITH="a/results.json ..." adds earlier results (e.g. a merged results.json kept in docs/benchmarks) to
# the main table, so a call that fills gaps prints the whole table.
# The whole protocol does not fit one ~540 s call: run `seed42` and `seeds` as two calls (then `ablation,ood`
# as a third). Every call merges everything OUT_DIR holds so far, so the second call's tables cover both; if
# the machine was released in between, carry OUT_DIR back (`carry: [".whl", "runs/mqar_vla_paper"]`).
# Outputs: OUT_DIR/<job>/results.json (rewritten after every run: a job stopped by SECONDS keeps what it
# finished) and OUT_DIR/<job>.log; merged tables and plots in OUT_DIR/{main,ablation,ood}/ (mean ± sample std
# over seeds); OUT_DIR.tgz packs everything (the device tool returns only a few files per call).
# A persistent XLA compilation cache (/tmp/mqar_paper_xla_cache) lets runs that differ only in the seed reuse
# the compiled train step (the same program: the seed changes the data and initial parameters only).
#   e.g. (device call, `carry: [".whl"]`): bash tools/gpu_mqar_paper.sh runs/mqar_vla_paper seed42 && cp runs/mqar_vla_paper.tgz $OUT/
set -euo pipefail
out=${1:?output directory}
parts=${2:?part: seed42, seeds, ablation, ood, merge (comma-separated)}
mixers=${3:-softmax,linear_attention,paper_deltanet,vla}
seconds=${4:-520}
config=configs/eval/mqar_vla_paper.yaml
for part in ${parts//,/ }; do
  case $part in seed42|seeds|n24|vla_gaps|ablation|ood|longctx|copy|merge) ;; *) echo "unknown part '$part' (seed42, seeds, n24, vla_gaps, ablation, ood, longctx, copy, merge)" >&2; exit 2;; esac
done
dry=${DRY_RUN:-}
if [ -z "$dry" ]; then
  source tools/gpu_env.sh mqar_paper
  mkdir -p "$out"
fi
pids=()

job() {  # job NAME ARGS...: one eval.mqar process writing OUT_DIR/NAME
  launch mqar "$config" "$@"
}

launch() {  # launch TASK CONFIG NAME ARGS...: one eval.TASK process writing OUT_DIR/NAME
  local task=$1 cfg=$2 name=$3
  shift 3
  if [ -n "$dry" ]; then
    printf '%s:' "$name"
    # shellcheck disable=SC2086
    printf ' %q' python3 -m "mixerlab.eval.$task" --config "$cfg" --out "$out/$name" "$@" ${MQAR_OVERRIDES:-}
    echo
    return
  fi
  # shellcheck disable=SC2086  # MQAR_OVERRIDES is a list of section.key=value words
  timeout -s INT "$seconds" python3 -m "mixerlab.eval.$task" --config "$cfg" --out "$out/$name" "$@" \
      ${MQAR_OVERRIDES:-} >"$out/$name.log" 2>&1 &
  pids+=($!)
}

for part in ${parts//,/ }; do
  for mixer in ${mixers//,/ }; do
    case $part in
      seed42)
        job "main_${mixer}_s42" --mixers "$mixer" --n 4,8,16,24 --seeds 42
        job "main_${mixer}_overload" --mixers "$mixer" --n 32,48 --seeds 42 train.steps=1000 ;;
      seeds)
        job "main_${mixer}_s123" --mixers "$mixer" --n 4,8,16,24 --seeds 123
        job "main_${mixer}_s999" --mixers "$mixer" --n 4,8,16,24 --seeds 999 ;;
      n24)
        for seed in 42 123 999; do job "main_${mixer}_n24_s${seed}" --mixers "$mixer" --n 24 --seeds "$seed"; done ;;
      longctx)
        for t in 64 128 256 512; do
          job "longctx_${mixer}_T${t}" --mixers "$mixer" --label "$mixer, T = $t" --n 8 --seeds 42 "task.seq_len=$t"
        done ;;
      copy)
        launch copy_task configs/eval/copy_vla_paper.yaml "copy_${mixer}" --mixers "$mixer" --seeds 42 ;;
      ood)
        job "ood_${mixer}" --mixers "$mixer" --n 8,16,24 --seeds 42 train.steps=1000 "task.ood_key_range=[64,127]" ;;
    esac
  done
  if [ "$part" = vla_gaps ]; then
    job main_vla_n16_s42 --mixers vla --n 16 --seeds 42
    job main_vla_n16_s999 --mixers vla --n 16 --seeds 999
    job main_vla_n48_s42 --mixers vla --n 48 --seeds 42 train.steps=1000
  fi
  if [ "$part" = ablation ]; then
    abl=(--mixers vla --n 8,16,32 --seeds 42 train.steps=1000)  # options before the trailing overrides
    job ablation_full --label "vla (full)" "${abl[@]}"
    job ablation_fixed_penalty --label "vla, A fixed = 10I" "${abl[@]}" mixers.vla.penalty_update=fixed
    job ablation_unnormalised_write --label "vla, write direction unnormalised" "${abl[@]}" \
        mixers.vla.normalize_write_direction=false
    job ablation_unnormalised_key --label "vla, key unnormalised" "${abl[@]}" mixers.vla.normalize_key=false
  fi
done
[ -n "$dry" ] && exit 0

status=0
wait_all "${pids[@]}" || status=$?
compgen -G "$out/*.log" >/dev/null && tail -n 8 "$out"/*.log

merge() {  # merge GROUP TITLE: every OUT_DIR/GROUP_*/results.json into OUT_DIR/GROUP
  local files=()
  # shellcheck disable=SC2206  # MERGE_WITH is a list of paths
  [ "$1" = main ] && files+=(${MERGE_WITH:-})
  for f in "$out/$1"_*/results.json; do [ -f "$f" ] && files+=("$f"); done
  if [ ${#files[@]} -gt 0 ]; then
    python3 -m mixerlab.eval.mqar --merge "${files[@]}" --out "$out/$1" --title "$2" || status=$?
  fi
}
merge main "MQAR, VLA paper setup (no short convs)"
merge ablation "VLA ablations (paper Table 4), 1000 steps, seed 42"
merge longctx "MQAR at n = 8 against the sequence length (paper Fig. 6), 2000 steps, seed 42"
merge ood "MQAR with OOD keys [64,127) (paper Table 13), 1000 steps, seed 42"
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")"
exit $status
