"""Open-domain QA evaluation: answer a question file through the pipeline (ralm/pipeline.py),
then EM/F1 (SQuAD v1.1, max over gold answers) of every question's best answer, withheld or
not, the share answered at the pipeline's threshold and their EM, and retrieval recall@k;
optionally fit the confidence map of the kind searched and its threshold on these questions
and more calibration sets over their own indexes (`CalibrationSet`: a generated corpus, a
corpus with articles deleted), mixing answerable ones and ones marked "unanswerable", and
report its reliability, measured on questions each map was not fitted on."""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from ralm.atomic import atomic_path
from ralm.data.qa import Question, has_answer
from ralm.defaults import MAX_UNANSWERABLE, QA_BATCH
from ralm.errors import RalmError, RalmWarning
from ralm.eval.calibration import (auroc, check_fittable, check_question_count, choose_threshold, cross_fitted, fit_two_stage,
                                   reliability, risk_coverage, selective_at, side_features, threshold_at_coverage)
from ralm.eval.metrics import exact_match, f1, recall_at_k
from ralm.eval.retrieval import warn_if_no_answer_retrieved
from ralm.models.confidence import ANY_KIND, FOUND, map_threshold
from ralm.retrieval.index import kinds
from ralm.retrieval.index.kinds import side_class
from ralm.pipeline import OpenQA
from ralm.progress import progress_bar


def default_predictions_path(questions: str | os.PathLike, index: str | os.PathLike, kind: str) -> Path:
    """./<questions>-<index>-<kind>.predictions.jsonl: the current directory, never a
    model's or an index's folder (a shared or read-only model must not be written into)."""
    return Path(f"{Path(questions).stem}-{Path(index).name}-{kind}.predictions.jsonl")


def found_features(qa: OpenQA, signals: Sequence[dict]) -> tuple[str, ...]:
    """Stage one's features for `qa`'s kind: the reader's and fusion's signals, and the top
    score of each side searched whose scores mean the same on any corpus."""
    calibrated = [name for name in qa.searcher.sides if side_class(name).calibrated_scores]
    return (*FOUND, *side_features(signals, calibrated=calibrated))


@dataclass(frozen=True)
class CalibrationSet:
    """More held-back questions to fit the confidence on, each over its own index (a generated
    corpus, a corpus with articles deleted): `name` groups them, `qa` reads them (the same reader,
    k and side as the questions evaluated)."""
    name: str
    qa: OpenQA
    questions: Sequence[Question]


@dataclass
class _Answered:
    """What evaluation keeps of each question answered."""
    rows: list = field(default_factory=list)  # the predictions file's
    ems: list = field(default_factory=list)
    f1s: list = field(default_factory=list)
    hits: list = field(default_factory=list)  # [retrieved] whether each retrieved block holds an answer
    signals: list = field(default_factory=list)


def _answer(qa: OpenQA, questions: Sequence[Question], *, retrieve: int, batch_size: int, bar, label: str) -> _Answered:
    out = _Answered()
    task = bar.add_task(label, total=len(questions))
    for i in range(0, len(questions), batch_size):
        chunk = questions[i : i + batch_size]
        for q, a in zip(chunk, qa.answer([q.question for q in chunk], retrieve=retrieve)):
            best = a.evidence[a.best]
            em, f = exact_match(best.span_text, q.answers), f1(best.span_text, q.answers)
            out.ems.append(em)
            out.f1s.append(f)
            out.signals.append(a.signals)
            # a block counts when its text holds an answer, as in `ralm eval retrieval`
            out.hits.append([has_answer(t, q.answers) for t in a.retrieved_texts])
            out.rows.append({"id": q.id, "question": q.question, "answers": list(q.answers), "prediction": best.span_text,
                             "score": round(a.score, 6), "em": em, "f1": round(f, 4), "evidence_id": best.id,
                             "evidence_title": best.title, "retrieval_prob": round(best.retrieval_prob, 6),
                             "span_prob": round(best.span_prob, 6), "answer_in_read": any(out.hits[-1][: qa.k]),
                             "read": [e.id for e in a.evidence], "signals": {k: v if v is None else round(v, 6)
                                                                               for k, v in a.signals.items()}})
        bar.advance(task, len(chunk))
    return out


