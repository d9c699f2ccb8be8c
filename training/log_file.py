"""The run's log file handler: a log that cannot be written (disk full) must not flood the terminal.

``logging.FileHandler`` answers a failed write with "--- Logging error ---" and a traceback on stderr, for
every record (orbax logs dozens when a checkpoint write fails), and its ``close()`` raises the same error from
a ``finally`` block, replacing the one-line error the run was stopping with. This handler drops records it
cannot write and says so once.
"""
from __future__ import annotations

import logging
import sys


class QuietFileHandler(logging.FileHandler):
    """A FileHandler whose write errors are one warning line on stderr (the first), never a traceback."""

    def __init__(self, filename: str, *args, **kwargs):
        self.failed: BaseException | None = None
        super().__init__(filename, *args, **kwargs)

    def handleError(self, record) -> None:  # noqa: N802 - logging's name
        error = sys.exc_info()[1]
        if self.failed is None:
            self.failed = error
            print(f"warning: cannot write the log file {self.baseFilename} ({type(error).__name__}: {error}); "
                  f"further records are dropped", file=sys.stderr, flush=True)

    def flush(self) -> None:
        try:
            super().flush()
        except OSError:
            self.handleError(None)  # reads the error from sys.exc_info(), as logging's own calls do

    def close(self) -> None:
        try:
            super().close()
        except OSError:  # the stream's final flush: already reported
            pass
