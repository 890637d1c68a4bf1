"""Calibrated answer confidence: P(the answer is right), whether or not the corpus holds one.

A reader's config.json keeps one map per retriever kind (hybrid, dense, BM25: their scores
differ in meaning and scale), chosen by the sides a question was searched with. Two forms:

  selective  logistic regression on the answer's signals (`Answer.signals`): the answer's
             probability p(a|x), the log-partition of the reading softmax, the entropy of
             p(z|x), the dense side's best score and the sides' agreement. Fitted on a mix
             of answerable questions and questions whose article is not in the corpus, it tells
             "the corpus does not hold this" apart from "the reader is unsure" (selective QA,
             Kamath et al., 2020). Its output never reaches 0 or 1.
  isotonic   a monotone map of p(a|x) alone, as breakpoints (raw score -> accuracy), applied
             by linear interpolation; older readers carry one map for every kind.

Fitting them on held-back questions is evaluation's job (eval/calibration.py). Below
`MIN_CONFIDENCE` an answer is withheld ("no answer found in the corpus").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ralm.errors import RalmError

# Answers whose calibrated P(correct) is below this are withheld. Chosen from the risk-coverage
# curve of held-back questions, half of them with their article removed from the corpus
# (benchmarks/RESULTS.md, "Hybrid retrieval and selective answering").
MIN_CONFIDENCE = 0.29

# Each signal as the selective model reads it: name -> how it is derived from `Answer.signals`.
FEATURES = ("logit_score", "log_partition", "retrieval_entropy", "top_dense", "top_bm25", "agreement")
# The ones new maps are fitted on. A raw BM25 score's scale is the corpus's own (its IDFs grow with
# the number of documents), so a map fitted on one corpus misreads it on another: on the 282-document
# demo corpus the top BM25 score sits at the 5th percentile of SQuAD's and pulled right answers
# under the threshold. Maps that use it still load.
FITTED = ("logit_score", "log_partition", "retrieval_entropy", "top_dense", "agreement")


def feature_vector(signals: dict, features: Sequence[str]) -> np.ndarray:
    """[F] the named features of one answer's signals (missing ones, e.g. a side the index
    lacks, read as 0)."""
    out = []
    for name in features:
        if name == "logit_score":
            p = min(max(float(signals.get("score", 0.0)), 1e-6), 1 - 1e-6)
            out.append(np.log(p / (1 - p)))
        else:
            value = signals.get(name)
            out.append(0.0 if value is None or not np.isfinite(value) else float(value))
    return np.array(out, dtype=np.float64)


@dataclass(frozen=True)
class Calibration:
    """Isotonic: p(a|x) alone -> P(correct)."""
    raw: tuple[float, ...]  # increasing raw scores
    confidence: tuple[float, ...]  # non-decreasing P(correct) at those scores
    questions: int  # how many questions it was fitted on

    def __call__(self, scores) -> np.ndarray:
        return np.interp(np.asarray(scores, dtype=np.float64), self.raw, self.confidence)

    def of_signals(self, signals: Sequence[dict]) -> np.ndarray:
        """[N] P(correct) of N answers' signals (`Answer.signals`), from their p(a|x) alone."""
        return self([s["score"] for s in signals])

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


@dataclass(frozen=True)
class SelectiveCalibration:
    """Logistic regression on standardised features: P(correct) = sigmoid(w · (x - mean) / scale + b)."""
    features: tuple[str, ...]
    mean: tuple[float, ...]
    scale: tuple[float, ...]
    weights: tuple[float, ...]
    bias: float
    questions: int

    def of_signals(self, signals: Sequence[dict]) -> np.ndarray:
        """[N] P(correct) of N answers' signals (`Answer.signals`)."""
        x = np.stack([feature_vector(s, self.features) for s in signals]) if len(signals) else np.zeros((0, len(self.features)))
        z = ((x - np.array(self.mean)) / np.array(self.scale)) @ np.array(self.weights) + self.bias
        return 1.0 / (1.0 + np.exp(-np.clip(z, -30, 30)))

    def to_json(self) -> dict:
        return {"method": "selective", "questions": self.questions, "features": list(self.features),
                "mean": [round(v, 8) for v in self.mean], "scale": [round(v, 8) for v in self.scale],
                "weights": [round(v, 8) for v in self.weights], "bias": round(self.bias, 8)}

    @classmethod
    def from_json(cls, obj: dict, source: str) -> "SelectiveCalibration":
        features = obj.get("features")
        lists = [obj.get(k) for k in ("mean", "scale", "weights")]
        ok = (isinstance(features, list) and all(f in FEATURES for f in features)
              and all(isinstance(v, list) and len(v) == len(features) for v in lists) and isinstance(obj.get("bias"), (int, float))
              and all(s > 0 for s in obj["scale"]))
        if not ok:
            raise RalmError(f"{source}: a selective calibration needs 'features' (of {', '.join(FEATURES)}) and equally long "
                            "'mean', 'scale' (> 0) and 'weights', and a 'bias'; refit it with `ralm eval qa --calibrate`")
        return cls(tuple(features), *(tuple(map(float, v)) for v in lists), float(obj["bias"]), int(obj.get("questions", 0)))


def calibration_from_json(obj: dict, source: str) -> Calibration | SelectiveCalibration:
    if obj.get("method") == "selective":
        return SelectiveCalibration.from_json(obj, source)
    return Calibration.from_json(obj, source)


@dataclass(frozen=True)
class Calibrations:
    """A reader's maps, one per retriever kind ("*": any kind, as older readers store one)."""
    by_kind: dict

    def for_kind(self, kind: str) -> Calibration | SelectiveCalibration | None:
        return self.by_kind.get(kind, self.by_kind.get("*"))

    def to_json(self) -> dict:
        if set(self.by_kind) == {"*"}:
            return self.by_kind["*"].to_json()
        return {"by_retriever": {k: c.to_json() for k, c in self.by_kind.items()}}

    @classmethod
    def from_json(cls, obj: dict | None, source: str) -> "Calibrations":
        if not obj:
            return cls({})
        if "by_retriever" in obj:
            maps = obj["by_retriever"]
            if not isinstance(maps, dict):
                raise RalmError(f"{source}: 'by_retriever' must map retriever kinds to calibrations")
            return cls({k: calibration_from_json(v, f"{source} ({k})") for k, v in maps.items()})
        return cls({"*": calibration_from_json(obj, source)})

    def with_kind(self, kind: str, cal: Calibration | SelectiveCalibration) -> "Calibrations":
        """These maps with `kind`'s replaced (an older single map is kept for the other kinds)."""
        return Calibrations({**self.by_kind, kind: cal})
