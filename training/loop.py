"""The training entry, train(): the start-up checks (run directory, data, tokenizer), the run-directory lock, and
the run itself (training/run_loop.py), started again with a more frugal model.remat=auto policy after an
out-of-memory stop before its first step."""
from __future__ import annotations

import dataclasses

import jax

from mixerlab.training import data as data_lib
from mixerlab.training import storage
from mixerlab.training import run_dir as run_dir_lib
from mixerlab.training import run_lock
from mixerlab.training import remat_auto
from mixerlab.training.tokenizer import load_tokenizer
from mixerlab.training.profiler import steady_profile_window
from mixerlab.training.progress import WARMUP_STEPS, _say
from mixerlab.training.run_log import LOG_NAME, _RunLog
from mixerlab.training.run_loop import RunResult, _Loop
from mixerlab.training.trainer import Trainer, evaluate

# The run's parts live in their own modules (trainer, run_loop, run_log, profiler, preemption, progress,
# data_state); these names are imported from here by the CLI, tools and tests.
__all__ = ["LOG_NAME", "WARMUP_STEPS", "RunResult", "Trainer", "evaluate", "steady_profile_window", "train"]


def train(cfg, *, stop_at_step: int | None = None, progress: bool = True) -> RunResult:
    """Runs (or resumes) the configured training. ``stop_at_step`` ends the run early after that step (and its
    checkpoint, if one is due) — used by tests to simulate an interruption.

    Everything that can be checked is checked before the first step (folders writable, the run directory's
    checkpoints made by the same model/optimizer/data config, the text columns), and nothing in the run
    directory is changed when a check fails. The run directory is locked for the length of the run: a second
    trainer on it is refused (training/run_lock.py)."""
    lock = run_lock.acquire_for_run(cfg.train.output_dir, report=_say)
    try:
        return _train(cfg, stop_at_step=stop_at_step, progress=progress)
    finally:
        if lock is not None:
            lock.release()


def _train(cfg, *, stop_at_step: int | None, progress: bool) -> RunResult:
    t_cfg = cfg.train
    run_dir, ckpt_dir, notes = _check_run_dir(cfg)
    notes += [f"warning: {note}" for note in _check_data(cfg)]
    tokenizer, vocab_size = _load_tokenizer(cfg)
    if not t_cfg.resume and jax.process_index() == 0:
        _set_aside_previous_run(run_dir)
    run_dir_lib.check_writable(ckpt_dir, "train.output_dir (its checkpoints folder)")
    # The run's appended files (train.log, metrics, TensorBoard, profile, plot) are written here, then uploaded
    # when the run directory is a gs:// / s3:// URL (storage.Staging); locally this is the run directory.
    staging = storage.Staging(run_dir)
    run_log = _RunLog(staging)
    for note in notes:
        _say(note)
    try:
        requested = cfg.model.remat
        while True:
            loop = _Loop(cfg, run_dir, ckpt_dir, staging, run_log)
            try:
                loop.setup(tokenizer, vocab_size, progress=progress)
                loop.run(stop_at_step)
            except remat_auto.OutOfDeviceMemory:
                policy = _more_frugal_after_oom(requested, loop)
                if policy is None:
                    raise
                _say(f"model.remat=auto: {loop.trainer.cfg.model.remat!r} ran out of device memory before its first "
                     f"step finished (the compiler's estimate fit); starting again with {policy!r}")
                cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=policy))
                continue
            finally:
                loop.close()
            break
        result = loop.result()
    finally:
        run_log.close()
        staging.cleanup()
    return result


def _more_frugal_after_oom(requested: str, loop) -> str | None:
    """After an out-of-memory stop: the next policy of ``model.remat=auto`` when auto chose the one that failed
    and no step finished (nothing logged or saved, so starting again loses nothing), else None."""
    trainer = getattr(loop, "trainer", None)
    if requested != "auto" or trainer is None or getattr(loop, "train_losses", None):
        return None
    return remat_auto.more_frugal(trainer.cfg.model.remat)


def _check_run_dir(cfg) -> tuple[str, str, list[str]]:
    """The run and checkpoint folders and notes on allowed config changes. On resume the checkpoints must come
    from a compatible config, and the run folder must be writable (RunDirError otherwise, before anything is
    written)."""
    run_dir = storage.absolute(cfg.train.output_dir)
    ckpt_dir = storage.join(run_dir, "checkpoints")
    changes = run_dir_lib.compare_with_checkpoint(cfg, run_dir) if cfg.train.resume else []
    run_dir_lib.check_writable(run_dir, "train.output_dir")
    return run_dir, ckpt_dir, [f"resuming with a changed setting: {c}" for c in changes]


def _check_data(cfg) -> list[str]:
    """Start-up check of the training and validation text (file and column in every message)."""
    if cfg.data.format == "pretokenized":  # the tokenizer match is checked when the iterators are built
        from mixerlab.training import pretokenized

        notes = pretokenized.check_token_data(cfg.data.train_path, "data.train_path")
        if cfg.train.eval_every and cfg.data.val_path:
            notes += pretokenized.check_token_data(cfg.data.val_path, "data.val_path")
        return notes
    notes = data_lib.check_text_data(cfg.data.train_path, "data.train_path", cfg.data.text_column)
    if cfg.train.eval_every and cfg.data.val_path:
        notes += data_lib.check_text_data(cfg.data.val_path, "data.val_path", cfg.data.text_column)
    return notes


def _load_tokenizer(cfg):
    tokenizer = load_tokenizer(cfg.data.tokenizer.kind, cfg.data.tokenizer.path)
    vocab_size = cfg.model.vocab_size or tokenizer.vocab_size
    if vocab_size < tokenizer.vocab_size:
        raise ValueError(f"model.vocab_size: got {vocab_size}; the tokenizer ({tokenizer.name}) needs at least "
                         f"{tokenizer.vocab_size}")
    return tokenizer, vocab_size


def _set_aside_previous_run(run_dir: str) -> None:
    """train.resume=false in a directory that holds a previous run: rename its checkpoints and metrics
    (``*.previous-N``) instead of deleting them or mixing the two runs."""
    moved = []
    for name in ("checkpoints", "checkpoints.quarantine", "metrics.jsonl", "tensorboard", LOG_NAME):
        path = storage.join(run_dir, name)
        if storage.exists(path, "train.output_dir"):
            n = 1
            while storage.exists(f"{path}.previous-{n}", "train.output_dir"):
                n += 1
            storage.move(path, f"{path}.previous-{n}", "train.output_dir")
            moved.append(f"{name}.previous-{n}")
    if moved:
        _say(f"train.resume=false: kept the previous run's files in {run_dir} as {', '.join(moved)}")
