"""The training loop: data -> jitted train step -> metrics, periodic validation and checkpoints, resume."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from flax import nnx

from mixerlab.models.decoder import Decoder, cross_entropy
from mixerlab.training import data as data_lib
from mixerlab.training import storage
from mixerlab.training import run_dir as run_dir_lib
from mixerlab.training import run_lock
from mixerlab.training.checkpoint import Checkpointer
from mixerlab.training.log_file import QuietFileHandler
from mixerlab.training import flop_model, mesh as mesh_lib, remat_auto
from mixerlab.training.prefetch import DevicePrefetcher
from mixerlab.training import tracking
from mixerlab.training.metrics import MetricsWriter, plot_loss_curve
from mixerlab.training.optim import make_optimizer, schedule
from mixerlab.training.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

LOG_NAME = "train.log"
PROFILE_NAME = "profile"
PLOT_NAME = "loss_curve.png"
# The first steps of a process compile the train step (the first; the second can compile again for the layouts
# of the step's own outputs): the profile window and the progress bar's rate and ETA start after them.
WARMUP_STEPS = 2
BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


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


class Trainer:
    """The model split into (graphdef, params, rest) and jitted, sharded steps over pure pytrees.

    Parameters are created directly in their shardings (a jitted init), so no host holds the full model.
    """

    def __init__(self, cfg, vocab_size: int, mesh=None):
        self.mesh = mesh if mesh is not None else mesh_lib.make_mesh(cfg)
        cfg = remat_auto.resolve(cfg, vocab_size, self.mesh)  # model.remat=auto: the fastest policy that fits
        self.cfg = cfg
        seed = cfg.train.seed
        abstract = nnx.eval_shape(lambda: Decoder(cfg.model, vocab_size, mixer_options=cfg.mixers,
                                                  rngs=nnx.Rngs(seed)))
        self.graphdef, abstract_params, abstract_rest = nnx.split(abstract, nnx.Param, ...)
        self.abstract_params = nnx.to_pure_dict(abstract_params)  # ShapeDtypeStructs
        self.tx = make_optimizer(cfg, abstract_params)  # groups from the Variable types
        self.lr = schedule(cfg)
        replicated = mesh_lib.replicated(self.mesh)
        self.param_shardings = mesh_lib.param_shardings(self.abstract_params, self.mesh, cfg, vocab_size)
        self.opt_shardings = mesh_lib.follow_param_shardings(
            jax.eval_shape(self.tx.init, self.abstract_params), self.abstract_params, self.param_shardings,
            replicated)
        self.abstract_rest = nnx.to_pure_dict(abstract_rest)
        self.rest_shardings = jax.tree.map(lambda _: replicated, self.abstract_rest)
        self.batch_sharding = mesh_lib.batch_sharding(self.mesh)
        # The key is an argument, not a constant: with a constant key XLA constant-folds the random draws of
        # every weight at compile time (minutes for a 1.34B model on GPU).
        self._init_fn = lambda key: self._split(Decoder(cfg.model, vocab_size, mixer_options=cfg.mixers,
                                                        rngs=nnx.Rngs(key)))
        self._seed = seed
        metric_sh = replicated
        self.train_step = jax.jit(self._train_step, donate_argnums=(0, 1),
                                  in_shardings=(self.param_shardings, self.opt_shardings, self.batch_sharding),
                                  out_shardings=(self.param_shardings, self.opt_shardings, metric_sh))
        self.eval_step = jax.jit(self._eval_step, in_shardings=(self.param_shardings, self.batch_sharding),
                                 out_shardings=(metric_sh, metric_sh))
        self.params = self.opt_state = self.rest = None

    @staticmethod
    def _split(model):
        _, params, rest = nnx.split(model, nnx.Param, ...)
        return nnx.to_pure_dict(params), nnx.to_pure_dict(rest)

    def initialize(self) -> None:
        """Draws the parameters (from train.seed) in their shardings and initialises the optimizer."""
        self.params, self.rest = jax.jit(self._init_fn, out_shardings=(self.param_shardings, self.rest_shardings))(
            jax.random.key(self._seed))
        self.opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(self.params)

    def _model(self, params):
        return nnx.merge(self.graphdef, params, self.rest)

    def _loss(self, params, batch):
        model = self._model(params)
        chunk = self.cfg.train.loss_chunk
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):  # lets ops shard_map their kernels
            if chunk and chunk < batch["inputs"].shape[1]:
                hidden = model.hidden(batch["inputs"], segment_ids=batch["segment_ids"],
                                      positions=batch["positions"])
                return model.chunked_loss(hidden, batch["targets"], batch["loss_mask"], chunk)
            logits = model(batch["inputs"], segment_ids=batch["segment_ids"], positions=batch["positions"])
        return cross_entropy(logits, batch["targets"], batch["loss_mask"])

    def _summed_loss(self, params, batch):
        loss, count = self._loss(params, batch)
        return loss * count, count

    def _loss_and_grads(self, params, batch):
        """Mean token loss and its gradient; with train.microbatches = n the batch is split into n
        strided micro-batches (rows j, j+n, ...: every device keeps its share) scanned with summed gradients."""
        n = self.cfg.train.microbatches
        grad_fn = jax.value_and_grad(self._summed_loss, has_aux=True)
        if n == 1:
            (total, count), grads = grad_fn(params, batch)
        else:
            micro = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1), batch)

            def body(carry, mb):
                (t1, c1), g1 = grad_fn(params, mb)
                t0, c0, g0 = carry
                return (t0 + t1, c0 + c1, jax.tree.map(jnp.add, g0, g1)), None

            zero = jnp.zeros((), jnp.float32)
            (total, count, grads), _ = jax.lax.scan(body, (zero, zero, jax.tree.map(jnp.zeros_like, params)), micro)
        denom = jnp.maximum(count, 1.0)
        return (total / denom, count), jax.tree.map(lambda g: g / denom, grads)

    def _train_step(self, params, opt_state, batch):
        (loss, count), grads = self._loss_and_grads(params, batch)
        grad_norm = optax.global_norm(grads)
        updates, new_opt_state = self.tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        # A non-finite loss or gradient leaves parameters and optimizer state untouched (the step is skipped).
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
        metrics = {"loss": loss, "grad_norm": grad_norm, "tokens": count, "skipped": 1.0 - ok.astype(jnp.float32),
                   "attention_pairs": flop_model.causal_pairs(batch["segment_ids"])}  # this batch's attention work
        return keep(new_params, params), keep(new_opt_state, opt_state), metrics

    def _eval_step(self, params, batch):
        loss, count = self._loss(params, batch)
        return loss * count, count

    def global_batch(self, local: dict) -> dict:
        """This process's rows -> global arrays sharded over (data, fsdp)."""
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(local[k]))
                for k in BATCH_KEYS}

    def lower_abstract_step(self):
        """The train step lowered on abstract, sharded arguments (nothing drawn or placed): for compile-time
        questions (does it fit, what does it cost). Non-parameter state (none in our models today) becomes a
        compile-time constant of zeros unless the trainer was initialized."""
        abstract = lambda tree, shardings: jax.tree.map(  # noqa: E731
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree, shardings)
        params = abstract(self.abstract_params, self.param_shardings)
        opt = abstract(jax.eval_shape(self.tx.init, self.abstract_params), self.opt_shardings)
        batch = self.abstract_batch(self.cfg.train.batch_size, self.cfg.data.seq_len)
        if self.rest is None:
            self.rest = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), self.abstract_rest)
        return self.train_step.lower(params, opt, batch)

    def abstract_batch(self, global_batch_size: int, seq_len: int) -> dict:
        shape = (global_batch_size, seq_len)
        dtypes = {"inputs": jnp.int32, "targets": jnp.int32, "segment_ids": jnp.int32, "positions": jnp.int32,
                  "loss_mask": jnp.float32}
        return {k: jax.ShapeDtypeStruct(shape, dtypes[k], sharding=self.batch_sharding) for k in BATCH_KEYS}


