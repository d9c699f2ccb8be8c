"""Side-by-side parity with a PyTorch implementation someone else wrote: the same weights, the same token batches,
the same optimizer — in mixerlab and in HF transformers (softmax → LlamaForCausalLM) or fla (gdn2 → fla's model).

    python tools/parity_torch.py --mixer softmax --steps 300 --out /tmp/parity_softmax
    python tools/parity_torch.py --mixer gdn2 --steps 300 --out /tmp/parity_gdn2

What it does, in one process on one GPU:
  1. builds the batches once from the embedded corpus (documents joined by EOS into one stream, cut into rows of
     seq_len + 1 tokens: every row is one causal sequence on both sides, no packed-document resets) and writes them
     to OUT/batches.npy, which both implementations read;
  2. draws mixerlab's initial weights (train.seed) and exports them with ``mixerlab.interop.export_model``;
     the PyTorch model loads that directory with ``from_pretrained``;
  3. logits: both models on the first batch, float32 (matmuls at full float32 on both sides) and bfloat16
     (mixerlab ``model.dtype=bfloat16``; torch under ``autocast(bfloat16)``);
  4. trains ``--steps`` steps in each of these runs, from the same initial weights on the same batches:
       ours_f32, ours_bf16 (the default mixed precision: float32 residual stream), ours_bf16_res16 (the
       residual stream in bfloat16 too), ours_*_seed1 (other initial weights: the seed-to-seed spread, and a
       second sample of each precision gap), torch_f32, torch_autocast;
     AdamW with mixerlab's settings on both sides (decay on every matrix, none on vectors; warmup + cosine to
     lr·min_lr_ratio as optax's warmup_cosine_decay_schedule; global-norm clipping);
  5. writes OUT/parity.json (every loss, the logit errors, the summary) and OUT/parity.png, and prints a table.

Summary rows (over steps ``--window``, default 200–300): mean |Δloss| ours vs torch (float32 and bfloat16), the
seed spread mean |ours_f32 − ours_f32_seed1|, and each implementation's bfloat16 − float32 mean difference.
Needs torch, transformers (and fla-core for gdn2) beside JAX on a CUDA machine.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

SHAPE = {"model.num_layers": 8, "model.d_model": 512, "model.num_heads": 8, "model.ffn_dim": 1408,
         "data.seq_len": 2048, "train.batch_size": 16, "optim.lr": 1.5e-3, "optim.warmup_steps": 30}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mixer", required=True, choices=["softmax", "gdn2", "gated_deltanet"])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", required=True)
    p.add_argument("--window", default="200,300", help="first,last step (1-based, inclusive) of the summary")
    p.add_argument("--runs", default="ours_f32,ours_bf16,ours_bf16_res16,ours_f32_seed1,torch_f32,torch_autocast")
    p.add_argument("--previous", help="an earlier parity.json of the same batches and weights: its curves join")
    p.add_argument("--merge", nargs="+", metavar="PARITY_JSON",
                   help="run nothing: join the curves of these parity.json files (same batches and initial "
                        "weights; e.g. the torch runs and ours from parallel processes) into OUT's parity.json, "
                        "plot and summary")
    p.add_argument("--set", action="append", default=[], help="section.key=value over the default shape")
    p.add_argument("--torch-core", choices=["kernel", "naive"], default="kernel",
                   help="gdn2: 'naive' runs fla's token-by-token naive_recurrent_gdn2 (plain torch, differentiable) "
                        "inside fla's layer instead of its chunk kernel: the CPU check, with fla's other kernels "
                        "under TRITON_INTERPRET=1 (the interpreter cannot run the chunk kernel)")
    p.add_argument("--torch-autotune", type=int, default=0, metavar="N",
                   help="fla's Triton kernels try only their first N autotune configurations (0: all). Their full "
                        "autotune compiles hundreds of variants; parity needs correct kernels, not the fastest. "
                        "With TRITON_INTERPRET=1 (fla's kernels on the CPU) nothing is timed and the first is used")
    p.add_argument("--torch-f32-dots", choices=["default", "tf32x3", "ieee"], default="default",
                   help="the precision of every float32-operand tl.dot in fla's Triton kernels (TRITON_F32_DEFAULT, "
                        "process-wide, and the dots whose precision fla's source pins: the triangular solve's TF32, "
                        "the safe-gate gradients' bf16x3). 'default' keeps fla's own: one TF32 pass, ~1e-3 "
                        "relative, so its float32 logits differ from a float32-accurate model by that much; "
                        "'tf32x3' is float32-accurate (what mixerlab's kernels do under the float32 matmul "
                        "setting this tool uses); 'ieee' is exact but compiles and runs far slower")
    a = p.parse_args(argv)
    lo, hi = (int(x) for x in a.window.split(","))
    if not 1 <= lo <= hi <= a.steps:
        p.error(f"--window {a.window}: need 1 <= first <= last <= --steps ({a.steps})")
    a.window = (lo, hi)
    a.runs = a.runs.split(",")
    return a


def config(args, **over):
    from mixerlab.training.config import load_config

    settings = {**SHAPE, "model.mixer": args.mixer, "train.steps": args.steps, "checkpoint.every": 0,
                **dict(s.split("=", 1) for s in args.set), **over}
    return load_config("configs/base.yaml", [f"{k}={v}" for k, v in settings.items()])


def make_batches(cfg, steps: int, path: str) -> np.ndarray:
    """[steps, B, T+1] int32 from the embedded training corpus, written to ``path`` and read back."""
    import pyarrow.parquet as pq

    from mixerlab.training.tokenizer import load_tokenizer

    tok = load_tokenizer(cfg.data.tokenizer.kind, cfg.data.tokenizer.path)
    texts = [t for f in sorted(glob.glob(os.path.join(cfg.data.train_path, "*.parquet")))
             for t in pq.read_table(f, columns=[cfg.data.text_column]).column(0).to_pylist()]
    stream = np.concatenate([np.asarray([*ids, tok.eos_id], np.int32) for ids in tok.encode_batch(texts)])
    b, t = cfg.train.batch_size, cfg.data.seq_len + 1
    rows = len(stream) // t
    order = np.random.default_rng(0).permutation(rows * math.ceil(steps * b / rows))[:steps * b] % rows
    batches = stream[:rows * t].reshape(rows, t)[order].reshape(steps, b, t)
    np.save(path, batches)
    return np.load(path)


def jax_batch(trainer, rows):
    inputs, targets = rows[:, :-1], rows[:, 1:]
    ones = np.ones(inputs.shape, np.int32)
    local = {"inputs": inputs, "targets": targets, "segment_ids": ones,
             "positions": np.broadcast_to(np.arange(inputs.shape[1], dtype=np.int32), inputs.shape),
             "loss_mask": ones.astype(np.float32)}
    return trainer.global_batch(local)


def ours(cfg, vocab, batches, *, train: bool = True):
    """(trainer, initial params as numpy, [losses] or None): train.seed's initial weights, trained on ``batches``."""
    import jax

    from mixerlab.training.trainer import Trainer

    trainer = Trainer(cfg, vocab)
    trainer.initialize()
    init = jax.tree.map(np.asarray, trainer.params)
    if not train:
        return trainer, init, None
    params, opt, losses = trainer.params, trainer.opt_state, []
    for rows in batches:
        params, opt, m = trainer.train_step(params, opt, jax_batch(trainer, rows))
        losses.append(m["loss"])
    return trainer, init, [float(x) for x in jax.device_get(losses)]


