"""Retrieval recall@k on a question file: a passage counts when it contains an answer."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Sequence

from ralm.atomic import atomic_path
from ralm.data.qa import Question, has_answer
from ralm.defaults import RETRIEVAL_KS
from ralm.errors import RalmWarning
from ralm.eval.metrics import recall_at_k
from ralm.progress import progress_bar
from ralm.renamed import renamed_keywords
from ralm.retrieval.index.kinds import kind_of
from ralm.retrieval.search.searcher import Searcher, pick_sides


@renamed_keywords(retriever="side")
def evaluate_retrieval(searcher: Searcher, questions: Sequence[Question], *, ks: Sequence[int] = RETRIEVAL_KS,
                       batch_size: int = 64, predictions: Path | None = None, show_progress: bool = True,
                       side: str | None = None) -> dict:
    """recall@k for each k over the side(s) `side` names, else the searcher's query config's
    (None: every side of the index, fused); per-question top passages go to `predictions`
    (JSONL) if given."""
    k_max = max(ks)
    hits, rows = [], []
    start = time.perf_counter()
    with progress_bar(show_progress) as bar:
        task = bar.add_task("retrieving", total=len(questions))
        for i in range(0, len(questions), batch_size):
            batch = questions[i : i + batch_size]
            for q, ranked in zip(batch, searcher.search([q.question for q in batch], k_max, side)):
                flags = [has_answer(h.text, q.answers) for h in ranked]
                hits.append(flags)
                rows.append({"id": q.id, "question": q.question, "answers": list(q.answers),
                             "retrieved": [{"id": h.id, "score": round(h.score, 4), "has_answer": f} for h, f in zip(ranked[:20], flags)]})
            bar.advance(task, len(batch))
    elapsed = time.perf_counter() - start
    warn_if_no_answer_retrieved(hits, searcher, k_max)
    if predictions is not None:
        with atomic_path(predictions) as tmp:
            tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    kind = kind_of(pick_sides(searcher.sides, searcher.query.given(side=side).side, searcher.index.root))
    return {**recall_at_k(hits, ks), "questions": len(questions), "seconds": round(elapsed, 2),
            "index": str(searcher.index.root), "version": searcher.current.name, "kind": kind, "retriever": kind}


def warn_if_no_answer_retrieved(hits: Sequence[Sequence[bool]], searcher, k: int) -> None:
    """Not one question with an answer among its passages almost always means an index of
    another corpus than the questions': say so rather than report a quiet 0."""
    if hits and not any(map(any, hits)):
        warnings.warn(RalmWarning(
            f"no question has an answer in its top-{min(k, len(searcher.current.blocks))} passages: is {searcher.index.root} an index of the "
            f"corpus these questions come from? It indexes {searcher.current.manifest.corpus}"), stacklevel=2)
