#!/usr/bin/env bash
# A few hundred measured steps of the 166M and 1.34B Muir configs on the GPU machine (one H200,
# JAX 0.11.2, Python 3.12). The paper configs point at FineWeb-Edu shards and a 32K SentencePiece model that
# the machine does not have, so the data is the embedded corpus + its 8192 BPE (the model keeps its 32K
# vocabulary: step time, tokens/s and MFU do not depend on which ids occur). Global batch is reduced from
# the paper's 128 x 4096 to fit a few hundred steps into the device budget (see docs/benchmarks/h200_muir.md).
#   usage: bash tools/h200_muir_runs.sh {166m|1p34b} OUT_DIR      (1p34b: STEPS=300 by default)
# A call that cannot hold the whole run: `timeout -s TERM SECONDS bash tools/h200_muir_runs.sh ...` — python is
# exec'd, so SIGTERM reaches the trainer, which saves a checkpoint; the same command resumes from it.
set -euo pipefail
which=${1:?166m or 1p34b}
out=${2:?output directory}
if ! python3 -c "import grain" 2>/dev/null; then  # the GPU machine lacks these; wheels carried in .whl/
  pip install -q --no-deps --target /tmp/site .whl/grain-*.whl .whl/array_record-*.whl .whl/portpicker-*.whl \
      .whl/tensorboardx-*.whl
fi
export PYTHONPATH=/tmp/site:$PWD MIXERLAB_LOG=${MIXERLAB_LOG:-INFO}
common="data.train_path=data/embedded/train data.val_path=data/embedded/val data.tokenizer.kind=hf
        data.tokenizer.path=data/embedded/tokenizer.json train.eval_every=0 checkpoint.every=0 train.log_every=25"
case $which in
  166m)  exec python3 train.py --config configs/paper/muir_166m.yaml $common train.steps=300 train.batch_size=32 \
           optim.warmup_steps=30 train.output_dir="$out/muir_166m" ;;
  1p34b) exec python3 train.py --config configs/paper/muir_1p34b.yaml $common train.steps=${STEPS:-300} \
           train.batch_size=8 optim.warmup_steps=30 train.log_every=10 train.output_dir="$out/muir_1p34b" ;;
  *) echo "unknown run '$which' (valid: 166m, 1p34b)" >&2; exit 2 ;;
esac
