#!/bin/bash
# call 1: ablations of the forward-alone kernels, jla forward in the same process
source tools/gpu_env.sh s18
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm,temperature.gpu,power.draw --format=csv
JAX_PLATFORMS=cuda JLA=1 OUT=$OUT timeout 540 python3 scratch/abl.py > $OUT/abl.log 2>&1
echo "rc=$?"; tail -c 6000 $OUT/abl.log
