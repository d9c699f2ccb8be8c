#!/usr/bin/env bash
# The LM comparison at a budget longer than one device call, on the GPU machine: for every model a short sweep of
# peak learning rates (the small comparison's 500 steps, configs/lm_compare/), the best LR per model picked by
# tools/lm_pick_lr.py (after one more LR beyond a winner at its grid's end), then the long runs (every model × every seed at that LR, LONG_STEPS steps). One detached
# pipeline (setsid) does all of it, so it runs on between calls; each call waits on it and brings back what it has.
#
#   bash tools/gpu_lm_budget.sh start OUT_DIR MODELS [WAIT]   start the pipeline, then wait WAIT s (default 560)
#   bash tools/gpu_lm_budget.sh wait OUT_DIR [WAIT]           wait WAIT s more (returns early when it is done)
#   bash tools/gpu_lm_budget.sh sweep-only OUT_DIR            a running pipeline stops after the sweep runs going
#                                                             now and its pick (no further LR round, no long runs):
#                                                             for when the device time left cannot hold them
#   MODELS: CONFIG=LR/LR/...,CONFIG=... (configs/lm_compare/CONFIG.yaml; ≥ 3 LRs each), e.g.
#           transformer=3e-4/6e-4/1e-3/1.5e-3,gdn2=7.5e-4/1.5e-3/3e-3
#   environment: SEEDS (default 0,1), LONG_STEPS (5000: 10× the sweep's 500 steps of 32,768 tokens),
#                LONG_EVERY (evaluation every this many steps, 250), SWEEP_LIMIT / LONG_LIMIT (each stage's
#                per-run time limit in seconds, 900 / 2400: a run past it is stopped and keeps its curve),
#                SWEEP_STEPS (default: the configs' 500), SET (overrides for every run, space-separated),
#                EXTEND_ROUNDS (1: rounds of one more LR beyond a winner at its grid's end; 0: none),
#                EVAL=1: then mixerlab.eval.perplexity (held-out loss at 1, 2 and 3.5× the context) on the final checkpoint
#                of every long run that finished, all at once (EVAL_DOCS documents, 200; EVAL_LIMIT s each, 600),
#                into long/RUN/eval/ (the long runs save only that final checkpoint),
#                SWEEP_ONLY=1: stop after the pick (lr.txt), e.g. to sweep one model beside another pipeline's long
#                runs and give it its long runs later with SWEEP_FROM=OUT_DIR/sweep,
#                LONG_MODELS=CONFIG,...: long runs for these models only (each must be in MODELS); the others are
#                swept and picked (lr.txt) for a later pipeline's SWEEP_FROM=OUT_DIR/sweep,
#                SWEEP_FROM=DIR: sweep runs already made (DIR/CONFIG_lrLR/ with metrics.jsonl and config.yaml, e.g.
#                an earlier budget's sweep/ or its copy under docs/benchmarks/raw/) are copied in, not run again
# Every call packs OUT_DIR.tgz (metrics, logs, configs, tables, plots; no checkpoints) and copies it to $OUT when
# that is set, so each call brings back the curves so far. The machine must stay held between calls (the next
# `wait` within its warm time): a pipeline on a machine given back is lost; the curves already back are not.
# Layout: OUT_DIR/sweep/CONFIG_lrLR/, OUT_DIR/lr.txt (CONFIG LR), OUT_DIR/long/CONFIG_sSEED/, OUT_DIR/pipeline.log,
# OUT_DIR/done (the pipeline's exit status) once it has ended.
# Device call (carry [".whl", "data/lm_corpus/device"]; more data parts as tools/gpu_lm_compare.sh says):
#   bash tools/gpu_lm_budget.sh start runs/budget transformer=...,gdn2=... 560
set -uo pipefail
mode=${1:?start, wait or sweep-only}; out=${2:?output directory}

pack() {
  tar czf "$out.tgz" --exclude=checkpoints --exclude=tensorboard --exclude='*.tgz' -C "$(dirname "$out")" \
    "$(basename "$out")"
  if [ -n "${OUT:-}" ]; then cp "$out.tgz" "$OUT/"; fi
}

