"""Train one model on one synthetic task setting in memory and measure held-out accuracy.

The model, optimizer and jitted step are the project's own (training.trainer.Trainer: models.decoder, AdamW with
warmup + cosine from training/optim.py, global-norm clip, weight-decay groups, skipped non-finite steps). This
module only supplies the data: fresh training batches every step from one seed stream, and a fixed held-out
set drawn from another, and turns the task's labels into the Trainer's batch (loss on labels != -100).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mixerlab.eval.synthetic.generators import IGNORE
from mixerlab.eval.synthetic.metrics import AccuracyCounter
from mixerlab.eval.synthetic.task import TaskConfig, generate, validate_task, with_task_schedule
from mixerlab.training.trainer import Trainer

TRAIN_STREAM, HELD_OUT_STREAM, OOD_STREAM = 1, 2, 3  # np.random.default_rng([seed, stream]): disjoint streams


@dataclasses.dataclass
class TaskRunResult:
    accuracy: float  # held-out per-query-token accuracy at the end
    exact_match: float  # held-out rows with every query right
    held_out: dict  # the full AccuracyCounter summary (lag buckets included)
    steps: int  # optimizer steps run (fewer than train.steps after an early stop)
    stopped_early: bool
    final_loss: float  # mean training loss over the last logged window
    skipped_steps: int  # non-finite steps the Trainer skipped
    first_step_s: float  # compile + first step
    train_s: float  # all steps, the first included, without evaluations
    eval_s: float
    history: list  # {"step", "loss"} every log_every steps and {"step", "accuracy"} at every evaluation
    num_params: int
    ood_accuracy: float | None = None  # held-out accuracy with keys from task.ood_key_range (None: not asked)
    ood_held_out: dict | None = None  # its AccuracyCounter summary


def trainer_batch(batch: dict) -> dict:
    """Task batch {inputs, labels} -> the Trainer's {inputs, targets, segment_ids, positions, loss_mask}."""
    inputs, labels = batch["inputs"], batch["labels"]
    scored = labels != IGNORE
    n, t = inputs.shape
    return {"inputs": inputs.astype(np.int32), "targets": np.where(scored, labels, 0).astype(np.int32),
            "segment_ids": np.ones((n, t), np.int32),
            "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (n, t)).copy(),
            "loss_mask": scored.astype(np.float32)}


class SyntheticTaskTrainer:
    """The project Trainer for one (config, task) pair plus a jitted argmax for held-out accuracy."""

    def __init__(self, cfg, task: TaskConfig):
        validate_task(task, cfg.model.vocab_size)
        self.cfg = with_task_schedule(cfg, task)
        self.task = task
        self.vocab_size = cfg.model.vocab_size
        self.trainer = Trainer(self.cfg, self.vocab_size)
        self.trainer.initialize()
        graphdef, rest, mesh = self.trainer.graphdef, self.trainer.rest, self.trainer.mesh

        def predict(params, inputs):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # as Trainer._loss: ops may shard_map
                logits = nnx.merge(graphdef, params, rest)(inputs)
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)

        self._predict = jax.jit(predict)

    @property
    def num_params(self) -> int:
        return int(sum(x.size for x in jax.tree.leaves(self.trainer.params)))

    def step(self, batch: dict) -> dict:
        t = self.trainer
        t.params, t.opt_state, metrics = t.train_step(t.params, t.opt_state, t.global_batch(trainer_batch(batch)))
        return {k: float(v) for k, v in metrics.items()}

    def evaluate(self, batches: list[dict]) -> dict:
        counter = AccuracyCounter(self.task.lag_buckets)
        for b in batches:
            predictions = np.asarray(self._predict(self.trainer.params, jnp.asarray(b["inputs"])))
            counter.add(b["inputs"], b["labels"], predictions)
        return counter.summary()


def held_out_batches(task: TaskConfig, seed: int, batch_size: int, vocab_size: int, *,
                     out_of_distribution: bool = False) -> list[dict]:
    rng = np.random.default_rng([seed, OOD_STREAM if out_of_distribution else HELD_OUT_STREAM])
    return [generate(task, rng, batch_size, vocab_size, out_of_distribution=out_of_distribution)
            for _ in range(task.eval_batches)]


def train_on_task(cfg, task: TaskConfig, *, log: Callable[[str], None] | None = None,
                  log_every: int | None = None) -> TaskRunResult:
    """Trains cfg's model (seed train.seed: parameters and both data streams) for train.steps on fresh task
    batches, evaluates on task.eval_batches held-out batches and returns the accuracies and timings."""
    runner = SyntheticTaskTrainer(cfg, task)
    steps, batch_size, seed = cfg.train.steps, cfg.train.batch_size, cfg.train.seed
    log_every = log_every or cfg.train.log_every
    held_out = held_out_batches(task, seed, batch_size, runner.vocab_size)
    train_rng = np.random.default_rng([seed, TRAIN_STREAM])

    history, window, last_loss = [], [], float("nan")
    skipped, first_step_s, train_s, eval_s = 0, 0.0, 0.0, 0.0
    summary, stopped_early, step = None, False, 0
    for step in range(1, steps + 1):
        batch = generate(task, train_rng, batch_size, runner.vocab_size)
        start = time.perf_counter()
        metrics = runner.step(batch)  # float() inside waits for the step: the timing is honest
        elapsed = time.perf_counter() - start
        train_s += elapsed
        if step == 1:
            first_step_s = elapsed
        skipped += int(metrics["skipped"])
        window.append(metrics["loss"])
        if step % log_every == 0 or step == steps:
            last_loss = float(np.mean(window))
            history.append({"step": step, "loss": last_loss})
            window = []
        if (task.eval_every and step % task.eval_every == 0) or step == steps:
            start = time.perf_counter()
            summary = runner.evaluate(held_out)
            eval_s += time.perf_counter() - start
            history.append({"step": step, "accuracy": summary["accuracy"]})
            if log is not None:
                log(f"  step {step}/{steps}: train loss {last_loss:.4f}, held-out accuracy {summary['accuracy']:.4f}")
            if task.target_accuracy is not None and summary["accuracy"] >= task.target_accuracy and step < steps:
                stopped_early = True
                break
    if window:  # an early stop between two log steps
        last_loss = float(np.mean(window))
        history.append({"step": step, "loss": last_loss})
    ood = None
    if task.ood_key_range:  # once, at the end (VLA paper, Table 13: ID and OOD accuracy of the final model)
        start = time.perf_counter()
        ood = runner.evaluate(held_out_batches(task, seed, batch_size, runner.vocab_size, out_of_distribution=True))
        eval_s += time.perf_counter() - start
    return TaskRunResult(
        accuracy=summary["accuracy"], exact_match=summary["exact_match"], held_out=summary, steps=step,
        stopped_early=stopped_early, final_loss=last_loss,
        skipped_steps=skipped, first_step_s=first_step_s, train_s=train_s, eval_s=eval_s, history=history,
        num_params=runner.num_params, ood_accuracy=None if ood is None else ood["accuracy"], ood_held_out=ood)
