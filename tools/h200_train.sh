#!/usr/bin/env bash
# The training-throughput measurements of docs/benchmarks/train_h200.md, on the GPU machine (one H200, JAX 0.11.2,
# Python 3.12): the paper configs on the embedded corpus (the output layer keeps its 32K vocabulary: step
# time does not depend on which token ids occur).
#   usage: bash tools/h200_train.sh {bench166|bench166_paper|bench166_noremat|bench166_loss_chunk|bench125|bench125_ia|bench125_vla|bench125_ratios|loop|losses|
#          losses_packed|losses_mamba2|losses_ia16|profile_ia125|profile_vla125|profile_mamba2} OUT_DIR
set -euo pipefail
what=${1:?bench166, bench166_paper, bench166_noremat, bench166_loss_chunk, bench125, bench125_ia, bench125_vla, bench125_ratios, loop, losses, losses_packed, losses_mamba2, losses_ia16, profile_ia125, profile_vla125 or profile_mamba2}
out=${2:?output directory}
mkdir -p "$out"
if ! python3 -c "import grain" 2>/dev/null; then  # the GPU machine lacks these; wheels carried in .whl/
  pip install -q --no-deps --target /tmp/site .whl/grain-*.whl .whl/array_record-*.whl .whl/portpicker-*.whl \
      .whl/tensorboardx-*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
data="data.train_path=data/embedded/train data.val_path=data/embedded/val data.tokenizer.kind=hf
      data.tokenizer.path=data/embedded/tokenizer.json"
