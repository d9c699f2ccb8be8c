"""The ``task:`` section of a synthetic-eval config, and the loader that splits it from the model config.

An eval config is an ordinary mixerlab config (``inherit: ../base.yaml``, checked by training/config.py) plus
one extra top-level section ``task:`` that only this package reads, so the main Config (and the "base.yaml
lists every key" test) stay untouched. Overrides ``task.<key>=value`` go to the task, every other override
to the main config. The task's vocabulary is ``model.vocab_size`` (one number for the model and the data).
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from mixerlab.eval.synthetic import generators
from mixerlab.training import config as config_lib


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    kind: Literal["mqar", "copy"] = "mqar"
    layout: Literal["vla_contiguous", "zoology"] = "vla_contiguous"  # MQAR only
    num_kv_pairs: int = 8  # n (MQAR)
    seq_len: int | None = None  # T; null: 3n+1 for vla_contiguous (required for zoology; copy: 64)
    power_a: float = 0.01  # zoology: p(gap) ∝ a (g+1)^(a-1)
    random_non_queries: bool = False  # zoology: replace filler 0s by uniform tokens
    warmup_fraction: float | None = 0.1  # optim.warmup_steps = round(fraction * train.steps); null: keep it
    eval_batches: int = 15  # held-out batches of train.batch_size rows (15 x 64 = 960 samples, VLA paper, Table 6)
    eval_every: int = 0  # steps between held-out evaluations during training; 0: only at the end
    target_accuracy: float | None = None  # stop early once held-out accuracy reaches this (checked at eval_every)
    lag_buckets: tuple[int, ...] = ()  # edges [e0, e1, ...): also report accuracy per key-to-query lag bucket
    # vla_contiguous: also evaluate on held-out rows whose keys come from [low, high) instead of the training
    # keys [1, V/2) (VLA paper, Table 13: [64, 127)); () = off. Values then avoid each row's keys.
    ood_key_range: tuple[int, ...] = ()

    def resolved_seq_len(self) -> int:
        if self.seq_len is not None:
            return self.seq_len
        if self.kind == "copy":
            return 64
        if self.layout == "vla_contiguous":
            return 3 * self.num_kv_pairs + 1
        raise ValueError("task.seq_len: got null; the zoology layout needs an explicit even seq_len (e.g. 64)")

    def describe(self) -> str:
        if self.kind == "copy":
            return f"copy T={self.resolved_seq_len()}"
        return f"mqar {self.layout} n={self.num_kv_pairs} T={self.resolved_seq_len()}"


def validate_task(task: TaskConfig, vocab_size: int | None) -> None:
    """Raises ValueError naming the key for settings no sample could satisfy (by drawing one sample)."""
    if vocab_size is None:
        raise ValueError("model.vocab_size: got null; synthetic tasks take their vocabulary from model.vocab_size")
    for key in ("eval_batches", "num_kv_pairs"):
        if getattr(task, key) < 1:
            raise ValueError(f"task.{key}: got {getattr(task, key)}; must be >= 1")
    if task.eval_every < 0:
        raise ValueError(f"task.eval_every: got {task.eval_every}; must be >= 0 (0: evaluate only at the end)")
    if task.warmup_fraction is not None and not 0.0 <= task.warmup_fraction < 1.0:
        raise ValueError(f"task.warmup_fraction: got {task.warmup_fraction}; must be in [0, 1) or null")
    if task.target_accuracy is not None and not 0.0 < task.target_accuracy <= 1.0:
        raise ValueError(f"task.target_accuracy: got {task.target_accuracy}; must be in (0, 1] or null")
    if list(task.lag_buckets) != sorted(set(task.lag_buckets)) or any(e < 0 for e in task.lag_buckets):
        raise ValueError(f"task.lag_buckets: got {list(task.lag_buckets)}; must be increasing non-negative edges")
    task.resolved_seq_len()
    if task.ood_key_range and (task.kind != "mqar" or task.layout != "vla_contiguous"):
        raise ValueError(f"task.ood_key_range: got {list(task.ood_key_range)}; out-of-distribution keys exist only "
                         f"for kind: mqar with layout: vla_contiguous (got {task.kind}, {task.layout})")
    try:  # the generators check their own ranges; their messages name the parameter first
        generate(task, np.random.default_rng(0), 1, vocab_size)
        if task.ood_key_range:
            generate(task, np.random.default_rng(0), 1, vocab_size, out_of_distribution=True)
    except ValueError as e:
        message = str(e)
        key = "task.ood_" if message.startswith("key_range") else ("model." if message.startswith("vocab_size")
                                                                   else "task.")
        raise ValueError(key + message) from None


def generate(task: TaskConfig, rng: np.random.Generator, num_examples: int, vocab_size: int, *,
             out_of_distribution: bool = False) -> dict:
    """One batch of ``num_examples`` rows of the configured task (keys from ``task.ood_key_range`` if
    ``out_of_distribution``)."""
    if task.kind == "copy":
        return generators.copy_task(rng, num_examples, seq_len=task.resolved_seq_len(), vocab_size=vocab_size)
    if task.layout == "zoology":
        return generators.mqar_zoology(rng, num_examples, seq_len=task.resolved_seq_len(),
                                       num_kv_pairs=task.num_kv_pairs, vocab_size=vocab_size, power_a=task.power_a,
                                       random_non_queries=task.random_non_queries)
    return generators.mqar_vla_contiguous(rng, num_examples, num_kv_pairs=task.num_kv_pairs,
                                          vocab_size=vocab_size, seq_len=task.seq_len,
                                          key_range=task.ood_key_range if out_of_distribution else None)


def load_eval_config(path: str, overrides=()) -> tuple[config_lib.Config, TaskConfig]:
    """(main Config, TaskConfig) from an eval YAML (``inherit:`` chains followed) and dotted overrides; both
    validated (ConfigError / ValueError naming the key)."""
    # training/config.py has no public "raw dict" reader; its helpers are reused so that inherit, override
    # parsing, typing and error messages behave exactly as for train.py.
    raw = config_lib._read_yaml_chain(path, seen=())
    task_raw = raw.pop("task", None) or {}
    for item in overrides:
        key, value = config_lib._parse_override(item)
        if key.startswith("task."):
            config_lib._set_dotted(task_raw, key[len("task."):], value)
        else:
            config_lib._set_dotted(raw, key, value)
    task = config_lib._build(TaskConfig, task_raw, "task")
    if task.warmup_fraction is not None:  # the fraction decides; a stale warmup_steps must not fail validation
        config_lib._set_dotted(raw, "optim.warmup_steps", 0)
    cfg = with_task_schedule(config_lib.from_dict(raw), task)
    validate_task(task, cfg.model.vocab_size)
    return cfg, task


def with_task_schedule(cfg, task: TaskConfig):
    """cfg with optim.warmup_steps = task.warmup_fraction of train.steps (VLA paper, Table 6: 10 %), if set."""
    if task.warmup_fraction is None:
        return cfg
    warmup = int(round(task.warmup_fraction * cfg.train.steps))
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, warmup_steps=warmup))
