"""Training-step benchmark: N warm steps of named configs, one table — step time, tokens/s, MFU, the share of
the step the device waits for the host, peak device memory.

    python tools/bench_train.py --steps 10 --warmup 3 \\
        muir_166m=configs/paper/muir_166m.yaml,train.batch_size=32 \\
        transformer_166m=configs/paper/transformer_166m.yaml,train.batch_size=32 \\
        --set data.train_path=data/embedded/train --set data.tokenizer.kind=hf \\
        --set data.tokenizer.path=data/embedded/tokenizer.json

Each RUN is ``name=config.yaml[,section.key=value,...]``; ``--set`` overrides apply to every run. A
long-context table at a fixed number of tokens per step, on documents longer than the context:

    python tools/bench_train.py --long-docs --seq-lens 4096,8192,16384,32768 --tokens-per-step 131072 \
        transformer=configs/paper/transformer_166m.yaml gdn2=configs/paper/gdn2_166m.yaml \
        muir=configs/paper/muir_166m.yaml --set data.train_path=data/embedded/train ...

(``--seq-lens`` runs every RUN at each length with train.batch_size = tokens per step / length, named
``name@length``). ``--long-docs`` joins the packed documents of every row into one (segment ids 1, positions
0..T−1, the EOS tokens left in as ordinary tokens): each row is then one document as long as the context, so
softmax attention does its full T(T+1)/2 pairs per row instead of the within-document pairs of short documents.

Each run goes in its own process (``--in_process`` to change that): peak memory is per run, and an out-of-memory run
is reported as such instead of ending the benchmark. Like train.py, each run applies ``train.gpu_memory_fraction``
before it touches the GPU (with ``--in_process`` only the first run's share can take effect).

Three timings per run, all after ``--warmup`` compiled steps:
  * pipeline — the trainer's way: host batches assembled and put on the device by a background thread
    (training/prefetch.py), no host sync inside the timed steps; this is the step time the table reports;
  * device — the same step on one batch already on the device: what the device alone needs;
  * synced — the previous loop: assemble the batch after the step, then wait for its loss (one host sync per
    step). Its difference to pipeline is what the prefetch buys.
device idle = 1 − device / pipeline (clipped at 0). Model FLOPs per step: training/flop_model.py, with softmax
attention counted from the timed batches' documents (docs/flops.md); mixers the flop model does not cover count
their projections only. MFU is against the chip's datasheet dense bf16 peak (pallas_kernels/chips.py; the H200:
989 TFLOP/s), "MFU (measured peak)" against the project's measured matmul rate (the H200: 790 TFLOP/s); a
device the table does not know gets none. An MFU above 100 % is refused: the run is reported as an error naming
the configuration and the FLOP count.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parse_run(text: str):
    name, sep, rest = text.partition("=")
    if not sep or not rest:
        raise SystemExit(f"bench_train: RUN {text!r} must be name=config.yaml[,section.key=value,...]")
    config, *overrides = rest.split(",")
    return name, config, overrides


def _timed(fn, steps: int) -> float:
    import jax

    start = time.perf_counter()
    out = None
    for _ in range(steps):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / steps


class _PolicyOutOfMemory(Exception):
    def __init__(self, policy):
        super().__init__(policy)
        self.policy = policy


def one_document_per_row(batch: dict) -> dict:
    """A packed batch with its document boundaries removed: every row one document of T tokens (padding, id 0,
    stays padding). The targets are the packed stream's next tokens, so they stay right; the loss now also covers
    each document's last token (its target is the next document's first)."""
    seg = np.asarray(batch["segment_ids"])
    real = seg != 0
    t = seg.shape[-1]
    out = dict(batch)
    out["segment_ids"] = real.astype(seg.dtype)
    out["positions"] = np.where(real, np.arange(t, dtype=np.asarray(batch["positions"]).dtype), 0)
    out["loss_mask"] = real.astype(np.asarray(batch["loss_mask"]).dtype)
    return out


class _Mapped:
    """An iterator of batches passed through ``fn`` (close() reaches the data workers)."""

    def __init__(self, parent, fn):
        self.parent, self.fn = parent, fn

    def __iter__(self):
        return self

    def __next__(self):
        return self.fn(next(self.parent))

    def close(self):
        if hasattr(self.parent, "close"):
            self.parent.close()


def measure(config: str, overrides: list[str], steps: int, warmup: int, depth: int, long_docs: bool = False) -> dict:
    """One run's numbers. Under ``model.remat=auto`` a chosen policy whose steps run out of device memory is
    replaced by the next more frugal one, as train.py does; the row lists the failed ones (``remat_out_of_memory``)."""
    import gc

    from mixerlab.training import config as config_lib
    from mixerlab.training import remat_auto

    auto = config_lib.load_config(config, overrides).model.remat == "auto"
    failed, policy = [], []
    while True:
        try:
            row = _measure(config, overrides + policy, steps, warmup, depth, fallback=auto, long_docs=long_docs)
            return {**row, "remat_out_of_memory": failed} if failed else row
        except _PolicyOutOfMemory as err:
            failed.append(err.policy)
        later = remat_auto.more_frugal(failed[-1])
        if later is None:
            raise RuntimeError(f"model.remat=auto: every policy ran out of device memory ({', '.join(failed)})")
        print(f"bench_train: model.remat=auto: {failed[-1]!r} ran out of device memory; trying {later!r}",
              file=sys.stderr, flush=True)
        policy = [f"model.remat={later}"]
        gc.collect()  # the failed attempt's arrays


def _measure(config: str, overrides: list[str], steps: int, warmup: int, depth: int, fallback: bool,
             long_docs: bool = False) -> dict:
    import jax

    from mixerlab.training import config as config_lib
    from mixerlab.training import data as data_lib
    from mixerlab.training import flop_model
    from mixerlab.training import remat_auto
    from mixerlab.training.distributed import gpu_memory_share
    from mixerlab.training.trainer import Trainer
    from mixerlab.training.prefetch import DevicePrefetcher
    from mixerlab.training.tokenizer import load_tokenizer

    cfg = config_lib.load_config(config, overrides)
    gpu_share = gpu_memory_share(cfg.train.gpu_memory_fraction)  # as train.py does, before the devices are touched
    tokenizer = load_tokenizer(cfg.data.tokenizer.kind, cfg.data.tokenizer.path)
    vocab = cfg.model.vocab_size or tokenizer.vocab_size
    trainer = Trainer(cfg, vocab)
    trainer.initialize()
    host = data_lib.train_iterator(cfg.data, tokenizer, global_batch_size=cfg.train.batch_size, seed=cfg.train.seed)
    if long_docs:
        host = _Mapped(host, one_document_per_row)
    state = {"params": trainer.params, "opt": trainer.opt_state}
    pairs = []  # each step's attention pairs, on the device until a timing is over

    def step(batch):
        state["params"], state["opt"], metrics = trainer.train_step(state["params"], state["opt"], batch)
        pairs.append(metrics["attention_pairs"])
        return metrics["loss"]

    def timed_pairs(fn) -> tuple[float, float]:
        """(seconds per step, mean attention pairs per step) of ``steps`` timed steps."""
        pairs.clear()
        seconds = _timed(fn, steps)
        return seconds, float(np.mean(jax.device_get(pairs)))

    try:
        with DevicePrefetcher(host, trainer.global_batch, depth=depth) as batches:
            compile_start = time.perf_counter()
            jax.block_until_ready(step(next(batches)))
            compile_s = time.perf_counter() - compile_start
            for _ in range(max(warmup - 1, 0)):
                jax.block_until_ready(step(next(batches)))
            pipeline, pipeline_pairs = timed_pairs(lambda: step(next(batches)))
            fixed = next(batches)
            device, device_pairs = timed_pairs(lambda: step(fixed))
        synced, synced_pairs = timed_pairs(lambda: float(step(trainer.global_batch(next(host)))))
        loss = float(step(fixed))
    except Exception as err:  # noqa: BLE001 - only the device's out-of-memory error under auto is retried
        if not (fallback and remat_auto.out_of_memory(err)):
            raise
        raise _PolicyOutOfMemory(trainer.cfg.model.remat) from None
    finally:
        if hasattr(host, "close"):
            host.close()

    tokens = cfg.train.batch_size * cfg.data.seq_len
    flops = flop_model.training_flops(cfg, trainer.abstract_params, vocab)
    chip = flop_model.device_chip()
    stats = jax.devices()[0].memory_stats() or {}
    what = f"{config} {' '.join(overrides)} ({cfg.train.batch_size}x{cfg.data.seq_len}{', long docs' * long_docs})"
    use = {name: flop_model.utilisation(flops.step_flops(tokens, p), t, jax.device_count(), chip, f"{what}, {name}")
           for name, t, p in (("pipeline", pipeline, pipeline_pairs), ("device", device, device_pairs),
                              ("synced", synced, synced_pairs))}
    return {"config": config, "overrides": overrides, "mixers": sorted(set(cfg.layer_mixers)),
            "params_M": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainer.abstract_params)) / 1e6,
            "batch": cfg.train.batch_size, "seq_len": cfg.data.seq_len, "devices": jax.device_count(),
            "remat": trainer.cfg.model.remat,  # model.remat=auto resolved
            "gpu_memory_fraction": gpu_share,
            "platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind,
            "compile_s": compile_s, "step_s": pipeline, "device_step_s": device, "synced_step_s": synced,
            "tokens_per_s": tokens / pipeline, "long_docs": long_docs,
            "model_flops_per_step": flops.step_flops(tokens, pipeline_pairs),
            "attention_flops_per_step": flops.per_attention_pair * pipeline_pairs,
            "attention_pairs_per_row": pipeline_pairs / cfg.train.batch_size,
            "model_tflops_per_s": use["pipeline"]["model_tflops_per_s"],
            "peak_chip": chip.name if chip else None, "peak_tflops": chip.bf16_peak / 1e12 if chip else None,
            "mfu": use["pipeline"].get("mfu"), "mfu_measured_peak": use["pipeline"].get("mfu_measured_peak"),
            "device_mfu": use["device"].get("mfu"), "synced_mfu": use["synced"].get("mfu"),
            "dtype": cfg.model.dtype,
            "device_idle": max(0.0, 1.0 - device / pipeline), "synced_device_idle": max(0.0, 1.0 - device / synced),
            "peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30 or None, "loss_after": loss,
            "flop_notes": list(flops.notes), "jax": jax.__version__}


HEADER = ("| run | batch | step | tokens/s | model TFLOP/s | attention share | MFU | MFU (measured peak) | device idle "
          "| peak GiB | previous loop (per-step sync) |")


def pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def error_row(name: str, error: str, header: str) -> str:
    """A table row of ``header``'s columns for a run that failed: dashes, then the error's last part."""
    return f"| {name} |" + " — |" * (header.count(" | ") - 1) + f" {error.split(' / ')[-1][:300]} |"


def print_table(header: str, rows: list[str]) -> None:
    print(header)
    print("|---" * (header.count(" | ") + 1) + "|")
    for row in rows:
        print(row)


def child_result(cmd: list[str], keep=lambda line: False) -> tuple[dict, list[str]]:
    """Runs one run's child process: (its JSON, the last line of its stdout; the stdout lines ``keep`` selects).
    The kept lines and the child's stderr go to this process's stderr as they come, so a run cut short (a time
    limit, a hang) still shows how far it got. A failed child raises RuntimeError with the kept lines and the last
    lines of its stderr. If this process is ended (SIGTERM, e.g. by ``timeout``, or Ctrl-C) the child is killed
    too: a cut benchmark leaves nothing running on the device for the next run to share it with."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
    stdout: list[str] = []
    stderr: list[str] = []
    kept: list[str] = []

    def echo_stderr():
        for line in proc.stderr:
            stderr.append(line.rstrip("\n"))
            print(f"  {stderr[-1]}", file=sys.stderr, flush=True)

    reader = threading.Thread(target=echo_stderr, daemon=True)
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if on_main else None
    try:
        reader.start()
        for line in proc.stdout:
            stdout.append(line.rstrip("\n"))
            if keep(stdout[-1]):
                kept.append(stdout[-1])
                print(f"  {kept[-1]}", file=sys.stderr, flush=True)
        proc.wait()
        reader.join()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if on_main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    if proc.returncode != 0:
        tail = [line for line in stderr if line.strip()][-3:]
        raise RuntimeError(" / ".join(kept + tail) or f"exit {proc.returncode}")
    results = [line for line in stdout if line.strip()]
    if not results:
        raise RuntimeError(f"{' '.join(cmd[:3])}: the child ended without printing its result")
    return json.loads(results[-1]), kept


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds child_result's finally, which kills the child


