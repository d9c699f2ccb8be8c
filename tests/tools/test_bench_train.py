"""tools/bench_train.py: one tiny run in process, and model.remat=auto's fallback when its choice runs out of
device memory (simulated: the jitted step raises the runtime's error under the policies that 'do not fit')."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))

import bench_train  # noqa: E402

TINY = ["model.d_model=64", "model.num_layers=1", "train.batch_size=2"]


def _oom_under(monkeypatch, policies, failed):
    from mixerlab.training import loop

    real_init = loop.Trainer.initialize

    def initialize(self):
        real_init(self)
        if self.cfg.model.remat in policies:
            def step(*args):
                failed.append(self.cfg.model.remat)
                raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 72.24GiB")
            self.train_step = step

    monkeypatch.setattr(loop.Trainer, "initialize", initialize)


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
