"""Calibrated answer confidence: P(the answer is right), whether or not the corpus holds one.

A reader's config.json keeps one map per index kind (hybrid, dense, BM25, ...: their scores
differ in meaning and scale), keyed by the name of the sides a question was searched with
(retrieval/index/kinds.py `kind_of`: an alias, else the sides joined, "bm25+dense+title"), and a
fallback map ("*") on the reader's own signals for any other kind. Three forms:

  two_stage  P(right) = P(found | x) x P(right | found, x): "found" is that a block read holds
             an answer (the corpus, the search and k decide it), fitted on the reading softmax's
             log-partition, its null mass, the retrieval entropy and the sides' scores; "right |
             found" on the answer's p(a|x) and null mass, fitted on the questions whose answer was
             read. The default: the two questions have different evidence, and one logistic map
             on everything ranked right against wrong answers worse than p(a|x) alone.
  selective  one logistic regression on the answer's signals (readers of ralm 0.4).
  isotonic   a monotone map of p(a|x) alone, as breakpoints (older readers).

Each map records what it was fitted with (`fitted_with`: the reader's fingerprint, k, the
threshold rule); `OpenQA` warns once when it reads with another reader or k.
Fitting them on held-back questions is evaluation's job (eval/calibration.py). Below
`MIN_CONFIDENCE` an answer is withheld ("no answer found in the corpus").
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ralm.defaults import MIN_CONFIDENCE
from ralm.errors import RalmError, RalmWarning


# Each signal as a map reads it (`feature_vector`): the named signals of `Answer.signals`, with
# probabilities as log-odds, and each side's best retrieval score as `top_<side>`.
FEATURES = ("logit_score", "logit_null", "logit_verify", "coverage", "entity_coverage", "log_partition", "retrieval_entropy",
            "agreement", "log_blocks")
_SIDE_FEATURE = re.compile(r"top_[a-z][a-z0-9_]*")
# The stage-one ("found") features of new maps, the sides' top scores added per kind. A raw BM25
# score's scale is the corpus's own (its IDFs grow with the number of documents), so a map fitted
# on one corpus misreads it on another: on the 282-document demo corpus the top BM25 score sat at
# the 5th percentile of SQuAD's and pulled right answers under the threshold; sides whose scores
# are scale-free (`Side.calibrated_scores`) give theirs.
# The verifier's P(supported) and the question's coverage by the answer's title and context (its
# words, its names) mean the same on any corpus (a reader without a verifier gives no P(supported):
# constant, left out of a fit). The names' coverage is what tells a sibling's record ("Jamal Hollis"
# read for "Bruno Hollis") from the asked one: fitted with it, fewer of the generated corpora's
# and the constructed near misses' unanswerable questions were answered at equal SQuAD coverage.
FOUND = ("log_partition", "logit_null", "retrieval_entropy", "agreement", "logit_verify", "coverage", "entity_coverage")
RIGHT = ("logit_score", "logit_null", "logit_verify", "coverage", "entity_coverage")  # stage two ("right | found")
# The fallback map's: what every kind of index gives, the reader's signals only.
ANY_KIND = ("log_partition", "logit_null", "retrieval_entropy", "logit_verify", "coverage", "entity_coverage")
# Older maps (ralm 0.4's selective ones) named these.
FITTED = ("logit_score", "log_partition", "retrieval_entropy", "top_dense", "agreement")


def map_threshold(cal) -> float:
    """The threshold a map was fitted with (its `fitted_with["threshold"]`, chosen on the
    questions it was fitted on), else MIN_CONFIDENCE (older maps, uncalibrated readers)."""
    t = (getattr(cal, "fitted_with", None) or {}).get("threshold")
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t <= 1 else MIN_CONFIDENCE


def is_feature(name: str) -> bool:
    return name in FEATURES or _SIDE_FEATURE.fullmatch(name) is not None


def _logit(p) -> float:
    p = min(max(float(p), 1e-6), 1 - 1e-6)
    return float(np.log(p / (1 - p)))


def feature_vector(signals: dict, features: Sequence[str]) -> np.ndarray:
    """[F] the named features of one answer's signals (missing ones, e.g. a side the index
    lacks or the null mass of a reader without one, read as 0)."""
    out = []
    for name in features:
        if name == "logit_score":
            out.append(_logit(signals.get("score", 0.0)))
        elif name in ("logit_null", "logit_verify"):
            p = signals.get("p_" + name.removeprefix("logit_"))
            out.append(_logit(p) if p is not None else 0.0)
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
    fitted_with: dict = field(default_factory=dict, compare=False)

    def of_signals(self, signals: Sequence[dict]) -> np.ndarray:
        """[N] P(correct) of N answers' signals (`Answer.signals`)."""
        x = np.stack([feature_vector(s, self.features) for s in signals]) if len(signals) else np.zeros((0, len(self.features)))
        z = ((x - np.array(self.mean)) / np.array(self.scale)) @ np.array(self.weights) + self.bias
        return 1.0 / (1.0 + np.exp(-np.clip(z, -30, 30)))

    def to_json(self) -> dict:
        return {"method": "selective", "questions": self.questions, "features": list(self.features),
                "mean": [round(v, 8) for v in self.mean], "scale": [round(v, 8) for v in self.scale],
                "weights": [round(v, 8) for v in self.weights], "bias": round(self.bias, 8),
                **({"fitted_with": self.fitted_with} if self.fitted_with else {})}

    @classmethod
    def from_json(cls, obj: dict, source: str) -> "SelectiveCalibration":
        features = obj.get("features")
        lists = [obj.get(k) for k in ("mean", "scale", "weights")]
        ok = (isinstance(features, list) and all(isinstance(f, str) and is_feature(f) for f in features)
              and all(isinstance(v, list) and len(v) == len(features) for v in lists) and isinstance(obj.get("bias"), (int, float))
              and all(s > 0 for s in obj["scale"]))
        if not ok:
            raise RalmError(f"{source}: a selective calibration needs 'features' (of {', '.join(FEATURES)}) and equally long "
                            "'mean', 'scale' (> 0) and 'weights', and a 'bias'; refit it with `ralm eval qa --calibrate`")
        return cls(tuple(features), *(tuple(map(float, v)) for v in lists), float(obj["bias"]), int(obj.get("questions", 0)),
                   _fitted_with(obj, source))


