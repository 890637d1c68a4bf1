"""Open-domain QA, retrieve then read: top-k blocks in, the most probable answer out, with evidence.

The answer is the text a with the highest p(a|x) = Σ_z p(z|x) Σ_{s in z, text(s) = a} exp f(s) / C:
p(z|x) is the softmax of the retrieval scores over the top-k (as in training), f the reader's
span scores, and C normalises over every valid span of every block read. One softmax shared by
the k blocks (not one per block) lets a block whose best span is weak lose to a confident one,
and an answer found in several blocks adds up (texts compared after SQuAD normalisation). On
held-out SQuAD questions this beats the best span of the best single block by 5.5 EM points
(dense retrieval; benchmarks/RESULTS.md, issue 22). A calibrated reader (models/confidence.py)
turns the answer's signals (p(a|x), the log-partition of that softmax, the retrieval scores of
each side and their agreement) into a confidence, P(correct), with the map fitted for the
retriever kind searched; below `min_confidence` the answer is withheld, "no answer found in the
corpus" (the best guess and the evidence are kept).

The CLI (`ask`, `eval qa`, `demo`), the server and evaluation (eval/openqa.py) all answer
through `OpenQA`; `OpenQA.open` loads it the way they do from an index directory and a run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ralm.data.qa import normalize_answer
from ralm.defaults import READ_K
from ralm.errors import RalmError
from ralm.models.confidence import MIN_CONFIDENCE, Calibrations
from ralm.models.reader import NEG, Reader, default_reader_path, is_reader_dir, top_spans, valid_spans
from ralm.retrieval.index.kinds import kind_of
from ralm.retrieval.index.store import IndexDir
from ralm.retrieval.search.live import LiveSearcher
from ralm.retrieval.search.searcher import Searcher, pick_sides
from ralm.retrieval.towers.encoders import Retriever, is_retriever_dir
from ralm.rundir import find_model
from ralm.runtime import autocast, resolve_dtype

N_BEST = 10  # spans per block that may add to an answer's probability


@dataclass(frozen=True)
class Evidence:
    row: int
    id: str
    title: str
    text: str
    retrieval_score: float  # raw score of the retriever (inner product, BM25, fused)
    retrieval_prob: float  # p(z|x) over the top-k
    span_text: str  # this block's best span; in the answer's block, the answer's span there
    span_prob: float  # p(that span | z, x)
    span: tuple[int, int] | None  # character offsets of that span in `text`
    found_by: tuple[str, ...] = ()  # the index's sides whose own top list held this block

    def to_json(self) -> dict:
        return {"id": self.id, "title": self.title, "text": self.text, "retrieval_score": round(self.retrieval_score, 6),
                "retrieval_prob": round(self.retrieval_prob, 6), "span_prob": round(self.span_prob, 6),
                "answer": self.span_text, "span": list(self.span) if self.span else None, "found_by": list(self.found_by)}


@dataclass(frozen=True)
class Answer:
    question: str
    answer: str  # "" when no answer is found (confidence below the threshold)
    score: float  # p(answer|x), summed over the blocks read (see the module's docstring)
    confidence: float | None  # calibrated P(correct) of the answer; None for an uncalibrated reader
    evidence: list[Evidence]  # in retrieval order; evidence[best], the block adding most to p(answer|x), holds it (even when withheld)
    best: int
    retrieved_rows: list[int]  # all retrieved rows (may be more than the k read)
    retrieved_texts: list[str]
    guess: str = ""  # the most probable answer, also when withheld ("" when no block had a span)
    retriever: str = ""  # the kind searched: hybrid, dense or bm25
    index_version: str = ""
    signals: dict = field(default_factory=dict)  # what the confidence is computed from (models/confidence.py)

    @property
    def no_answer(self) -> bool:
        return not self.answer

    def to_json(self) -> dict:
        return {"answer": self.answer, "no_answer": self.no_answer, "guess": self.guess, "score": round(self.score, 6),
                "confidence": None if self.confidence is None else round(self.confidence, 4),
                "retriever": self.retriever, "index_version": self.index_version,
                "evidence": [e.to_json() for e in self.evidence], "best": self.best}


class OpenQA:
    """A reader over a searcher: questions in, answers with evidence out. The searcher's every
    side is searched (fused) unless `retriever` picks one ("dense", "bm25")."""

    def __init__(self, reader: Reader, searcher: Searcher, k: int = READ_K, device: torch.device | None = None,
                 dtype: str | torch.dtype | None = None, min_confidence: float = MIN_CONFIDENCE, retriever: str | None = None):
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
        self.retriever = retriever
        self.kind = kind_of(pick_sides(searcher.sides, retriever, searcher.index.root))  # checks `retriever` now
        self.calibrations = Calibrations.from_json(reader.cfg.calibration, "reader config.json")

    @property
    def calibration(self):
        """The confidence map for the retriever kind searched (None: uncalibrated)."""
        return self.calibrations.for_kind(self.kind)

    def __repr__(self) -> str:
        return (f"OpenQA(k={self.k}, retriever={self.kind}, min_confidence={self.min_confidence}, calibrated="
                f"{self.calibration is not None}, device={self.device}, reader={self.reader!r}, searcher={self.searcher!r})")

    @classmethod
    def open(cls, index: str | os.PathLike, model: str | os.PathLike | None = None, k: int = READ_K,
             retriever: str | None = None, device: torch.device | None = None, dtype: str | torch.dtype | None = None,
             min_confidence: float = MIN_CONFIDENCE) -> "OpenQA":
        """The pipeline over the index directory `index`. `model`: a fine-tuning run (its reader,
        and its query tower where `open_searcher` says), a reader checkpoint, or None (the
        package's general-purpose reader); `retriever`: one side instead of all, fused."""
        device = device or torch.device("cpu")
        reader = Reader.from_pretrained(resolve_reader(model)).to(device)
        return cls(reader, open_searcher(index, model, device=device, dtype=dtype), k, device, dtype, min_confidence, retriever)

    @torch.inference_mode()
    def answer(self, questions: Sequence[str], retrieve: int | None = None) -> list[Answer]:
        """Read the top `k` blocks of each question; `retrieve` (>= k) blocks are fetched, for recall@k."""
        if isinstance(questions, str):
            raise RalmError("answer() takes a list of questions; wrap a single question in a list")
        if not questions:
            return []
        retrieve = max(retrieve or self.k, self.k)
        snap = self.searcher.current  # one version (and overlay) for retrieval and reading
        ranked = self.searcher.rank(list(questions), retrieve, snap, self.retriever)
        scores, rows = ranked.scores, ranked.rows  # [Q, R]
        blocks = snap.blocks
        k = min(self.k, rows.shape[1])
        records = [[blocks.record(int(r)) for r in qrows] for qrows in rows]
        # Whole blocks (up to the encoder's positions), not the training window, which would hide
        # the tail of every long block from the reader.
        batch = self.reader.featurize([q for q in questions for _ in range(k)], [rec["text"] for qrec in records for rec in qrec[:k]],
                                      max_len=self.reader.max_read_len)
        dev_batch = batch.to(self.device)
        with autocast(self.device, self.dtype):
            span_scores = self.reader(dev_batch)  # [Q*k, L, W]
        valid = valid_spans(dev_batch, self.reader.cfg.max_span_width)
        f, start, width, log_norm = (t.cpu() for t in top_spans(span_scores, valid, N_BEST))  # [Q*k, n] x3, [Q*k]
        p_z = torch.softmax(torch.from_numpy(np.asarray(scores[:, :k], dtype=np.float32)), -1)  # [Q, k]
        out = []
        for qi, question in enumerate(questions):
            pairs = range(qi * k, qi * k + k)  # this question's (question, block) pairs, block j at pairs[j]
            texts = [[self.reader.span_text(batch, n, int(start[n, r]), int(width[n, r]))
                      if batch.evidence_end[n] > batch.evidence_start[n] and f[n, r] > NEG / 2 else None
                      for r in range(f.shape[1])] for n in pairs]
            log_pz = torch.log(p_z[qi])
            score, best, shown = pick_answer(log_pz, f[pairs.start : pairs.stop], log_norm[pairs.start : pairs.stop], texts)
            evidence = []
            for j, n in enumerate(pairs):
                rec, r = records[qi][j], shown[j]
                text, span = texts[j][r] if r is not None else ("", None)
                span_prob = float((f[n, r] - log_norm[n]).exp()) if r is not None else 0.0
                evidence.append(Evidence(int(rows[qi, j]), rec["id"], rec["title"], rec["text"], float(scores[qi, j]),
                                         float(p_z[qi, j]), text, span_prob, span, ranked.found_by[qi][j]))
            signals = {"score": score,
                       "log_partition": float(torch.logsumexp(log_pz + log_norm[pairs.start : pairs.stop], 0)),
                       "retrieval_entropy": float(-(p_z[qi] * log_pz).sum()),
                       "agreement": float(ranked.agreement[qi]) if ranked.agreement is not None else None,
                       **{f"top_{side}": float(top[qi]) for side, top in ranked.top.items()}}
            confidence = None if self.calibration is None else float(self.calibration.of_signals([signals])[0])
            guess = evidence[best].span_text if best is not None else ""
            withheld = best is None or (confidence is not None and confidence < self.min_confidence)
            out.append(Answer(question, "" if withheld else guess, score, confidence, evidence, best or 0,
                              [int(r) for r in rows[qi]], [r["text"] for r in records[qi]], guess, self.kind, snap.name, signals))
        return out


def pick_answer(log_pz: torch.Tensor, f: torch.Tensor, log_norm: torch.Tensor,
                texts: list[list[tuple[str, tuple[int, int]] | None]]) -> tuple[float, int | None, list[int | None]]:
    """The most probable answer of one question (see the module's docstring).

    log_pz [k]: log p(z|x); f [k, n]: each block's n best span scores; log_norm [k]: log Σ exp f
    over each block's valid spans; texts[j][r]: (text, char span) of span r of block j, None where
    there is no such span, in descending score order. Spans whose text normalises to "" are
    skipped. Returns (p(answer|x), the block adding most to it (None: no span at all), the span
    each block shows: its best, except the answer's block, which shows the answer).
    """
    log_w = log_pz - torch.logsumexp(log_pz + log_norm, 0)  # [k]: a shared softmax over all blocks' spans
    keys = {(j, r): normalize_answer(t[0]) for j, row in enumerate(texts) for r, t in enumerate(row) if t}
    # a span that normalises to nothing ("the", ",") is no answer: it neither wins nor pools mass
    joint = {(j, r): float((log_w[j] + f[j, r]).exp()) for (j, r), key in keys.items() if key}
    shown = [next((r for r in range(len(row)) if (j, r) in joint), None) for j, row in enumerate(texts)]  # spans come best first
    mass: dict[str, float] = {}
    for jr, p in joint.items():
        mass[keys[jr]] = mass.get(keys[jr], 0.0) + p
    if not mass:
        return 0.0, None, shown
    answer = max(mass, key=mass.get)
    best_j, best_r = max((jr for jr in joint if keys[jr] == answer), key=joint.get)
    shown[best_j] = best_r
    return mass[answer], best_j, shown


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


def open_searcher(index: str | os.PathLike, model: str | os.PathLike | None = None, *, device: torch.device | None = None,
                  dtype: str | torch.dtype | None = None) -> LiveSearcher:
    """The searcher for `index`, over every side it holds and its live updates (`ralm index
    add/delete`, the server's /documents). Its dense side uses the run's fine-tuned query tower
    (RUN/final/retriever) when it was built with that run's document tower, else its own."""
    device = device or torch.device("cpu")
    idx = IndexDir(index)
    candidate = find_model(model, "retriever", is_retriever_dir) if model is not None else None
    tuned = None
    if "dense" in idx.sides and candidate is not None:
        tuned = Retriever.from_pretrained(candidate)  # loaded once: fingerprinted, then searched with
        if tuned.doc_fingerprint() != idx.version(idx.latest()).doc_fingerprint:
            tuned = None
    return LiveSearcher(Searcher(idx, tuned.to(device).eval() if tuned is not None else None, device, dtype=dtype))
