"""Open-domain QA evaluation: answer a question file through the pipeline (ralm/pipeline.py),
then EM/F1 (SQuAD v1.1, max over gold answers) of every question's best answer, withheld or
not, the share answered at the pipeline's threshold and their EM, and retrieval recall@k;
optionally fit the confidence map of the kind searched on these questions (which may
mix answerable ones and ones the corpus cannot answer) and report its reliability, measured on
questions each map was not fitted on."""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np

from ralm.atomic import atomic_path
from ralm.data.qa import Question, has_answer
from ralm.defaults import QA_BATCH
from ralm.errors import RalmWarning
from ralm.eval.calibration import (auroc, check_fittable, check_question_count, cross_fitted, fit_two_stage, reliability,
                                   risk_coverage, side_features)
from ralm.eval.metrics import exact_match, f1, recall_at_k
from ralm.eval.retrieval import warn_if_no_answer_retrieved
from ralm.models.confidence import FOUND
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


def evaluate_qa(qa: OpenQA, questions: Sequence[Question], *, ks: Sequence[int] = (1, 5, 20), batch_size: int = QA_BATCH,
                predictions: Path | None = None, show_progress: bool = True, calibrate: bool = False) -> dict:
    """EM / F1 (percentages, max over gold answers) of the best answer (also when the threshold
    withholds it), `answered` (% of questions answered at `qa.min_confidence`) and
    `answered_em` (EM over those), and recall@k; per-question JSONL to `predictions`.
    `calibrate` fits the confidence map of `qa`'s kind on these questions; with a
    calibration the result holds reliability bins and each prediction its confidence."""
    if calibrate:
        check_question_count(len(questions))
    ems, f1s, hits, rows, signals = [], [], [], [], []
    start = time.perf_counter()
    with progress_bar(show_progress) as bar:
        task = bar.add_task("answering", total=len(questions))
        for i in range(0, len(questions), batch_size):
            chunk = questions[i : i + batch_size]
            for q, a in zip(chunk, qa.answer([q.question for q in chunk], retrieve=max(ks))):
                best = a.evidence[a.best]
                em, f = exact_match(best.span_text, q.answers), f1(best.span_text, q.answers)
                ems.append(em)
                f1s.append(f)
                signals.append(a.signals)
                # a block counts when its text holds an answer, as in `ralm eval retrieval`
                hits.append([has_answer(t, q.answers) for t in a.retrieved_texts])
                rows.append({"id": q.id, "question": q.question, "answers": list(q.answers), "prediction": best.span_text,
                             "score": round(a.score, 6), "em": em, "f1": round(f, 4), "evidence_id": best.id,
                             "evidence_title": best.title, "retrieval_prob": round(best.retrieval_prob, 6),
                             "span_prob": round(best.span_prob, 6), "answer_in_read": any(hits[-1][: qa.k]),
                             "read": [e.id for e in a.evidence], "signals": {k: v if v is None else round(v, 6)
                                                                               for k, v in a.signals.items()}})
            bar.advance(task, len(chunk))
    warn_if_no_answer_retrieved(hits, qa.searcher, max(max(ks), qa.k))
    n = max(len(questions), 1)
    result = {"em": round(100 * sum(ems) / n, 2), "f1": round(100 * sum(f1s) / n, 2),
              **{key: round(v, 2) for key, v in recall_at_k(hits, ks).items()},
              "questions": len(questions), "k": qa.k, "seconds": round(time.perf_counter() - start, 2)}
    confidence = None
    if calibrate:
        check_fittable(ems)
        found = [float(any(h[: qa.k])) for h in hits]  # an answer is in a block read
        fitted_with = {"reader": qa.reader.fingerprint(), "k": qa.k, "questions": len(ems)}
        features = found_features(qa, signals)

        def fit(rows):
            return fit_two_stage([signals[i] for i in rows], [found[i] for i in rows], [ems[i] for i in rows],
                                 found_features=features, fitted_with=fitted_with)

        titles = [q.extra.get("title") for q in questions]
        groups = titles if all(isinstance(t, str) for t in titles) else None
        confidence = cross_fitted(signals, fit, groups=groups)  # measured on questions (articles) the map did not see
        qa.calibrations = qa.calibrations.with_kind(qa.kind, fit(np.arange(len(ems))))
        result["reliability"] = {**reliability(confidence, ems), "cross_fitted": "by article" if groups else "by half"}
    elif qa.calibration is not None:
        confidence = qa.calibration.of_signals(signals)
        result["reliability"] = reliability(confidence, ems)
    answered = [c >= qa.min_confidence for c in confidence] if confidence is not None else [True] * len(ems)
    for i, row in enumerate(rows):
        row["no_answer"] = not answered[i]
        if confidence is not None:
            row["confidence"] = round(float(confidence[i]), 4)
    n_answered = sum(answered)
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
