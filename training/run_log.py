"""<run_dir>/train.log: every message of a run, and the library tracebacks the terminal should not get."""
from __future__ import annotations

import logging
import sys

import jax

from mixerlab.training import storage
from mixerlab.training.log_file import QuietFileHandler

log = logging.getLogger(__name__)

LOG_NAME = "train.log"


class _RunLog:
    """<run_dir>/train.log for the length of a run: every message of the run, plus what the terminal should not
    get as dumps: orbax's (absl) and asyncio's error tracebacks and exceptions raised in library callbacks
    (a failed checkpoint write otherwise prints hundreds of lines before the one-line error)."""

    QUIET = ("absl", "asyncio")

    def __init__(self, staging: storage.Staging):
        self.staging = staging
        primary = jax.process_index() == 0
        if primary:
            staging.pull(LOG_NAME)  # a remote log is continued, as a local one is appended to
        self.handler = QuietFileHandler(staging.path(LOG_NAME)) if primary else logging.NullHandler()
        self.handler.setLevel(logging.INFO)
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger = logging.getLogger("mixerlab.training")
        logger.addHandler(self.handler)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        self._propagate = {}
        for name in self.QUIET:
            quiet = logging.getLogger(name)
            self._propagate[name] = quiet.propagate
            quiet.addHandler(self.handler)
            quiet.propagate = False
        self._unraisable = sys.unraisablehook
        sys.unraisablehook = self._log_unraisable

    @staticmethod
    def _log_unraisable(info) -> None:
        log.info("exception ignored in %r: %s", info.object, info.err_msg or "",
                 exc_info=(info.exc_type, info.exc_value, info.exc_traceback))

    def close(self) -> None:
        sys.unraisablehook = self._unraisable
        for name, propagate in self._propagate.items():
            logging.getLogger(name).removeHandler(self.handler)
            logging.getLogger(name).propagate = propagate
        logging.getLogger("mixerlab.training").removeHandler(self.handler)
        self.handler.close()
        self.staging.push(LOG_NAME, strict=False)

    def sync(self) -> None:
        """Uploads the log so far (remote run directories)."""
        self.handler.flush()
        self.staging.push(LOG_NAME, strict=False)
