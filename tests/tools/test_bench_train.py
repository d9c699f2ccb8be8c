"""tools/bench_train.py: one tiny run in process, and model.remat=auto's fallback when its choice runs out of
device memory (simulated: the jitted step raises the runtime's error under the policies that 'do not fit')."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))

import bench_train  # noqa: E402

TINY = ["model.d_model=64", "model.num_layers=1", "train.batch_size=2"]


def _oom_under(monkeypatch, policies, failed):
    from mixerlab.training import trainer

    real_init = trainer.Trainer.initialize

    def initialize(self):
        real_init(self)
        if self.cfg.model.remat in policies:
            def step(*args):
                failed.append(self.cfg.model.remat)
                raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 72.24GiB")
            self.train_step = step

    monkeypatch.setattr(trainer.Trainer, "initialize", initialize)


def test_auto_falls_back_to_the_next_policy(monkeypatch):
    failed = []
    _oom_under(monkeypatch, ("none",), failed)
    row = bench_train.measure("configs/tiny.yaml", TINY + ["model.remat=auto"], steps=1, warmup=1, depth=1)
    assert failed == ["none"] and row["remat"] == "dots" and row["remat_out_of_memory"] == ["none"]
    assert row["step_s"] > 0 and row["loss_after"] > 0


def test_an_explicit_policy_is_not_retried(monkeypatch):
    failed = []
    _oom_under(monkeypatch, ("dots",), failed)
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        bench_train.measure("configs/tiny.yaml", TINY + ["model.remat=dots"], steps=1, warmup=1, depth=1)
    assert failed == ["dots"]


def test_one_document_per_row_joins_the_packed_documents():
    seg = np.array([[1, 1, 2, 2, 2, 3], [1, 1, 1, 1, 0, 0]], np.int32)
    batch = {"inputs": np.arange(12).reshape(2, 6), "segment_ids": seg,
             "positions": np.array([[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 0, 0]], np.int32),
             "loss_mask": np.array([[1, 0, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]], np.float32)}
    out = bench_train.one_document_per_row(batch)
    np.testing.assert_array_equal(out["segment_ids"], [[1] * 6, [1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(out["positions"], [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 0, 0]])
    np.testing.assert_array_equal(out["loss_mask"], [[1] * 6, [1, 1, 1, 1, 0, 0]])
    assert out["inputs"] is batch["inputs"] and batch["segment_ids"] is seg  # the input batch is left alone


def test_seq_lens_expand_every_run_at_fixed_tokens_per_step():
    runs = bench_train.expand_runs(["a=x.yaml,model.remat=none", "b=y.yaml"], [4096, 8192], 32768)
    assert runs == ["a@4096=x.yaml,model.remat=none,data.seq_len=4096,train.batch_size=8",
                    "a@8192=x.yaml,model.remat=none,data.seq_len=8192,train.batch_size=4",
                    "b@4096=y.yaml,data.seq_len=4096,train.batch_size=8",
                    "b@8192=y.yaml,data.seq_len=8192,train.batch_size=4"]
    assert bench_train.expand_runs(["a=x.yaml"], [], None) == ["a=x.yaml"]
    with pytest.raises(SystemExit, match="not a multiple"):
        bench_train.expand_runs(["a=x.yaml"], [3000], 32768)


def test_long_docs_pay_full_attention_and_mfu_uses_the_datasheet_peak(monkeypatch):
    from mixerlab.pallas_kernels import chips
    from mixerlab.training import flop_model

    fake = chips.Chip("fake", ("cpu",), 1e14, 5e13, None, None, "test")
    monkeypatch.setattr(flop_model, "device_chip", lambda device=None: fake)
    t = 128
    row = bench_train.measure("configs/tiny.yaml", TINY + [f"data.seq_len={t}"], steps=1, warmup=1, depth=1,
                              long_docs=True)
    assert row["attention_pairs_per_row"] == t * (t + 1) / 2 and row["long_docs"]
    assert row["mfu"] == pytest.approx(row["model_tflops_per_s"] * 1e12 / 1e14)
    assert row["mfu_measured_peak"] == pytest.approx(2 * row["mfu"])
    assert row["model_flops_per_step"] == pytest.approx(row["model_tflops_per_s"] * 1e12 * row["step_s"])
    assert "| 2×128 |" in bench_train._row("tiny", row)


def test_an_mfu_above_100_percent_is_refused(monkeypatch):
    from mixerlab.pallas_kernels import chips
    from mixerlab.training import flop_model

    slow = chips.Chip("slow", ("cpu",), 1.0, None, None, None, "test")
    monkeypatch.setattr(flop_model, "device_chip", lambda device=None: slow)
    with pytest.raises(flop_model.ImpossibleMFU, match=r"configs/tiny\.yaml .*2x64.*is above 100 %.*model FLOPs"):
        bench_train.measure("configs/tiny.yaml", TINY, steps=1, warmup=1, depth=1)


def test_a_child_run_is_shown_as_it_goes_and_its_result_returned(capfd):
    child = ("import sys, json; print('model.remat=auto: chose dots', flush=True); print('compiling', file=sys.stderr);"
             " print('noise'); print(json.dumps({'step_s': 0.5}))")
    result, kept = bench_train.child_result([sys.executable, "-c", child],
                                            keep=lambda line: line.startswith("model.remat=auto"))
    assert result == {"step_s": 0.5} and kept == ["model.remat=auto: chose dots"]
    err = capfd.readouterr().err
    assert "model.remat=auto: chose dots" in err and "compiling" in err and "noise" not in err


def test_a_failed_child_names_its_last_lines():
    child = "import sys; print('model.remat=auto: chose none'); sys.exit('RESOURCE_EXHAUSTED: out of memory')"
    with pytest.raises(RuntimeError, match="chose none / RESOURCE_EXHAUSTED"):
        bench_train.child_result([sys.executable, "-c", child], keep=lambda line: line.startswith("model.remat"))
    with pytest.raises(RuntimeError, match="without printing its result"):
        bench_train.child_result([sys.executable, "-c", "pass"])


def test_ending_the_benchmark_ends_its_child(tmp_path):
    """`timeout` sends SIGTERM to the benchmark, not to the run it started: the run must not live on."""
    import signal
    import subprocess
    import time

    pid_file = tmp_path / "child.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    parent = (f"import sys; sys.path.insert(0, {os.path.dirname(bench_train.__file__)!r}); import bench_train; "
              f"bench_train.child_result([sys.executable, '-c', {child!r}])")
    proc = subprocess.Popen([sys.executable, "-c", parent])
    child_pid = None
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        child_pid = int(pid_file.read_text())
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        alive = True
        for _ in range(100):  # killed and reaped by the benchmark before it exits
            try:
                os.kill(child_pid, 0)
            except ProcessLookupError:
                alive = False
                break
            time.sleep(0.1)
    finally:  # nothing left sleeping when the test fails
        for pid in filter(None, (proc.pid, child_pid)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    assert rc == 128 + signal.SIGTERM
    assert not alive, "the child outlived the benchmark"