def ours_logits(trainer, params, rows):
    import jax
    from flax import nnx

    model = nnx.merge(trainer.graphdef, jax.device_put(params, trainer.param_shardings), trainer.rest)
    return np.asarray(model(rows[:, :-1]), np.float32)


def torch_schedule(cfg):
    """optax.warmup_cosine_decay_schedule(0, lr, warmup, max(steps, warmup + 1), lr·min_ratio) as a factor of lr."""
    o, steps = cfg.optim, cfg.train.steps
    decay = max(steps, o.warmup_steps + 1)

    def factor(step):
        if step < o.warmup_steps:
            return step / o.warmup_steps
        frac = min(step - o.warmup_steps, decay - o.warmup_steps) / (decay - o.warmup_steps)
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))

    return factor


def DEVICE():  # noqa: N802  the GPU when torch sees one (the measurements), else the CPU (smoke tests)
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# fla modules whose kernels pin a tl.dot precision in the source (input_precision=NAME), which TRITON_F32_DEFAULT
# does not reach: GDN-2's and Gated DeltaNet's triangular solve ('tf32' on TF32 GPUs), GDN-2's and KDA's safe-gate
# gradient dots ('bf16x3' from Triton 3.6). Imported here so that their constants can be reset before any compile.
_FLA_PINNED = ("fla.ops.gdn2.chunk_intra", "fla.ops.gated_delta_rule.chunk_fwd", "fla.ops.kda.chunk_intra")