def unanswerable_of(q: Question) -> bool:
    """Whether a held-back question is marked as one its corpus cannot answer: "unanswerable":
    true (or SQuAD 2.0's "is_impossible")."""
    return bool(q.extra.get("unanswerable") or q.extra.get("is_impossible"))


def evaluate_qa(qa: OpenQA, questions: Sequence[Question], *, ks: Sequence[int] = (1, 5, 20), batch_size: int = QA_BATCH,
                predictions: Path | None = None, show_progress: bool = True, calibrate: bool = False,
                also: Sequence[CalibrationSet] = (), max_unanswerable: float = MAX_UNANSWERABLE,
                coverage: float | None = None) -> dict:
    """EM / F1 (percentages, max over gold answers) of the best answer (also when the threshold
    withholds it), `answered` (% of questions answered at `qa.threshold`) and
    `answered_em` (EM over those), and recall@k; per-question JSONL to `predictions`.
    `calibrate` fits the confidence map of `qa`'s kind (and, for the default kind, the fallback
    map of any other) on these questions and those of `also`, pooled, and its threshold
    (`choose_threshold`: at most `max_unanswerable` of each set's unanswerable questions
    answered, on confidences cross-fitted leaving whole articles or generated corpora out; with
    `coverage`, `threshold_at_coverage` of these questions instead);
    with a calibration the result holds reliability bins and each prediction its confidence."""
    if calibrate:
        check_question_count(len(questions) + sum(len(s.questions) for s in also))
    for s in also:
        if s.qa.k != qa.k or s.qa.kind != qa.kind:
            raise RalmError(f"calibration set {s.name} is read with k {s.qa.k} and side(s) {s.qa.kind}, the questions "
                            f"with k {qa.k} and {qa.kind}: a map is fitted on the signals exactly as served")
    start = time.perf_counter()
    retrieve = max(max(ks), qa.k)
    with progress_bar(show_progress) as bar:
        main = _answer(qa, questions, retrieve=retrieve, batch_size=batch_size, bar=bar, label="answering")
        extra = [_answer(s.qa, s.questions, retrieve=s.qa.k, batch_size=batch_size, bar=bar, label=f"calibration set {s.name}")
                 for s in also]
    # questions with no answer at all (a set of unanswerable ones) say nothing of the index
    warn_if_no_answer_retrieved([h for h, q in zip(main.hits, questions) if q.answers], qa.searcher, retrieve)
    ems, rows = main.ems, main.rows
    n = max(len(questions), 1)
    result = {"em": round(100 * sum(ems) / n, 2), "f1": round(100 * sum(main.f1s) / n, 2),
              **{key: round(v, 2) for key, v in recall_at_k(main.hits, ks).items()},
              "questions": len(questions), "k": qa.k, "seconds": round(time.perf_counter() - start, 2)}
    confidence = None
    if calibrate:
        confidence, result["calibration_fit"] = _calibrate(qa, questions, main, also, extra, max_unanswerable, coverage)
        result["reliability"] = {**reliability(confidence, ems), "cross_fitted": result["calibration_fit"]["cross_fitted"]}
        result["seconds"] = round(time.perf_counter() - start, 2)
    elif qa.calibration is not None:
        confidence = qa.calibration.of_signals(main.signals)
        result["reliability"] = reliability(confidence, ems)
    answered = [c >= qa.threshold for c in confidence] if confidence is not None else [True] * len(ems)
    for i, row in enumerate(rows):
        row["no_answer"] = not answered[i]
        if confidence is not None:
            row["confidence"] = round(float(confidence[i]), 4)
    n_answered = sum(answered)
    result["threshold"] = qa.threshold if confidence is not None else None
    result["answered"] = round(100 * n_answered / n, 2)
    result["answered_em"] = round(100 * sum(e for e, a in zip(ems, answered) if a) / n_answered, 2) if n_answered else None
    if confidence is not None:
        curve = risk_coverage(confidence, ems)
        result["aurc"] = curve["aurc"]
        area = auroc(confidence, ems)
        result["auroc"] = None if area is None else round(area, 4)
        if area is None:  # nothing to rank: every answer right, or every one wrong
            note = f"AUROC is undefined: all {len(ems)} answers were {'right' if ems and ems[0] else 'wrong'}"
            result["notes"] = [note]
            warnings.warn(RalmWarning(note))
    if predictions is not None:
        with atomic_path(predictions) as tmp:
            tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return result


