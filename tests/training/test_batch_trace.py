"""MIXERLAB_BATCH_TRACE: one line of row hashes per batch drawn, the iterator otherwise unchanged."""
import json

import numpy as np

from mixerlab.training import batch_trace


def _batch(first_token: int, rows: int = 2) -> dict:
    base = np.arange(rows * 4, dtype=np.int32).reshape(rows, 4) + first_token
    return {"inputs": base, "targets": base + 1, "segment_ids": np.ones_like(base), "positions": base * 0,
            "loss_mask": np.ones(base.shape, np.float32)}


class _Iterator:
    def __init__(self):
        self.batches = iter([_batch(0), _batch(100)])
        self.state = {"pos": 0}

    def __next__(self):
        self.state = {"pos": self.state["pos"] + 1}
        return next(self.batches)

    def get_state(self):
        return self.state


def test_untraced_without_the_variable(monkeypatch):
    monkeypatch.delenv(batch_trace.ENV, raising=False)
    it = _Iterator()
    assert batch_trace.maybe_trace(it, 0) is it


def test_each_batch_is_one_line_of_row_hashes(monkeypatch, tmp_path):
    monkeypatch.setenv(batch_trace.ENV, str(tmp_path / "trace"))
    it = batch_trace.maybe_trace(_Iterator(), 3)
    first, second = next(it), next(it)
    assert it.get_state() == {"pos": 2}  # the iterator's own methods pass through
    lines = [json.loads(line) for line in open(tmp_path / "trace" / "batches.3.jsonl")]
    assert [(r["batch"], r["process"]) for r in lines] == [(1, 3), (2, 3)]
    assert lines[0]["rows"] == batch_trace.row_hashes(first) and lines[1]["rows"] == batch_trace.row_hashes(second)
    assert len(set(lines[0]["rows"] + lines[1]["rows"])) == 4  # different rows, different hashes
    swapped = {k: v[::-1] for k, v in first.items()}
    assert batch_trace.row_hashes(swapped) == lines[0]["rows"][::-1]  # a row's hash is the row's, not its place
    masked = dict(first, loss_mask=np.zeros_like(first["loss_mask"]))
    assert batch_trace.row_hashes(masked) != lines[0]["rows"]  # every array of the row counts
