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
kind searched; below `min_confidence` the answer is withheld, "no answer found in the
corpus" (the best guess and the evidence are kept); by default `min_confidence` is each map's
own threshold, chosen when it was fitted (`ralm eval qa --calibrate`), so `side="dense"`
withholds at the dense map's. What a question is searched and answered with (k blocks read,
the side(s), the fusion, `min_confidence`) is one QueryConfig (retrieval/search/query.py),
the searcher's unless one is given; the server passes each request's own to `answer`.

The CLI (`ask`, `eval qa`, `demo`), the server and evaluation (eval/openqa.py) all answer
through `OpenQA`; `OpenQA.open` loads it the way they do from an index directory and a run. Its
reading step is two functions, `read_blocks` (the reader over (question, block) pairs) and
`pick_answer` (one question's answer and signals from its blocks read), which studies of reading
settings call directly (benchmarks/qa/qa_settings.py reads once and picks under many settings).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np
import torch

from ralm.data.qa import name_coverage, normalize_answer, question_coverage
from ralm.data.reader_features import ReaderBatch, answer_context, valid_spans
from ralm.defaults import READ_K
from ralm.errors import RalmError
from ralm.models.confidence import Calibrations, check_fitted_with, map_threshold
from ralm.models.reader import NEG, Reader, default_reader_path, is_reader_dir, top_spans
from ralm.renamed import renamed_keywords
from ralm.retrieval.index.kinds import kind_of
from ralm.retrieval.index.store import IndexDir
from ralm.retrieval.search.live import LiveSearcher
from ralm.retrieval.search.query import QueryConfig
from ralm.retrieval.search.searcher import Searcher, pick_sides
from ralm.retrieval.towers.encoders import is_retriever_dir
from ralm.rundir import find_model
from ralm.runtime import Runtime, autocast

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
    kind: str = ""  # what was searched: hybrid, dense or bm25
    index_version: str = ""
    signals: dict = field(default_factory=dict)  # what the confidence is computed from (models/confidence.py)

    @property
    def no_answer(self) -> bool:
        return not self.answer

    def to_json(self) -> dict:
        return {"question": self.question, "answer": self.answer, "no_answer": self.no_answer, "guess": self.guess,
                "score": round(self.score, 6),
                "confidence": None if self.confidence is None else round(self.confidence, 4),
                "kind": self.kind, "retriever": self.kind, "index_version": self.index_version,
                "evidence": [e.to_json() for e in self.evidence], "best": self.best}


class OpenQA:
    """A reader over a searcher: questions in, answers with evidence out, as its QueryConfig
    says: the searcher's every side is searched (fused) unless `side` picks one ("dense",
    "bm25"), and `k` blocks are read (None: READ_K)."""

    @renamed_keywords(retriever="side")
    def __init__(self, reader: Reader, searcher: Searcher, *, query: QueryConfig | None = None, runtime: Runtime | None = None,
                 k: int | None = None, min_confidence: float | None = None, side: str | None = None,
                 device: torch.device | None = None, dtype: str | torch.dtype | None = None):
        """`query`: how questions are searched and answered (None: the searcher's); `k`, `side`,
        `min_confidence`: set on it (the older spelling). `runtime`: where the reader reads
        (None: the searcher's); `device`/`dtype`: the older spelling of it (`Runtime.of`)."""
        self.reader = reader.eval()
        self.searcher = searcher
        self.query = (query or searcher.query).given(k=k, side=side, min_confidence=min_confidence)
        if runtime is None and device is None and dtype is None:
            runtime = searcher.runtime
        self.runtime = Runtime.of(runtime, device=device, dtype=dtype)  # what it reads with (`read_blocks`)
        self.device, self.dtype = self.runtime.device, self.runtime.dtype  # the runtime's, for those who read them
        self.calibrations = Calibrations.from_json(reader.cfg.calibration, "reader config.json")
        self._reading(self.query, searcher.sides, check=True)  # checks `side` now, and the map against the reader and k

    @property
    def k(self) -> int:
        """Blocks read per question."""
        return self.query.k or READ_K

    @property
    def side(self) -> str | None:
        return self.query.side

    @property
    def min_confidence(self) -> float | None:
        return self.query.min_confidence

    @property
    def kind(self) -> str:
        """What is searched (hybrid, dense, bm25), of the sides the index holds now."""
        return self._reading(self.query, self.searcher.sides)[0]

    @property
    def calibration(self):
        """The confidence map for the kind searched (None: uncalibrated)."""
        return self.calibrations.for_kind(self.kind)

    @property
    def threshold(self) -> float:
        """The confidence below which an answer is withheld: `min_confidence` when given, else the
        threshold the kind's map was fitted with (each side its own), else MIN_CONFIDENCE."""
        return self._reading(self.query, self.searcher.sides)[2]

    def _reading(self, query: QueryConfig, sides: tuple[str, ...], *, check: bool = False) -> tuple[str, object, float]:
        """(the kind `query` searches of `sides`, its confidence map or None, the threshold it is
        withheld below). With `check`, a map fitted with another reader or k warns, once."""
        kind = kind_of(pick_sides(tuple(sides), query.side, self.searcher.index.root))
        calibration = self.calibrations.for_kind(kind)
        if check and calibration is not None:
            check_fitted_with(calibration, kind=kind, reader=self._fingerprint, k=query.k or READ_K)
        threshold = query.min_confidence if query.min_confidence is not None else map_threshold(calibration)
        return kind, calibration, threshold

    @cached_property
    def _fingerprint(self) -> str:
        return self.reader.fingerprint()

    def __repr__(self) -> str:
        return (f"OpenQA(k={self.k}, kind={self.kind}, threshold={self.threshold}, calibrated="
                f"{self.calibration is not None}, device={self.device}, reader={self.reader!r}, searcher={self.searcher!r})")

    @classmethod
    @renamed_keywords(retriever="side")
    def open(cls, index: str | os.PathLike, model: str | os.PathLike | None = None, *, query: QueryConfig | None = None,
             runtime: Runtime | None = None, k: int | None = None, side: str | None = None,
             min_confidence: float | None = None, device: torch.device | None = None,
             dtype: str | torch.dtype | None = None) -> "OpenQA":
        """The pipeline over the index directory `index`. `model`: a fine-tuning run (its reader,
        and its query tower where `open_searcher` says), a reader checkpoint, or None (the
        package's general-purpose reader); `query`: how questions are searched and answered
        (None: QueryConfig()'s: READ_K blocks read over every side, fused), held by the searcher
        too; `k`, `side`, `min_confidence`: set on it (the older spelling); `runtime`: where and
        how it computes (None: the CPU, auto dtype; `device`/`dtype`, the older spelling, still
        work), resolved here once for the reader and the searcher."""
        rt = Runtime.of(runtime, device=device, dtype=dtype)
        query = (query or QueryConfig()).given(k=k, side=side, min_confidence=min_confidence)
        reader = Reader.from_pretrained(resolve_reader(model)).to(rt.device)
        return cls(reader, open_searcher(index, model, query=query, runtime=rt), runtime=rt)

    @torch.inference_mode()
    def answer(self, questions: Sequence[str], retrieve: int | None = None, *, query: QueryConfig | None = None) -> list[Answer]:
        """Read the top k blocks of each question, searched and answered as `query` (None: this
        OpenQA's) says; `retrieve` (>= k) blocks are fetched, for recall@k."""
        if isinstance(questions, str):
            raise RalmError("answer() takes a list of questions; wrap a single question in a list")
        if not questions:
            return []
        query = query or self.query
        read_k = query.k or READ_K
        retrieve = max(retrieve or read_k, read_k)
        snap = self.searcher.current  # one version (and overlay) for retrieval and reading
        kind, calibration, threshold = self._reading(query, tuple(snap.sides), check=query is not self.query)
        ranked = self.searcher.rank(list(questions), retrieve, snap, query=query)
        scores, rows = ranked.scores, ranked.rows  # [Q, R]
        blocks = snap.blocks
        log_blocks = math.log(max(len(blocks), 1))  # the corpus size, which the sides' top scores grow with
        k = min(read_k, rows.shape[1])
        records = [[blocks.record(int(r)) for r in qrows] for qrows in rows]
        read = read_blocks(self.reader, [q for q in questions for _ in range(k)],
                           [rec["text"] for qrec in records for rec in qrec[:k]],
                           titles=[rec["title"] for qrec in records for rec in qrec[:k]], runtime=self.runtime)
        log_pz = torch.log_softmax(torch.from_numpy(np.asarray(scores[:, :k], dtype=np.float32)), -1)  # [Q, k]
        readings = [pick_answer(log_pz[qi], read[qi * k : qi * k + k]) for qi in range(len(questions))]
        checks = check_answers(self.reader, questions, readings, [qrec[:k] for qrec in records], runtime=self.runtime)
        out = []
        for qi, question in enumerate(questions):
            mine, reading = read[qi * k : qi * k + k], readings[qi]  # this question's blocks, in retrieval order
            evidence = []
            for j, (block, r) in enumerate(zip(mine, reading.shown)):
                rec, span = records[qi][j], block.spans[r] if r is not None else None
                evidence.append(Evidence(int(rows[qi, j]), rec["id"], rec["title"], rec["text"], float(scores[qi, j]),
                                         float(log_pz[qi, j].exp()), span.text if span else "",
                                         math.exp(span.score - block.log_norm) if span else 0.0,
                                         span.offsets if span else None, ranked.found_by[qi][j]))
            signals = {**reading.signals, **checks[qi],
                       "agreement": float(ranked.agreement[qi]) if ranked.agreement is not None else None,
                       **{f"top_{side}": float(top[qi]) for side, top in ranked.top.items()}, "log_blocks": log_blocks}
            confidence = None if calibration is None else float(calibration.of_signals([signals])[0])
            withheld = reading.best is None or (confidence is not None and confidence < threshold)
            out.append(Answer(question, "" if withheld else reading.answer, reading.score, confidence, evidence, reading.best or 0,
                              [int(r) for r in rows[qi]], [r["text"] for r in records[qi]], reading.answer, kind,
                              snap.name, signals))
        return out


# -- reading: blocks in, one question's answer out ----------------------------------------------

class Span(NamedTuple):
    score: float  # the reader's span score f(s)
    text: str
    offsets: tuple[int, int] | None  # character offsets of the span in the block's text


@dataclass(frozen=True)
class ReadBlock:
    """What the reader found in one block for one question: all any answer needs."""
    spans: list[Span]  # the block's N_BEST highest-scoring valid spans, best first
    log_norm: float  # log Σ exp f over every valid span of the block, so blocks can share one softmax
    null: float | None = None  # the block's null-span score g ("no answer here"), for readers trained with one


@dataclass(frozen=True)
class Reading:
    """One question's answer over the blocks read (see the module's docstring)."""
    answer: str  # the most probable answer as its best block shows it ("" when no block had a span)
    score: float  # p(answer|x)
    best: int | None  # the block adding most to p(answer|x) (None: no span at all)
    shown: list[int | None]  # the span each block shows: its best, except the answer's block, which shows the answer
    signals: dict  # p(answer|x), the log-partition of the shared softmax, the entropy of p(z|x)
    span_offsets: tuple[int, int] | None = None  # the answer's character span in its best block's text


def read_blocks(reader: Reader, questions: Sequence[str], texts: Sequence[str], *, titles: Sequence[str] | None = None,
                runtime: Runtime | None = None, device: torch.device | str | None = None,
                dtype: str | torch.dtype | None = None) -> list[ReadBlock]:
    """Read block texts[n] (titled titles[n]) for questions[n] (N pairs), each block whole (up
    to the encoder's positions), not the training window, which would hide the tail of every
    long block. `runtime`: where the reader (already there) reads and its compute dtype (None:
    the CPU, auto dtype; the older `device`/`dtype` still work, see `Runtime.of`)."""
    rt = Runtime.of(runtime, device=device, dtype=dtype)
    batch = reader.featurizer.featurize(questions, texts, max_len=reader.featurizer.max_read_len, titles=titles)
    return read_batch(reader, batch, runtime=rt)


def check_answers(reader: Reader, questions: Sequence[str], readings: Sequence["Reading"], records: Sequence[Sequence[dict]],
                  *, runtime: Runtime) -> list[dict]:
    """What each question's answer is checked by, on the answer's context (its sentence, the one
    before it and its block's title): `coverage`, the share of the question's content words found
    there, `entity_coverage`, the share of its names (another entity's record names others), and `p_verify`, the reader's verifier's P(the context states the answer for the thing
    and the relation asked; Read + Verify, Hu et al. 2019) where it has one. {} for a question
    without an answer. records[q]: the blocks read for question q, in reading order."""
    out: list[dict] = [{} for _ in questions]
    todo = [(q, records[q][r.best], answer_context(records[q][r.best]["text"], r.span_offsets))
            for q, r in enumerate(readings) if r.best is not None and r.span_offsets is not None]
    for q, rec, context in todo:
        out[q]["coverage"] = question_coverage(questions[q], f"{rec['title']} {context}")
        out[q]["entity_coverage"] = name_coverage(questions[q], f"{rec['title']} {context}")
    if reader.verify_head is None or not todo:
        return out
    batch = reader.featurizer.featurize_verify([questions[q] for q, _, _ in todo], [readings[q].answer for q, _, _ in todo],
                                               [context for _, _, context in todo], titles=[rec["title"] for _, rec, _ in todo])
    with autocast(runtime.device, runtime.dtype):
        logits = reader.verify(batch.to(runtime.device))  # [T]
    for (q, _, _), p in zip(todo, torch.sigmoid(logits.float()).cpu().tolist()):
        out[q]["p_verify"] = p
    return out


def read_batch(reader: Reader, batch: ReaderBatch, *, runtime: Runtime | None = None, device: torch.device | str | None = None,
               dtype: str | torch.dtype | None = None) -> list[ReadBlock]:
    """What the reader finds in each input of a featurised batch (`read_blocks`' second half, for
    reading one batch with several readers of the same wordpieces). `runtime`: as `read_blocks`'."""
    rt = Runtime.of(runtime, device=device, dtype=dtype)
    dev_batch = batch.to(rt.device)
    with autocast(rt.device, rt.dtype):
        span_scores = reader(dev_batch)  # [N, L, W]
    valid = valid_spans(dev_batch, reader.cfg.max_span_width)
    f, start, width, log_norm = (t.cpu() for t in top_spans(span_scores, valid, N_BEST))  # [N, n] x3, [N]
    null = reader.null_scores(span_scores)
    null = None if null is None else null.float().cpu().tolist()  # [N]
    out = []
    for n in range(len(batch.texts)):
        has_evidence = batch.evidence_end[n] > batch.evidence_start[n]
        spans = [Span(float(f[n, r]), *batch.span_text(n, int(start[n, r]), int(width[n, r])))
                 for r in range(f.shape[1]) if has_evidence and f[n, r] > NEG / 2]
        out.append(ReadBlock(spans, float(log_norm[n]), None if null is None else null[n]))
    return out


def pick_answer(log_pz: torch.Tensor, blocks: Sequence[ReadBlock]) -> Reading:
    """The most probable answer of one question over its k blocks read, log_pz [k] = log p(z|x).
    Spans whose text normalises to "" are skipped. A reader with null spans puts each block's
    null in the softmax too: p(a|x) is then what is left after "not in what I read", p_null."""
    nulls = [b.null for b in blocks]
    with_null = bool(blocks) and all(g is not None for g in nulls)
    log_block = torch.tensor([b.log_norm for b in blocks])  # [k]
    if with_null:
        log_block = torch.logaddexp(log_block, torch.tensor(nulls))
    log_partition = torch.logsumexp(log_pz + log_block, 0)
    log_w = (log_pz - log_partition).tolist()  # [k]: a shared softmax over all blocks' spans
    keys = {(j, r): normalize_answer(s.text) for j, b in enumerate(blocks) for r, s in enumerate(b.spans)}
    # a span that normalises to nothing ("the", ",") is no answer: it neither wins nor pools mass
    joint = {(j, r): math.exp(log_w[j] + blocks[j].spans[r].score) for (j, r), key in keys.items() if key}
    shown = [next((r for r in range(len(b.spans)) if (j, r) in joint), None) for j, b in enumerate(blocks)]  # best first
    mass: dict[str, float] = {}
    for jr, p in joint.items():
        mass[keys[jr]] = mass.get(keys[jr], 0.0) + p
    signals = {"log_partition": float(log_partition), "retrieval_entropy": float(-(log_pz.exp() * log_pz).sum())}
    if with_null:
        signals["p_null"] = float(torch.exp(torch.logsumexp(log_pz + torch.tensor(nulls), 0) - log_partition))
    if not mass:
        return Reading("", 0.0, None, shown, {"score": 0.0, **signals})
    answer = max(mass, key=mass.get)
    best_j, best_r = max((jr for jr in joint if keys[jr] == answer), key=joint.get)
    shown[best_j] = best_r
    span = blocks[best_j].spans[best_r]
    return Reading(span.text, mass[answer], best_j, shown, {"score": mass[answer], **signals}, span.offsets)


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


def open_searcher(index: str | os.PathLike, model: str | os.PathLike | None = None, *, query: QueryConfig | None = None,
                  runtime: Runtime | None = None, device: torch.device | None = None, dtype: str | torch.dtype | None = None
                  ) -> LiveSearcher:
    """The searcher for `index`, over every side it holds and its live updates (`ralm index
    add/delete`, the server's /documents). Its dense side uses the run's fine-tuned query tower
    (RUN/final/retriever) when it was built with that run's document tower, else its own.
    `query` and `runtime` (or the older `device`/`dtype`): as `Searcher`'s."""
    idx = IndexDir(index)
    candidate = find_model(model, "retriever", is_retriever_dir) if model is not None else None
    return LiveSearcher(Searcher(idx, candidate, query=query, runtime=Runtime.of(runtime, device=device, dtype=dtype),
                                 own_if_other=True))
