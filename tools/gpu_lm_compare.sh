#!/usr/bin/env bash
# The small language-model comparison (configs/lm_compare/) on the GPU machine: every model as its own train.py
# process, all at once on the one GPU (42M-parameter models leave most of an H200 idle; the CPU cores compile
# them in parallel), each killed after SECONDS (SIGKILL: a SIGTERM would make the trainer checkpoint; but see
# LM_COMPARE_RESUME below). Every run writes its metrics.jsonl as it goes, so a run cut by the time limit keeps its
# curve; the report (tools/lm_compare_report.py) marks how far each got. OUT_DIR.tgz packs
# the metrics, logs, configs, table and plot (not checkpoints or TensorBoard files): the device tool returns only
# a few files per call, so copy that one file out.
#
#   usage: bash tools/gpu_lm_compare.sh OUT_DIR [MODELS] [SECONDS] [section.key=value ...]
#   MODELS   comma-separated runs (default: the seven models below). A run is a config name in configs/lm_compare/
#            (its run directory takes that name) or LABEL:CONFIG:key=value:key=value... (a run named LABEL, the
#            config with those overrides on top of the ones for every run), e.g.
#            transformer,transformer_lr3:transformer:optim.lr=3e-3,gdn2_noconv:gdn2:mixers.gdn2.use_short_conv=false
#   e.g. (device call, carry [".whl", "data/lm_corpus/device"]):
#        bash tools/gpu_lm_compare.sh runs/lm_compare transformer,gdn2,muir 530; cp runs/lm_compare.tgz $OUT/
# LM_COMPARE_RESUME=1: runs longer than one call. Each run gets SIGTERM (then SIGKILL 60 s later) at SECONDS, so the
# trainer saves a checkpoint; the same command in the next call on the still-warm machine (runs/ stays there between
# calls) resumes every run where it stopped (train.resume=true). The report marks a run still under way by its
# step count. Without it, every call starts its runs afresh and kills them at SECONDS (their curves are kept).
# On a host with several GPUs (CUDA_VISIBLE_DEVICES, else every GPU nvidia-smi lists; LM_COMPARE_GPUS=N: the first
# N of them) the runs are dealt round-robin, one GPU each; the runs on one GPU share it.
# The data (data/lm_corpus/device: Parquet text + tokenizer) comes from
#   python tools/build_lm_corpus.py ... --device_subset TOKENS [--device_parts K]   (docs/lm_corpus.md)
# With K parts (for a budget that would repeat one subset more than ~3 times), on one warm machine: a call with
# carry [".whl", "data/lm_corpus/device"] and the command `true`, then one per part with carry
# ["data/lm_corpus/device_parts/part-0000k.parquet"] and `true`, then the runs (carry [".whl"]): this script first
# moves the parts into data/lm_corpus/device/train/. Every part must be there before the first run starts (the
# pipeline gives each batch row its share of the documents by their count).
set -euo pipefail
out=${1:?output directory}
models=${2:-transformer,gdn2,muir,muir_static_gamma,muir_no_gamma,interdomain,s4d}
seconds=${3:-500}
shift $(( $# < 3 ? $# : 3 ))
for run in ${models//,/ }; do
  IFS=: read -r label config _ <<< "$run"; config=${config:-$label}
  [ -f "configs/lm_compare/$config.yaml" ] || {
    echo "run '$run': no configs/lm_compare/$config.yaml (a run is NAME or LABEL:CONFIG:key=value...)" >&2; exit 2; }
done
[ -f data/lm_corpus/device/tokenizer.json ] || {
  echo "data/lm_corpus/device/tokenizer.json missing: build it with tools/build_lm_corpus.py (docs/lm_corpus.md)" >&2
  exit 2; }
if compgen -G "data/lm_corpus/device_parts/*.parquet" >/dev/null; then
  mv data/lm_corpus/device_parts/*.parquet data/lm_corpus/device/train/
fi
echo "train data: $(ls data/lm_corpus/device/train | tr '\n' ' ')"
source tools/gpu_env.sh lm_compare
# Several GPUs: run i on GPU i mod n (gpu_for in gpu_env.sh). The runs of one GPU share it: each JAX process gets
# its share of that GPU's memory (remat: auto picks a policy that fits it).
n_runs=$(tr ',' '\n' <<< "$models" | grep -c .)
n_gpus=$(gpu_list | grep -c . || true); (( n_gpus >= 1 )) || n_gpus=1
per_gpu=$(( (n_runs + n_gpus - 1) / n_gpus ))
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-$(python3 -c "print(round(0.9 / $per_gpu, 3))")}
echo "$n_runs runs on $n_gpus GPU(s), up to $per_gpu per GPU, XLA_PYTHON_CLIENT_MEM_FRACTION=$XLA_PYTHON_CLIENT_MEM_FRACTION each"
mkdir -p "$out"
pids=()
i=0
for run in ${models//,/ }; do
  IFS=: read -r -a parts <<< "$run"; label=${parts[0]}; config=${parts[1]:-$label}
  train=(train.py --config "configs/lm_compare/$config.yaml" train.output_dir="$out/$label")
  gpu=$(gpu_for "$i"); i=$((i + 1))
  place=(env); if [ -n "$gpu" ]; then place=(env CUDA_VISIBLE_DEVICES="$gpu"); echo "$label: GPU $gpu"; fi
  if [ -n "${LM_COMPARE_RESUME:-}" ]; then  # SIGTERM: the trainer checkpoints; the log grows call by call
    "${place[@]}" timeout --foreground -s TERM -k 60 "$seconds" python3 "${train[@]}" train.resume=true "$@" \
        "${parts[@]:2}" >>"$out/$label.log" 2>&1 &
  else
    "${place[@]}" timeout -s KILL "$seconds" python3 "${train[@]}" train.resume=false "$@" "${parts[@]:2}" \
        >"$out/$label.log" 2>&1 &
  fi
  pids+=($!)
done
status=0
wait_all "${pids[@]}" || status=$?
tail -n 3 "$out"/*.log
python3 tools/lm_compare_report.py "$out" || status=$?
tar czf "$out.tgz" --exclude=checkpoints --exclude=tensorboard -C "$(dirname "$out")" "$(basename "$out")"
exit $status
