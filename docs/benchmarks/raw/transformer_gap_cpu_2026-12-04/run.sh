# run from the repo root (CPU, 2 cores, 2026-12-04): the tiny Transformer-gap check of transformer_gap_cpu_2026-12-02
# (2 layers, d = 128, one head of 128, 8 x 256 tokens a step, 300 steps, float32), now with the Transformer also run
# with a short convolution on q, k, v (mixers.softmax.use_short_conv, without and with SiLU), two seeds each; on the
# embedded corpus (data/embedded), because the held-out corpus of that run is not on this machine. One at a time.
DATA="data.train_path=data/embedded/train data.val_path=data/embedded/val data.tokenizer.kind=hf data.tokenizer.path=data/embedded/tokenizer.json"
COMMON="model.num_layers=2 model.d_model=128 model.num_heads=1 model.head_dim=128 model.value_head_dim=128 data.seq_len=256 train.batch_size=8 train.steps=300 train.log_every=25 train.eval_every=100 train.eval_batches=8 optim.warmup_steps=30 data.num_workers=2 model.dtype=float32 $DATA"
OUT=docs/benchmarks/raw/transformer_gap_cpu_2026-12-04
for seed in 0 1; do
  for run in "transformer transformer model.ffn_dim=512" "transformer_conv transformer_conv model.ffn_dim=512" \
             "transformer_conv_silu transformer_conv model.ffn_dim=512 mixers.softmax.conv_activation=true" \
             "gdn2 gdn2 model.ffn_dim=320" "gdn2_noconv gdn2 model.ffn_dim=320 mixers.gdn2.use_short_conv=false"; do
    set -- $run; name=$1; cfg=$2; shift 2
    /usr/bin/time -f "%e s" .venv/bin/python train.py --config configs/lm_compare/$cfg.yaml $COMMON train.seed=$seed \
        train.output_dir=/tmp/tgap/${name}_s$seed "$@" > /tmp/tgap/${name}_s$seed.log 2>&1
    cp /tmp/tgap/${name}_s$seed/metrics.jsonl $OUT/${name}_s$seed.jsonl
  done
done
