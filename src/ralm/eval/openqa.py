"""Open-domain QA: retrieve top-k blocks, read each, answer with the best span overall.

For each retrieved block z the reader's best span s_z is taken; the answer is the s_z with
the highest p(z|x)·p(s_z|z,x), where p(z|x) is the softmax of the retrieval scores over the
top-k (as in training) and p(s|z,x) the reader's softmax over the spans of z.
A calibrated reader (eval/calibration.py) turns that raw score into a confidence, P(correct);
below `min_confidence` the answer is "no answer found in the corpus" (the evidence is kept).
`evaluate_qa` adds EM/F1 (SQuAD v1.1, max over gold answers) and retrieval recall@k.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ralm.atomic import atomic_path
from ralm.data.qa import Question, has_answer
from ralm.errors import RalmError
from ralm.eval.calibration import MIN_CONFIDENCE, Calibration, fit_isotonic, reliability
from ralm.eval.metrics import exact_match, f1, recall_at_k
from ralm.eval.retrieval import warn_if_no_answer_retrieved
from ralm.models.reader import Reader, best_spans, default_reader_path, is_reader_dir, valid_spans
from ralm.progress import progress_bar
from ralm.retrieval.encoders import Retriever, is_retriever_dir
from ralm.retrieval.hybrid import HybridSearcher
from ralm.retrieval.searcher import Searcher
from ralm.retrieval.store import IndexDir
from ralm.runtime import autocast, resolve_dtype


@dataclass(frozen=True)
class Evidence:
    row: int
    id: str
    title: str
    text: str
    retrieval_score: float  # raw score of the retriever (inner product, BM25, fused)
    retrieval_prob: float  # p(z|x) over the top-k
    span_text: str
    span_prob: float  # p(best span | z, x)
    span: tuple[int, int] | None  # character offsets of the best span in `text`

    def to_json(self) -> dict:
        return {"id": self.id, "title": self.title, "text": self.text, "retrieval_score": round(self.retrieval_score, 6),
                "retrieval_prob": round(self.retrieval_prob, 6), "span_prob": round(self.span_prob, 6),
                "answer": self.span_text, "span": list(self.span) if self.span else None}


@dataclass(frozen=True)
class Answer:
    question: str
    answer: str  # "" when no answer is found (confidence below the threshold)
    score: float  # p(z|x)·p(span|z,x) of the chosen span
    confidence: float | None  # calibrated P(correct) of that span; None for an uncalibrated reader
    evidence: list[Evidence]  # in retrieval order; evidence[best] holds the best span (even when withheld)
    best: int
    retrieved_rows: list[int]  # all retrieved rows (may be more than the k read)
    retrieved_texts: list[str]

    @property
    def no_answer(self) -> bool:
        return not self.answer

    def to_json(self) -> dict:
        return {"answer": self.answer, "no_answer": self.no_answer, "score": round(self.score, 6),
                "confidence": None if self.confidence is None else round(self.confidence, 4),
                "evidence": [e.to_json() for e in self.evidence], "best": self.best}


class OpenQA:
    """A reader over a searcher (dense, BM25 or hybrid): questions in, answers with evidence out."""

    def __init__(self, reader: Reader, searcher: Searcher | HybridSearcher, k: int = 5,
                 device: torch.device | None = None, dtype: str | torch.dtype | None = None,
                 min_confidence: float = MIN_CONFIDENCE):
        if k <= 0:
            raise RalmError(f"k must be a positive integer, got {k}")
        if not 0 <= min_confidence <= 1:
            raise RalmError(f"--min-confidence must be in [0, 1], got {min_confidence}")
        self.reader = reader.eval()
        self.searcher = searcher
        self.k = k
        self.device = device or torch.device("cpu")
        self.dtype = resolve_dtype(dtype, self.device)
        self.min_confidence = min_confidence
        cal = reader.cfg.calibration
        self.calibration = Calibration.from_json(cal, "reader config.json") if cal else None

    @torch.inference_mode()
    def answer(self, questions: Sequence[str], retrieve: int | None = None) -> list[Answer]:
        """Read the top `k` blocks of each question; `retrieve` (>= k) blocks are fetched, for recall@k."""
        retrieve = max(retrieve or self.k, self.k)
        scores, rows = self.searcher.search_rows(list(questions), retrieve)  # [Q, R]
        blocks = self.searcher.current.blocks
        k = min(self.k, rows.shape[1])
        records = [[blocks.record(int(r)) for r in qrows] for qrows in rows]
        batch = self.reader.featurize([q for q in questions for _ in range(k)], [rec["text"] for qrec in records for rec in qrec[:k]])
        dev_batch = batch.to(self.device)
        with autocast(self.device, self.dtype):
            span_scores = self.reader(dev_batch)  # [Q*k, L, W]
        valid = valid_spans(dev_batch, self.reader.cfg.max_span_width)
        start, width, log_p_span = (t.cpu() for t in best_spans(span_scores, valid))  # [Q*k] each
        p_z = torch.softmax(torch.from_numpy(np.asarray(scores[:, :k], dtype=np.float32)), -1)  # [Q, k]
        out = []
        for qi, question in enumerate(questions):
            evidence = []
            for j in range(k):
                n = qi * k + j
                rec = records[qi][j]
                has_span = int(batch.evidence_end[n]) > int(batch.evidence_start[n])
                text, span = self.reader.span_text(batch, n, int(start[n]), int(width[n])) if has_span else ("", None)
                evidence.append(Evidence(int(rows[qi, j]), rec["id"], rec["title"], rec["text"], float(scores[qi, j]),
                                         float(p_z[qi, j]), text, float(log_p_span[n].exp()) if has_span else 0.0, span))
            joint = [e.retrieval_prob * e.span_prob for e in evidence]
            best = int(np.argmax(joint))
            confidence = None if self.calibration is None else float(self.calibration(joint[best]))
            withheld = confidence is not None and confidence < self.min_confidence
            out.append(Answer(question, "" if withheld else evidence[best].span_text, joint[best], confidence, evidence,
                              best, [int(r) for r in rows[qi]], [r["text"] for r in records[qi]]))
        return out


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


# -- loading a fine-tuned run against an index ------------------------------------------------

def resolve_reader(model: str | os.PathLike | None) -> Path:
    """RUN (uses RUN/final/reader), a reader checkpoint directory, or None: the package's
    general-purpose reader."""
    if model is None:
        return default_reader_path()
    path = Path(model)
    for candidate in (path / "final" / "reader", path):
        if is_reader_dir(candidate):
            return candidate
    raise RalmError(f"--model {model}: neither a fine-tuning run (RUN/final/reader) nor a reader checkpoint; "
                    "train one with `ralm finetune`")


def open_searcher(index: str | os.PathLike, model: str | os.PathLike | None = None, hybrid: str | os.PathLike | None = None,
                  alpha: float = 0.5, device: torch.device | None = None,
                  dtype: str | torch.dtype | None = None) -> Searcher | HybridSearcher:
    """The searcher for `index`. A dense index uses the run's fine-tuned query tower
    (RUN/final/retriever) when it was built with that run's document tower, else its own
    retriever. `hybrid` names a BM25 index over the same blocks to fuse with."""
    device = device or torch.device("cpu")
    retriever = None
    if model is not None and IndexDir(index).kind == "dense":
        candidate = Path(model) / "final" / "retriever"
        if is_retriever_dir(candidate):
            idx = IndexDir(index)
            built_with = idx.version_manifest(idx.latest())["doc_fingerprint"]
            if Retriever.from_pretrained(candidate).doc_fingerprint() == built_with:
                retriever = str(candidate)
    searcher = Searcher.open(index, model=retriever, device=device, dtype=dtype)
    if hybrid is None:
        return searcher
    return HybridSearcher(searcher, Searcher.open(hybrid, device=device, dtype=dtype), alpha=alpha)