progress() {  # the last logged step and loss of every run so far
  local f
  for f in "$out"/sweep/*/metrics.jsonl "$out"/long/*/metrics.jsonl; do
    [ -f "$f" ] || continue
    echo "$(basename "$(dirname "$(dirname "$f")")")/$(basename "$(dirname "$f")"): $(grep '"train"' "$f" | tail -n 1 |
      python3 -c 'import json,sys; r=json.loads(sys.stdin.read() or "{}"); print(r.get("step"), round(r.get("loss", 0), 4))')"
  done
}

wait_for_pipeline() {  # until OUT_DIR/done or $1 seconds, a progress report every 120 s
  local limit=$1 start=$SECONDS next=120
  while [ ! -f "$out/done" ] && (( SECONDS - start < limit )); do
    sleep 5
    if (( SECONDS - start >= next )); then echo "--- $((SECONDS - start)) s"; progress; next=$((next + 120)); fi
  done
  if [ -f "$out/done" ]; then echo "pipeline ended, status $(cat "$out/done")"; else echo "pipeline still running"; fi
  tail -n 20 "$out/pipeline.log"
  progress
  pack
}

pipeline() {  # the sweep, the pick, the long runs (runs detached: its output goes to OUT_DIR/pipeline.log)
  local models=$1 seeds=${SEEDS:-0,1} sweep="" long="" config lrs lr seed status=0
  for spec in ${models//,/ }; do
    config=${spec%%=*}; lrs=${spec#*=}
    for lr in ${lrs//\// }; do sweep+="${sweep:+,}${config}_lr${lr}:${config}:optim.lr=${lr}"; done
  done
  if [ -n "${SWEEP_FROM:-}" ]; then  # runs made before: copied in, not run again
    local todo="" run label
    for run in ${sweep//,/ }; do
      label=${run%%:*}
      if [ -f "$SWEEP_FROM/$label/metrics.jsonl" ] && [ -f "$SWEEP_FROM/$label/config.yaml" ]; then
        mkdir -p "$out/sweep/$label"; cp "$SWEEP_FROM/$label/metrics.jsonl" "$SWEEP_FROM/$label/config.yaml" \
          "$out/sweep/$label/"
        echo "sweep: $label reused from $SWEEP_FROM"
      else
        todo+="${todo:+,}$run"
      fi
    done
    sweep=$todo
  fi
  echo "sweep: ${sweep:-nothing to run}"
  if [ -n "$sweep" ]; then
    # shellcheck disable=SC2086  # SET: a list of overrides
    bash tools/gpu_lm_compare.sh "$out/sweep" "$sweep" "${SWEEP_LIMIT:-900}" checkpoint.every=0 ${SET:-} \
      ${SWEEP_STEPS:+train.steps=$SWEEP_STEPS} || status=$?
  fi
  for (( round = 1; round <= ${EXTEND_ROUNDS:-1}; round++ )); do  # a winner at its grid's end: one LR further out
    local more=""
    [ -f "$out/sweep_only" ] && { echo "sweep-only: no further LR round"; break; }
    while read -r config lr; do more+="${more:+,}${config}_lr${lr}:${config}:optim.lr=${lr}"; done \
      < <(python3 tools/lm_pick_lr.py "$out/sweep" --extend)
    [ -n "$more" ] || break
    echo "sweep, round $((round + 1)) (winners at a grid end): $more"
    # shellcheck disable=SC2086
    bash tools/gpu_lm_compare.sh "$out/sweep" "$more" "${SWEEP_LIMIT:-900}" checkpoint.every=0 ${SET:-} \
      ${SWEEP_STEPS:+train.steps=$SWEEP_STEPS} || status=$?
  done
  python3 tools/lm_pick_lr.py "$out/sweep" > "$out/lr.txt" || status=$?
  if [ -n "${SWEEP_ONLY:-}" ] || [ -f "$out/sweep_only" ]; then
    if [ -n "${SWEEP_ONLY:-}" ]; then echo "SWEEP_ONLY: no long runs"; else echo "sweep-only: no long runs"; fi
    echo "$status" > "$out/done"; return
  fi
  while read -r config lr; do
    if [ -n "${LONG_MODELS:-}" ] && [[ ",$LONG_MODELS," != *",$config,"* ]]; then
      echo "long runs: $config (LR $lr) left for later (LONG_MODELS=$LONG_MODELS)"; continue
    fi
    for seed in ${seeds//,/ }; do
      long+="${long:+,}${config}_s${seed}:${config}:optim.lr=${lr}:train.seed=${seed}"
    done
  done < "$out/lr.txt"
  echo "long runs: $long"
  if [ -n "$long" ]; then
    bash tools/gpu_lm_compare.sh "$out/long" "$long" "${LONG_LIMIT:-2400}" train.steps="${LONG_STEPS:-5000}" \
      train.eval_every="${LONG_EVERY:-250}" checkpoint.every="${LONG_STEPS:-5000}" ${SET:-} || status=$?
  fi
  if [ -n "${EVAL:-}" ]; then  # the final checkpoint of every long run that finished: held-out loss by length
    source tools/gpu_env.sh lm_compare
    local evals=() runs=() gpu
    for run in "$out"/long/*/; do  # all at once, as the runs were (one GPU each where there are several)
      [ -d "$run" ] || continue
      [ -n "$(ls -A "$run/checkpoints" 2>/dev/null)" ] || { echo "eval: $run has no checkpoint (cut short)"; continue; }
      gpu=$(gpu_for "${#evals[@]}")
      echo "eval: $run${gpu:+ (GPU $gpu)}"
      env ${gpu:+CUDA_VISIBLE_DEVICES=$gpu} timeout "${EVAL_LIMIT:-600}" python3 -m mixerlab.eval.perplexity \
        --run "$run" --max_docs "${EVAL_DOCS:-200}" --stream_tokens 0 > "$run/eval.log" 2>&1 &
      evals+=($!); runs+=("$run")
    done
    for i in "${!evals[@]}"; do
      wait "${evals[$i]}" || { echo "eval of ${runs[$i]} failed: ${runs[$i]}eval.log"; status=1; }
    done
  fi
  echo "$status" > "$out/done"
}

case $mode in
  start)
    models=${3:?MODELS: CONFIG=LR/LR/...,...}; wait_s=${4:-560}
    for spec in ${models//,/ }; do
      config=${spec%%=*}; lrs=${spec#*=}
      [ -f "configs/lm_compare/$config.yaml" ] || { echo "model '$spec': no configs/lm_compare/$config.yaml" >&2; exit 2; }
      n=$(tr '/' '\n' <<< "$lrs" | grep -c .)
      (( n >= 3 )) || { echo "model '$spec': a sweep needs at least 3 LRs (CONFIG=LR/LR/LR)" >&2; exit 2; }
    done
    long_models=${LONG_MODELS:-}
    for config in ${long_models//,/ }; do
      [[ ",$models" == *",$config="* ]] || { echo "LONG_MODELS: '$config' is not one of MODELS ($models)" >&2; exit 2; }
    done
    [ -e "$out" ] && { echo "$out exists: a pipeline was started there (use 'wait', or another OUT_DIR)" >&2; exit 2; }
    mkdir -p "$out"
    setsid nohup bash "$0" pipeline "$out" "$models" > "$out/pipeline.log" 2>&1 < /dev/null &
    echo "pipeline started (pid $!): $out/pipeline.log"
    wait_for_pipeline "$wait_s" ;;
  pipeline) pipeline "${3:?}" ;;  # what `start` runs detached
  sweep-only)
    [ -f "$out/pipeline.log" ] || { echo "$out/pipeline.log missing: no pipeline was started there" >&2; exit 2; }
    if [ -f "$out/done" ]; then echo "the pipeline in $out has already ended (status $(cat "$out/done"))"; exit 0; fi
    touch "$out/sweep_only"; echo "the pipeline in $out stops after its sweep and LR pick (no long runs)" ;;
  wait)
    [ -f "$out/pipeline.log" ] || { echo "$out/pipeline.log missing: no pipeline was started there" >&2; exit 2; }
    wait_for_pipeline "${3:-560}" ;;
  *) echo "unknown mode '$mode': start, wait or sweep-only" >&2; exit 2 ;;
esac
