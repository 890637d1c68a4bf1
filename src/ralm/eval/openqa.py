"""Open-domain QA evaluation: answer a question file through the pipeline (ralm/pipeline.py),
then EM/F1 (SQuAD v1.1, max over gold answers) and retrieval recall@k; optionally fit the
reader's confidence calibration on these questions and report its reliability."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Sequence

from ralm.atomic import atomic_path
from ralm.data.qa import Question, has_answer
from ralm.eval.calibration import fit_isotonic, reliability
from ralm.eval.metrics import exact_match, f1, recall_at_k
from ralm.eval.retrieval import warn_if_no_answer_retrieved
from ralm.pipeline import OpenQA
from ralm.progress import progress_bar


def default_predictions_path(questions: str | os.PathLike, index: str | os.PathLike,
                             hybrid: str | os.PathLike | None = None) -> Path:
    """./<questions>-<index>[-hybrid-<bm25>].predictions.jsonl: the current directory, never a
    model's or an index's folder (a shared or read-only model must not be written into)."""
    name = f"{Path(questions).stem}-{Path(index).name}" + (f"-hybrid-{Path(hybrid).name}" if hybrid else "")
    return Path(f"{name}.predictions.jsonl")


def evaluate_qa(qa: OpenQA, questions: Sequence[Question], ks: Sequence[int] = (1, 5, 20), batch_size: int = 8,
                predictions: Path | None = None, show_progress: bool = True, calibrate: bool = False) -> dict:
    """EM / F1 (percentages, max over gold answers) and recall@k of the best span (also when the
    threshold would withhold it); per-question JSONL to `predictions`. `calibrate` fits
    `qa.calibration` on these questions (raw score -> exact match); with a calibration the
    result holds reliability bins and each prediction its confidence."""
    ems, f1s, hits, rows, raw = [], [], [], [], []
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
                raw.append(a.score)
                # a block counts when its text holds an answer, as in `ralm eval retrieval`
                hits.append([has_answer(t, q.answers) for t in a.retrieved_texts])
                rows.append({"id": q.id, "question": q.question, "answers": list(q.answers), "prediction": best.span_text,
                             "score": round(a.score, 6), "em": em, "f1": round(f, 4), "evidence_id": best.id,
                             "evidence_title": best.title, "retrieval_prob": round(best.retrieval_prob, 6),
                             "span_prob": round(best.span_prob, 6), "answer_in_read": any(hits[-1][: qa.k]),
                             "read": [e.id for e in a.evidence]})
            bar.advance(task, len(chunk))
    warn_if_no_answer_retrieved(hits, qa.searcher, max(max(ks), qa.k))
    n = max(len(questions), 1)
    result = {"em": round(100 * sum(ems) / n, 2), "f1": round(100 * sum(f1s) / n, 2),
              **{key: round(v, 2) for key, v in recall_at_k(hits, ks).items()},
              "questions": len(questions), "k": qa.k, "seconds": round(time.perf_counter() - start, 2)}
    if calibrate:
        qa.calibration = fit_isotonic(raw, ems)
    if qa.calibration is not None:
        confidence = qa.calibration(raw)
        for row, c in zip(rows, confidence):
            row["confidence"] = round(float(c), 4)
        result["reliability"] = reliability(confidence, ems)
    if predictions is not None:
        with atomic_path(predictions) as tmp:
            tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return result
