"""RULER's scoring: case-insensitive string containment of the reference answers in the prediction.

* ``string_match_all`` (RULER's metric for NIAH, VT, CWE, FWE): a sample scores the fraction of its references
  that occur in the prediction; the task score is the mean over samples, times 100, rounded to 2 decimals.
* ``string_match_part`` (RULER's metric for its QA tasks): a sample scores 1 when any one of its references
  occurs in the prediction.

Before scoring, RULER post-processes a prediction: strip, replace every control character (U+0000..U+001F)
with a newline, strip again (``postprocess_prediction``).
"""
from __future__ import annotations

import re
from typing import Sequence

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess_prediction(text: str) -> str:
    return _CONTROL.sub("\n", text.strip()).strip()


def _check_reference(ref: Sequence[str]) -> None:
    if isinstance(ref, str) or len(ref) == 0:
        raise ValueError(f"references: each sample needs a non-empty list of answer strings, got {ref!r}")


def sample_match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of ``references`` contained (case-insensitively) in ``prediction``."""
    _check_reference(references)
    pred = prediction.lower()
    return sum(r.lower() in pred for r in references) / len(references)


def sample_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 when any of ``references`` is contained (case-insensitively) in ``prediction``, else 0.0."""
    _check_reference(references)
    pred = prediction.lower()
    return float(any(r.lower() in pred for r in references))


SAMPLE_METRICS = {"string_match_all": sample_match_all, "string_match_part": sample_match_part}


def _corpus(sample_fn, predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    if len(predictions) != len(references) or not predictions:
        raise ValueError(f"predictions and references must be equally long and non-empty, got "
                         f"{len(predictions)} and {len(references)}")
    total = sum(sample_fn(p, r) for p, r in zip(predictions, references))
    return round(total / len(predictions) * 100, 2)


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's task score in percent (2 decimals): mean over samples of the fraction of references found."""
    return _corpus(sample_match_all, predictions, references)


def string_match_part(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's QA task score in percent (2 decimals): share of samples where any reference is found."""
    return _corpus(sample_match_part, predictions, references)


CORPUS_METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def score_sample(metric: str, prediction: str, references: Sequence[str]) -> float:
    if metric not in SAMPLE_METRICS:
        raise ValueError(f"metric: unknown metric {metric!r}; valid: {', '.join(SAMPLE_METRICS)}")
    return SAMPLE_METRICS[metric](prediction, references)
