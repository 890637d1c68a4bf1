"""Fitting the answer confidence (models/confidence.py) on held-back questions, and measuring it.

The map is isotonic regression (pool adjacent violators) of exact-match correctness on the raw
score, as breakpoints at each step's mean score; `reliability` compares confidence with
correctness in bins.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ralm.errors import RalmError
from ralm.models.confidence import Calibration


def fit_isotonic(scores: Sequence[float], correct: Sequence[float]) -> Calibration:
    """The non-decreasing step function of `scores` closest to `correct` (0/1) in squared error,
    as breakpoints at the mean score of each step."""
    x, y = np.asarray(scores, dtype=np.float64), np.asarray(correct, dtype=np.float64)
    if len(x) == 0 or len(x) != len(y):
        raise RalmError(f"calibration needs as many scores as outcomes (>0), got {len(x)} and {len(y)}")
    values, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)  # equal scores: one point
    blocks: list[list[float]] = []  # [weight, sum of scores, sum of outcomes], means increasing
    for w, sx, sy in zip(counts, values * counts, np.bincount(inverse, weights=y)):
        blocks.append([float(w), float(sx), float(sy)])
        while len(blocks) > 1 and blocks[-2][2] / blocks[-2][0] >= blocks[-1][2] / blocks[-1][0]:
            last = blocks.pop()
            blocks[-1] = [a + b for a, b in zip(blocks[-1], last)]
    return Calibration(tuple(b[1] / b[0] for b in blocks), tuple(b[2] / b[0] for b in blocks), len(x))


def reliability(confidence: Sequence[float], correct: Sequence[float], bins: int = 10,
                thresholds: Sequence[float] = (0.2, 0.5, 0.8)) -> dict:
    """Reliability bins (equal width on [0, 1]: count, mean confidence, accuracy), the expected
    calibration error, and for each threshold t the share of questions answered with
    confidence >= t and the accuracy of those answers."""
    c, y = np.asarray(confidence, dtype=np.float64), np.asarray(correct, dtype=np.float64)
    which = np.minimum((c * bins).astype(int), bins - 1)
    rows, ece = [], 0.0
    for b in range(bins):
        inside = which == b
        if inside.any():
            rows.append({"lo": b / bins, "hi": (b + 1) / bins, "count": int(inside.sum()),
                         "confidence": round(float(c[inside].mean()), 4), "accuracy": round(float(y[inside].mean()), 4)})
            ece += inside.mean() * abs(c[inside].mean() - y[inside].mean())
    at = [{"min_confidence": t, "answered": round(float((c >= t).mean()), 4),
           "accuracy": round(float(y[c >= t].mean()), 4) if (c >= t).any() else None} for t in thresholds]
    return {"bins": rows, "ece": round(float(ece), 4), "at": at}