@dataclass(frozen=True)
class TwoStageCalibration:
    """P(right) = P(found | x) x P(right | found, x), each a logistic map (`SelectiveCalibration`)."""
    found: SelectiveCalibration
    right: SelectiveCalibration
    fitted_with: dict = field(default_factory=dict, compare=False)

    @property
    def questions(self) -> int:
        return self.found.questions

    def of_signals(self, signals: Sequence[dict]) -> np.ndarray:
        """[N] P(correct) of N answers' signals (`Answer.signals`)."""
        return self.found.of_signals(signals) * self.right.of_signals(signals)

    def to_json(self) -> dict:
        return {"method": "two_stage", "questions": self.questions, "found": self.found.to_json(),
                "right": self.right.to_json(), **({"fitted_with": self.fitted_with} if self.fitted_with else {})}

    @classmethod
    def from_json(cls, obj: dict, source: str) -> "TwoStageCalibration":
        if not isinstance(obj.get("found"), dict) or not isinstance(obj.get("right"), dict):
            raise RalmError(f"{source}: a two-stage calibration needs 'found' and 'right' maps; refit it with "
                            "`ralm eval qa --calibrate`")
        return cls(SelectiveCalibration.from_json(obj["found"], f"{source} (found)"),
                   SelectiveCalibration.from_json(obj["right"], f"{source} (right)"), _fitted_with(obj, source))


def _fitted_with(obj: dict, source: str) -> dict:
    fitted = obj.get("fitted_with", {})
    if not isinstance(fitted, dict):
        raise RalmError(f"{source}: 'fitted_with' must be an object (reader, k, threshold rule)")
    return fitted


def calibration_from_json(obj: dict, source: str) -> Calibration | SelectiveCalibration | TwoStageCalibration:
    method = obj.get("method")
    if method == "two_stage":
        return TwoStageCalibration.from_json(obj, source)
    if method == "selective":
        return SelectiveCalibration.from_json(obj, source)
    return Calibration.from_json(obj, source)


_warned: set[tuple] = set()


def fitted_with_another_reader(cal, reader: str) -> bool:
    """Whether a map records the fingerprint of another reader than `reader` (one that records
    none: no)."""
    return (getattr(cal, "fitted_with", None) or {}).get("reader") not in (None, reader)


def check_fitted_with(cal, *, kind: str, reader: str, k: int) -> None:
    """Warn once (per map and mismatch) when a map is read with another reader or k than it
    was fitted with: its confidences then mean something else. Maps that record nothing pass."""
    fitted = getattr(cal, "fitted_with", None) or {}
    problems = []
    if fitted_with_another_reader(cal, reader):
        problems.append(f"another reader ({fitted['reader']}, this one {reader})")
    if fitted.get("k") not in (None, k):
        problems.append(f"k = {fitted['k']} blocks read (now {k})")
    key = (kind, reader, k, id(cal))
    if problems and key not in _warned:
        _warned.add(key)
        warnings.warn(RalmWarning(f"the {kind} confidence map was fitted with {' and '.join(problems)}: its confidences "
                                  "may be off; refit it with `ralm eval qa --calibrate`"), stacklevel=2)


@dataclass(frozen=True)
class Calibrations:
    """A reader's maps, one per index kind, and "*": the fallback for any other kind (older
    readers store one map for every kind there)."""
    by_kind: dict

    def for_kind(self, kind: str) -> Calibration | SelectiveCalibration | TwoStageCalibration | None:
        """The kind's map, else the fallback ("*": fitted on the reader's own signals, so that any
        kind, a new one included, withholds answers)."""
        return self.by_kind.get(kind, self.by_kind.get("*"))

    def to_json(self) -> dict:
        if set(self.by_kind) == {"*"}:
            return self.by_kind["*"].to_json()
        return {"by_kind": {k: c.to_json() for k, c in self.by_kind.items()}}

    @classmethod
    def from_json(cls, obj: dict | None, source: str) -> "Calibrations":
        if not obj:
            return cls({})
        key = next((k for k in ("by_kind", "by_retriever") if k in obj), None)  # by_retriever: readers of ralm 0.4
        if key is not None:
            maps = obj[key]
            if not isinstance(maps, dict):
                raise RalmError(f"{source}: '{key}' must map index kinds to calibrations")
            return cls({k: calibration_from_json(v, f"{source} ({k})") for k, v in maps.items()})
        return cls({"*": calibration_from_json(obj, source)})

    def with_kind(self, kind: str, cal: Calibration | SelectiveCalibration | TwoStageCalibration) -> "Calibrations":
        """These maps with `kind`'s replaced (an older single map is kept for the other kinds)."""
        return Calibrations({**self.by_kind, kind: cal})
