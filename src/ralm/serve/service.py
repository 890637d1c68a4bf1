"""What the server holds: the live searcher over every side of its index (hybrid by default),
one OpenQA over it (the reader; each /ask passes its request's k and side on the config's
QueryConfig), latency statistics, and a watcher thread that follows the index between requests:
new versions are swapped in, updates other processes log (`ralm index add/delete`) applied, and
the log compacted into a new version, in the background, once it holds `compact_after` records.
The OpenQA reads the live searcher's current snapshot at each call, so it answers from the
version swapped in; batches run one at a time (serve/batching.py), and nothing an answer
computes is kept on the OpenQA."""

from __future__ import annotations

import logging
import threading
from collections import deque
from pathlib import Path
from typing import Sequence

import numpy as np

from ralm.data.corpus import Document
from ralm.configs import ConfigError
from ralm.errors import RalmError
from ralm.pipeline import OpenQA, open_searcher, resolve_reader
from ralm.retrieval.index.kinds import KINDS, kind_of
from ralm.retrieval.search.compaction import compact_index
from ralm.retrieval.search.searcher import Hit
from ralm.runtime import Runtime
from ralm.serve.config import ServeConfig

log = logging.getLogger("ralm.serve")


class Service:
    def __init__(self, cfg: ServeConfig, runtime: Runtime | None = None):
        if cfg.index is None:
            raise ConfigError("index", "names no index directory to serve")
        self.cfg = cfg
        self.runtime = Runtime.of(runtime)
        self.live = open_searcher(cfg.index, cfg.model, query=cfg.query, runtime=self.runtime)  # where documents are written
        self.qa: OpenQA | None = None  # the one OpenQA of every /ask, over the live searcher and its query config
        if cfg.model:
            from ralm.models.reader import Reader

            self.qa = OpenQA(Reader.from_pretrained(resolve_reader(cfg.model)).to(self.runtime.device), self.live,
                             runtime=self.runtime)
        self.latency = {"ask": deque(maxlen=2000), "search": deque(maxlen=2000)}
        self.swaps = 0
        self.compactions = 0
        self._swap_errors: dict[Path, str] = {}  # index root -> the last failure logged
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="ralm-index-watcher")
        self._compactor: threading.Thread | None = None
        self._compact_error: str | None = None

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self._watcher.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.cfg.poll_seconds):
            self.refresh()
            if 0 < self.cfg.compact_after < self.live.current.log.records and not (self._compactor and self._compactor.is_alive()):
                self._compactor = threading.Thread(target=self.compact, daemon=True, name="ralm-compactor")
                self._compactor.start()

    def compact(self) -> None:
        """Fold the update log into a new index version (search/compaction.py), unless another
        process is compacting; searches and writes go on meanwhile."""
        try:
            done = compact_index(self.live, wait=False)
            self._compact_error = None
            if done is not None and done.version is not None:
                self.compactions += 1
                log.info("compacted %d logged updates of %s into %s (%.1f s)", done.folded, done.index, done.version, done.seconds)
        except Exception as e:  # the log keeps every update; the next poll tries again
            if self._compact_error != str(e):  # logged once, not at every poll
                log.warning("not compacting %s: %s", self.live.index.root, e)
            self._compact_error = str(e)

    def refresh(self) -> bool:
        """Swap in a newer index version, if any, and apply the updates other processes logged;
        errors keep the old version."""
        live = self.live
        try:
            swapped = live.refresh()
            if swapped:
                self.swaps += 1
                log.info("swapped %s to %s", live.index.root, live.current.name)
            self._swap_errors.pop(live.index.root, None)
            return swapped
        except Exception as e:  # a bad new version must not take the server down
            if self._swap_errors.get(live.index.root) != str(e):  # polled every second: log each failure once
                log.warning("not swapping %s: %s", live.index.root, e)
            self._swap_errors[live.index.root] = str(e)
            return False

    # -- queries --------------------------------------------------------------------------
    def kinds(self) -> list[str]:
        """What a query's `side` may name: its own kind first, then every registered kind whose
        sides the index holds, then each side it holds."""
        have = set(self.live.sides)
        named = [kind_of(self.live.sides), *(k for k, sides in KINDS.items() if set(sides) <= have), *self.live.sides]
        return list(dict.fromkeys(named))

    @property
    def default_kind(self) -> str:
        return kind_of(self.live.sides)

    def _check(self, side: str | None) -> str | None:
        if side is not None and side not in self.kinds():
            raise RalmError(f"side '{side}' is not available on this server (available: {', '.join(self.kinds())}); "
                            f"`ralm index upgrade INDEX` adds the missing side")
        return side

    def search(self, queries: Sequence[str], k: int, side: str | None = None) -> list[list[Hit]]:
        """Top-k passages of each query (one batched model call), searched as the config's query
        with the request's k and side."""
        return self.live.search(list(queries), query=self.cfg.query.given(k=k, side=self._check(side)))

    def ask(self, questions: Sequence[str], k: int, side: str | None = None) -> list[dict]:
        """Answers with evidence (one batched retrieval and reader call), as the config's query
        with the request's k and side says: each side withholds at its own map's threshold
        unless the config's min_confidence is set."""
        if self.qa is None:
            raise LookupError("no reader is loaded: start the server with --model RUN (a `ralm finetune` run)")
        query = self.cfg.query.given(k=k, side=self._check(side))
        return [a.to_json() for a in self.qa.answer(list(questions), query=query)]

    def record_latency(self, endpoint: str, seconds: float) -> None:
        self.latency[endpoint].append(seconds)

    # -- documents: one live searcher, one update log, every side -----------------------------
    def add(self, docs: Sequence[Document]) -> list[str]:
        return self.live.add(docs)

    def add_file(self, docs: Sequence[Document], name: str) -> tuple[list[str], list[str]]:
        return self.live.replace_files(docs, [name])

    def delete(self, doc_id: str) -> list[str]:
        """Delete what `doc_id` names (a file's name: its every section and page); the ids deleted."""
        return self.live.delete([doc_id])

    def documents_named(self, doc_id: str) -> list[str]:
        return self.live.documents_named(doc_id)

    def files(self, offset: int, limit: int) -> dict:
        """A page of the index's files (a document posted by id is a file of one), the live ones
        first, the last changed first; `name` is what DELETE /documents/NAME deletes."""
        total, page = self.live.files(offset, limit)
        return {"total": total, "offset": offset, "limit": limit, "index_version": self.live.current.name,
                "files": [{"name": f.name, "title": f.title, "documents": f.documents} for f in page]}

    # -- stats ----------------------------------------------------------------------------
    def stats(self) -> dict:
        """Sizes, versions and latencies; no file paths (anyone who can read /stats sees it)."""
        def pct(values, q):
            return round(1000 * float(np.percentile(list(values), q)), 2) if values else None

        main = self.live
        snap = main.current
        return {
            "corpus_blocks": len(main),
            "overlay_documents": len(snap.delta.docs),
            "index_version": snap.name,
            "index_swaps": self.swaps,
            "kinds": self.kinds(),
            "retrievers": self.kinds(),  # the same, under its name before "kinds"
            "reader_loaded": self.qa is not None,
            "latency_ms": {name: {"count": len(v), "p50": pct(v, 50), "p99": pct(v, 99)} for name, v in self.latency.items()},
        }