def _calibrate(qa: OpenQA, questions: Sequence[Question], main: _Answered, also: Sequence[CalibrationSet],
               extra: Sequence[_Answered], max_unanswerable: float, coverage: float | None = None) -> tuple[np.ndarray, dict]:
    """Fit `qa`'s kind's map (and for the default kind the fallback "*") on every set's questions
    pooled, choose its threshold, and install it in `qa`. Returns (the questions' cross-fitted
    confidences, a report of the fit)."""
    sets = [("questions", questions, main, qa.k), *((s.name, s.questions, a, s.qa.k) for s, a in zip(also, extra))]
    signals = [sig for _, _, a, _ in sets for sig in a.signals]
    ems = [e for _, _, a, _ in sets for e in a.ems]
    check_fittable(ems)
    found = [float(any(h[:k])) for _, _, a, k in sets for h in a.hits]  # an answer is in a block read
    unanswerable = [unanswerable_of(q) for _, qs, _, _ in sets for q in qs]
    names = [name for name, qs, _, _ in sets for _ in qs]
    titles = [q.extra.get("title") for _, qs, _, _ in sets for q in qs]
    by_title = all(isinstance(t, str) for t in titles)
    # leave whole articles (or generated corpora) of one set out of each fit; else alternate halves
    groups = [f"{name}/{t}" if by_title else f"{name}/{i % 2}" for i, (name, t) in enumerate(zip(names, titles))]
    rule = (f"the lowest threshold at which at most {max_unanswerable:.0%} of each calibration set's unanswerable questions "
            "get an answer" if coverage is None else
            f"the highest threshold at which at least {coverage:.2%} of the questions' answerable ones get an answer"
            ) + ", on confidences cross-fitted leaving whole articles / generated corpora out"
    maps = {qa.kind: found_features(qa, signals)}
    if qa.kind == kinds.DEFAULT_KIND:
        maps["*"] = ANY_KIND  # the fallback for any other kind: the reader's own signals only
    report: dict = {"sets": {name: {"questions": len(qs), "unanswerable": sum(map(unanswerable_of, qs))} for name, qs, _, _ in sets},
                    "cross_fitted": "by article" if by_title else "by half", "rule": rule, "maps": {}}
    main_confidence = None
    for key, features in maps.items():
        def fit(rows, threshold=None, features=features):
            fitted_with = {"reader": qa.reader.fingerprint(), "k": qa.k, "questions": len(rows), "sets": sorted(report["sets"]),
                           "threshold_rule": rule, **({"threshold": threshold} if threshold is not None else {})}
            return fit_two_stage([signals[i] for i in rows], [found[i] for i in rows], [ems[i] for i in rows],
                                 found_features=features, fitted_with=fitted_with)

        crossed = cross_fitted(signals, fit, groups=groups)  # measured on questions (articles) the map did not see
        threshold = (choose_threshold(crossed, unanswerable, names, max_unanswerable=max_unanswerable) if coverage is None
                     else threshold_at_coverage(crossed[: len(questions)], unanswerable[: len(questions)], coverage))
        if threshold is None:
            threshold = map_threshold(qa.calibrations.for_kind(key))
            note = (f"no calibration question is marked unanswerable (\"unanswerable\": true): the {key} threshold stays "
                    f"{threshold}; add questions the corpus cannot answer to choose it" if coverage is None else
                    f"no question is answerable: the {key} threshold stays {threshold}; --coverage is a share of answerable ones")
            report.setdefault("notes", []).append(note)
            warnings.warn(RalmWarning(note))
        qa.calibrations = qa.calibrations.with_kind(key, fit(np.arange(len(ems)), threshold))
        report["maps"][key] = {"threshold": threshold, "by_set": {
            name: selective_at(crossed[np.array(names) == name], np.array(ems)[np.array(names) == name],
                               np.array(unanswerable)[np.array(names) == name], threshold) for name in report["sets"]}}
        if key == qa.kind:
            main_confidence = crossed[: len(questions)]
    return main_confidence, report
