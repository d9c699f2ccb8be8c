# run from the repo root (CPU, 2 cores, 2026-12-02); the three runs one after another, ~9 min each
COMMON="model.num_layers=2 model.d_model=128 model.num_heads=1 model.head_dim=128 model.value_head_dim=128 data.seq_len=256 train.batch_size=8 train.steps=300 train.log_every=25 train.eval_every=100 train.eval_batches=8 optim.warmup_steps=30 data.num_workers=2 model.dtype=float32"
for run in "transformer model.ffn_dim=512" "gdn2 model.ffn_dim=320" "gdn2_noconv model.ffn_dim=320 mixers.gdn2.use_short_conv=false"; do
  set -- $run; name=$1; shift
  cfg=configs/lm_compare/${name%_noconv}.yaml
  /usr/bin/time -f "%e s" .venv/bin/python train.py --config $cfg $COMMON train.output_dir=/tmp/tgap/$name "$@" > /tmp/tgap/$name.log 2>&1
done
