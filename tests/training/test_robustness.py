"""Preemption (SIGTERM), non-finite steps and unreadable checkpoints."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from mixerlab.training import run_loop
from mixerlab.training.config import load_config
from mixerlab.training.loop import train

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg(tmp_path, name, *extra):
    return load_config("configs/tiny.yaml", [f"train.output_dir={tmp_path / name}", "train.eval_every=0", *extra])


class _PoisonedIterator:
    """Wraps the real data iterator and puts a NaN into the loss mask of the chosen steps' batches."""

    def __init__(self, inner, poison_steps):
        self.inner, self.poison_steps, self.step = inner, set(poison_steps), 0

    def __iter__(self):
        return self

    def __next__(self):
        batch = dict(next(self.inner))
        self.step += 1
        if self.step in self.poison_steps:
            mask = batch["loss_mask"].copy()
            mask[0, 3] = np.nan
            batch["loss_mask"] = mask
        return batch

    def get_state(self):
        return self.inner.get_state()

    def set_state(self, state):
        self.inner.set_state(state)


def _poison(monkeypatch, steps):
    real = run_loop.data_lib.train_iterator
    monkeypatch.setattr(run_loop.data_lib, "train_iterator", lambda *a, **k: _PoisonedIterator(real(*a, **k), steps))


def test_nan_batch_is_skipped_counted_and_leaves_parameters_untouched(tmp_path, monkeypatch):
    clean = train(_cfg(tmp_path, "clean", "train.steps=6", "checkpoint.every=0"), progress=False)
    _poison(monkeypatch, [3])
    run = train(_cfg(tmp_path, "poisoned", "train.steps=6", "checkpoint.every=0"), progress=False)
    assert run.skipped_steps == [3]
    assert not np.isfinite(run.train_losses[3])
    assert run.train_losses[1] == clean.train_losses[1] and run.train_losses[2] == clean.train_losses[2]
    # Step 4 sees the parameters after step 2 (step 3 was skipped), so it differs from the clean run but is finite.
    assert all(np.isfinite(run.train_losses[s]) for s in (4, 5, 6))
    rows = [json.loads(line) for line in open(run.metrics_path)]
    assert rows[-1]["skipped_total"] == 1


def test_consecutive_non_finite_steps_stop_the_run(tmp_path, monkeypatch):
    _poison(monkeypatch, [2, 3, 4])
    with pytest.raises(FloatingPointError, match="3 consecutive steps.*train.max_consecutive_skips=3") as err:
        train(_cfg(tmp_path, "stop", "train.steps=8", "train.max_consecutive_skips=3"), progress=False)
    # The message says what is really on disk (checkpoint.every=10: nothing yet).
    assert "no checkpoint was written to" in str(err.value) and "last good parameters" not in str(err.value)
    # Every skipped step has its row, the last one (which stopped the run) included.
    rows = [json.loads(line) for line in open(tmp_path / "stop" / "metrics.jsonl")]
    assert [(r["step"], r["skipped_total"]) for r in rows if r.get("skipped")] == [(2, 1), (3, 2), (4, 3)]


def test_unreadable_newest_checkpoint_is_reported_and_an_older_one_used(tmp_path, capsys):
    cfg = _cfg(tmp_path, "corrupt", "train.steps=6", "checkpoint.every=2")
    full = train(cfg, progress=False)
    newest = os.path.join(full.checkpoint_dir, "6")
    for root, _dirs, files in os.walk(os.path.join(newest, "params")):
        for f in files:
            with open(os.path.join(root, f), "wb") as fh:
                fh.write(b"garbage")
    resumed = train(load_config("configs/tiny.yaml", [f"train.output_dir={tmp_path / 'corrupt'}",
                                                      "train.eval_every=0", "train.steps=8", "checkpoint.every=2",
                                                      "optim.warmup_steps=5"]), progress=False)
    out = capsys.readouterr().out
    assert "checkpoint step 6" in out and "the manifest says" in out and "checkpoints.quarantine/6" in out
    assert sorted(resumed.train_losses) == [5, 6, 7, 8]


@pytest.mark.extended  # test_train's bitwise resume and test_reliability's SIGTERM tests cover this path
@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_resume_continues_identically(tmp_path):
    args = ["configs/tiny.yaml", "train.steps=40", "train.log_every=1", "checkpoint.every=1000",
            "train.eval_every=0"]
    reference = train(load_config(args[0], [*args[1:], f"train.output_dir={tmp_path / 'ref'}"]), progress=False)

    run_dir = tmp_path / "preempted"
    cmd = [sys.executable, "train.py", "--config", *args, f"train.output_dir={run_dir}"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "training ended before it could be preempted:\n" + proc.communicate()[0]
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 143, out
    assert "SIGTERM: saved a checkpoint" in out
    stopped_at = max(json.loads(line)["step"] for line in metrics.read_text().splitlines())
    assert stopped_at < 40
    assert os.listdir(run_dir / "checkpoints") == [str(stopped_at)]

    resumed = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    losses = {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines())}
    assert sorted(losses) == list(range(1, 41))
    for step in range(1, 41):
        assert losses[step] == reference.train_losses[step], f"step {step}"
