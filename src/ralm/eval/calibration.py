"""Calibrated answer confidence: a monotone map from the pipeline's raw answer score
p(z|x)·p(span|z,x) to P(the answer is right), fitted on held-back questions.

The map is isotonic regression (pool adjacent violators) of exact-match correctness on the raw
score. It is stored as breakpoints (block mean score -> block accuracy) in the reader's
config.json and applied by linear interpolation between them (constant beyond the ends), so
the confidence never decreases when the raw score grows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ralm.errors import RalmError

# Answers whose calibrated confidence P(correct) is below this are withheld ("no answer found
# in the corpus"): an answer that is wrong four times in five misleads more than it helps.
MIN_CONFIDENCE = 0.2


@dataclass(frozen=True)
class Calibration:
    raw: tuple[float, ...]  # increasing raw scores
    confidence: tuple[float, ...]  # non-decreasing P(correct) at those scores
    questions: int  # how many questions it was fitted on

    def __call__(self, scores) -> np.ndarray:
        return np.interp(np.asarray(scores, dtype=np.float64), self.raw, self.confidence)

    def to_json(self) -> dict:
        return {"method": "isotonic", "questions": self.questions,
                "raw": [round(x, 8) for x in self.raw], "confidence": [round(y, 6) for y in self.confidence]}

    @classmethod
    def from_json(cls, obj: dict, source: str) -> "Calibration":
        raw, conf = obj.get("raw"), obj.get("confidence")
        ok = isinstance(raw, list) and isinstance(conf, list) and 0 < len(raw) == len(conf)
        if not ok or np.any(np.diff(raw) <= 0) or np.any(np.diff(conf) < 0):
            raise RalmError(f"{source}: calibration must hold equally long 'raw' (increasing) and 'confidence' "
                            "(non-decreasing) lists; refit it with `ralm eval qa --calibrate`")
        return cls(tuple(map(float, raw)), tuple(map(float, conf)), int(obj.get("questions", 0)))


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