def run_all(tool: str, runs: list[str], one, out: str | None) -> dict:
    """{name: one(run)} for each run in turn; a run that raises is reported as its error and the next one goes on.
    Each result is printed (stderr) as it comes and ``out`` (JSON) rewritten, so a cut benchmark keeps its rows."""
    results = {}
    for run in runs:
        name = _parse_run(run)[0]
        print(f"{tool}: {name} ...", file=sys.stderr, flush=True)
        try:
            results[name] = one(run)
        except Exception as e:  # noqa: BLE001 - report and go on with the next run
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"{tool}: {name}: {json.dumps(results[name])[:400]}", file=sys.stderr, flush=True)
        if out:
            with open(out, "w") as f:
                json.dump(results, f, indent=1)
    return results


def _row(name: str, r: dict) -> str:
    if "error" in r:
        return error_row(name, r["error"], HEADER)
    peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
    share = r["attention_flops_per_step"] / r["model_flops_per_step"]
    return (f"| {name} | {r['batch']}×{r['seq_len']} | {r['step_s']:.3f} s | {r['tokens_per_s'] / 1e3:,.0f}K | "
            f"{r['model_tflops_per_s']:.1f} | {pct(share)} | {pct(r['mfu'])} | {pct(r['mfu_measured_peak'])} | "
            f"{pct(r['device_idle'])} | {peak} | synced loop {r['synced_step_s']:.3f} s "
            f"({pct(r['synced_mfu'])}, idle {pct(r['synced_device_idle'])}); remat {r.get('remat', '?')} |")


