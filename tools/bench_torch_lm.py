"""The PyTorch anchor of the step-time tables: the implementation someone else wrote (HF transformers' Llama for
the softmax model; fla's model classes for gdn2, gated_deltanet, deltanet and kda), at a mixerlab config's shape,
trained the way its users train it, timed like tools/bench_train.py times mixerlab.

    python tools/bench_torch_lm.py --steps 10 --warmup 3 --autotune 1 \\
        fla_gdn2_166m=configs/paper/gdn2_166m.yaml,train.batch_size=32 \\
        --set mixers.gdn2.gate_act=sigmoid --set model.norm_eps=1e-5 \\
        --set model.ffn_kind=swiglu --set model.ffn_dim=1880
    python tools/bench_torch_lm.py --seq-lens 4096,8192,16384,32768 --tokens-per-step 131072 fla_gdn2=... ...

Each RUN (``name=config.yaml[,section.key=value,...]``, ``--seq-lens`` / ``--tokens-per-step`` as in
bench_train): mixerlab draws the config's initial weights on the CPU and exports them (``mixerlab.interop``; a
setting the target cannot hold is refused there in one line: fla's GDN-2 layer has a sigmoid output gate and one
norm eps, fla's and HF's models a SwiGLU FFN, hence the ``--set`` above); PyTorch loads the directory on the
GPU in float32 and trains it: bf16 autocast over the forward, the model's own loss (``labels=``; fla's fused
cross-entropy where its config has it), fused AdamW with mixerlab's groups (decay on matrices), global-norm
clipping; no torch.compile. Random tokens, every row one document (what ``bench_train.py --long-docs`` gives
mixerlab): softmax attention does its full causal work. The first step (fla's Triton compile and autotune) is
timed apart; then ``--steps`` steps between two CUDA synchronisations after ``--warmup``. FLOPs and MFU: the
same FLOP model (training/flop_model.py) and the GPU's datasheet peak (pallas_kernels/chips.py).
``--autotune N``: fla's Triton kernels try only their first N autotune configurations (0: all; a full autotune of
the GDN-2 model took more than 300 s on the H200). Each run goes in its own process; one that fails is reported.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # JAX only draws and exports the weights; the GPU is torch's
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_train import _parse_run, child_result, error_row, expand_runs, pct, print_table, run_all, run_arguments  # noqa: E402
from parity_torch import limit_triton_autotune  # noqa: E402


def torch_model(config: str, overrides: list[str], device: str = "cuda"):
    """(cfg, vocab, the exported model's target name, the PyTorch model on ``device`` in float32, the parameter
    pytree of mixerlab's model for the FLOP count)."""
    import torch
    from flax import nnx

    from mixerlab import interop
    from mixerlab.models.decoder import build_model
    from mixerlab.training import config as config_lib
    from mixerlab.training.tokenizer import load_tokenizer

    cfg = config_lib.load_config(config, overrides)
    vocab = cfg.model.vocab_size or load_tokenizer(cfg.data.tokenizer.kind, cfg.data.tokenizer.path).vocab_size
    model = build_model(cfg, vocab, seed=cfg.train.seed)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    with tempfile.TemporaryDirectory() as hf_dir:
        target = interop.export_model(model, cfg, hf_dir, tokenizer_path=cfg.data.tokenizer.path)
        net = interop.load_torch(hf_dir, dtype=torch.float32).to(device)
    return cfg, vocab, target, net, params


def measure(config: str, overrides: list[str], steps: int, warmup: int, autotune: int) -> dict:
    import torch

    from mixerlab.pallas_kernels import chips
    from mixerlab.training import flop_model

    if not torch.cuda.is_available():
        raise SystemExit("bench_torch_lm: needs a CUDA GPU visible to torch (the anchor is a GPU measurement)")
    limit_triton_autotune(autotune)
    cfg, vocab, target, net, params = torch_model(config, overrides)
    o, rows, length = cfg.optim, cfg.train.batch_size, cfg.data.seq_len
    opt = torch.optim.AdamW([{"params": [p for p in net.parameters() if p.ndim >= 2], "weight_decay": o.weight_decay},
                             {"params": [p for p in net.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.b1, o.b2), eps=o.eps, fused=True)
    tokens = torch.randint(0, vocab, (rows, length), device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = net(input_ids=tokens, labels=tokens).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if o.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), o.grad_clip)
        opt.step()
        return loss

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / max(n, 1)

    torch.cuda.reset_peak_memory_stats()
    first = timed(1)
    timed(max(warmup - 1, 0))
    seconds = timed(steps)
    loss = float(step())
    flops = flop_model.training_flops(cfg, params, vocab)
    step_flops = flops.step_flops(rows * length, flop_model.full_row_pairs(rows, length))
    chip = chips.by_device_kind(torch.cuda.get_device_name())
    what = f"{config} {' '.join(overrides)} ({rows}x{length}, PyTorch {target})"
    use = flop_model.utilisation(step_flops, seconds, 1, chip, what)
    return {"config": config, "overrides": overrides, "target": target, "batch": rows, "seq_len": length,
            "params_M": sum(p.numel() for p in net.parameters()) / 1e6, "first_step_s": first, "step_s": seconds,
            "tokens_per_s": rows * length / seconds, "model_flops_per_step": step_flops,
            "model_tflops_per_s": use["model_tflops_per_s"], "mfu": use.get("mfu"),
            "mfu_measured_peak": use.get("mfu_measured_peak"), "peak_chip": chip.name if chip else None,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "loss_after": loss, "autotune": autotune,
            "device": torch.cuda.get_device_name(), "torch": torch.__version__}


HEADER = ("| run | target | batch | first step | step | tokens/s | model TFLOP/s | MFU | MFU (measured peak) "
          "| peak GiB |")


def _row(name: str, r: dict) -> str:
    if "error" in r:
        return error_row(name, r["error"], HEADER)
    return (f"| {name} | {r['target']} | {r['batch']}×{r['seq_len']} | {r['first_step_s']:.1f} s | {r['step_s']:.3f} s "
            f"| {r['tokens_per_s'] / 1e3:,.0f}K | {r['model_tflops_per_s']:.1f} | {pct(r['mfu'])} "
            f"| {pct(r['mfu_measured_peak'])} | {r['peak_gib']:.1f} |")


def main(argv=None) -> None:
    p = run_arguments(__doc__)
    p.add_argument("--autotune", type=int, default=1, metavar="N",
                   help="fla's Triton kernels try only their first N autotune configurations (0: all; default 1)")
    args = p.parse_args(argv)
    if args.child:  # one run, its JSON on the last line of stdout
        _, config, overrides = _parse_run(args.child)
        print(json.dumps(measure(config, overrides + args.set, args.steps, args.warmup, args.autotune)), flush=True)
        return
    if not args.runs:
        p.error("give at least one RUN (name=config.yaml[,section.key=value,...])")
    def one(run: str) -> dict:
        return child_result([sys.executable, os.path.abspath(__file__), "--child", run, "--steps", str(args.steps),
                             "--warmup", str(args.warmup), "--autotune", str(args.autotune),
                             *[f"--set={s}" for s in args.set]])[0]

    results = run_all("bench_torch_lm", expand_runs(args.runs, args.seq_lens, args.tokens_per_step), one, args.out)
    print_table(HEADER, [_row(name, r) for name, r in results.items()])


if __name__ == "__main__":
    main()
