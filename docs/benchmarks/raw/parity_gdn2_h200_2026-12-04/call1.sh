set -u
OUT=$OUT/parity_gdn2; mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.used --format=csv > $OUT/gpu.txt
bash tools/h200_parity.sh parity gdn2 ours_f32,torch_f32,torch_autocast,ours_bf16,ours_f32_seed1,ours_bf16_seed1 $OUT \
  --set mixers.gdn2.gate_act=sigmoid --set model.norm_eps=1e-5 --set mixers.gdn2.decay_rank=64 --set mixers.gdn2.gate_rank=64 &
P=$!
(source tools/gpu_env.sh interop; timeout 420 python3 -m pytest tests/interop/test_interop_torch.py -q -n 0 -p no:cacheprovider -rs > $OUT/interop_torch_gpu.log 2>&1; echo "rc $?" >> $OUT/interop_torch_gpu.log) &
wait
tail -5 $OUT/interop_torch_gpu.log