def expand_runs(runs: list[str], seq_lens: list[int], tokens_per_step: int | None) -> list[str]:
    """Every RUN at every length of ``seq_lens`` with batch = tokens_per_step / length, named name@length (no
    lengths: the runs as given)."""
    if not seq_lens:
        return list(runs)
    if not tokens_per_step:
        raise SystemExit("bench_train: --seq-lens needs --tokens-per-step (tokens in every step)")
    out = []
    for run in runs:
        name, config, overrides = _parse_run(run)
        for length in seq_lens:
            if tokens_per_step % length:
                raise SystemExit(f"bench_train: --tokens-per-step {tokens_per_step} is not a multiple of the "
                                 f"--seq-lens length {length}")
            out.append(",".join([f"{name}@{length}={config}", *overrides, f"data.seq_len={length}",
                                 f"train.batch_size={tokens_per_step // length}"]))
    return out


def run_arguments(doc: str) -> argparse.ArgumentParser:
    """The arguments every step-time benchmark takes: RUNs, --set, --steps, --warmup, --seq-lens,
    --tokens-per-step, --out, and the hidden --child (one run in a child process)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", metavar="RUN", help="name=config.yaml[,section.key=value,...]")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every run")
    p.add_argument("--steps", type=int, default=10, help="timed steps per timing (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first, the first included (default 3)")
    p.add_argument("--seq-lens", type=lambda t: [int(x) for x in t.split(",") if x], default=[],
                   metavar="T1,T2,...", help="run every RUN at each context length (with --tokens-per-step)")
    p.add_argument("--tokens-per-step", type=int, help="tokens per step for --seq-lens (batch = tokens / length)")
    p.add_argument("--out", help="write every run's numbers to this JSON file")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> None:
    p = run_arguments(__doc__)
    p.add_argument("--depth", type=int, default=2, help="batches prefetched ahead (default 2)")
    p.add_argument("--long-docs", action="store_true",
                   help="one document per row (the packed documents joined): attention over the whole context")
    p.add_argument("--in_process", action="store_true", help="run every config in this process")
    args = p.parse_args(argv)

    if args.child:  # one run, its JSON on the last line of stdout
        _, config, overrides = _parse_run(args.child)
        print(json.dumps(measure(config, overrides + args.set, args.steps, args.warmup, args.depth,
                                 long_docs=args.long_docs)), flush=True)
        return
    if not args.runs:
        p.error("give at least one RUN (name=config.yaml[,section.key=value,...])")

    def one(run: str) -> dict:
        _, config, overrides = _parse_run(run)
        if args.in_process:
            return measure(config, overrides + args.set, args.steps, args.warmup, args.depth, long_docs=args.long_docs)
        cmd = [sys.executable, os.path.abspath(__file__), "--child", run, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--depth", str(args.depth), *[f"--set={s}" for s in args.set],
               *(["--long-docs"] if args.long_docs else [])]
        # what model.remat=auto decided goes with the result, or before the error's last lines
        result, auto = child_result(cmd, keep=lambda line: line.startswith("model.remat=auto"))
        return {**result, "remat_auto": auto} if auto else result

    results = run_all("bench_train", expand_runs(args.runs, args.seq_lens, args.tokens_per_step), one, args.out)
    print_table(HEADER, [_row(name, r) for name, r in results.items()])


if __name__ == "__main__":
    main()
