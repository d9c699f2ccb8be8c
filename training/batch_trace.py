"""``MIXERLAB_BATCH_TRACE=<folder>``: every process appends one JSON line per training batch it draws to
``<folder>/batches.<process index>.jsonl``: ``{"batch": n, "process": p, "rows": [hash, ...]}``, a short hash of
each of its rows (all five arrays of the row). The union of the processes' rows of batch n is the global batch
n, so two launches (1 process or 8, any mesh) can be checked to train on the same rows in the same steps.

``n`` counts the batches this process drew since it started (a resumed run starts again at 1, at the restored
position); with ``train.prefetch`` > 0 the last few drawn may not have been trained on when the run ends.
For debugging and tests: hashing costs a few microseconds per row.
"""
from __future__ import annotations

import hashlib
import json
import os

ENV = "MIXERLAB_BATCH_TRACE"
KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def row_hashes(batch: dict) -> list[str]:
    rows = len(batch[KEYS[0]])
    out = []
    for r in range(rows):
        h = hashlib.blake2b(digest_size=8)
        for k in KEYS:
            h.update(batch[k][r].tobytes())
        out.append(h.hexdigest())
    return out


class TracedBatches:
    """The iterator ``inner`` (get_state, set_state, close pass through) writing each batch's row hashes."""

    def __init__(self, inner, folder: str, process_index: int):
        self._inner = inner
        self._process = process_index
        self._count = 0
        os.makedirs(folder, exist_ok=True)
        self._path = os.path.join(folder, f"batches.{process_index}.jsonl")

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self._inner)
        self._count += 1
        with open(self._path, "a") as f:
            f.write(json.dumps({"batch": self._count, "process": self._process, "rows": row_hashes(batch)}) + "\n")
        return batch

    def __getattr__(self, name):
        return getattr(self._inner, name)


def maybe_trace(iterator, process_index: int):
    """``iterator`` itself, or traced when MIXERLAB_BATCH_TRACE is set."""
    folder = os.environ.get(ENV)
    return TracedBatches(iterator, folder, process_index) if folder else iterator
