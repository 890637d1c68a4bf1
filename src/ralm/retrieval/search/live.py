"""Live knowledge updates: documents added, replaced or deleted while an index is in use.

An overlay (search/overlay.py) sits on top of the searcher's current index version:
  - added documents are split into blocks and kept by every side of the index (dense: embedded
    with the document tower; BM25: scored with the index's statistics), searched beside it;
  - replaced and deleted documents hide their main-index blocks (tombstones).
Every change goes to the index's one update log (search/update_log.py) before it is applied,
and the log is replayed when the overlay opens, so an acknowledged update survives a crash or
restart, and every side replays the same log. Rows >= len(main) name overlay blocks; a
snapshot (`current`) keeps a search consistent across a concurrent update or index swap.
`ralm index add/delete` and the server's /documents write through it; every command that
opens an index searches through it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ralm.data.corpus import Document
from ralm.errors import RalmError
from ralm.retrieval.backends.exact import check_k
from ralm.retrieval.index.store import VersionManifest
from ralm.retrieval.search.overlay import Delta, OverlayBlocks, with_adds, without
from ralm.retrieval.search.searcher import LoadedVersion, Searcher
from ralm.retrieval.search.update_log import UpdateLog

log = logging.getLogger("ralm.live")


@dataclass(frozen=True)
class Snapshot:
    """An index version with the overlay on top; what it needs of the version is computed once."""
    version: LoadedVersion
    delta: Delta
    hidden_rows: np.ndarray  # sorted main-index rows of the hidden documents
    scorers: dict  # side -> OverlayScorer of the overlay blocks on this version's scale

    @property
    def blocks(self) -> OverlayBlocks:
        return OverlayBlocks(self.version.blocks, self.delta)

    @property
    def name(self) -> str:
        return self.version.name

    @property
    def manifest(self) -> VersionManifest:
        return self.version.manifest

    @property
    def sides(self) -> dict:
        return self.version.sides


class LiveSearcher(Searcher):
    """A Searcher plus live document updates, with the same search interface."""

    def __init__(self, searcher: Searcher):
        self.searcher = searcher
        self.updates = UpdateLog(searcher.index.root)
        self._lock = threading.Lock()  # serialises writers; readers use snapshots
        added, deleted = self.updates.replay()
        version = searcher.current
        self._snap = self._snapshot(version, self._with_adds(Delta(hidden_docs=frozenset(deleted)), added, version))

    @classmethod
    def open(cls, path, model: str | None = None, *, device: torch.device | None = None, check_model: bool = True,
             dtype: str | torch.dtype | None = None) -> "LiveSearcher":
        return cls(Searcher.open(path, model, device=device, check_model=check_model, dtype=dtype))

    def __getattr__(self, name: str):
        """What a live searcher does not hold itself (index, device, dtype, models, fusion, ...) is
        its searcher's, so the searcher's methods it inherits read the one copy."""
        if name == "searcher":  # not set yet (copying, unpickling): no searcher to ask
            raise AttributeError(name)
        return getattr(self.searcher, name)

    # -- snapshots ------------------------------------------------------------------------
    @property
    def current(self) -> Snapshot:
        return self._snap

    def __len__(self) -> int:
        snap = self._snap
        return len(snap.blocks) - len(snap.hidden_rows)

    def __repr__(self) -> str:
        snap = self._snap
        return (f"LiveSearcher({str(self.index.root)!r}, version={snap.name}, sides={list(self.sides)}, blocks={len(self)}, "
                f"live documents={len(snap.delta.docs)}, hidden documents={len(snap.delta.hidden_docs)})")

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
        scorers = {name: side.overlay_scorer(delta.state.get(name), delta.records) for name, side in version.sides.items()}
        return Snapshot(version, delta, np.array(hidden, dtype=np.int64), scorers)
    def _rows_by_doc(self, version: LoadedVersion):
        """Main-index rows of each document (doc id -> range), once per version: a lookup in the
        block store's document hashes (data/blocks.py DocumentRows). Writers build it before
        they take the lock; for a store without the hashes that reads a record per document."""
        return version.blocks.document_rows()

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
            snap = self._snapshot(self._snap.version, self._with_adds(self._snap.delta, latest, self._snap.version))
            self.updates.append([{"op": "add", "id": d.id, "title": d.title, "text": d.text} for d in latest])
            self._snap = snap
        return [d.id for d in latest]

    def delete(self, doc_ids: Sequence[str]) -> None:
        """Delete documents, all or none (KeyError names the first id the index does not hold),
        in one pass over the overlay and one durable log append however many there are."""
        if isinstance(doc_ids, str):  # would delete each of its characters
            raise RalmError("delete() takes a list of document ids; wrap a single id in a list")
        ids = list(dict.fromkeys(doc_ids))
        self._rows_by_doc(self._snap.version)  # outside the lock
        with self._lock:
            missing = next((i for i in ids if not self.exists(i)), None)
            if missing is not None:
                raise KeyError(missing)
            snap = self._snapshot(self._snap.version, without(self._snap.delta, ids, self._snap.version.sides))
            self.updates.append([{"op": "delete", "id": i} for i in ids])
            self._snap = snap

    def exists(self, doc_id: str) -> bool:
        snap = self._snap
        if doc_id in snap.delta.docs:
            return True
        return doc_id not in snap.delta.hidden_docs and doc_id in self._rows_by_doc(snap.version)

    def _with_adds(self, old: Delta, docs: Sequence[Document], version: LoadedVersion) -> Delta:
        tokenizer = next(iter(version.sides.values())).block_tokenizer()  # every side's blocks: the same wordpieces
        return with_adds(old, docs, tokenizer=tokenizer, block_cfg=version.blocks.config, sides=version.sides)

    # -- search: the overlay on each side -------------------------------------------------
    def side_search(self, encoded, k: int, snap: Snapshot, side: str) -> tuple[np.ndarray, np.ndarray]:
        """`encode`'s output -> (scores [Q, k], rows [Q, k]) over main (minus hidden) + overlay."""
        check_k(k)
        n_main = len(snap.version.blocks)
        main_k = min(k + len(snap.hidden_rows), n_main)
        m_scores, m_rows = self.searcher.side_search(encoded, main_k, snap.version, side)  # [Q, main_k]
        if snap.delta.records:
            o_scores = snap.scorers[side].scores(encoded)  # [Q, M]
            o_rows = np.broadcast_to(np.arange(len(snap.delta.records)), o_scores.shape)
            scores = np.concatenate([m_scores, o_scores], 1)
            rows = np.concatenate([m_rows, o_rows + n_main], 1)
        else:
            scores, rows = m_scores, m_rows
        scores = np.where(np.isin(rows, snap.hidden_rows), -np.inf, scores)
        order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        s, r = np.take_along_axis(scores, order, 1), np.take_along_axis(rows, order, 1)
        live = np.isfinite(s).all(0)  # drop columns that only hold hidden rows (tiny corpora)
        return s[:, live].astype(np.float32), r[:, live]

    def side_scores(self, encoded, i: int, rows: np.ndarray, *, snap: Snapshot, side: str) -> np.ndarray | None:
        """Query i's scores of rows [C] (main and overlay) on one side, or None."""
        n_main = len(snap.version.blocks)
        main = rows < n_main
        a = self.searcher.side_scores(encoded, i, rows[main], snap=snap.version, side=side)
        b = snap.scorers[side].score_rows(encoded, i, rows[~main] - n_main) if not main.all() else np.zeros(0, np.float32)
        if a is None or b is None:
            return None
        out = np.zeros(len(rows), np.float32)
        out[main], out[~main] = a, b
        return out
