"""Mixer x setting x seed sweeps over one eval config: one trained model per run, one record per run.

A mixer entry is a registered name (``gdn2``) or a hybrid layer pattern joined by ``+`` (``gdn2+softmax`` sets
``model.layer_pattern=[gdn2,softmax]``). A setting is a set of ``task.*`` overrides with a label (``n=8``,
``T=64,n=4``). Every run reloads the config with its overrides, so every value is checked as in train.py.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

from mixerlab.eval.synthetic.task import load_eval_config
from mixerlab.eval.synthetic.train import train_on_task


@dataclasses.dataclass(frozen=True)
class Setting:
    label: str  # column name in the table
    x: float  # position on the plot's x-axis (n for MQAR)
    overrides: tuple[str, ...]  # task.* (or any section.key) overrides


def mixer_overrides(entry: str) -> list[str]:
    """``gdn2`` -> model.mixer=gdn2 (no pattern); ``gdn2+softmax`` -> a hybrid layer pattern."""
    parts = [p.strip() for p in entry.split("+") if p.strip()]
    if not parts:
        raise ValueError(f"--mixers: empty entry in {entry!r}; give names like gdn2 or gdn2+softmax")
    if len(parts) == 1:
        return [f"model.mixer={parts[0]}", "model.layer_pattern=null"]
    return [f"model.mixer={parts[0]}", f"model.layer_pattern=[{','.join(parts)}]"]


def mqar_settings(layout: str, ns=(), pairs=()) -> list[Setting]:
    """vla_contiguous: one setting per n (T = 3n+1 unless task.seq_len is fixed); zoology: (T, n) pairs."""
    if layout == "zoology":
        if not pairs:
            raise ValueError("--pairs: the zoology layout needs (T, n) pairs, e.g. --pairs 64:4,128:8")
        return [Setting(f"T={t},n={n}", float(n), ("task.layout=zoology", f"task.seq_len={t}",
                                                     f"task.num_kv_pairs={n}")) for t, n in pairs]
    if not ns:
        raise ValueError("--n: the vla_contiguous layout needs key-value pair counts, e.g. --n 4,8,16")
    return [Setting(f"n={n}", float(n), ("task.layout=vla_contiguous", f"task.num_kv_pairs={n}")) for n in ns]


def run_sweep(config_path: str, mixers: list[str], settings: list[Setting], seeds: list[int | None],
              overrides: list[str] = (), *, log: Callable[[str], None] = print,
              on_record: Callable[[dict], None] | None = None, verbose_runs: bool = False) -> list[dict]:
    """Trains every (mixer, setting, seed); returns one record per run (in order) and calls ``on_record``
    after each (the CLI rewrites its JSON there, so a long sweep keeps what it finished)."""
    runs = [(m, s, seed) for m in mixers for s in settings for seed in seeds]
    # Fail on a bad mixer/setting before hours of training, not in the middle of the sweep.
    for mixer, setting, seed in runs:
        _load(config_path, overrides, mixer, setting, seed)
    records = []
    for i, (mixer, setting, seed) in enumerate(runs, 1):
        cfg, task = _load(config_path, overrides, mixer, setting, seed)
        start = time.perf_counter()
        result = train_on_task(cfg, task, log=log if verbose_runs else None)
        wall = time.perf_counter() - start
        record = {"mixer": mixer, "setting": setting.label, "x": setting.x, "seed": cfg.train.seed,
                  "train_steps": cfg.train.steps, "task": dataclasses.asdict(task), "seq_len": task.resolved_seq_len(),
                  **{k: v for k, v in dataclasses.asdict(result).items()}, "wall_s": wall}
        records.append(record)
        ood = "" if result.ood_accuracy is None else f", OOD-key accuracy {result.ood_accuracy:.4f}"
        log(f"[{i}/{len(runs)}] {mixer:<18} {setting.label:<12} seed {cfg.train.seed}: accuracy "
            f"{result.accuracy:.4f} (exact match {result.exact_match:.3f}){ood}, loss {result.final_loss:.4f}, "
            f"{result.steps} steps{' (early stop)' if result.stopped_early else ''}, {wall:.1f} s "
            f"(first step {result.first_step_s:.1f} s), {result.num_params / 1e3:.0f}k params")
        if on_record is not None:
            on_record(record)
    return records


def _load(config_path, overrides, mixer, setting, seed):
    extra = [] if seed is None else [f"train.seed={seed}"]
    return load_eval_config(config_path, list(overrides) + mixer_overrides(mixer) + list(setting.overrides) + extra)
