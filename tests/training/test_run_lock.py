"""One trainer per run directory: a second one is refused with one line naming the holder; a lock left by a
killed trainer is taken over (same host: its process is gone; elsewhere: its heartbeat is too old)."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

import train as train_cli
from mixerlab.training import loop, run_lock, run_loop
from mixerlab.training.config import load_config
from mixerlab.training.run_dir import RunDirError
from mixerlab.training.run_lock import LOCK_NAME, RunLock


def _write_lock(run_dir, **fields):
    os.makedirs(run_dir, exist_ok=True)
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "heartbeat": time.time(),
              "token": "someone-else", **fields}
    path = os.path.join(run_dir, LOCK_NAME)
    with open(path, "w") as f:
        json.dump(holder, f)
    return path


def _dead_pid():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def test_a_second_lock_is_refused_with_the_holder_and_released_on_exit(tmp_path):
    run = str(tmp_path / "run")
    with RunLock(run) as first:
        assert os.path.exists(os.path.join(run, LOCK_NAME))
        with pytest.raises(RunDirError) as info:
            RunLock(run).acquire()
        message = str(info.value)
        assert "\n" not in message and f"{run} is in use by another trainer" in message
        assert f"host {socket.gethostname()}, pid {os.getpid()}, since " in message and " UTC" in message
        assert first.held
    assert not os.path.exists(os.path.join(run, LOCK_NAME))
    with RunLock(run):  # free again
        pass


def test_a_lock_of_a_killed_trainer_on_this_host_is_taken_over(tmp_path):
    run = str(tmp_path / "run")
    _write_lock(run, pid=_dead_pid())
    said = []
    with RunLock(run, report=said.append) as lock:
        assert json.load(open(os.path.join(run, LOCK_NAME)))["token"] == lock.token
    assert len(said) == 1 and "no longer running" in said[0] and "on this host is gone" in said[0]


def test_another_hosts_lock_counts_until_its_heartbeat_is_older_than_the_timeout(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    monkeypatch.setenv(run_lock.TIMEOUT_ENV, "60")
    path = _write_lock(run, host="another-host", pid=1)
    with pytest.raises(RunDirError, match="host another-host, pid 1"):
        RunLock(run).acquire()
    old = time.time() - 61
    _write_lock(run, host="another-host", pid=1, heartbeat=old)
    os.utime(path, (old, old))  # a local heartbeat is the file's modification time
    said = []
    with RunLock(run, report=said.append):
        pass
    assert "heartbeat is 61 s old" in said[0] and "MIXERLAB_LOCK_TIMEOUT=60" in said[0]


def test_the_holder_keeps_its_heartbeat_fresh(tmp_path, monkeypatch):
    monkeypatch.setenv(run_lock.TIMEOUT_ENV, "1")  # beats every 0.25 s
    run = str(tmp_path / "run")
    with RunLock(run):
        path = os.path.join(run, LOCK_NAME)
        os.utime(path, (time.time() - 100, time.time() - 100))
        time.sleep(0.8)
        assert time.time() - os.path.getmtime(path) < 1.0
        assert run_lock.stale_reason(RunLock(run).read()) is None


def _cfg(run_dir, *extra):
    return load_config("configs/tiny.yaml", [f"train.output_dir={run_dir}", "train.eval_every=0",
                                             "optim.warmup_steps=1", *extra])


def test_train_py_refuses_a_locked_run_directory_in_one_line_with_exit_code_2(tmp_path, capsys):
    run = tmp_path / "run"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(str(run), pid=live.pid)
        code = train_cli.main(["--config", "configs/tiny.yaml", f"train.output_dir={run}", "train.steps=6"])
    finally:
        live.kill()
        live.wait()
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: train.output_dir: {run} is in use by another trainer (host "
                             f"{socket.gethostname()}, pid {live.pid}, since ")
    assert sorted(os.listdir(run)) == [LOCK_NAME]  # nothing written by the refused run


def test_the_lock_is_released_after_an_error_and_after_sigterm(tmp_path, monkeypatch):
    run = tmp_path / "run"
    with pytest.raises(Exception, match="data.train_path"):
        loop.train(_cfg(run, "train.steps=2", f"data.train_path={tmp_path}/no-such-corpus"), progress=False)
    assert not (run / LOCK_NAME).exists()

    real = run_loop.data_lib.train_iterator

    class _TermAtBatch2:
        def __init__(self, inner):
            self.inner, self.n = inner, 0

        def __next__(self):
            self.n += 1
            if self.n == 2:
                assert (run / LOCK_NAME).exists()  # held while training
                os.kill(os.getpid(), signal.SIGTERM)
            return next(self.inner)

        def get_state(self):
            return self.inner.get_state()

        def set_state(self, state):
            self.inner.set_state(state)

    monkeypatch.setattr(run_loop.data_lib, "train_iterator", lambda *a, **k: _TermAtBatch2(real(*a, **k)))
    result = loop.train(_cfg(run, "train.steps=6", "train.log_every=1", "train.prefetch=0"), progress=False)
    assert result.preempted and not (run / LOCK_NAME).exists()
