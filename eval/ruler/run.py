"""The RULER runner: build the sample grid, generate with any ``generate_fn``, score, aggregate.

``generate_fn(prompts, max_new_tokens, stop_tokens=()) -> new tokens per prompt`` is the interface of
``eval.generate.greedy_generate`` with the model bound (``functools.partial(greedy_generate, model)``); tests pass
fakes. The tokenizer is the model's (``training.tokenizer``): it sizes the prompts and decodes the predictions.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable, Mapping, Sequence

from mixerlab.eval.ruler import haystack as hs
from mixerlab.eval.ruler import report, scoring, tasks
from mixerlab.eval.ruler.generators import Sample, generate_sample
from mixerlab.training.tokenizer import Tokenizer

GenerateFn = Callable[..., list[list[int]]]


def sample_seed(seed: int, task: str, length: int, depth: float, index: int) -> int:
    """A stable per-sample seed (independent of PYTHONHASHSEED and of the other grid points)."""
    digest = hashlib.sha256(f"{seed}|{task}|{length}|{float(depth)!r}|{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _check_grid(task_names, lengths, depths, num_samples) -> None:
    if not task_names:
        raise ValueError(f"tasks: give at least one task; valid tasks: {', '.join(tasks.TASKS)}")
    for name in task_names:
        tasks.get_task(name)
    if not lengths:
        raise ValueError("lengths: give at least one length in tokens")
    if not depths:
        raise ValueError("depths: give at least one depth in [0, 1]")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"samples: must be an integer >= 1, got {num_samples!r}")


def build_samples(tokenizer: Tokenizer, *, task_names: Sequence[str], lengths: Sequence[int],
                  depths: Sequence[float], num_samples: int, seed: int = 0, spread: float = 0.0,
                  task_options: Mapping[str, Mapping[str, Any]] | None = None,
                  essay_path: str = hs.DEFAULT_ESSAY_PATH) -> list[Sample]:
    """Every (task, length, depth, sample index) of the grid, in that nesting order."""
    _check_grid(task_names, lengths, depths, num_samples)
    task_options = dict(task_options or {})
    for name in task_options:
        if name not in task_names:
            raise ValueError(f"task options: {name!r} is not among the tasks being run ({', '.join(task_names)})")
    samples = []
    for name in task_names:
        for length in lengths:
            for depth in depths:
                for i in range(num_samples):
                    samples.append(generate_sample(
                        name, tokenizer=tokenizer, length=length, depth=depth,
                        seed=sample_seed(seed, name, length, depth, i), spread=spread, essay_path=essay_path,
                        **task_options.get(name, {})))
    return samples


def _check_batch_size(batch_size) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: must be an integer >= 1, got {batch_size!r}")


def _cut_at_stop(ids: Sequence[int], stop_tokens: tuple[int, ...]) -> list[int]:
    out = []
    for t in ids:
        if int(t) in stop_tokens:
            break
        out.append(int(t))
    return out


def predict(samples: Sequence[Sample], generate_fn: GenerateFn, tokenizer: Tokenizer, *, batch_size: int = 8,
            log: Callable[[str], None] | None = None) -> list[str]:
    """Greedy continuations of every sample's prompt, decoded and post-processed as RULER does. Samples are
    batched in order, a batch never mixing generation budgets; output is cut at the first stop token."""
    _check_batch_size(batch_size)
    stop = (int(tokenizer.eos_id),)
    predictions: list[str] = []
    i = 0
    while i < len(samples):
        budget = samples[i].max_new_tokens
        j = i
        while j < len(samples) and j - i < batch_size and samples[j].max_new_tokens == budget:
            j += 1
        prompts = [tokenizer.encode(s.prompt) for s in samples[i:j]]
        # A short last batch is padded with copies of its last prompt (outputs dropped), so that a jitted
        # generate_fn sees one batch size.
        padded = prompts + [prompts[-1]] * (min(batch_size, len(samples)) - len(prompts))
        outs = generate_fn(padded, budget, stop_tokens=stop)
        if len(outs) != len(padded):
            raise ValueError(f"generate_fn returned {len(outs)} continuations for {len(padded)} prompts")
        for out in outs[:len(prompts)]:
            if len(out) > budget:
                raise ValueError(f"generate_fn returned {len(out)} tokens, more than max_new_tokens={budget}")
            predictions.append(scoring.postprocess_prediction(tokenizer.decode(_cut_at_stop(out, stop))))
        if log is not None and (j == len(samples) or 10 * j // len(samples) > 10 * i // len(samples)):
            log(f"[ruler] generated {j}/{len(samples)}")
        i = j
    return predictions


def score(samples: Sequence[Sample], predictions: Sequence[str]) -> list[dict[str, Any]]:
    """One record per sample: grid point, answers, prediction and RULER sample score (0..1)."""
    records = []
    for s, pred in zip(samples, predictions, strict=True):
        metric = tasks.get_task(s.task).metric
        m = s.metadata
        records.append(dict(task=s.task, length=m["length"], depth=m["depth"], seed=m["seed"], metric=metric,
                            prompt_tokens=m["prompt_tokens"], total_tokens=m["total_tokens"],
                            needle_depths=m["needle_depths"], answers=list(s.answers), prediction=pred,
                            score=scoring.score_sample(metric, pred, s.answers), prompt=s.prompt))
    return records


def evaluate(tokenizer: Tokenizer, generate_fn: GenerateFn, *, task_names: Sequence[str],
             lengths: Sequence[int], depths: Sequence[float], num_samples: int, seed: int = 0,
             spread: float = 0.0, task_options: Mapping[str, Mapping[str, Any]] | None = None,
             essay_path: str = hs.DEFAULT_ESSAY_PATH, batch_size: int = 8,
             log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Builds the grid, generates, scores and aggregates: ``{"config", "summary", "records"}``."""
    _check_batch_size(batch_size)
    samples = build_samples(tokenizer, task_names=task_names, lengths=lengths, depths=depths,
                            num_samples=num_samples, seed=seed, spread=spread, task_options=task_options,
                            essay_path=essay_path)
    if log is not None:
        log(f"[ruler] {len(samples)} samples: {len(task_names)} tasks x {len(lengths)} lengths x "
            f"{len(depths)} depths x {num_samples}")
    records = score(samples, predict(samples, generate_fn, tokenizer, batch_size=batch_size, log=log))
    config = dict(tasks=list(task_names), lengths=list(lengths), depths=list(depths), samples=num_samples,
                  seed=seed, spread=spread, essay_path=essay_path, tokenizer=getattr(tokenizer, "name", None),
                  task_options={name: s.metadata["options"] for name, s in
                                {s.task: s for s in samples}.items()})
    return dict(config=config, summary=report.aggregate(records), records=records)
