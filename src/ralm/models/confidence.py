"""Calibrated answer confidence: a monotone map from the pipeline's raw answer score
p(z|x)·p(span|z,x) to P(the answer is right), stored as breakpoints (raw score -> accuracy)
in the reader's config.json and applied by linear interpolation between them (constant
beyond the ends), so the confidence never decreases when the raw score grows.
Fitting it on held-back questions is evaluation's job (eval/calibration.py).
"""

from __future__ import annotations

from dataclasses import dataclass

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
