"""Open-domain QA, retrieve then read: top-k blocks in, the best span overall out, with evidence.

For each retrieved block z the reader's best span s_z is taken; the answer is the s_z with
the highest p(z|x)·p(s_z|z,x), where p(z|x) is the softmax of the retrieval scores over the
top-k (as in training) and p(s|z,x) the reader's softmax over the spans of z.
A calibrated reader (models/confidence.py) turns that raw score into a confidence, P(correct);
below `min_confidence` the answer is "no answer found in the corpus" (the evidence is kept).

The CLI (`ask`, `eval qa`, `demo`), the server and evaluation (eval/openqa.py) all answer
through `OpenQA`; `OpenQA.open` loads it the way they do from an index directory and a run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ralm.errors import RalmError
from ralm.models.confidence import MIN_CONFIDENCE, Calibration
from ralm.models.reader import Reader, best_spans, default_reader_path, is_reader_dir, valid_spans
from ralm.retrieval.encoders import Retriever, is_retriever_dir
from ralm.retrieval.hybrid import HybridSearcher
from ralm.retrieval.searcher import Searcher
from ralm.retrieval.store import IndexDir
from ralm.rundir import final_dir, find_model
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
            raise RalmError(f"the minimum confidence must be in [0, 1], got {min_confidence}")
        self.reader = reader.eval()
        self.searcher = searcher
        self.k = k
        self.device = device or torch.device("cpu")
        self.dtype = resolve_dtype(dtype, self.device)
        self.min_confidence = min_confidence
        cal = reader.cfg.calibration
        self.calibration = Calibration.from_json(cal, "reader config.json") if cal else None

    @classmethod
    def open(cls, index: str | os.PathLike, model: str | os.PathLike | None = None, k: int = 5,
             hybrid: str | os.PathLike | None = None, alpha: float = 0.5, device: torch.device | None = None,
             dtype: str | torch.dtype | None = None, min_confidence: float = MIN_CONFIDENCE) -> "OpenQA":
        """The pipeline over the index directory `index`. `model`: a fine-tuning run (its reader,
        and its query tower where `open_searcher` says), a reader checkpoint, or None (the
        package's general-purpose reader); `hybrid`: a BM25 index to fuse with (`alpha`: dense weight)."""
        device = device or torch.device("cpu")
        reader = Reader.from_pretrained(resolve_reader(model)).to(device)
        return cls(reader, open_searcher(index, model, hybrid, alpha, device, dtype), k, device, dtype, min_confidence)

    @torch.inference_mode()
    def answer(self, questions: Sequence[str], retrieve: int | None = None) -> list[Answer]:
        """Read the top `k` blocks of each question; `retrieve` (>= k) blocks are fetched, for recall@k."""
        if isinstance(questions, str):
            raise RalmError("answer() takes a list of questions; wrap a single question in a list")
        if not questions:
            return []
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


# -- loading a fine-tuned run against an index ------------------------------------------------

def resolve_reader(model: str | os.PathLike | None) -> Path:
    """RUN (uses RUN/final/reader), a reader checkpoint directory, or None: the package's
    general-purpose reader."""
    if model is None:
        return default_reader_path()
    found = find_model(model, "reader", is_reader_dir)
    if found is not None:
        return found
    raise RalmError(f"{model}: neither a fine-tuning run (RUN/final/reader) nor a reader checkpoint; "
                    "train one with `ralm finetune`")


def open_searcher(index: str | os.PathLike, model: str | os.PathLike | None = None, hybrid: str | os.PathLike | None = None,
                  alpha: float = 0.5, device: torch.device | None = None,
                  dtype: str | torch.dtype | None = None) -> Searcher | HybridSearcher:
    """The searcher for `index`. A dense index uses the run's fine-tuned query tower
    (RUN/final/retriever) when it was built with that run's document tower, else its own
    retriever. `hybrid` names a BM25 index over the same blocks to fuse with."""
    device = device or torch.device("cpu")
    idx = IndexDir(index)
    searcher = None
    candidate = final_dir(model, "retriever") if model is not None else None
    if idx.kind == "dense" and candidate is not None and is_retriever_dir(candidate):
        tuned = Retriever.from_pretrained(candidate)  # loaded once: fingerprinted, then searched with
        if tuned.doc_fingerprint() == idx.version_manifest(idx.latest())["doc_fingerprint"]:
            searcher = Searcher(idx, tuned.to(device).eval(), device, dtype=dtype)
    searcher = searcher or Searcher.open(index, device=device, dtype=dtype)
    if hybrid is None:
        return searcher
    return HybridSearcher(searcher, Searcher.open(hybrid, device=device, dtype=dtype), alpha=alpha)
