"""Live knowledge updates: documents added, replaced or deleted while an index is served.

An overlay (retrieval/search/overlay.py) sits on top of the searcher's current index version:
  - added documents are split into blocks and embedded with the document tower (dense) or
    scored with the BM25 index's statistics (bm25), and searched beside the main index;
  - replaced and deleted documents hide their main-index blocks (tombstones).
Every change goes to the update log (retrieval/search/update_log.py) before it is applied, and the
log is replayed when the overlay opens, so an acknowledged update survives a crash or restart.
Rows >= len(main) name overlay blocks; a snapshot (`current`) keeps a search consistent
across a concurrent update or index swap.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ralm.data.blocks import BlockStore
from ralm.data.corpus import Document
from ralm.errors import RalmError
from ralm.retrieval.backends.bm25 import LiveBM25, _tokens
from ralm.retrieval.backends.exact import check_k
from ralm.retrieval.search.overlay import Delta, OverlayBlocks, with_adds, without
from ralm.retrieval.search.searcher import Hit, LoadedVersion, Searcher, hits
from ralm.retrieval.search.update_log import UpdateLog

log = logging.getLogger("ralm.live")


@dataclass(frozen=True)
class Snapshot:
    """An index version with the overlay on top; what it needs of the version is computed once."""
    version: LoadedVersion
    delta: Delta
    hidden_rows: np.ndarray  # sorted main-index rows of the hidden documents
    bm25: LiveBM25 | None  # the overlay blocks' BM25 scores on this version's scale (bm25)

    @property
    def blocks(self) -> OverlayBlocks:
        return OverlayBlocks(self.version.blocks, self.delta)

    @property
    def name(self) -> str:
        return self.version.name

    @property
    def manifest(self) -> dict:
        return self.version.manifest


class LiveSearcher:
    """A Searcher plus live document updates, with the same search interface."""

    def __init__(self, searcher: Searcher):
        self.searcher = searcher
        self.index = searcher.index
        self.updates = UpdateLog(searcher.index.root)
        self._lock = threading.Lock()  # serialises writers; readers use snapshots
        self._doc_rows: tuple[str, dict[str, range]] | None = None  # (version name, map), built on first use
        self._bm25_tokenizer = None
        added, deleted = self.updates.replay()
        self._snap = self._snapshot(searcher.current, self._with_adds(Delta(hidden_docs=frozenset(deleted)), added))

    # -- snapshots ------------------------------------------------------------------------
    @property
    def current(self) -> Snapshot:
        return self._snap

    def __len__(self) -> int:
        snap = self._snap
        return len(snap.blocks) - len(snap.hidden_rows)

    def refresh(self) -> bool:
        """Swap in a newer index version (the overlay stays on top of it). The version loads,
        and its documents' rows are read, before the writer lock is taken."""
        version = self.searcher.newer_version()
        if version is None:
            return False
        if self._snap.delta.hidden_docs:
            self._rows_by_doc(version)
        with self._lock:
            self.searcher.current = version
            self._snap = self._snapshot(version, self._snap.delta)
        return True

    def _snapshot(self, version: LoadedVersion, delta: Delta) -> Snapshot:
        rows_of = self._rows_by_doc(version) if delta.hidden_docs else {}
        hidden = sorted(r for d in delta.hidden_docs for r in rows_of.get(d, ()))
        bm25 = None
        if self.searcher.retriever is None and delta.records:
            if version.index.avgdl is None:
                version.index.avgdl = _measured_avgdl(version.blocks)
            bm25 = LiveBM25(version.index, [f"{r['title']} {r['text']}" for r in delta.records])
        return Snapshot(version, delta, np.array(hidden, dtype=np.int64), bm25)

    def _rows_by_doc(self, version: LoadedVersion) -> dict[str, range]:
        """Main-index rows of each document, once per version. A document's blocks are
        consecutive rows, so the map reads one record per document; writers build it before
        they take the lock, which a corpus of millions of documents would hold for minutes."""
        cached = self._doc_rows
        if cached is None or cached[0] != version.name:
            blocks = version.blocks
            starts = np.flatnonzero(np.diff(blocks.doc_index, prepend=-1))  # first row of each document
            ends = np.append(starts[1:], len(blocks))
            cached = (version.name, {blocks.record(int(s))["doc_id"]: range(int(s), int(e)) for s, e in zip(starts, ends)})
            self._doc_rows = cached
        return cached[1]

    # -- updates --------------------------------------------------------------------------
    def add(self, docs: Sequence[Document]) -> list[str]:
        """Add or replace documents; durable (logged + fsync'd) before they are searchable.
        An id given twice keeps its last version, as a replay of the log would."""
        for d in docs:
            if not d.id.strip() or not d.text.strip():
                raise RalmError("a document needs a non-empty 'id' and 'text'")
        latest = list({d.id: d for d in docs}.values())
        self._rows_by_doc(self._snap.version)  # outside the lock
        with self._lock:
            snap = self._snapshot(self._snap.version, self._with_adds(self._snap.delta, latest))
            self.updates.append([{"op": "add", "id": d.id, "title": d.title, "text": d.text} for d in latest])
            self._snap = snap
        return [d.id for d in latest]

    def delete(self, doc_id: str) -> None:
        self._rows_by_doc(self._snap.version)  # outside the lock
        with self._lock:
            if not self.exists(doc_id):
                raise KeyError(doc_id)
            snap = self._snapshot(self._snap.version, without(self._snap.delta, doc_id))
            self.updates.append([{"op": "delete", "id": doc_id}])
            self._snap = snap

    def exists(self, doc_id: str) -> bool:
        snap = self._snap
        if doc_id in snap.delta.docs:
            return True
        return doc_id not in snap.delta.hidden_docs and doc_id in self._rows_by_doc(snap.version)

    def _with_adds(self, old: Delta, docs: Sequence[Document]) -> Delta:
        return with_adds(old, docs, self._tokenizer(), self.searcher.current.blocks.config, self.searcher.retriever,
                         self.searcher.dtype)

    def _tokenizer(self):
        if self.searcher.retriever is not None:
            return self.searcher.retriever.tokenizer
        if self._bm25_tokenizer is None:
            from ralm.retrieval.towers.loading import load_tokenizer

            self._bm25_tokenizer = load_tokenizer(None)
        return self._bm25_tokenizer

    # -- search ---------------------------------------------------------------------------
    def encode(self, queries: Sequence[str]) -> torch.Tensor | list[str]:
        return self.searcher.encode(queries)

    def search_encoded(self, encoded: torch.Tensor | list[str], k: int, snap: Snapshot | None = None
                       ) -> tuple[np.ndarray, np.ndarray]:
        """`encode`'s output -> (scores [Q, k], rows [Q, k]) over main (minus hidden) + overlay."""
        check_k(k)
        snap = snap or self._snap
        n_main = len(snap.version.blocks)
        main_k = min(k + len(snap.hidden_rows), n_main)
        m_scores, m_rows = self.searcher.search_encoded(encoded, main_k, snap.version)  # [Q, main_k]
        d = snap.delta
        if d.records:
            o_scores = encoded.numpy() @ d.embeddings.T if d.embeddings is not None else snap.bm25.scores(encoded)  # [Q, M]
            o_rows = np.broadcast_to(np.arange(len(d.records)), o_scores.shape)
            scores = np.concatenate([m_scores, o_scores], 1)
            rows = np.concatenate([m_rows, o_rows + n_main], 1)
        else:
            scores, rows = m_scores, m_rows
        scores = np.where(np.isin(rows, snap.hidden_rows), -np.inf, scores)
        order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        s, r = np.take_along_axis(scores, order, 1), np.take_along_axis(rows, order, 1)
        live = np.isfinite(s).all(0)  # drop columns that only hold hidden rows (tiny corpora)
        return s[:, live].astype(np.float32), r[:, live]

    def search_rows(self, queries: Sequence[str], k: int, snap: Snapshot | None = None) -> tuple[np.ndarray, np.ndarray]:
        """[Q] strings -> (scores [Q, k], rows [Q, k]) over main (minus hidden) + overlay."""
        return self.search_encoded(self.encode(queries), k, snap)

    def exact_scores(self, qvec: np.ndarray, rows: np.ndarray, snap: Snapshot) -> np.ndarray:
        """Dense: [D] query vector, [C] rows -> [C] inner products with the stored embeddings."""
        n_main = len(snap.version.blocks)
        out = np.zeros(len(rows), np.float32)
        main = rows < n_main
        out[main] = self.searcher.exact_scores(qvec, rows[main], snap.version)
        if not main.all():
            out[~main] = snap.delta.embeddings[rows[~main] - n_main] @ qvec
        return out

    def match_rows(self, rows: np.ndarray, other: Snapshot, snap: Snapshot) -> np.ndarray:
        """Rows of another live searcher's snapshot over the same block store (hybrid search's
        BM25 side) as rows of `snap`, -1 where `snap` does not hold that block: main-index rows
        are shared; overlay blocks are matched by id, as the two overlays may order them apart."""
        n_main = len(snap.version.blocks)
        out = np.where(np.isin(rows, snap.hidden_rows), -1, rows)
        for i in zip(*np.nonzero(rows >= n_main)):
            block_id = other.delta.records[rows[i] - n_main]["id"]
            out[i] = n_main + snap.delta.row_of[block_id] if block_id in snap.delta.row_of else -1
        return out

    def search(self, queries: Sequence[str], k: int = 5) -> list[list[Hit]]:
        snap = self._snap
        scores, rows = self.search_rows(queries, k, snap)
        return hits(snap.blocks, scores, rows, bm25=self.searcher.retriever is None)


def _measured_avgdl(blocks: BlockStore, sample: int = 10_000) -> float:
    """The average block length of a BM25 index built by ralm <= 0.2.0, which did not record
    it: measured on up to `sample` evenly spaced blocks (all of them in a smaller corpus)."""
    rows = np.unique(np.linspace(0, len(blocks) - 1, min(sample, len(blocks))).astype(np.int64))
    texts = [f"{r['title']} {r['text']}" for r in blocks.records(rows)]
    log.warning("the BM25 index does not record its average block length (built by ralm <= 0.2.0); measured it "
                "on %d blocks for scoring live documents: rebuild it for the exact figure", len(rows))
    return float(np.mean([len(t) for t in _tokens(texts)]))
