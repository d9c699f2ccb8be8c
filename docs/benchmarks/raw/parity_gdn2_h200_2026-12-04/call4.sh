set -u
source tools/gpu_env.sh p2
export TRITON_CACHE_AUTOTUNING=1
O=/tmp/p2; mkdir -p $O; T0=$(date +%s)
SETS="--set mixers.gdn2.gate_act=sigmoid --set model.norm_eps=1e-5 --set mixers.gdn2.decay_rank=64 --set mixers.gdn2.gate_rank=64"
# fla's side with its Triton dots in full float32 (their default for float32 inputs is TF32)
TRITON_F32_DEFAULT=ieee timeout 250 python3 tools/parity_torch.py --mixer gdn2 --steps 300 --runs torch_f32 --torch-autotune 1 \
  --out /tmp/pA $SETS 2>&1 | grep -v -i warn | grep -v Loading > $O/torch_ieee.log
echo "rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 )) s" >> $O/torch_ieee.log
cp /tmp/pA/parity.json $O/parity_ieee.json 2>/dev/null || cp /tmp/pA/parity_partial.json $O/parity_ieee_partial.json
cat $O/torch_ieee.log
left=$(( 570 - ($(date +%s) - T0) ))
sets="--set data.train_path=data/embedded/train --set data.val_path=data/embedded/val --set data.tokenizer.kind=hf --set data.tokenizer.path=data/embedded/tokenizer.json"
timeout $left python3 tools/bench_train.py --steps 10 --warmup 2 --out $O/train_rwkv7.json $sets \
    rwkv7_166m=configs/paper/rwkv7_166m.yaml,train.batch_size=32 2>&1 | grep -v -i warn > $O/train_rwkv7.log
echo "rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 )) s" >> $O/train_rwkv7.log
tail -5 $O/train_rwkv7.log
tar czf $OUT/p2.tgz -C /tmp p2
