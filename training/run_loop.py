"""One training run's loop: restore, then steps with their metrics, logging, validation, checkpoints, profile
and preemption; its RunResult."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import jax
import yaml

from mixerlab.training import data as data_lib
from mixerlab.training import storage
from mixerlab.training import run_dir as run_dir_lib
from mixerlab.training.checkpoint import Checkpointer
from mixerlab.training import flop_model, remat_auto
from mixerlab.training.prefetch import DevicePrefetcher
from mixerlab.training import tracking
from mixerlab.training.metrics import MetricsWriter, plot_loss_curve
from mixerlab.training.data_state import _all_data_states, _own_data_state
from mixerlab.training.preemption import _SigtermFlag
from mixerlab.training.profiler import PROFILE_NAME, _Profiler
from mixerlab.training.progress import _advance, _print, _progress, _say
from mixerlab.training.trainer import Trainer, evaluate

log = logging.getLogger(__name__)

PLOT_NAME = "loss_curve.png"


@dataclasses.dataclass
class RunResult:
    run_dir: str
    final_step: int
    train_losses: dict  # step -> loss, every step this process ran
    val_loss: float | None
    metrics_path: str
    plot_path: str | None
    checkpoint_dir: str
    skipped_steps: list  # steps whose update was skipped (non-finite loss or gradient)
    preempted: bool = False  # stopped early by SIGTERM (after saving a checkpoint)
    vocab_size: int | None = None  # the model's (the reference for "diverged": ln(vocab_size), training/run_summary.py)


class _Loop:
    """One training run: restore, then steps with their logging, validation and checkpoints."""

    def __init__(self, cfg, run_dir: str, ckpt_dir: str, staging: storage.Staging | None = None, run_log=None):
        self.cfg, self.run_dir, self.ckpt_dir = cfg, run_dir, ckpt_dir
        self.staging = staging if staging is not None else storage.Staging(run_dir)
        self.run_log = run_log
        self.data_iter = self.metrics = self.checkpointer = self.profiler = self.preemption = self.bar = None
        self.tracker = None
        self.batches = None
        self.pending: list = []  # (step, device metrics) not yet fetched to the host

    def setup(self, tokenizer, vocab_size: int, *, progress: bool) -> None:
        """Model, data, outputs and the restored state (close() undoes whatever part of this ran)."""
        cfg, run_dir, ckpt_dir, t_cfg = self.cfg, self.run_dir, self.ckpt_dir, self.cfg.train
        self.vocab_size = vocab_size
        self.trainer = Trainer(cfg, vocab_size)
        self.trainer.initialize()
        self.n_params = sum(x.size for x in jax.tree.leaves(self.trainer.params))
        self.flops = flop_model.training_flops(cfg, self.trainer.abstract_params, vocab_size)
        self.chip = flop_model.device_chip()
        for note in self.flops.notes:
            log.info("flop model: %s", note)
        self.data_iter = data_lib.train_iterator(cfg.data, tokenizer, global_batch_size=t_cfg.batch_size,
                                                 seed=t_cfg.seed, process_index=jax.process_index(),
                                                 process_count=jax.process_count())
        self.val_batches = self._val_batches(tokenizer)
        self.checkpointer = Checkpointer(ckpt_dir, keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)
        self.start_step = self._restore()
        # Batches are built and put on the devices by a background thread while the step runs (after the
        # restore: it starts from the restored data position); the state of the batch consumed last is what a
        # checkpoint stores.
        self.batches = DevicePrefetcher(self.data_iter, self.trainer.global_batch, depth=t_cfg.prefetch,
                                        state=lambda: json.loads(json.dumps(self.data_iter.get_state()))) \
            if t_cfg.prefetch else None
        # after the restore: a refused checkpoint leaves the metrics alone
        self.metrics = MetricsWriter(run_dir, self.staging)
        self._resume_metrics()
        self._record_config_changes()
        self.tracker = tracking.open_tracker(cfg, run_dir)  # W&B when logging.wandb; else a no-op
        if jax.process_index() == 0:
            storage.write_text(storage.join(run_dir, "config.yaml"), yaml.safe_dump(cfg.to_dict(), sort_keys=False),
                               "train.output_dir")
        _print(f"mixerlab: {','.join(sorted(set(cfg.layer_mixers)))} model, {self.n_params / 1e6:.2f}M parameters, "
               f"vocab {vocab_size} ({tokenizer.name}), {t_cfg.steps} steps of {t_cfg.batch_size}x"
               f"{cfg.data.seq_len} tokens on {jax.device_count()} {jax.devices()[0].platform} device(s), mesh "
               f"{dict(self.trainer.mesh.shape)}; {self.flops.per_token / 1e6:.1f} MFLOP/token"
               + f"; {flop_model.peak_description(self.chip, cfg.model.dtype)}"
               + (f"; resuming at step {self.start_step}" if self.start_step else ""))
        self.train_losses: dict[int, float] = {}
        self.skipped_steps: list[int] = []
        self.consecutive_skips = 0
        self.mfu_refused = False  # an impossible MFU is said once
        self.val_loss = None
        self.last_step = self.start_step
        self.preemption = _SigtermFlag()
        self.profiler = _Profiler(cfg.profile, self.staging.path(PROFILE_NAME),
                                  storage.join(run_dir, PROFILE_NAME), process_start=self.start_step,
                                  busy=self._busy_step, last_step=t_cfg.steps)
        self.bar = _progress(progress, self.start_step, t_cfg.steps)
        self._reset_window()

    def _val_batches(self, tokenizer) -> list:
        t_cfg = self.cfg.train
        if not (t_cfg.eval_every and self.cfg.data.val_path):
            return []
        # Every process evaluates its own rows of each global batch (the same global batch on all hosts).
        local, p = t_cfg.batch_size // jax.process_count(), jax.process_index()
        return [{k: v[p * local:(p + 1) * local] for k, v in b.items()}
                for b in data_lib.eval_batches(self.cfg.data, tokenizer, batch_size=t_cfg.batch_size,
                                               max_batches=t_cfg.eval_batches)]

    def _restore(self) -> int:
        """The step to continue after: the newest good checkpoint's (bad ones are quarantined), else 0."""
        start = 0
        if self.cfg.train.resume:
            restored = self.checkpointer.restore_newest(params=self.trainer.params, opt_state=self.trainer.opt_state,
                                                        report=_say)
            if restored is not None:
                start, self.trainer.params, self.trainer.opt_state, data_state, _meta = restored
                self.data_iter.set_state(_own_data_state(data_state))
                log.info("resumed from %s at step %d", self.ckpt_dir, start)
            elif self.checkpointer.quarantined:
                _say(f"warning: none of the checkpoints in {self.ckpt_dir} could be used (all moved to "
                     f"{self.checkpointer.quarantine_dir}); starting from step 0")
        return start

    def _resume_metrics(self) -> None:
        """Drops metrics rows logged after the restored step, so that the files describe one run."""
        if not self.cfg.train.resume:
            return
        dropped = self.metrics.resume_at(self.start_step)
        if dropped:
            _say(f"resuming at step {self.start_step}: dropped {dropped} metrics rows logged after it "
                 f"(they are logged again as the steps rerun)")

    def _record_config_changes(self) -> None:
        """A resumed run whose settings changed (optim.lr, train.steps, ...) says so in metrics.jsonl, from what to
        what (the terminal and train.log got the same notes before the run started)."""
        if not self.start_step:
            return
        changed = {k: {"from": a, "to": b} for k, (a, b) in run_dir_lib.changed_settings(self.cfg, self.run_dir).items()
                   if k not in ("train.output_dir", "train.resume")}
        if changed:
            self.metrics.write_event(self.start_step, "config_change", {"changed": changed})

    def _reset_window(self) -> None:  # throughput over train steps only: no evals/checkpoints
        self.window_tokens, self.window_seconds, self.steps_in_window = 0.0, 0.0, 0
        self.window_flops = 0.0
        self.window_start = time.perf_counter()

    def run(self, stop_at_step: int | None) -> None:
        try:
            self._run(stop_at_step)
        except Exception as err:  # noqa: BLE001 - only the device's out-of-memory error gets advice
            if not remat_auto.out_of_memory(err):
                raise
            raise remat_auto.OutOfDeviceMemory(remat_auto.advice_after_oom(self.trainer.cfg, self.cfg.model.remat)) \
                from err

    def _run(self, stop_at_step: int | None) -> None:
        t_cfg, c_cfg = self.cfg.train, self.cfg.checkpoint
        for step in range(self.start_step + 1, t_cfg.steps + 1):
            self._step(step)
            # The host waits for the device only here: every train.log_every steps and before an evaluation, a
            # checkpoint, a stop or the end; the steps in between are dispatched without a sync.
            if (step % t_cfg.log_every == 0 or step == t_cfg.steps or self.preemption.requested
                    or (self.val_batches and step % t_cfg.eval_every == 0)
                    or (c_cfg.every and step % c_cfg.every == 0)
                    or (stop_at_step is not None and step >= stop_at_step)):
                self._fetch_metrics()
            self._maybe_eval(step)
            saved = self._maybe_save(step)
            if self.preemption.requested:
                self._report_preemption(step, saved)
                break
            if stop_at_step is not None and step >= stop_at_step:
                break

    def _step(self, step: int) -> None:
        self.profiler.before(step)
        batch = next(self.batches) if self.batches is not None else self.trainer.global_batch(next(self.data_iter))
        self.trainer.params, self.trainer.opt_state, m = self.trainer.train_step(
            self.trainer.params, self.trainer.opt_state, batch)
        self.pending.append((step, m))
        if self.profiler.active:  # a trace should hold whole steps
            jax.block_until_ready(m)
        self.profiler.after(step)
        self.last_step = step
        if self.bar is not None:
            _advance(self.bar, step - self.start_step)

    def _busy_step(self, step: int) -> bool:
        """A step followed by host work: the metrics fetch, an evaluation or a checkpoint."""
        t_cfg, every = self.cfg.train, self.cfg.checkpoint.every
        return (step % t_cfg.log_every == 0 or step == t_cfg.steps or bool(every and step % every == 0)
                or bool(self.val_batches and step % t_cfg.eval_every == 0))

    def _fetch_metrics(self) -> None:
        """One host sync for the pending steps; then, step by step: losses, skip checks and rows."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        fetched = jax.device_get([m for _, m in pending])
        self.window_seconds += time.perf_counter() - self.window_start
        self.window_start = time.perf_counter()
        for (step, _), m in zip(pending, fetched):
            m = {k: float(v) for k, v in m.items()}
            self.train_losses[step] = m["loss"]
            self.window_tokens += m["tokens"]
            self.window_flops += self.flops.step_flops(self.cfg.train.batch_size * self.cfg.data.seq_len,
                                                       m["attention_pairs"])
            self.steps_in_window += 1
            skipped = self._check_skip(step, m)
            self._log(step, m, force=skipped)
            if skipped and self.consecutive_skips >= self.cfg.train.max_consecutive_skips:
                self._stop_on_skips(step)

    def _check_skip(self, step: int, m: dict) -> bool:
        if not m["skipped"]:
            self.consecutive_skips = 0
            return False
        self.skipped_steps.append(step)
        self.consecutive_skips += 1
        _say(f"warning: step {step}: non-finite loss ({m['loss']}) or gradient norm ({m['grad_norm']}); update "
             f"skipped ({len(self.skipped_steps)} skipped so far)", self.bar)
        return True

    def _stop_on_skips(self, step: int) -> None:
        t_cfg = self.cfg.train
        self.checkpointer.finish()
        newest = self.checkpointer.latest_step()
        where = (f"the newest checkpoint in {self.ckpt_dir} is step {newest}"
                 if newest is not None else f"no checkpoint was written to {self.ckpt_dir}")
        raise FloatingPointError(
            f"{self.consecutive_skips} consecutive steps (up to step {step}) had a non-finite loss or gradient "
            f"(train.max_consecutive_skips={t_cfg.max_consecutive_skips}); stopping. Skipped steps leave the "
            f"parameters untouched; {where}. Lower optim.lr or check the data before resuming")

    def _log(self, step: int, m: dict, *, force: bool) -> None:
        """A train row every train.log_every steps, at the last step and at every skipped step."""
        t_cfg = self.cfg.train
        if not (force or step % t_cfg.log_every == 0 or step == t_cfg.steps):
            return
        tok_s = self.window_tokens / max(self.window_seconds, 1e-9)
        row = {"loss": m["loss"], "grad_norm": m["grad_norm"], "lr": float(self.trainer.lr(step - 1)),
               "tokens_per_s": tok_s, "step_time_s": self.window_seconds / max(self.steps_in_window, 1),
               "skipped": m["skipped"], "skipped_total": len(self.skipped_steps)}
        row.update(self._utilisation())
        self.metrics.write(step, "train", row)
        self.tracker.write(step, "train", row)
        log.info("step %d: loss %.4f, grad norm %.3g, lr %.3g, %.0f tokens/s%s", step, m["loss"], m["grad_norm"],
                 row["lr"], tok_s, " (update skipped)" if m["skipped"] else "")
        if self.bar is not None:
            extra = {"mfu": f"{row['mfu']:.1%}"} if "mfu" in row else {}
            self.bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{tok_s:,.0f}", **extra)
        if step % t_cfg.log_every == 0 or step == t_cfg.steps:  # a skipped step's extra row keeps the window
            self.window_tokens, self.window_seconds, self.steps_in_window = 0.0, 0.0, 0
            self.window_flops = 0.0

    def _utilisation(self) -> dict:
        """Model TFLOP/s and MFU of the window (training/flop_model.py); an MFU above 100 % is not logged, and
        said once."""
        n, cfg = max(self.steps_in_window, 1), self.cfg
        what = (f"train.output_dir={cfg.train.output_dir} ({','.join(sorted(set(cfg.layer_mixers)))}, "
                f"{cfg.train.batch_size}x{cfg.data.seq_len})")
        try:
            return flop_model.utilisation(self.window_flops / n, self.window_seconds / n, jax.device_count(),
                                          self.chip, what)
        except flop_model.ImpossibleMFU as err:
            if not self.mfu_refused:
                _say(f"error: {err}", self.bar)
                self.mfu_refused = True
            return {"model_tflops_per_s": self.window_flops / max(self.window_seconds, 1e-12) / 1e12}

    def _maybe_eval(self, step: int) -> None:
        t_cfg = self.cfg.train
        if self.val_batches and (step % t_cfg.eval_every == 0 or step == t_cfg.steps):
            ev = evaluate(self.trainer, self.val_batches)
            self.val_loss = ev["loss"]
            self.metrics.write(step, "val", ev)
            self.tracker.write(step, "val", ev)
            _print(f"step {step}: validation loss {ev['loss']:.4f}, perplexity {ev['perplexity']:.2f}", self.bar)
            self.window_start = time.perf_counter()  # evaluation time is not training throughput

    def _maybe_save(self, step: int) -> bool:
        """Saves when due (or on SIGTERM); True when a checkpoint of this step was written."""
        c_cfg, t_cfg = self.cfg.checkpoint, self.cfg.train
        due = c_cfg.every and (step % c_cfg.every == 0 or step == t_cfg.steps)
        if not (due or self.preemption.requested):
            return False
        data_state = self.batches.last_state if self.batches is not None else self.data_iter.get_state()
        saved = self.checkpointer.save(step, params=self.trainer.params, opt_state=self.trainer.opt_state,
                                       data_state=_all_data_states(data_state),
                                       meta={"step": step, "val_loss": self.val_loss, "config": self.cfg.to_dict()})
        if saved:  # the metrics up to a checkpoint are in the bucket with it (later rows are dropped on resume)
            self.metrics.sync()
            if self.run_log is not None:
                self.run_log.sync()
        else:
            newest = self.checkpointer.latest_step()
            _say(f"warning: step {step}: no checkpoint written (the parameters are not finite); the newest "
                 f"checkpoint is {'step ' + str(newest) if newest is not None else 'none'}", self.bar)
        self.window_start = time.perf_counter()
        return saved

    def _report_preemption(self, step: int, saved: bool) -> None:
        if saved:
            self.checkpointer.finish()  # the message below is only true once the save is complete
            _say(f"SIGTERM: saved a checkpoint at step {step} in {self.ckpt_dir}; the same command resumes",
                 self.bar)
        else:
            newest = self.checkpointer.latest_step()
            _say(f"SIGTERM: stopped after step {step} without a checkpoint of it; the same command resumes from "
                 + (f"step {newest}" if newest is not None else "step 0"), self.bar)

    def close(self) -> None:
        """Stops the profiler, the progress bar, pending saves and the data workers, whatever happened."""
        for part in (self.profiler, self.preemption, self.bar):
            if part is not None:
                part.close()
        try:
            if self.checkpointer is not None:
                self.checkpointer.close()
        finally:
            if self.metrics is not None:
                self.metrics.close()
            if self.tracker is not None:
                self.tracker.close()
            self.staging.push(PROFILE_NAME, strict=False)
            if self.batches is not None:
                self.batches.close()
            if hasattr(self.data_iter, "close"):  # stops grain's prefetch threads/processes now, not at exit
                self.data_iter.close()

    def result(self) -> RunResult:
        plot_path = None
        if jax.process_index() == 0 and os.path.exists(self.metrics.jsonl_path):
            plot_loss_curve(self.metrics.jsonl_path, self.staging.path(PLOT_NAME),
                            title=f"{','.join(sorted(set(self.cfg.layer_mixers)))} — {storage.basename(self.run_dir)}")
            self.staging.push(PLOT_NAME)
            plot_path = storage.join(self.run_dir, PLOT_NAME)
        return RunResult(run_dir=self.run_dir, final_step=self.last_step, train_losses=self.train_losses,
                         val_loss=self.val_loss, metrics_path=self.metrics.jsonl_url, plot_path=plot_path,
                         checkpoint_dir=self.ckpt_dir, skipped_steps=self.skipped_steps,
                         preempted=self.preemption.requested, vocab_size=self.vocab_size)
