"""What the server holds: live searchers (dense / BM25, and hybrid over the two), the reader,
latency statistics, and a watcher thread that swaps in new index versions between requests."""

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
from ralm.defaults import HYBRID_ALPHA
from ralm.errors import RalmError
from ralm.models.confidence import MIN_CONFIDENCE
from ralm.pipeline import OpenQA, open_searcher, resolve_reader
from ralm.retrieval.search.hybrid import HybridSearcher
from ralm.retrieval.search.live import LiveSearcher
from ralm.retrieval.search.searcher import Hit, Searcher
from ralm.retrieval.search.update_log import LOG
from ralm.runtime import resolve_dtype

log = logging.getLogger("ralm.serve")


@dataclass
class ServeConfig:
    index: str
    model: str | None = None  # a fine-tuning run (RUN/final/reader), for /ask
    min_confidence: float = MIN_CONFIDENCE  # /ask withholds answers less likely to be right
    bm25: str | None = None  # a BM25 index over the same corpus, for retriever=bm25|hybrid
    api_key: str | None = None
    host: str = "127.0.0.1"  # the address the server binds; Host headers naming it are accepted
    allowed_hosts: tuple[str, ...] = ()  # more Host header names to accept ("*": any)
    hybrid_alpha: float = HYBRID_ALPHA
    hybrid_depth: int = 100
    poll_seconds: float = 1.0
    max_body_bytes: int = 1 << 20

    def __post_init__(self):
        if not 0 <= self.min_confidence <= 1:  # checked at start-up, not on the first /ask
            raise RalmError(f"the minimum confidence must be in [0, 1], got {self.min_confidence}")


class Pinned:
    """A searcher pinned to one snapshot, so a request reads the rows it searched even if
    documents are added or the index swaps meanwhile."""

    def __init__(self, searcher: LiveSearcher | HybridSearcher):
        self.searcher, self.current = searcher, searcher.current

    def search_rows(self, queries: Sequence[str], k: int):
        return self.searcher.search_rows(queries, k, self.current)