def evaluate(trainer: Trainer, batches: list[dict]) -> dict:
    total, count = 0.0, 0.0
    for batch in batches:
        s, c = trainer.eval_step(trainer.params, trainer.global_batch(batch))
        total += float(s)
        count += float(c)
    loss = total / max(count, 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": count}


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


class _RunLog:
    """<run_dir>/train.log for the length of a run: every message of the run, plus what the terminal should not
    get as dumps: orbax's (absl) and asyncio's error tracebacks and exceptions raised in library callbacks
    (a failed checkpoint write otherwise prints hundreds of lines before the one-line error)."""

    QUIET = ("absl", "asyncio")

    def __init__(self, staging: storage.Staging):
        self.staging = staging
        primary = jax.process_index() == 0
        if primary:
            staging.pull(LOG_NAME)  # a remote log is continued, as a local one is appended to
        self.handler = QuietFileHandler(staging.path(LOG_NAME)) if primary else logging.NullHandler()
        self.handler.setLevel(logging.INFO)
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger = logging.getLogger("mixerlab.training")
        logger.addHandler(self.handler)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        self._propagate = {}
        for name in self.QUIET:
            quiet = logging.getLogger(name)
            self._propagate[name] = quiet.propagate
            quiet.addHandler(self.handler)
            quiet.propagate = False
        self._unraisable = sys.unraisablehook
        sys.unraisablehook = self._log_unraisable

    @staticmethod
    def _log_unraisable(info) -> None:
        log.info("exception ignored in %r: %s", info.object, info.err_msg or "",
                 exc_info=(info.exc_type, info.exc_value, info.exc_traceback))

    def close(self) -> None:
        sys.unraisablehook = self._unraisable
        for name, propagate in self._propagate.items():
            logging.getLogger(name).removeHandler(self.handler)
            logging.getLogger(name).propagate = propagate
        logging.getLogger("mixerlab.training").removeHandler(self.handler)
        self.handler.close()
        self.staging.push(LOG_NAME, strict=False)

    def sync(self) -> None:
        """Uploads the log so far (remote run directories)."""
        self.handler.flush()
        self.staging.push(LOG_NAME, strict=False)


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


def steady_profile_window(requested: int, num_steps: int, process_start: int, busy, last_step: int) -> int:
    """The first step of a profile window of ``num_steps`` steps that measures the steady state: not before the
    process's compile steps (WARMUP_STEPS after ``process_start``), and, when one exists a little later, a window
    whose steps before its last are not followed by host work (``busy``: metrics fetch, evaluation, checkpoint;
    the last step's work comes after the trace stops)."""
    first = max(requested, process_start + WARMUP_STEPS + 1)
    for start in range(first, min(first + 64, last_step - num_steps + 2)):
        if not any(busy(s) for s in range(start, start + num_steps - 1)):
            return start
    return first


def _advance(bar, nth: int) -> None:
    """One step on the progress bar; the rate (and ETA) counts only the steps after the process's compile steps."""
    if nth > WARMUP_STEPS:
        bar.update(1)
        return
    from tqdm.std import EMA

    bar.n += 1
    bar.initial = bar.last_print_n = bar.n  # the rate restarts from here
    bar.last_print_t = bar.start_t = bar._time()
    bar._ema_dn, bar._ema_dt = EMA(bar.smoothing), EMA(bar.smoothing)
    bar.refresh()


class _Profiler:
    """Captures a jax.profiler trace (TensorBoard/xprof + a Perfetto JSON) of profile.num_steps steps, moved past
    the compile steps and host work when needed (steady_profile_window)."""

    def __init__(self, cfg, directory: str, url: str | None = None, *, process_start: int = 0, busy=None,
                 last_step: int | None = None):
        first = cfg.start_step
        if cfg.start_step > 0 and last_step is not None:
            first = steady_profile_window(cfg.start_step, cfg.num_steps, process_start, busy or (lambda s: False),
                                          last_step)
            if first != cfg.start_step and jax.process_index() == 0:
                _say(f"profile: steps {first}-{first + cfg.num_steps - 1} instead of {cfg.start_step}-"
                     f"{cfg.start_step + cfg.num_steps - 1} (profile.start_step): after the steps that compile and "
                     f"clear of logging, evaluation and checkpoint steps")
        self.first, self.last = first, first + cfg.num_steps - 1
        self.enabled = cfg.start_step > 0 and (cfg.all_hosts or jax.process_index() == 0)
        self.directory, self.active = directory, False  # written locally; uploaded to url (if remote) at the end
        self.url = url or directory

    def before(self, step: int) -> None:
        if self.enabled and step == self.first:
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self.active = True

    def after(self, step: int) -> None:
        if self.active and step >= self.last:
            self.close()
            _print(f"profile of steps {self.first}-{self.last} written to {self.url} "
                   f"(tensorboard --logdir {self.url}; python tools/summarize_profile.py {self.url})")

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False


class _SigtermFlag:
    """Turns SIGTERM (preemption) into a flag the loop checks after each step: it then saves a checkpoint
    and returns. Only installed in the main thread; the previous handler is restored afterwards."""

    def __init__(self):
        self.requested = False
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def restore(self):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    close = restore


def _progress(enabled: bool, start: int, total: int):
    if not enabled or jax.process_index() != 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)


