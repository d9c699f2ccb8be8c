"""What the command line says when a run ends: the final numbers, whether the run diverged, and the numbers of a
run that was already complete (read back from its metrics.jsonl).

Diverged, here: the median of the last ``RECENT`` train losses of the run is not finite or above
``DIVERGED_FACTOR`` x ln(vocabulary size). ln(V) is the loss of a uniform prediction, which is where a freshly
initialised model starts; a run that ends half as far again above it has learned nothing and its parameters are
damaged (``optim.lr=10`` on the tiny config climbs from 9.0 to 300-1400). The median ignores a single spike. A run
that hits ``train.max_consecutive_skips`` (non-finite steps in a row) already stops with an error of its own.
"""
from __future__ import annotations

import dataclasses
import math

from mixerlab.training import storage

DIVERGED_FACTOR = 1.5
RECENT = 10


@dataclasses.dataclass(frozen=True)
class Divergence:
    recent_loss: float  # median of the last RECENT train losses
    limit: float  # DIVERGED_FACTOR * ln(vocab)
    uniform_loss: float  # ln(vocab)
    first_step: int  # the first step whose loss crossed the limit (or was not finite)


def divergence(losses: dict, vocab_size: int | None) -> Divergence | None:
    """A Divergence when the run's recent losses say it diverged (see the module docstring), else None."""
    if not losses or not vocab_size:
        return None
    steps = sorted(losses)
    recent = sorted(losses[s] for s in steps[-RECENT:])
    nans = [v for v in recent if not math.isfinite(v)]
    finite = [v for v in recent if math.isfinite(v)]
    # non-finite losses count as above any limit; the median of the recent window
    ordered = finite + [math.inf] * len(nans)
    median = ordered[len(ordered) // 2]
    uniform = math.log(vocab_size)
    limit = DIVERGED_FACTOR * uniform
    if median <= limit:
        return None
    first = next(s for s in steps if not losses[s] <= limit)  # NaN is not <= anything
    return Divergence(recent_loss=median, limit=limit, uniform_loss=uniform, first_step=first)


def divergence_lines(div: Divergence, checkpoint_dir: str, lr: float) -> list[str]:
    """The end-of-run report of a diverged run: what happened, which checkpoints hold diverged parameters, and how
    to go on."""
    steps = _checkpoint_steps(checkpoint_dir)
    bad = [s for s in steps if s >= div.first_step]
    good = [s for s in steps if s < div.first_step]
    recent = "not finite" if not math.isfinite(div.recent_loss) else f"{div.recent_loss:.1f}"
    lines = [f"DIVERGED: the recent train loss (median of the last {RECENT} steps) is {recent}, above "
             f"{DIVERGED_FACTOR} x ln(vocab) = {div.limit:.2f} (a uniform guess scores {div.uniform_loss:.2f}); "
             f"the loss first crossed that limit at step {div.first_step}."]
    if bad:
        lines.append(f"  checkpoints of steps {', '.join(map(str, bad))} in {checkpoint_dir} hold the diverged "
                     f"parameters; delete them before resuming"
                     + (f" (the newest from before the divergence is step {good[-1]})" if good else
                        " (none is from before the divergence: start over with train.resume=false)"))
    lines.append(f"  lower optim.lr (now {lr:g}) and resume: optim.lr may change on resume")
    return lines


def completed_run_lines(metrics_path: str, steps: int) -> list[str]:
    """The numbers of a run that had already reached train.steps, from its metrics.jsonl."""
    from mixerlab.training.metrics import read_metrics

    try:
        rows = read_metrics(metrics_path)
    except (OSError, ValueError, storage.StorageError):
        rows = []
    train = [r for r in rows if r.get("split") == "train" and "loss" in r]
    val = [r for r in rows if r.get("split") == "val" and "loss" in r]
    numbers = []
    if train:
        numbers.append(f"final train loss {train[-1]['loss']:.4f} (step {train[-1]['step']})")
    if val:
        numbers.append(f"validation loss {val[-1]['loss']:.4f} (step {val[-1]['step']})")
    return [f"already complete: the run reached train.steps={steps} before; nothing was trained"
            + (f"; {', '.join(numbers)}" if numbers else f"; {metrics_path} holds no losses"),
            "  to train further raise train.steps (allowed on resume); for a new run choose another "
            "train.output_dir or train.resume=false"]


def _checkpoint_steps(checkpoint_dir: str) -> list[int]:
    try:
        return sorted(int(n) for n in storage.listdir(checkpoint_dir, "train.output_dir") if n.isdigit())
    except (OSError, storage.StorageError):
        return []
