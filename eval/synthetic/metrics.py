"""Accuracy of predictions on the labelled positions (labels != IGNORE), in numpy.

``predictions`` are the model's argmax tokens [N,T] at every position; a labelled position is correct when the
prediction equals its label. "Per-query-token accuracy" (docs/evaluation.md) = correct labelled positions / labelled
positions; "exact match" = rows whose labelled positions are all correct.
"""
from __future__ import annotations

import numpy as np

from mixerlab.eval.synthetic.generators import IGNORE


class AccuracyCounter:
    """Accumulates counts over evaluation batches; ``summary()`` gives the rates."""

    def __init__(self, lag_buckets=()):
        self.lag_edges = tuple(lag_buckets)
        self.correct = self.total = self.rows = self.exact_rows = 0
        self.bucket_correct = np.zeros(max(len(self.lag_edges) - 1, 0), np.int64)
        self.bucket_total = np.zeros_like(self.bucket_correct)

    def add(self, inputs: np.ndarray, labels: np.ndarray, predictions: np.ndarray) -> None:
        if predictions.shape != labels.shape:
            raise ValueError(f"predictions: shape {predictions.shape} must equal the labels' shape {labels.shape}")
        scored = labels != IGNORE
        hit = (predictions == labels) & scored
        self.correct += int(hit.sum())
        self.total += int(scored.sum())
        self.rows += labels.shape[0]
        self.exact_rows += int(np.all(hit | ~scored, axis=1).sum())
        if self.lag_edges:
            lags = recall_lags(inputs, labels)
            bucket = np.searchsorted(self.lag_edges, lags, side="right") - 1  # -1 / len-1: outside the edges
            inside = scored & (bucket >= 0) & (bucket < len(self.lag_edges) - 1)
            np.add.at(self.bucket_total, bucket[inside], 1)
            np.add.at(self.bucket_correct, bucket[inside], hit[inside].astype(np.int64))

    def summary(self) -> dict:
        out = {"accuracy": self.correct / max(self.total, 1), "exact_match": self.exact_rows / max(self.rows, 1),
               "scored_tokens": self.total, "rows": self.rows}
        for i in range(len(self.bucket_total)):
            name = f"lag_{self.lag_edges[i]}_{self.lag_edges[i + 1]}"
            out[name] = float(self.bucket_correct[i] / self.bucket_total[i]) if self.bucket_total[i] else None
        return out


def recall_lags(inputs: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """For every labelled position t (an MQAR query key), t minus the position where that key first appears
    in the row (its binding in the context); -1 at unlabelled positions or when the key never appeared before."""
    n_rows, T = inputs.shape
    t = np.arange(T)
    same = inputs[:, :, None] == inputs[:, None, :]  # [N, t, j]: token at j equals token at t
    earlier = same & (t[None, None, :] < t[None, :, None])
    first = np.where(earlier.any(axis=2), earlier.argmax(axis=2), -1)
    return np.where((labels != IGNORE) & (first >= 0), t[None, :] - first, -1)
