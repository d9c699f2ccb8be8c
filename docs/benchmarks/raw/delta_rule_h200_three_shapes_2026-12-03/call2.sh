#!/bin/bash
# call 2: cost of the search passes' empty programs (K1's, B2b's, both left out; nothing is flagged with these gates)
source tools/gpu_env.sh s19
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm,temperature.gpu,power.draw --format=csv
cp scratch/abl_search.py $OUT/
JLA=1 timeout 420 python3 scratch/abl_search.py > $OUT/abl_search.log 2>&1
echo "abl rc=$?"; grep -a -v "^\s*$" $OUT/abl_search.log | cut -c1-250 | tail -25
