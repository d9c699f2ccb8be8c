#!/usr/bin/env bash
# H200: correctness + timing of the Pallas-Triton delta-rule kernel at its default tiling, then a timing
# sweep of tilings at B8·T4096·H16·D128 (bf16, fwd+bwd). Run from the repo root on the GPU machine with
# `carry: [".whl"]`; everything lands in $OUT/sweep.tar.gz.  SWEEP="chunk leaf overrides-json; ..." overrides
# the list below.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=$PWD/runs/jax_cache
mkdir -p runs/sweep
B="python3 tools/bench_delta_rule_gpu.py --shapes 8x4096 --skip fla_compare,fla,jla,cudnn"
${FIRST:-true} && timeout ${FIRST_S:-240} $B --modes ${MODES:-f32_highest,bf16} --correctness-shape 2,512,4,128,128 \
  --budget 220 --out runs/sweep/default.json 2>&1 | tee runs/sweep/default.log | grep -v "^\s*$" | tail -25
IFS=';' read -ra ROWS <<< "${SWEEP:-64 16 {\"block_k\": 16}; 64 16 {\"block_k\": 64}; 64 8 {}; 128 16 {}}"
for row in "${ROWS[@]}"; do
  read -r c l ov <<< "$row"
  tag="c${c}_l${l}_$(echo "$ov" | tr -dc 'a-z0-9_')"
  timeout ${ROW_S:-90} $B,correctness,probe,breakdown --no-gdn2-variant --chunk "$c" --leaf "$l" --overrides "$ov" \
    --budget 80 --out runs/sweep/$tag.json > runs/sweep/$tag.log 2>&1
  echo "$tag: $(grep -A2 '^| B·T' runs/sweep/$tag.log | tail -1)"
done
tar czf $OUT/sweep.tar.gz runs/sweep
