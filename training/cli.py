"""Pretrain a language model with a chosen token mixer (the ``mixerlab-train`` command and ``train.py``).

    mixerlab-train --config configs/base.yaml model.mixer=gdn2 train.steps=200
    python train.py --config configs/base.yaml model.mixer=gdn2 train.steps=200     # the same, from a checkout

Dotted ``section.key=value`` arguments override the YAML config (see training/config.py for every key).
``--config`` is a file or a config shipped in the package (``base``, ``paper/muir_166m``: training/config_files.py);
data paths are relative to the working directory.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from .cli_errors import entry_point

# errors raised by this package (training or mixerlab.training, by layout) are already one readable line
_OWN_PACKAGE = __package__


@entry_point("mixerlab-train")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/base.yaml",
                        help="YAML config: a file, or a config shipped with the package by name, e.g. base, tiny, "
                        "paper/muir_166m (default: configs/base.yaml)")
    parser.add_argument("--print_config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--compile_only", action="store_true",
                        help="AOT-compile the train step for --topology (no TPU needed) and print a memory/FLOP report")
    parser.add_argument("--topology", default="v5e:2x2", help="TPU topology for --compile_only, e.g. v5e:16x16, "
                        "v6e:4x4, v5p:2x2x1 (default v5e:2x2)")
    parser.add_argument("--distributed", action="store_true",
                        help="multi-host: jax.distributed.initialize() with auto-detection (TPU pods, SLURM)")
    parser.add_argument("--coordinator_address", default=None, help="multi-process: host:port of process 0")
    parser.add_argument("--num_processes", type=int, default=None)
    parser.add_argument("--process_id", type=int, default=None)
    parser.add_argument("--distributed_timeout", type=float, default=None, metavar="SECONDS",
                        help="multi-process: how long start-up waits for every process, and how long a lost process "
                        "goes unnoticed at most (default 300)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = parser.parse_args(argv)
    level = os.environ.get("MIXERLAB_LOG", "WARNING")
    if not logging.getLogger().handlers:
        logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger().handlers[0].setLevel(level)  # the run's log file gets more detail than the terminal

    from .config import ConfigError, load_config
    from .config_files import resolve_config_path

    try:
        cfg = load_config(resolve_config_path(args.config), args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return 0

    if args.compile_only:
        return _compile_only(cfg, args.topology)

    from .distributed import DEFAULT_TIMEOUT_S, check_mesh, exit_now, gpu_memory_share, initialize

    gpu_memory_share(cfg.train.gpu_memory_fraction)
    initialize(distributed=args.distributed, coordinator_address=args.coordinator_address,
               num_processes=args.num_processes, process_id=args.process_id,
               timeout_s=DEFAULT_TIMEOUT_S if args.distributed_timeout is None else args.distributed_timeout)
    check_mesh(cfg)
    from .loop import train

    start = time.perf_counter()
    try:
        result = train(cfg)
    except Exception as e:  # one readable line here; the traceback goes to the run's log file
        return exit_now(_report_error(cfg, e))  # several processes: no exit barrier waiting for a dead one
    minutes = (time.perf_counter() - start) / 60
    lines, code = _summary(cfg, result, minutes)
    print("\n" + "\n".join(lines))
    _append_to_run_log(cfg, "".join(f"{time.strftime('%Y-%m-%d %H:%M:%S')} INFO train.py: {line}\n"
                                    for line in lines), primary_only=True)
    return code


def _summary(cfg, result, minutes: float) -> tuple[list[str], int]:
    """The end-of-run lines and the exit code: 0 done, 143 stopped by SIGTERM, 1 diverged."""
    from .run_summary import completed_run_lines, divergence, divergence_lines

    if not result.train_losses and not result.preempted and result.final_step >= cfg.train.steps:
        return completed_run_lines(result.metrics_path, cfg.train.steps) + [
            f"  metrics:     {result.metrics_path}", f"  checkpoints: {result.checkpoint_dir}"], 0
    diverged = divergence(result.train_losses, result.vocab_size)
    lines = [f"{'stopped' if result.preempted else 'diverged' if diverged else 'done'} in {minutes:.1f} min: step "
             f"{result.final_step}, final train loss {result.train_losses.get(result.final_step, float('nan')):.4f}"
             + (f", validation loss {result.val_loss:.4f}" if result.val_loss is not None else ""),
             f"  metrics:     {result.metrics_path} (TensorBoard: {result.run_dir.rstrip('/')}/tensorboard)",
             f"  checkpoints: {result.checkpoint_dir}"]
    if result.plot_path:
        lines.append(f"  loss curve:  {result.plot_path}")
    if result.skipped_steps:
        lines.append(f"  skipped steps (non-finite): {len(result.skipped_steps)}: {result.skipped_steps[:20]}")
    if diverged:
        lines += divergence_lines(diverged, result.checkpoint_dir, cfg.optim.lr)
    if result.preempted:
        lines.append("stopped by SIGTERM before the last step; run the same command to resume")
        return lines, 143
    return lines, 1 if diverged else 0


def _append_to_run_log(cfg, text: str, *, primary_only: bool = False) -> str | None:
    """Appends ``text`` to <output_dir>/train.log (the run's log is closed by now); its path, or None when it
    is not written (``primary_only`` and not process 0, or an error)."""
    import jax

    from mixerlab.training import storage

    from .loop import LOG_NAME

    if primary_only and jax.process_index() != 0:
        return None
    log_path = storage.join(storage.absolute(cfg.train.output_dir), LOG_NAME)
    try:
        if storage.is_url(log_path):  # no append on object stores: the log is rewritten with the entry added
            previous = storage.read_text(log_path) if storage.exists(log_path) else ""
            storage.write_text(log_path, previous + text)
        else:
            with open(log_path, "a") as f:
                f.write(text)
        return log_path
    except OSError:
        return None


def _report_error(cfg, e: Exception) -> int:
    """Prints one line for a failed run (library errors run to hundreds of lines) and appends the full
    traceback to <output_dir>/train.log. Exit code 2 for a refused run directory or bad data, 1 otherwise."""
    import traceback

    from .checkpoint import short_error
    from .distributed import lost_process_line
    from .run_dir import RunDirError

    if isinstance(e, RunDirError):  # a refused run writes nothing into the directory it refused
        print(f"error: {e}", file=sys.stderr)
        return 2
    ours = isinstance(e, FloatingPointError) or type(e).__module__.startswith(_OWN_PACKAGE)
    line = str(e) if ours or isinstance(e, ValueError) else short_error(e, limit=400)
    line = lost_process_line(e, line)
    entry = f"{time.strftime('%Y-%m-%d %H:%M:%S')} ERROR train.py: {line}\n" + "".join(traceback.format_exception(e))
    log_path = _append_to_run_log(cfg, entry)
    where = f" (details: {log_path})" if log_path else ""
    print(f"error: {line}{where}", file=sys.stderr)
    return 2 if isinstance(e, ValueError) else 1


def _compile_only(cfg, topology: str) -> int:
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")  # quiets libtpu's start-up on a CPU host
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from .aot import compile_for_topology
    from .tokenizer import load_tokenizer

    vocab = cfg.model.vocab_size
    if vocab is None:
        vocab = load_tokenizer(cfg.data.tokenizer.kind, cfg.data.tokenizer.path).vocab_size
    try:
        report = compile_for_topology(cfg, topology, vocab)
    except Exception as e:  # a bad topology string or a compile failure (e.g. out of VMEM/HBM)
        print(f"--compile_only for topology {topology!r} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(report.table())
    return 0 if report.fits in (True, None) else 3



if __name__ == "__main__":
    sys.exit(main())
