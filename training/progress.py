"""What a run shows on the terminal (and writes to train.log): messages and the progress bar."""
from __future__ import annotations

import logging

import jax

log = logging.getLogger(__name__)

# The first steps of a process compile the train step (the first; the second can compile again for the layouts
# of the step's own outputs): the profile window and the progress bar's rate and ETA start after them.
WARMUP_STEPS = 2


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