def _say(msg: str, bar=None) -> None:
    """A message for the terminal that also goes to the run's log file."""
    _print(msg, bar)


def _print(msg: str, bar=None) -> None:
    """Everything the run prints also goes to train.log (INFO: the terminal's handler shows WARNING and up)."""
    log.info(msg)
    if jax.process_index() != 0:
        return
    if bar is not None:
        bar.write(msg)
    else:
        print(msg, flush=True)


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


def _all_data_states(state) -> dict:
    """Every process's grain iterator state (each host reads its own shard), gathered so that the primary
    host's checkpoint holds all of them."""
    mine = json.dumps(state).encode()
    if jax.process_count() == 1:
        return {"per_process": [json.loads(mine)]}
    from jax.experimental import multihost_utils

    length = int(np.max(multihost_utils.process_allgather(np.array([len(mine)], np.int32))))
    padded = np.zeros(length, np.uint8)
    padded[: len(mine)] = np.frombuffer(mine, np.uint8)
    everyone = np.asarray(multihost_utils.process_allgather(padded))
    return {"per_process": [json.loads(bytes(row).rstrip(b"\0")) for row in everyone]}


def _own_data_state(saved: dict) -> dict:
    states = saved["per_process"]
    if len(states) != jax.process_count():
        raise ValueError(f"the checkpoint's data state is from {len(states)} processes, this run has "
                         f"{jax.process_count()}; resume with the same number of hosts (or start a new run)")
    return states[jax.process_index()]
