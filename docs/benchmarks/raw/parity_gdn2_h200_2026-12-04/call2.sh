set -u
source tools/gpu_env.sh parity
export TRITON_CACHE_AUTOTUNING=1
O=$OUT/parity_gdn2; mkdir -p $O
SETS="--set mixers.gdn2.gate_act=sigmoid --set model.norm_eps=1e-5 --set mixers.gdn2.decay_rank=64 --set mixers.gdn2.gate_rank=64"
(timeout 545 python3 tools/parity_torch.py --mixer gdn2 --steps 300 --runs torch_f32,torch_autocast,ours_bf16 --out /tmp/pA $SETS 2>&1 | grep -v -i warn | grep -v Loading > $O/parity_gdn2_torch.log) &
sleep 20
(timeout 530 python3 tools/parity_torch.py --mixer gdn2 --steps 300 --runs ours_f32_seed1,ours_bf16_seed1 --out /tmp/pB $SETS 2>&1 | grep -v -i warn > $O/parity_gdn2_seed.log) &
wait
for d in pA pB; do cp /tmp/$d/parity.json $O/parity_$d.json 2>/dev/null || cp /tmp/$d/parity_partial.json $O/parity_partial_$d.json; done
cat $O/*.log
