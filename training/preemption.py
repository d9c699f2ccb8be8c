"""SIGTERM (preemption) as a flag the training loop checks after each step."""
from __future__ import annotations

import signal
import threading


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
