#!/usr/bin/env bash
# H200 check and benchmark of the Pallas-Triton delta-rule kernel, in two device calls (fla's first
# autotuning takes minutes, so it gets a call of its own). Run from the repo root on the GPU machine with
# `carry: [".whl"]`; logs and JSON land in $OUT/delta_rule_h200_<phase>.tar.gz.
#   PHASE=ours  GPU tests (-m gpu), correctness vs the reference (f32 highest/tf32, bf16), timing of ours,
#               jax-linear-attention and cuDNN at the three shapes, per-kernel breakdown
#   PHASE=fla   ours vs fla chunk_gdn2 on the same inputs (bf16), fla timing (SHAPES, default 8x4096);
#               SKIP=fla_compare times only (the comparison's own fla autotuning costs about 4 minutes)
#   PHASE=kernels GPU tests, the knob profile of K1 / B2a / B2b (VARIANTS), ours and cuDNN end to end at SHAPES
set -u
PHASE=${PHASE:-ours}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}  # kept while the machine stays warm
R=runs/delta_rule_h200_$PHASE && mkdir -p $R
OV=${OVERRIDES:-"{}"}
B="python3 tools/bench_delta_rule_gpu.py --correctness-shape 2,512,4,128,128"
if [ "$PHASE" = ours ]; then
  JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -m gpu tests/pallas_kernels/test_delta_rule_pallas_triton.py -p no:cacheprovider \
    2>&1 | tee $R/pytest_gpu.log | tail -3
  timeout 420 $B --skip fla_compare,fla --modes f32_highest,f32_tf32,bf16 --shapes ${SHAPES:-8x4096,2x16384,1x32768} \
    --budget 400 --out $R/bench.json > $R/bench.log 2>&1
elif [ "$PHASE" = kernels ]; then
  JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -m gpu tests/pallas_kernels/test_delta_rule_pallas_triton.py -p no:cacheprovider \
    2>&1 | tee $R/pytest_gpu.log | tail -3
  timeout 200 python3 tools/profile_delta_rule_gpu.py --reps 15 --variants ${VARIANTS:-base,intra_warps8,key_grads_warps8,block_k16} \
    2>&1 | tee $R/profile.log | grep "^|"
  timeout 200 $B --skip probe,correctness,fla_compare,fla,jla --no-gdn2-variant --shapes ${SHAPES:-8x4096,2x16384,1x32768} \
    --overrides "$OV" --budget 190 --out $R/bench.json > $R/bench.log 2>&1
else
  timeout 560 $B --skip probe,correctness,jla,cudnn,breakdown${SKIP:+,$SKIP} --no-gdn2-variant --fla-dtypes bf16 \
    --shapes ${SHAPES:-8x4096} --budget 540 --out $R/bench.json > $R/bench.log 2>&1
fi
grep -v "^\s*$" $R/bench.log | grep -v "^\[.*\] *kernel" | tail -20
tar czf $OUT/delta_rule_h200_$PHASE.tar.gz $R