sets=$(for kv in $data; do printf -- "--set %s " "$kv"; done)
case $what in
  bench166) python3 tools/bench_train.py --steps 10 --warmup 3 --out "$out/bench166.json" $sets \
      transformer_166m=configs/paper/transformer_166m.yaml,train.batch_size=32 \
      gdn2_166m=configs/paper/gdn2_166m.yaml,train.batch_size=32 \
      muir_166m=configs/paper/muir_166m.yaml,train.batch_size=32 ;;
  bench166_paper)  # the paper configs as shipped (model.remat auto, train.gpu_memory_fraction 0.9) at 32x4096
    python3 tools/bench_train.py --steps 10 --warmup 3 --out "$out/bench166_paper.json" $sets \
      gdn2_166m=configs/paper/gdn2_166m.yaml,train.batch_size=32 \
      muir_166m=configs/paper/muir_166m.yaml,train.batch_size=32 \
      transformer_166m=configs/paper/transformer_166m.yaml,train.batch_size=32 ;;
  bench166_noremat)  # the recurrent 166M models without recomputation (≈ 92 GiB), and auto under a 95 % allocator share
    python3 tools/bench_train.py --steps 10 --warmup 3 --out "$out/bench166_noremat.json" $sets \
      gdn2_166m_none=configs/paper/gdn2_166m.yaml,train.batch_size=32,model.remat=none \
      muir_166m_none=configs/paper/muir_166m.yaml,train.batch_size=32,model.remat=none
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 tools/bench_train.py --steps 10 --warmup 3 \
      --out "$out/bench166_auto95.json" $sets gdn2_166m_auto=configs/paper/gdn2_166m.yaml,train.batch_size=32,model.remat=auto ;;
  bench166_loss_chunk)  # the recurrent 166M models as shipped (remat auto) and with the output layer + loss in
    # slices of 1024 tokens: without the [32, 4096, 32000] float32 logits alive, auto may afford less recomputation
    python3 tools/bench_train.py --steps 10 --warmup 3 --out "$out/bench166_loss_chunk.json" $sets \
      gdn2_166m=configs/paper/gdn2_166m.yaml,train.batch_size=32 \
      gdn2_166m_loss_chunk=configs/paper/gdn2_166m.yaml,train.batch_size=32,train.loss_chunk=1024 \
      muir_166m_loss_chunk=configs/paper/muir_166m.yaml,train.batch_size=32,train.loss_chunk=1024 ;;
  bench125) python3 tools/bench_train.py --steps 10 --warmup 3 --out "$out/bench125.json" $sets \
      softmax_125m=configs/paper/ia_softmax_125m.yaml,train.batch_size=8 \
      gdn2_125m=configs/paper/ia_softmax_125m.yaml,train.batch_size=8,model.mixer=gdn2 \
      transformer_166m_noremat=configs/paper/transformer_166m.yaml,train.batch_size=32,model.remat=none ;;
  bench125_ia)  # the IA paper's 125M shape: GDN-2 (the reference point), interdomain and S4D-only
    python3 tools/bench_train.py --steps 10 --warmup 3 --out "$out/bench125_ia.json" $sets \
      gdn2_125m=configs/paper/ia_softmax_125m.yaml,train.batch_size=8,model.mixer=gdn2 \
      interdomain_125m=configs/paper/ia_interdomain_125m.yaml,train.batch_size=8 \
      s4d_125m=configs/paper/ia_s4d_125m.yaml,train.batch_size=8 ;;
  bench125_vla)  # the IA paper's 125M shape with the VLA mixer on its Triton A-pass kernel, GDN-2 beside it
    python3 tools/bench_train.py --steps 10 --warmup 3 --out "$out/bench125_vla.json" $sets \
      vla_125m=configs/paper/ia_softmax_125m.yaml,train.batch_size=8,model.mixer=vla,mixers.vla.implementation=pallas_triton \
      gdn2_125m=configs/paper/ia_softmax_125m.yaml,train.batch_size=8,model.mixer=gdn2 ;;
  bench125_ratios)  # GDN-2, interdomain and VLA at the 125M shape, and the opt-in forms (interdomain on 16-bit
    # GEMMs, VLA with the split A-pass backward), each in its own process, one call
    python3 tools/bench_train.py --steps 10 --warmup 3 --out "$out/bench125_ratios.json" $sets \
      gdn2_125m=configs/paper/ia_softmax_125m.yaml,train.batch_size=8,model.mixer=gdn2 \
      interdomain_125m=configs/paper/ia_interdomain_125m.yaml,train.batch_size=8 \
      vla_125m=configs/paper/ia_softmax_125m.yaml,train.batch_size=8,model.mixer=vla \
      interdomain_16bit_125m=configs/paper/ia_interdomain_125m.yaml,train.batch_size=8,mixers.interdomain.implementation=toeplitz_16bit \
      vla_split_125m=configs/paper/ia_softmax_125m.yaml,train.batch_size=8,model.mixer=vla,mixers.vla.implementation=pallas_triton_split ;;
  loop)  # the trainer itself (prefetch, metrics every 10 steps): 40 steps of Muir 166M
    python3 train.py --config configs/paper/muir_166m.yaml $data train.steps=40 train.batch_size=32 \
      train.log_every=10 train.eval_every=0 checkpoint.every=0 optim.warmup_steps=10 \
      train.output_dir="$out/muir_166m_loop" ;;
  losses)  # the first 200 losses of the 8x4096 Transformer: cuDNN with a dense document mask vs flash attention
    for impl in cudnn auto; do
      python3 train.py --config configs/paper/transformer_166m.yaml $data train.steps=200 train.batch_size=8 \
        train.log_every=1 train.eval_every=0 checkpoint.every=0 optim.warmup_steps=20 \
        mixers.softmax.implementation=$impl train.output_dir="$out/losses_$impl"
    done ;;
  losses_packed)  # the first 200 losses of the 125M-shape softmax model at 8x4096: cuDNN packed vs Pallas flash
    for impl in cudnn_packed pallas_triton; do
      python3 train.py --config configs/paper/ia_softmax_125m.yaml $data train.steps=200 train.batch_size=8 \
        train.log_every=10 train.eval_every=0 checkpoint.every=0 optim.warmup_steps=20 \
        mixers.softmax.implementation=$impl train.output_dir="$out/losses_$impl"
    done ;;
  losses_mamba2)  # the first 200 losses of Mamba-2 166M at 8x4096: the SSD kernels vs the delta-rule kernels
    for impl in pallas_triton delta_rule_triton; do
      python3 train.py --config configs/paper/mamba2_166m.yaml $data train.steps=200 train.batch_size=8 \
        train.log_every=10 train.eval_every=0 checkpoint.every=0 optim.warmup_steps=20 \
        mixers.mamba2.implementation=$impl train.output_dir="$out/losses_$impl"
    done ;;
  losses_ia16)  # the first 200 losses of IA 125M at 8x4096: the Toeplitz form with float32 vs 16-bit GEMM operands
    for impl in toeplitz toeplitz_16bit; do
      python3 train.py --config configs/paper/ia_interdomain_125m.yaml $data train.steps=200 train.batch_size=8 \
        train.log_every=10 train.eval_every=0 checkpoint.every=0 optim.warmup_steps=20 \
        mixers.interdomain.implementation=$impl train.output_dir="$out/losses_$impl"
    done ;;
  profile_ia125|profile_vla125|profile_mamba2)  # where a step goes: 2 profiled steps of IA or VLA 125M (8x4096) or
    # Mamba-2 166M (32x4096): the top 45 ops (summary.txt) and the source lines of the 15 slowest fusions (origins.txt)
    extra=""
    case $what in
      profile_ia125) cfg=configs/paper/ia_interdomain_125m.yaml; batch=8 ;;
      profile_vla125) cfg=configs/paper/ia_softmax_125m.yaml; batch=8; extra=model.mixer=vla ;;
      *) cfg=configs/paper/mamba2_166m.yaml; batch=32 ;;
    esac
    XLA_FLAGS="--xla_dump_to=$out/dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train_step.*" \
      python3 train.py --config $cfg $data $extra train.steps=8 train.batch_size=$batch optim.warmup_steps=2 \
        profile.start_step=5 profile.num_steps=2 train.output_dir="$out/run" train.eval_every=0 checkpoint.every=0
    python3 tools/summarize_profile.py "$out/run/profile" --top 45 | tee "$out/summary.txt"
    python3 tools/hlo_origin.py "$out/dump" $(awk '$4 ~ /fusion/ {print $4}' "$out/summary.txt" | head -15) \
      > "$out/origins.txt"
    rm -rf "$out/dump" "$out/run/profile" ;;
  *) echo "unknown '$what' (valid: bench166, bench166_paper, bench166_noremat, bench166_loss_chunk, bench125, bench125_ia, bench125_vla, bench125_ratios, loop, losses, losses_packed, losses_mamba2, losses_ia16, profile_ia125, profile_vla125, profile_mamba2)" >&2; exit 2 ;;
esac
# what the device tool brings back is limited in files and depth: the metrics, logs and summaries stay, the
# checkpoints and event files of these short runs go
find "$out" -depth -type d \( -name checkpoints -o -name tensorboard \) -exec rm -rf {} +
