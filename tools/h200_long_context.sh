#!/usr/bin/env bash
# The long-context step-time table (documents longer than the context, so softmax attention pays its whole causal
# work; fixed 131,072 tokens per step at 4K/8K/16K/32K) and its PyTorch anchor, on the GPU machine, one PART per
# device call (each fits in ~560 s), from the repo root with `carry: [".whl"]` (grain and its dependencies; fla-core
# and flash-linear-attention for the anchor):
#   bash tools/h200_long_context.sh PART OUT_DIR
#   PART: transformer | gdn2 | muir   the 166M paper configs (tools/bench_train.py --long-docs --seq-lens ...)
#         ia | vla                    the IA paper's 125M shape (interdomain; VLA on ia_softmax_125m), GDN-2's 125M
#                                     row beside them is part `gdn2_125m`
#         gdn2_125m                   GDN-2 at the 125M shape
#         anchor                      fla's GDN-2 model at the 166M shape in PyTorch (tools/bench_torch_lm.py)
# Writes OUT_DIR/PART.json, OUT_DIR/PART.log and OUT_DIR.tgz (the device tool returns only a few files).
set -u
part=${1:?transformer, gdn2, muir, ia, vla, gdn2_125m or anchor}; out=${2:?output directory}
source tools/gpu_env.sh long_context
mkdir -p "$out"
lens="--seq-lens 4096,8192,16384,32768 --tokens-per-step 131072"
data="--set data.train_path=data/embedded/train --set data.val_path=data/embedded/val --set data.tokenizer.kind=hf
      --set data.tokenizer.path=data/embedded/tokenizer.json"
bench() { timeout 560 python3 tools/bench_train.py --long-docs --steps 10 --warmup 2 $lens $data --out "$out/$part.json" "$@"; }
case $part in
  transformer|gdn2|muir) bench "${part}=configs/paper/${part}_166m.yaml" ;;
  ia)        bench ia_125m=configs/paper/ia_interdomain_125m.yaml ;;
  vla)       bench vla_125m=configs/paper/ia_softmax_125m.yaml,model.mixer=vla,mixers.vla.implementation=pallas_triton ;;
  gdn2_125m) bench gdn2_125m=configs/paper/ia_softmax_125m.yaml,model.mixer=gdn2 ;;
  anchor)  # what fla's model can hold: a sigmoid output gate, one norm eps, and a SwiGLU FFN (width 1880: the same
    # matrix parameters as the paper's 2-matrix GELU FFN of width 2816; 166.4M parameters in all)
    timeout 560 python3 tools/bench_torch_lm.py --steps 10 --warmup 3 --autotune 1 $lens --out "$out/$part.json" \
      fla_gdn2=configs/paper/gdn2_166m.yaml,mixers.gdn2.gate_act=sigmoid,model.norm_eps=1e-5,model.ffn_kind=swiglu,model.ffn_dim=1880 ;;
  *) echo "unknown PART '$part': transformer, gdn2, muir, ia, vla, gdn2_125m or anchor" >&2; exit 2 ;;
esac 2>&1 | grep -v -i warn | tee "$out/$part.log"
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")"
