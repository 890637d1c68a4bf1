"""Fitting the answer confidence (models/confidence.py) on held-back questions, and measuring it.

`fit_two_stage`: P(found) x P(right | found), each a logistic regression (Newton's method,
L2-regularised), the default; `fit_selective`: one logistic regression of exact-match
correctness; `fit_isotonic`: isotonic regression (pool adjacent violators) on the raw score
alone. `cross_fitted` predicts each question with a map fitted without it (without its article,
where questions name one), so the error reported is on questions the map did not see.
`reliability` compares confidence with correctness in bins; `risk_coverage` gives selective
answering's curve; `auroc` is None where one class is missing; `choose_threshold` picks the
threshold a map is served with, on its cross-fitted confidences.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ralm.defaults import MAX_UNANSWERABLE
from ralm.errors import RalmError
from ralm.models.confidence import FITTED, FOUND, RIGHT, Calibration, SelectiveCalibration, TwoStageCalibration, feature_vector

MIN_QUESTIONS = 50  # fewer than this cannot tell a map from noise: refused


def fit_isotonic(scores: Sequence[float], correct: Sequence[float], smoothing: float = 1.0) -> Calibration:
    """The non-decreasing step function of `scores` closest to `correct` (0/1) in squared error,
    as breakpoints at the mean score of each step; each step's value is then shrunk towards 1/2
    by `smoothing` pseudo-outcomes of each kind ((right + s) / (n + 2s): a step of 3 right out of
    3 says 0.8, not certain), and kept non-decreasing."""
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
    shrunk = np.maximum.accumulate([(b[2] + smoothing) / (b[0] + 2 * smoothing) for b in blocks])
    return Calibration(tuple(b[1] / b[0] for b in blocks), tuple(shrunk.tolist()), len(x))


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


def check_question_count(n: int) -> None:
    """Enough questions to fit a map on: checked before they are answered (answering is the slow part)."""
    if n < MIN_QUESTIONS:
        raise RalmError(f"calibration needs at least {MIN_QUESTIONS} held-back questions, got {n}")


def check_fittable(correct: Sequence[float]) -> None:
    y = np.asarray(correct, dtype=np.float64)
    check_question_count(len(y))
    if y.min() == y.max():
        raise RalmError(f"calibration needs both right and wrong answers among its {len(y)} questions (all were "
                        f"{'right' if y[0] else 'wrong'}): is the index the questions' corpus?")


def _logistic(x: np.ndarray, y: np.ndarray, *, l2: float, steps: int = 100) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """L2-regularised logistic regression on standardised columns by Newton's method: (mean,
    scale, weights, bias). Outcomes all alike give the smoothed rate, (k + 1) / (n + 2), as bias."""
    mean, scale = x.mean(0), x.std(0)
    if y.min() == y.max():
        rate = (y.sum() + 1) / (len(y) + 2)
        return mean, np.ones_like(scale), np.zeros(x.shape[1]), float(np.log(rate / (1 - rate)))
    z = np.hstack([(x - mean) / scale, np.ones((len(y), 1))])  # [N, F + 1], the last column the bias
    reg = np.diag([l2] * x.shape[1] + [0.0])
    w = np.zeros(z.shape[1])
    for _ in range(steps):
        p = 1.0 / (1.0 + np.exp(-np.clip(z @ w, -30, 30)))
        grad = z.T @ (p - y) + reg @ w
        hess = (z * (p * (1 - p))[:, None]).T @ z + reg + 1e-9 * np.eye(len(w))
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return mean, scale, w[:-1], float(w[-1])


def fit_selective(signals: Sequence[dict], correct: Sequence[float], *, features: Sequence[str] = FITTED,
                  l2: float = 1.0, fitted_with: dict | None = None) -> SelectiveCalibration:
    """Logistic regression of `correct` (0/1) on the named features of each answer's signals,
    standardised; features constant over these questions (a side the index lacks) are left out."""
    y = np.asarray(correct, dtype=np.float64)
    x_all = np.stack([feature_vector(s, features) for s in signals])  # [N, F]
    keep = [j for j in range(x_all.shape[1]) if np.ptp(x_all[:, j]) > 0]
    mean, scale, weights, bias = _logistic(x_all[:, keep], y, l2=l2)
    return SelectiveCalibration(tuple(features[j] for j in keep), tuple(mean.tolist()), tuple(scale.tolist()),
                                tuple(weights.tolist()), bias, len(y), dict(fitted_with or {}))


def fit_two_stage(signals: Sequence[dict], found: Sequence[float], correct: Sequence[float], *,
                  found_features: Sequence[str] = FOUND, right_features: Sequence[str] = RIGHT, l2: float = 1.0,
                  fitted_with: dict | None = None) -> TwoStageCalibration:
    """P(found | x) on every question (found: a block read holds an answer), times P(right |
    found, x) fitted on the questions whose answer was read (models/confidence.py)."""
    y = np.asarray(correct, dtype=np.float64)
    # `found` matches answers in block text by tokens, EM compares normalised spans: the two differ
    # at the edges, and an answer EM counts right was read whatever the token match says
    f = np.maximum(np.asarray(found, dtype=np.float64), y)
    read = [s for s, hit in zip(signals, f) if hit]
    if not read:
        raise RalmError(f"calibration needs questions whose answer is in the blocks read; none of the {len(f)} has one: "
                        "is the index the questions' corpus?")
    return TwoStageCalibration(fit_selective(signals, f, features=found_features, l2=l2),
                               fit_selective(read, y[f > 0], features=right_features, l2=l2), dict(fitted_with or {}))


def side_features(signals: Sequence[dict], *, calibrated: Sequence[str]) -> tuple[str, ...]:
    """The `top_<side>` features these answers carry for the sides in `calibrated` (those whose
    scores mean the same on any corpus)."""
    present = {k for s in signals for k in s if k.startswith("top_")}
    return tuple(f"top_{side}" for side in calibrated if f"top_{side}" in present)


def cross_fitted(signals: Sequence[dict], fit: Callable[[np.ndarray], object], *,
                 groups: Sequence[str] | None = None) -> np.ndarray:
    """[N] each question's confidence from a map fitted without it: `fit(train rows)` returns a
    map. With `groups` (e.g. each question's article) every group is predicted by a map fitted
    on the others (leave-group-out: no article helps predict itself); else each half by a map
    fitted on the other (alternate questions)."""
    n = len(signals)
    folds = np.unique(np.asarray(groups), return_inverse=True)[1] if groups is not None else np.arange(n) % 2
    out = np.zeros(n)
    for fold in np.unique(folds):
        test = folds == fold
        cal = fit(np.flatnonzero(~test))
        out[test] = cal.of_signals([signals[i] for i in np.flatnonzero(test)])
    return out


def risk_coverage(confidence: Sequence[float], correct: Sequence[float]) -> dict:
    """Selective answering's curve: answering the questions of highest confidence first, the
    share answered (coverage) against the error among those answered (risk); and the area
    under it (lower is better)."""
    c, y = np.asarray(confidence, dtype=np.float64), np.asarray(correct, dtype=np.float64)
    order = np.argsort(-c, kind="stable")
    n = np.arange(1, len(c) + 1)
    risk = 1 - np.cumsum(y[order]) / n
    return {"coverage": (n / len(c)).tolist(), "risk": risk.tolist(), "threshold": c[order].tolist(),
            "aurc": round(float(risk.mean()), 4) if len(c) else None}


def auroc(scores: Sequence[float], positive: Sequence[bool]) -> float | None:
    """Area under the ROC curve: P(a random positive scores above a random negative), ties half;
    None when there is no pair to rank (every outcome alike)."""
    s, pos = np.asarray(scores, dtype=np.float64), np.asarray(positive, dtype=bool)
    if pos.all() or not pos.any():
        return None
    values, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - (counts - 1) / 2)[inverse]  # 1-based, ties at their mean rank
    return float((ranks[pos].sum() - pos.sum() * (pos.sum() + 1) / 2) / (pos.sum() * (~pos).sum()))


def choose_threshold(confidence: Sequence[float], unanswerable: Sequence[bool], sets: Sequence[str], *,
                     max_unanswerable: float = MAX_UNANSWERABLE) -> float | None:
    """The lowest threshold (on a 0.01 grid: the most answers) at which at most
    `max_unanswerable` of the unanswerable questions of every set (`sets[i]`: the set question i
    belongs to, e.g. SQuAD with deleted articles, or a generated corpus) would be answered: a
    confidence that holds on each corpus, not on their average. None without unanswerable
    questions (nothing to choose it on); 0.99 when no lower one holds."""
    c, un, sets = np.asarray(confidence, dtype=np.float64), np.asarray(unanswerable, dtype=bool), np.asarray(sets)
    if not un.any():
        return None
    groups = [(sets == name) & un for name in np.unique(sets[un])]
    for t in np.round(np.arange(0.01, 1.0, 0.01), 2):
        if all((c[g] >= t).mean() <= max_unanswerable for g in groups):
            return float(t)
    return 0.99


def threshold_at_coverage(confidence: Sequence[float], unanswerable: Sequence[bool], coverage: float) -> float | None:
    """The highest threshold (on a 0.01 grid: the fewest answers) at which at least `coverage` of
    the answerable questions would be answered: a new reader (a new null, a new map) judged at the
    coverage of the one it replaces. None without answerable questions."""
    c, un = np.asarray(confidence, dtype=np.float64), np.asarray(unanswerable, dtype=bool)
    if un.all():
        return None
    for t in np.round(np.arange(0.99, 0.0, -0.01), 2):
        if (c[~un] >= t).mean() >= coverage:
            return float(t)
    return 0.0


def selective_at(confidence: Sequence[float], correct: Sequence[float], unanswerable: Sequence[bool], t: float) -> dict:
    """At threshold t: the shares of answerable and of unanswerable questions answered, and the
    accuracy of the answers given."""
    c, y, un = np.asarray(confidence, dtype=np.float64), np.asarray(correct, dtype=np.float64), np.asarray(unanswerable, dtype=bool)
    ans = c >= t
    share = lambda m: round(float(ans[m].mean()), 4) if m.any() else None  # noqa: E731
    return {"threshold": t, "answerable_answered": share(~un), "unanswerable_answered": share(un),
            "answered_em": round(float(y[ans].mean()), 4) if ans.any() else None}
