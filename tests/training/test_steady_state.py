"""The profile window and the progress bar's rate/ETA measure the steady state, not the steps that compile
(training/progress.py: WARMUP_STEPS, _advance; training/profiler.py: steady_profile_window)."""
import io

import pytest
from tqdm import tqdm

from mixerlab.training.profiler import steady_profile_window
from mixerlab.training.progress import WARMUP_STEPS, _advance


def _busy(log_every=10, eval_every=0, ckpt_every=0):
    return lambda s: s % log_every == 0 or bool(eval_every and s % eval_every == 0) or bool(
        ckpt_every and s % ckpt_every == 0)


@pytest.mark.parametrize("requested, num, start, busy, expected", [
    (1, 3, 0, _busy(), 3),  # step 1 compiles, step 2 may: the window starts at the third step
    (2, 3, 0, _busy(), 3),
    (15, 3, 0, _busy(), 15),  # already steady: 15, 16 are not followed by host work (17 is the last)
    (9, 3, 0, _busy(), 11),  # 10 is a logging step (metrics fetch): 11-13
    (8, 3, 0, _busy(), 8),  # 8-10: the fetch after 10, the last, comes after the trace stops
    (41, 3, 40, _busy(), 43),  # resumed at step 40: its first two steps compile again
    (6, 2, 0, _busy(log_every=1), 6),  # every step logs: no clear window, the compile steps are still avoided
    (98, 5, 0, _busy(), 98),  # no room before the end: the requested window as it is
])
def test_the_profile_window_starts_after_the_compile_steps_and_clear_of_host_work(requested, num, start, busy,
                                                                                  expected):
    assert steady_profile_window(requested, num, start, busy, last_step=100) == expected


def test_the_profile_window_avoids_evaluations_and_checkpoints():
    busy = _busy(log_every=100, eval_every=20, ckpt_every=25)
    assert steady_profile_window(19, 3, 0, busy, last_step=200) == 21  # 20: an evaluation
    assert steady_profile_window(24, 3, 0, busy, last_step=200) == 26  # 25: a checkpoint


class _Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_the_eta_counts_only_the_steps_after_the_compile(monkeypatch):
    clock = _Clock()
    bar = tqdm(total=20, file=io.StringIO(), mininterval=0, miniters=1)
    bar._time = clock
    bar.start_t = bar.last_print_t = clock()
    durations = [120.0] + [1.0] * 9  # the first step compiles for two minutes, then one second per step
    for nth, seconds in enumerate(durations, start=1):
        clock.t += seconds
        _advance(bar, nth)
    fmt = bar.format_dict
    assert bar.n == 10 and bar.initial == WARMUP_STEPS
    assert fmt["rate"] == pytest.approx(1.0)  # steps/s after the compile; the whole run's average is 0.078
    assert fmt["elapsed"] == pytest.approx(10 - WARMUP_STEPS)
    remaining = (fmt["total"] - fmt["n"]) / fmt["rate"]
    assert remaining == pytest.approx(10.0)  # not 128 s
    bar.close()
