"""What the server holds: live searchers (dense / BM25), the reader, latency statistics, and
a watcher thread that swaps in new index versions between requests."""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ralm.data.corpus import Document
from ralm.errors import RalmError
from ralm.eval.calibration import MIN_CONFIDENCE
from ralm.eval.openqa import OpenQA, open_searcher, resolve_reader
from ralm.retrieval.hybrid import fuse
from ralm.retrieval.live import LiveSearcher, Snapshot
from ralm.retrieval.searcher import Hit, Searcher

log = logging.getLogger("ralm.serve")


@dataclass
class ServeConfig:
    index: str
    model: str | None = None  # a fine-tuning run (RUN/final/reader), for /ask
    min_confidence: float = MIN_CONFIDENCE  # /ask withholds answers less likely to be right
    bm25: str | None = None  # a BM25 index over the same corpus, for retriever=bm25|hybrid
    api_key: str | None = None
    max_k: int = 100
    hybrid_alpha: float = 0.5
    hybrid_depth: int = 100
    poll_seconds: float = 1.0
    max_body_bytes: int = 1 << 20


class Pinned:
    """A live searcher pinned to one snapshot, so a request reads the rows it searched even if
    documents are added or the index swaps meanwhile."""

    def __init__(self, live: LiveSearcher):
        self.live, self.current = live, live.current

    def search_rows(self, queries: Sequence[str], k: int):
        return self.live.search_rows(queries, k, self.current)


class Service:
    def __init__(self, cfg: ServeConfig, device: torch.device | None = None):
        self.cfg = cfg
        self.device = device or torch.device("cpu")
        base = open_searcher(cfg.index, cfg.model, device=self.device)
        if not isinstance(base, Searcher):
            raise RalmError("--index must be a dense or BM25 index directory")
        self.searchers: dict[str, LiveSearcher] = {base.index.kind: LiveSearcher(base)}
        if cfg.bm25:
            other = LiveSearcher(Searcher.open(cfg.bm25, device=self.device))
            if other.index.kind != "bm25":
                raise RalmError(f"--bm25 {cfg.bm25} is a {other.index.kind} index, not a BM25 one")
            if other.current.manifest["blocks"] != base.current.manifest["blocks"]:
                raise RalmError(f"--bm25 {cfg.bm25} was built over another corpus than --index {cfg.index}")
            self.searchers.setdefault("bm25", other)
        self.default_retriever = base.index.kind
        self.reader = None
        if cfg.model:
            from ralm.models.reader import Reader

            self.reader = Reader.from_pretrained(resolve_reader(cfg.model)).to(self.device).eval()
        self.latency = {"ask": deque(maxlen=2000), "search": deque(maxlen=2000)}
        self.swaps = 0
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="ralm-index-watcher")

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self._watcher.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.cfg.poll_seconds):
            self.refresh()

    def refresh(self) -> bool:
        """Swap any searcher whose index directory has a newer version; errors keep the old one."""
        swapped = False
        for live in self.searchers.values():
            try:
                if live.refresh():
                    swapped = True
                    self.swaps += 1
                    log.info("swapped %s to %s", live.index.root, live.current.name)
            except Exception as e:  # a bad new version must not take the server down
                log.warning("not swapping %s: %s", live.index.root, e)
        return swapped

    # -- queries --------------------------------------------------------------------------
    def retrievers(self) -> list[str]:
        names = list(self.searchers)
        return names + ["hybrid"] if {"dense", "bm25"} <= set(names) else names

    def _live(self, retriever: str | None) -> LiveSearcher:
        name = retriever or self.default_retriever
        if name not in self.searchers:
            raise RalmError(f"retriever '{name}' is not available on this server (available: {', '.join(self.retrievers())})")
        return self.searchers[name]

    def search(self, queries: Sequence[str], k: int, retriever: str | None = None) -> list[list[Hit]]:
        """Top-k passages of each query (one batched model call)."""
        if retriever == "hybrid":
            return [self._hybrid(q, k) for q in queries]
        return self._live(retriever).search(list(queries), k)

    def _hybrid(self, query: str, k: int) -> list[Hit]:
        if "hybrid" not in self.retrievers():
            raise RalmError("retriever 'hybrid' needs both a dense and a BM25 index (start with --bm25 DIR)")
        dense, bm25 = self.searchers["dense"], self.searchers["bm25"]
        d_snap, b_snap = dense.current, bm25.current
        depth = max(k, self.cfg.hybrid_depth)
        d_s, d_r = dense.search_rows([query], depth, d_snap)
        b_s, b_r = bm25.search_rows([query], depth, b_snap)
        rows = np.union1d(d_r[0], b_r[0])
        # A row outside one side's list gets that list's lowest score (an upper bound).
        d_of, b_of = dict(zip(d_r[0].tolist(), d_s[0].tolist())), dict(zip(b_r[0].tolist(), b_s[0].tolist()))
        d_floor, b_floor = float(d_s[0].min()), float(b_s[0].min())
        fused = fuse(np.array([d_of.get(int(r), d_floor) for r in rows]), np.array([b_of.get(int(r), b_floor) for r in rows]),
                     self.cfg.hybrid_alpha)
        top = np.argsort(-fused, kind="stable")[:k]
        return [_hit(d_snap, int(rows[i]), float(fused[i])) for i in top]

    def ask(self, questions: Sequence[str], k: int, retriever: str | None = None) -> list[dict]:
        """Answers with evidence (one batched retrieval and reader call)."""
        if self.reader is None:
            raise LookupError("no reader is loaded: start the server with --model RUN (a `ralm finetune` run)")
        qa = OpenQA(self.reader, Pinned(self._live(retriever)), k=k, device=self.device, min_confidence=self.cfg.min_confidence)
        return [a.to_json() for a in qa.answer(list(questions))]

    def record_latency(self, endpoint: str, seconds: float) -> None:
        self.latency[endpoint].append(seconds)

    # -- documents ------------------------------------------------------------------------
    def add(self, docs: Sequence[Document]) -> list[str]:
        ids = []
        for live in self.searchers.values():
            ids = live.add(docs)
        return ids

    def delete(self, doc_id: str) -> None:
        for live in self.searchers.values():
            live.delete(doc_id)

    def exists(self, doc_id: str) -> bool:
        return next(iter(self.searchers.values())).exists(doc_id)

    # -- stats ----------------------------------------------------------------------------
    def stats(self) -> dict:
        def pct(values, q):
            return round(1000 * float(np.percentile(list(values), q)), 2) if values else None

        main = self.searchers[self.default_retriever]
        snap = main.current
        return {
            "corpus_blocks": len(main),
            "overlay_documents": len(snap.delta.docs),
            "index": str(Path(self.cfg.index)),
            "index_version": snap.name,
            "index_swaps": self.swaps,
            "retrievers": self.retrievers(),
            "model": self.cfg.model,
            "reader_loaded": self.reader is not None,
            "latency_ms": {name: {"count": len(v), "p50": pct(v, 50), "p99": pct(v, 99)} for name, v in self.latency.items()},
        }


def _hit(snap: Snapshot, row: int, score: float) -> Hit:
    rec = snap.blocks.record(row)
    return Hit(row, rec["id"], rec["doc_id"], rec["title"], rec["text"], score)