def pinned_dot_precisions(module_names=_FLA_PINNED) -> list[tuple[object, str]]:
    """(module, NAME) of every ``*_DOT_PRECISION`` constant in those modules (the ones that are installed)."""
    import importlib

    found = []
    for name in module_names:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        found += [(module, attr) for attr in sorted(vars(module)) if attr.endswith("_DOT_PRECISION")]
    return found


def force_fla_dot_precision(precision: str, module_names=_FLA_PINNED, constexpr=None) -> list[str]:
    """Set every pinned fla dot precision to ``precision`` (Triton reads a kernel's global constexprs when it
    compiles it, so this must run before the first call). Returns "module.NAME: old -> new" lines for the log."""
    if constexpr is None:
        import triton.language as tl

        constexpr = tl.constexpr
    changed = []
    for module, attr in pinned_dot_precisions(module_names):
        old = getattr(module, attr)
        setattr(module, attr, constexpr(precision))
        changed.append(f"{module.__name__}.{attr}: {getattr(old, 'value', old)} -> {precision}")
    return changed


def limit_triton_autotune(n: int) -> None:
    """Makes Triton's autotuner consider only the first ``n`` configurations of each kernel (module docstring)."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if n <= 0 and not interpret:
        return
    from triton.runtime import autotuner

    prune = autotuner.Autotuner.prune_configs
    autotuner.Autotuner.prune_configs = lambda self, kwargs: prune(self, kwargs)[:max(n, 1) if not interpret else 1]
    if interpret:  # the interpreter has no GPU driver to time with
        autotuner.Autotuner._bench = lambda self, *args, config, **meta: [0.0, 0.0, 0.0]


def use_naive_gdn2_core() -> None:
    """fla's GDN-2 layer with its recurrence computed by fla's own naive reference (q, k L2-normalised first, as
    the chunk kernel's ``use_qk_l2norm_in_kernel`` does, eps 1e-6 inside the square root)."""
    import fla.layers.gdn2 as layer
    from fla.ops.gdn2.naive import naive_recurrent_gdn2

    def l2(x):
        return x * (x.float().pow(2).sum(-1, keepdim=True) + 1e-6).rsqrt().to(x.dtype)

    def chunk_gdn2(q, k, v, g, b, w, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
                   cu_seqlens=None, **unused):
        if cu_seqlens is not None:
            raise SystemExit("parity_torch --torch-core naive: packed sequences (cu_seqlens) are not supported")
        if use_qk_l2norm_in_kernel:
            q, k = l2(q), l2(k)
        return naive_recurrent_gdn2(q, k, v, g, b, w, initial_state=initial_state,
                                    output_final_state=output_final_state)

    layer.chunk_gdn2 = chunk_gdn2


def torch_model(hf_dir):
    import torch

    from mixerlab.interop import load_torch

    return load_torch(hf_dir, dtype=torch.float32).to(DEVICE())


def torch_train(cfg, hf_dir, batches, *, autocast: bool):
    import torch
    import torch.nn.functional as F

    model = torch_model(hf_dir)
    o = cfg.optim
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.b1, o.b2), eps=o.eps, fused=DEVICE() == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, torch_schedule(cfg))
    losses = []
    for rows in batches:
        x = torch.from_numpy(np.ascontiguousarray(rows)).long().to(DEVICE())
        with torch.autocast(DEVICE(), dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if o.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        sched.step()
        losses.append(loss.detach())
    return model, [float(x) for x in torch.stack(losses).cpu()]


def torch_logits(hf_dir, rows, *, autocast: bool):
    import torch

    model = torch_model(hf_dir).eval()
    with torch.no_grad(), torch.autocast(DEVICE(), dtype=torch.bfloat16, enabled=autocast):
        x = torch.from_numpy(np.ascontiguousarray(rows[:, :-1])).long().to(DEVICE())
        return model(input_ids=x).logits.float().cpu().numpy()


def logit_error(a, b):
    d = a - b
    return {"max_abs": float(np.max(np.abs(d))), "rel_rms": float(np.sqrt(np.mean(d * d) / np.mean(b * b)))}


def summarize(curves: dict, window) -> dict:
    """Mean |Δloss| between implementations and seeds, and mean (bfloat16 − float32) per implementation and seed,
    over the window's steps."""
    lo, hi = window
    w = lambda name: np.asarray(curves[name][lo - 1:hi])  # noqa: E731
    out = {}
    pairs = {"ours_vs_torch_f32": ("ours_f32", "torch_f32"), "ours_vs_torch_bf16": ("ours_bf16", "torch_autocast"),
             "seed_spread_f32": ("ours_f32", "ours_f32_seed1"), "seed_spread_bf16": ("ours_bf16", "ours_bf16_seed1")}
    for key, (a, b) in pairs.items():
        if a in curves and b in curves:
            out[key + "_mean_abs"] = float(np.mean(np.abs(w(a) - w(b))))
    for a, b in GAPS:
        if a in curves and b in curves:
            out[f"{a}_minus_{b}_mean"] = float(np.mean(w(a) - w(b)))
    return out


GAPS = [("ours_bf16", "ours_f32"), ("ours_bf16_res16", "ours_f32"), ("ours_bf16_seed1", "ours_f32_seed1"),
        ("ours_bf16_res16_seed1", "ours_f32_seed1"), ("torch_autocast", "torch_f32")]


def plot(curves: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, dx) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, ys in curves.items():
        ax.plot(np.arange(1, len(ys) + 1), ys, label=name, lw=1)
    ax.set(xlabel="step", ylabel="train loss (nats)", title=title)
    ax.legend(fontsize=8)
    for a, b in [("ours_f32", "torch_f32"), ("ours_bf16", "torch_autocast"), ("ours_f32", "ours_f32_seed1"), *GAPS]:
        if a in curves and b in curves:
            dx.plot(np.arange(1, len(curves[a]) + 1), np.subtract(curves[a], curves[b]), label=f"{a} − {b}", lw=1)
    dx.axhline(0, color="k", lw=0.5)
    dx.set(xlabel="step", ylabel="Δ loss (nats)", title="differences")
    dx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


OURS = {  # run name -> overrides of the base shape
    "ours_f32": {}, "ours_bf16": {"model.dtype": "bfloat16"},
    "ours_bf16_res16": {"model.dtype": "bfloat16", "model.residual_dtype": "null"},
    "ours_f32_seed1": {"train.seed": 1}, "ours_bf16_seed1": {"model.dtype": "bfloat16", "train.seed": 1},
    "ours_bf16_res16_seed1": {"model.dtype": "bfloat16", "model.residual_dtype": "null", "train.seed": 1},
}


def digest(tree) -> str:
    import hashlib

    import jax

    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()[:16]


def join(parts: list[dict], refusal: str) -> tuple[dict, dict]:
    """(curves, timings) of parity results made on the same mixer, batches and initial weights (a later part wins
    a run name); ``refusal`` is the error when they were not."""
    keys = {(p.get("mixer"), p.get("batches_sha"), p.get("init_sha")) for p in parts}
    if len(keys) != 1:
        raise SystemExit(f"parity_torch: {refusal}: {sorted(map(str, keys))}")
    return ({k: v for p in parts for k, v in p["curves"].items()},
            {k: v for p in parts for k, v in p.get("timings_s", {}).items()})


def merge(args) -> int:
    """--merge: one parity.json from several of the same batches and initial weights."""
    parts = []
    for path in args.merge:
        with open(path) as f:
            parts.append(json.load(f))
    curves, timings = join(parts, "--merge files differ in mixer, batches or initial weights")
    result = {k: v for p in parts for k, v in p.items() if k not in ("curves", "timings_s", "summary", "window")}
    result["logits"] = {k: v for p in parts for k, v in p.get("logits", {}).items()}
    torch_parts = [p for p in parts if any(k.startswith("torch") for k in p["curves"])]
    for key in ("torch_f32_dots", "torch_core"):  # how the torch side ran: from the part that ran it
        if torch_parts and key in torch_parts[-1]:
            result[key] = torch_parts[-1][key]
    result["merged_from"] = list(args.merge)
    os.makedirs(args.out, exist_ok=True)
    finish(args, result, curves, timings)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.merge:
        return merge(args)
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")  # float32 means float32 (torch's default too)
    from mixerlab.training.tokenizer import load_tokenizer

    unknown = [r for r in args.runs if r not in OURS and r not in ("torch_f32", "torch_autocast")]
    if unknown:
        raise SystemExit(f"parity_torch: unknown --runs {unknown}; known: {[*OURS, 'torch_f32', 'torch_autocast']}")
    os.makedirs(args.out, exist_ok=True)
    if any(r.startswith("torch") for r in args.runs):
        if args.torch_f32_dots != "default":  # read by Triton when it compiles a kernel (before any is compiled)
            os.environ["TRITON_F32_DEFAULT"] = args.torch_f32_dots
            for line in force_fla_dot_precision(args.torch_f32_dots):  # and the dots that name their own
                print(f"parity: {line}", flush=True)
        limit_triton_autotune(args.torch_autotune)
        if args.torch_core == "naive":
            use_naive_gdn2_core()
    base = config(args)
    vocab = load_tokenizer(base.data.tokenizer.kind, base.data.tokenizer.path).vocab_size
    batches = make_batches(base, args.steps, os.path.join(args.out, "batches.npy"))
    print(f"parity: {args.mixer}, batches {batches.shape} (sha {digest(batches)}), vocab {vocab}", flush=True)
    curves, timings = {}, {}
    result = {"mixer": args.mixer, "shape": SHAPE, "set": args.set, "steps": args.steps, "batches_sha": digest(batches),
              "torch_f32_dots": args.torch_f32_dots, "torch_core": args.torch_core}
    first = batches[0][:4]
    logits = {}
    # ours_f32 first (its weights are exported), then the torch runs, then the other runs of ours
    hf_dir = os.path.join(args.out, "hf_init")
    order = ["ours_f32"] + [r for r in args.runs if r.startswith("torch")] + [r for r in OURS if r in args.runs]
    for name in dict.fromkeys(order):
        t0 = time.time()
        if name.startswith("torch"):
            _, curves[name] = torch_train(base, hf_dir, batches, autocast=name == "torch_autocast")
            timings[name] = time.time() - t0
            print(f"  {name}: last loss {curves[name][-1]:.4f} ({timings[name]:.0f} s)", flush=True)
            save_partial(args, result, curves)
            continue
        trainer, init, losses = ours(config(args, **OURS[name]), vocab, batches, train=name in args.runs)
        if losses is not None:
            curves[name], timings[name] = losses, time.time() - t0
            print(f"  {name}: init sha {digest(init)}, last loss {losses[-1]:.4f} ({timings[name]:.0f} s)", flush=True)
            save_partial(args, result, curves)
        if name == "ours_bf16" and "torch_autocast" in logits:
            bf16 = ours_logits(trainer, init, first)
            result["logits"].update(bf16=logit_error(bf16, logits["torch_autocast"]),
                                    bf16_ours_vs_f32=logit_error(bf16, logits["ours_f32"]),
                                    bf16_torch_vs_f32=logit_error(logits["torch_autocast"], logits["torch_f32"]))
            print(f"logits bf16: {result['logits']['bf16']}", flush=True)
        if name == "ours_f32":
            result["init_sha"] = digest(init)
            logits["ours_f32"] = ours_logits(trainer, init, first)
            if any(r.startswith("torch") for r in args.runs):
                from mixerlab import interop

                result["model_type"] = interop.export_model(nnx_model(trainer, init), trainer.cfg, hf_dir,
                                                            tokenizer_path=base.data.tokenizer.path)
                logits["torch_f32"] = torch_logits(hf_dir, first, autocast=False)
                logits["torch_autocast"] = torch_logits(hf_dir, first, autocast=True)
                result["logits"] = {"f32": logit_error(logits["ours_f32"], logits["torch_f32"])}
                print(f"logits f32: {result['logits']['f32']}", flush=True)
    finish(args, result, curves, timings)
    return 0


def save_partial(args, result, curves) -> None:
    """The curves so far (a call cut short by its time limit keeps them)."""
    with open(os.path.join(args.out, "parity_partial.json"), "w") as f:
        json.dump({**result, "curves": curves}, f)


def finish(args, result, curves, timings) -> None:
    """Joins --previous's curves, writes parity.json and parity.png, prints the summary."""
    if args.previous:  # curves of an earlier call on the same batches and initial weights
        with open(args.previous) as f:
            prev = json.load(f)
        curves, timings = join([prev, {**result, "curves": curves, "timings_s": timings}],
                               f"--previous {args.previous} ran other batches or initial weights")
    result.update(curves=curves, timings_s=timings, window=args.window, summary=summarize(curves, args.window))
    with open(os.path.join(args.out, "parity.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(curves, os.path.join(args.out, "parity.png"), f"{args.mixer}: mixerlab vs PyTorch, same init and batches")
    for k, v in result["summary"].items():
        print(f"  {k:40s} {v:+.4f}")


def nnx_model(trainer, params):
    import jax
    from flax import nnx

    return nnx.merge(trainer.graphdef, jax.tree.map(np.asarray, params), trainer.rest)


if __name__ == "__main__":
    raise SystemExit(main())
