"""Where two implementations part: the gradient of every parameter, mixerlab's against the PyTorch model's (HF
Llama, fla), from the same weights on the same batch, at chosen steps of mixerlab's float32 training run.

    TRITON_INTERPRET=1 JAX_PLATFORMS=cpu python tools/parity_grads.py --mixer gdn2 --torch-core naive \\
        --at 0,50,56,60,100 --steps 300 --out OUT --set ...   (the flags of the tools/parity_torch.py run)

When two float32 training curves from the same weights separate (tools/parity_torch.py), this tells a defect
from rounding: at each step of ``--at`` it exports mixerlab's current weights, loads them into the PyTorch model,
and compares the two losses and the two gradients tensor by tensor on that step's batch (mixerlab's gradients go
through the same name-and-layout table as the weights: every mapping is a transpose or reshape). Rounding gives
a relative error of ~1e-6 on every tensor; a difference in the model shows as tensors orders of magnitude above
the rest. Writes OUT/grads.json and prints, per step, the losses and the five worst tensors.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import parity_torch  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mixer", required=True, choices=["softmax", "gdn2", "gated_deltanet"])
    p.add_argument("--at", required=True, help="comma-separated steps (0 = the initial weights)")
    p.add_argument("--steps", type=int, default=300,
                   help="the length of the training run the steps belong to (its schedule and its batches, as "
                        "tools/parity_torch.py --steps draws them); default 300")
    p.add_argument("--out", required=True)
    p.add_argument("--set", action="append", default=[], help="section.key=value over tools/parity_torch.py's shape")
    p.add_argument("--torch-core", choices=["kernel", "naive"], default="kernel",
                   help="as tools/parity_torch.py (gdn2 on the CPU: 'naive')")
    a = p.parse_args(argv)
    try:
        a.at = sorted({int(s) for s in a.at.split(",")})
    except ValueError:
        p.error(f"--at {a.at!r}: expected comma-separated step numbers, e.g. 0,50,100")
    if a.at[0] < 0 or a.at[-1] >= a.steps:
        p.error(f"--at {a.at}: steps must lie in 0..{a.steps - 1} (--steps {a.steps})")
    return a


def tensor_errors(ours: dict, theirs: dict) -> dict:
    """{name: (max |Δ| / max |theirs|, ‖Δ‖ / ‖theirs‖)} over the names both have; a name only one has is an error."""
    if set(ours) != set(theirs):
        raise SystemExit(f"parity_grads: tensor names differ: only ours {sorted(set(ours) - set(theirs))[:5]}, "
                         f"only theirs {sorted(set(theirs) - set(ours))[:5]}")
    out = {}
    for name, want in theirs.items():
        got = np.asarray(ours[name], np.float64)
        want = np.asarray(want, np.float64)
        if got.shape != want.shape:
            raise SystemExit(f"parity_grads: {name}: ours {got.shape}, theirs {want.shape}")
        d = got - want
        scale, norm = float(np.max(np.abs(want))), float(np.linalg.norm(want))
        out[name] = (float(np.max(np.abs(d))) / max(scale, 1e-30), float(np.linalg.norm(d)) / max(norm, 1e-30))
    return out


def torch_grads(hf_dir, rows) -> tuple[float, dict]:
    """(loss, {tensor name: gradient}) of the PyTorch model loaded from ``hf_dir`` on one batch of rows."""
    import torch
    import torch.nn.functional as F

    model = parity_torch.torch_model(hf_dir).train()
    x = torch.from_numpy(np.ascontiguousarray(rows)).long().to(parity_torch.DEVICE())
    logits = model(input_ids=x[:, :-1]).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    return float(loss), {n: p.grad.detach().float().cpu().numpy() for n, p in model.named_parameters()
                         if p.grad is not None}


def ours_grads(trainer, params, rows) -> tuple[float, dict]:
    """(loss, {target tensor name: gradient}) of mixerlab's model: the gradient tree mapped by the export table."""
    import jax

    from mixerlab.interop import hf_dir as layout
    from mixerlab.interop import targets

    batch = parity_torch.jax_batch(trainer, rows)
    (loss, _), grads = jax.jit(trainer._loss_and_grads)(params, batch)
    model = parity_torch.nnx_model(trainer, grads)
    name = targets.check(trainer.cfg, int(model.embed.embedding.shape[0]), None)
    return float(loss), layout.to_tensors(trainer.cfg, name, layout.flat_params(model))


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    from mixerlab import interop
    from mixerlab.training.tokenizer import load_tokenizer
    from mixerlab.training.trainer import Trainer

    if args.torch_core == "naive":
        parity_torch.use_naive_gdn2_core()
    parity_torch.limit_triton_autotune(1)
    cfg = parity_torch.config(args)
    vocab = load_tokenizer(cfg.data.tokenizer.kind, cfg.data.tokenizer.path).vocab_size
    os.makedirs(args.out, exist_ok=True)
    batches = parity_torch.make_batches(cfg, args.steps, os.path.join(args.out, "batches.npy"))
    trainer = Trainer(cfg, vocab)
    trainer.initialize()
    params, opt = trainer.params, trainer.opt_state
    report = {"mixer": args.mixer, "set": args.set, "batches_sha": parity_torch.digest(batches), "steps": {}}
    for step, rows in enumerate(batches[:args.at[-1] + 1]):
        if step in args.at:
            hf_dir = os.path.join(args.out, f"hf_step{step}")
            interop.export_model(parity_torch.nnx_model(trainer, params), cfg, hf_dir,
                                 tokenizer_path=cfg.data.tokenizer.path)
            loss_ours, g_ours = ours_grads(trainer, params, rows)
            loss_torch, g_torch = torch_grads(hf_dir, rows)
            errors = tensor_errors(g_ours, g_torch)
            worst = sorted(errors.items(), key=lambda kv: -kv[1][1])
            report["steps"][step] = {"loss_ours": loss_ours, "loss_torch": loss_torch,
                                     "median_rel_norm": float(np.median([e[1] for e in errors.values()])),
                                     "tensors": errors}
            print(f"step {step}: loss ours {loss_ours:.7f} torch {loss_torch:.7f} (Δ {loss_ours - loss_torch:+.2e}); "
                  f"median ‖Δg‖/‖g‖ {report['steps'][step]['median_rel_norm']:.1e}; worst:", flush=True)
            for name, (max_rel, norm_rel) in worst[:5]:
                print(f"    {name:60s} ‖Δ‖/‖g‖ {norm_rel:.1e}  max {max_rel:.1e}", flush=True)
            with open(os.path.join(args.out, "grads.json"), "w") as f:
                json.dump(report, f, indent=1)
        params, opt, _ = trainer.train_step(params, opt, parity_torch.jax_batch(trainer, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
