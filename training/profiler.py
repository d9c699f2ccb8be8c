"""The profile.* trace of a few steady-state steps (jax.profiler: TensorBoard/xprof + Perfetto)."""
from __future__ import annotations

import jax

from mixerlab.training.progress import WARMUP_STEPS, _print, _say

PROFILE_NAME = "profile"


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
