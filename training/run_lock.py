"""One trainer per run directory: ``<run dir>/mixerlab.lock``, held for the length of a run.

The lock is a small JSON file (an object on gs:// / s3://) naming its holder: host, pid, when it started, and a
heartbeat the holder rewrites every ``timeout / 4`` seconds from a background thread. A second trainer on the
same directory is refused with one line naming the holder (``RunDirError``: exit code 2 from train.py).

A lock is *stale*, and taken over with a warning, when its holder cannot be running any more:
* on the same host, its pid is not a live process (a killed trainer; found at once), or
* its heartbeat is older than the timeout (another host, a frozen process, or a reused pid): the timeout is
  ``MIXERLAB_LOCK_TIMEOUT`` seconds (default 120). Hosts are assumed to agree on the time within that.

Local directories are locked atomically (``O_CREAT | O_EXCL``). Object stores have no create-if-absent in
fsspec, so there the lock is written and read back after a short pause: of two trainers starting within that
pause, the one whose write landed last keeps the lock and the other is refused.

In multi-process runs (jax.distributed) process 0 alone takes and releases the lock; the others learn its
outcome from a broadcast, so that all of them are refused together.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
import time
import uuid

from mixerlab.training import storage
from mixerlab.training.run_dir import RunDirError

log = logging.getLogger(__name__)

LOCK_NAME = "mixerlab.lock"
TIMEOUT_ENV = "MIXERLAB_LOCK_TIMEOUT"
DEFAULT_TIMEOUT_S = 120.0
SETTLE_S = 1.0  # object stores: how long a written lock must survive before it counts as taken


def timeout_s() -> float:
    try:
        return max(float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)), 1.0)
    except ValueError:
        return DEFAULT_TIMEOUT_S


pid_alive = storage.process_alive


def _utc(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def stale_reason(holder: dict, now: float | None = None, timeout: float | None = None) -> str | None:
    """Why the lock of ``holder`` no longer protects a live run (None: it does)."""
    now = time.time() if now is None else now
    timeout = timeout_s() if timeout is None else timeout
    if holder.get("host") == socket.gethostname() and not pid_alive(int(holder.get("pid", -1))):
        return f"its process {holder.get('pid')} on this host is gone"
    age = now - float(holder.get("heartbeat", 0))
    if age > timeout:
        return f"its heartbeat is {age:.0f} s old (more than {TIMEOUT_ENV}={timeout:g} s)"
    return None


def describe(holder: dict, now: float | None = None) -> str:
    now = time.time() if now is None else now
    age = now - float(holder.get("heartbeat", 0))
    return (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since "
            f"{_utc(float(holder.get('started', 0)))} (heartbeat {max(age, 0):.0f} s ago)")


class RunLock:
    """The lock of ``run_dir``; ``acquire()`` or RunDirError, ``release()`` (idempotent)."""

    def __init__(self, run_dir: str, *, report=print):
        self.run_dir = storage.absolute(run_dir)
        self.path = storage.join(self.run_dir, LOCK_NAME)
        self.remote = storage.is_url(self.run_dir)
        self.report = report
        self.token = uuid.uuid4().hex
        self.held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                        "token": self.token}

    # ------------------------------------------------------------------------------------------ reading
    def read(self) -> dict | None:
        """The current holder (None: no lock, or an unreadable one, which is treated as absent)."""
        try:
            storage.refresh(self.path)  # another trainer's write must be seen, not a cached listing
            if not storage.exists(self.path, "train.output_dir"):
                return None
            holder = json.loads(storage.read_text(self.path, "train.output_dir"))
        except (OSError, ValueError):
            return None
        if not isinstance(holder, dict):
            return None
        if not self.remote:  # a local heartbeat is the file's mtime (touched, not rewritten)
            try:
                holder["heartbeat"] = max(float(holder.get("heartbeat", 0)), os.path.getmtime(self.path))
            except OSError:
                pass
        return holder

    # ------------------------------------------------------------------------------------------ taking
    def acquire(self) -> None:
        for _attempt in range(3):
            if self._try_take():
                self.held = True
                self._start_heartbeat()
                return
            holder = self.read()
            if holder is None:
                continue  # released (or taken over) meanwhile: try again
            why = stale_reason(holder)
            if why is None:
                raise RunDirError(
                    f"train.output_dir: {self.run_dir} is in use by another trainer ({describe(holder)}; lock "
                    f"{self.path}). Wait for it to finish or stop it, or choose another train.output_dir; a lock "
                    f"whose trainer was killed is taken over once that process is gone (same host) or its "
                    f"heartbeat is older than {timeout_s():g} s")
            self.report(f"warning: {self.path}: taking over the lock of a trainer that is no longer running "
                        f"({describe(holder)}): {why}")
            storage.remove(self.path, "train.output_dir")
        raise RunDirError(f"train.output_dir: {self.run_dir}: could not take the lock {self.path} (other trainers "
                          f"keep taking it); make sure only one trainer uses this directory")

    def _payload(self) -> str:
        return json.dumps({**self._record, "heartbeat": time.time()})

    def _try_take(self) -> bool:
        if not self.remote:
            os.makedirs(self.run_dir, exist_ok=True)
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as f:
                f.write(self._payload())
            return True
        if self.read() is not None:
            return False
        storage.write_text(self.path, self._payload(), "train.output_dir")
        time.sleep(SETTLE_S)  # a trainer that wrote at the same time: the later write wins, the other backs off
        holder = self.read()
        return holder is not None and holder.get("token") == self.token

    # ------------------------------------------------------------------------------------------ heartbeat
    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="mixerlab-run-lock", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        interval = timeout_s() / 4
        warned = False
        while not self._stop.wait(interval):
            try:
                holder = self.read()
                if holder is None or holder.get("token") != self.token:
                    if not warned:
                        log.warning("%s: the run lock was removed or taken by another trainer (%s)", self.path,
                                    describe(holder) if holder else "no lock")
                        warned = True
                    continue
                if self.remote:
                    storage.write_text(self.path, self._payload(), "train.output_dir")
                else:
                    os.utime(self.path)
            except OSError as e:  # a missed beat is not fatal; the timeout allows for several
                log.info("run lock heartbeat failed: %s", e)

    # ------------------------------------------------------------------------------------------ release
    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            holder = self.read()
            if holder is not None and holder.get("token") == self.token:
                storage.remove(self.path, "train.output_dir")
        except OSError as e:
            log.warning("could not remove the run lock %s: %s", self.path, e)

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


def acquire_for_run(run_dir: str, *, report=print) -> RunLock | None:
    """Process 0 takes the lock of ``run_dir``; every process raises the same RunDirError if it is held.
    Returns the lock to release (None on the other processes)."""
    import jax

    from mixerlab.training.run_dir import check_writable

    lock, error = None, None
    if jax.process_index() == 0:
        check_writable(storage.absolute(run_dir), "train.output_dir")  # a missing bucket or folder, named
        lock = RunLock(run_dir, report=report)
        try:
            lock.acquire()
        except RunDirError as e:
            error = e
    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        refused = bool(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
        if refused and error is None:
            error = RunDirError(f"train.output_dir: {storage.absolute(run_dir)} is in use by another trainer "
                                f"(process 0 names it)")
    if error is not None:
        raise error
    return lock