class Service:
    def __init__(self, cfg: ServeConfig, device: torch.device | None = None, dtype: str | torch.dtype | None = None):
        self.cfg = cfg
        self.device = device or torch.device("cpu")
        self.dtype = resolve_dtype(dtype, self.device)
        base = LiveSearcher(open_searcher(cfg.index, cfg.model, device=self.device, dtype=self.dtype))
        self.live: dict[str, LiveSearcher] = {base.index.kind: base}  # where documents are written
        self.searchers: dict[str, LiveSearcher | HybridSearcher] = dict(self.live)
        if cfg.bm25:
            if base.index.kind != "dense":
                raise RalmError(f"--bm25 goes with a dense --index; {cfg.index} is a {base.index.kind} index")
            bm25 = LiveSearcher(Searcher.open(cfg.bm25, device=self.device, dtype=self.dtype))
            if bm25.index.kind != "bm25":
                raise RalmError(f"--bm25 {cfg.bm25} is a {bm25.index.kind} index, not a BM25 one")
            hybrid = HybridSearcher(base, bm25, cfg.hybrid_alpha, cfg.hybrid_depth)
            _check_same_updates(base, bm25, cfg)
            self.live["bm25"] = bm25
            self.searchers.update(bm25=bm25, hybrid=hybrid)
        self.default_retriever = base.index.kind
        self.reader = None
        if cfg.model:
            from ralm.models.reader import Reader

            self.reader = Reader.from_pretrained(resolve_reader(cfg.model)).to(self.device).eval()
        self.latency = {"ask": deque(maxlen=2000), "search": deque(maxlen=2000)}
        self.swaps = 0
        self._swap_errors: dict[Path, str] = {}  # index root -> the last failure logged
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
        for live in self.live.values():
            try:
                if live.refresh():
                    swapped = True
                    self.swaps += 1
                    log.info("swapped %s to %s", live.index.root, live.current.name)
                self._swap_errors.pop(live.index.root, None)
            except Exception as e:  # a bad new version must not take the server down
                if self._swap_errors.get(live.index.root) != str(e):  # polled every second: log each failure once
                    log.warning("not swapping %s: %s", live.index.root, e)
                self._swap_errors[live.index.root] = str(e)
        return swapped

    # -- queries --------------------------------------------------------------------------
    def retrievers(self) -> list[str]:
        return list(self.searchers)

    def _searcher(self, retriever: str | None) -> LiveSearcher | HybridSearcher:
        name = retriever or self.default_retriever
        if name not in self.searchers:
            needs = {"dense": "a dense --index", "bm25": "--bm25 DIR", "hybrid": "a dense --index and --bm25 DIR"}[name]
            raise RalmError(f"retriever '{name}' is not available on this server (available: {', '.join(self.retrievers())}); "
                            f"it needs {needs}")
        return self.searchers[name]

    def search(self, queries: Sequence[str], k: int, retriever: str | None = None) -> list[list[Hit]]:
        """Top-k passages of each query (one batched model call)."""
        return self._searcher(retriever).search(list(queries), k)

    def ask(self, questions: Sequence[str], k: int, retriever: str | None = None) -> list[dict]:
        """Answers with evidence (one batched retrieval and reader call)."""
        if self.reader is None:
            raise LookupError("no reader is loaded: start the server with --model RUN (a `ralm finetune` run)")
        qa = OpenQA(self.reader, Pinned(self._searcher(retriever)), k=k, device=self.device, dtype=self.dtype,
                    min_confidence=self.cfg.min_confidence)
        return [a.to_json() for a in qa.answer(list(questions))]

    def record_latency(self, endpoint: str, seconds: float) -> None:
        self.latency[endpoint].append(seconds)

    # -- documents ------------------------------------------------------------------------
    def add(self, docs: Sequence[Document]) -> list[str]:
        ids = []
        for live in self.live.values():
            ids = live.add(docs)
        return ids

    def delete(self, doc_id: str) -> None:
        for live in self.live.values():
            live.delete(doc_id)

    def exists(self, doc_id: str) -> bool:
        return self.live[self.default_retriever].exists(doc_id)

    # -- stats ----------------------------------------------------------------------------
    def stats(self) -> dict:
        """Sizes, versions and latencies; no file paths (anyone who can read /stats sees it)."""
        def pct(values, q):
            return round(1000 * float(np.percentile(list(values), q)), 2) if values else None

        main = self.live[self.default_retriever]
        snap = main.current
        return {
            "corpus_blocks": len(main),
            "overlay_documents": len(snap.delta.docs),
            "index_version": snap.name,
            "index_swaps": self.swaps,
            "retrievers": self.retrievers(),
            "reader_loaded": self.reader is not None,
            "latency_ms": {name: {"count": len(v), "p50": pct(v, 50), "p99": pct(v, 99)} for name, v in self.latency.items()},
        }


def _check_same_updates(dense: LiveSearcher, bm25: LiveSearcher, cfg: ServeConfig) -> None:
    """Hybrid search fuses the two sides' scores of one block: their live documents must agree
    (they do when only this server writes them, to both)."""
    a, b = dense.current, bm25.current
    differ = sorted(i for i in a.delta.docs.keys() | b.delta.docs.keys() if a.delta.docs.get(i) != b.delta.docs.get(i))
    if not differ and not np.array_equal(a.hidden_rows, b.hidden_rows):
        differ = sorted(a.delta.hidden_docs ^ b.delta.hidden_docs)
    if differ:
        raise RalmError(f"--index {cfg.index} and --bm25 {cfg.bm25} hold different live updates ({LOG}): documents "
                        f"{', '.join(map(repr, differ[:3]))}{' ...' if len(differ) > 3 else ''} differ; with the server "
                        f"stopped, copy one {LOG} over the other, or rebuild both indexes from a corpus with the updates")
