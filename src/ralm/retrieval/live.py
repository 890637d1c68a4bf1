"""Live knowledge updates: documents added, replaced or deleted while an index is served.

An overlay sits on top of the searcher's current index version:
  - added documents are split into blocks and embedded with the document tower (dense) or
    put in a small BM25 index (bm25), and searched beside the main index;
  - replaced and deleted documents hide their main-index blocks (tombstones).
Every change is appended to `DIR/updates.jsonl` and fsync'd before it is applied, and the log
is replayed when the overlay opens, so an acknowledged update survives a crash or restart.
Rows >= len(main) name overlay blocks; a snapshot (`current`) keeps a search consistent
across a concurrent update or index swap.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from ralm.data.blocks import BlockStore, iter_blocks
from ralm.data.corpus import Document
from ralm.errors import RalmError
from ralm.retrieval.bm25 import BM25Index
from ralm.retrieval.encoders import encode_rows
from ralm.retrieval.exact import check_k
from ralm.retrieval.searcher import Hit, LoadedVersion, Searcher

LOG = "updates.jsonl"


@dataclass(frozen=True)
class Delta:
    """The overlay's state at one moment (immutable; an update makes a new one)."""
    records: tuple[dict, ...] = ()  # {"id", "doc_id", "title", "text"} per overlay block
    embeddings: np.ndarray | None = None  # [M, D] (dense)
    bm25: BM25Index | None = None  # over the overlay blocks (bm25)
    hidden_docs: frozenset[str] = frozenset()  # doc ids whose main-index blocks are hidden
    docs: dict = field(default_factory=dict)  # doc id -> Document, the overlay's documents


def _check_entry(e, path: Path, lineno: int) -> None:
    """A well-formed JSON line that is not an update record was not written by ralm (edited by
    hand, another program): stop with its file:line, as replaying around it could silently drop
    or resurrect documents."""
    add = isinstance(e, dict) and e.get("op") == "add" and isinstance(e.get("text"), str) and isinstance(e.get("title", ""), str)
    if not (isinstance(e, dict) and isinstance(e.get("id"), str) and (add or e.get("op") == "delete")):
        raise RalmError(f'{path}:{lineno}: not an update record ({{"op": "add", "id", "title", "text"}} or '
                        f'{{"op": "delete", "id"}}); fix or remove the line')


class OverlayBlocks:
    """BlockStore-like view: main rows first, then the overlay's blocks."""

    def __init__(self, main: BlockStore, delta: Delta):
        self.main, self.delta = main, delta

    def __len__(self) -> int:
        return len(self.main) + len(self.delta.records)

    def record(self, row: int) -> dict:
        n = len(self.main)
        return self.main.record(row) if row < n else dict(self.delta.records[row - n])


@dataclass(frozen=True)
class Snapshot:
    version: LoadedVersion
    delta: Delta
    blocks: OverlayBlocks

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
        self.log_path = Path(searcher.index.root) / LOG
        self._lock = threading.Lock()  # serialises writers; readers use snapshots
        self._delta = Delta()
        self._main_rows: dict[str, list[int]] | None = None
        self._replay()

    # -- snapshots ------------------------------------------------------------------------
    @property
    def current(self) -> Snapshot:
        version, delta = self.searcher.current, self._delta
        return Snapshot(version, delta, OverlayBlocks(version.blocks, delta))

    def __len__(self) -> int:
        return len(self.current.blocks) - self._hidden_count(self.current)

    def refresh(self) -> bool:
        """Swap in a newer index version (the overlay stays on top of it)."""
        with self._lock:
            swapped = self.searcher.refresh()
            if swapped:
                self._main_rows = None
            return swapped

    # -- updates --------------------------------------------------------------------------
    def add(self, docs: Sequence[Document]) -> list[str]:
        """Add or replace documents; durable (logged + fsync'd) before they are searchable."""
        for d in docs:
            if not d.id.strip() or not d.text.strip():
                raise RalmError("a document needs a non-empty 'id' and 'text'")
        with self._lock:
            self._append([{"op": "add", "id": d.id, "title": d.title, "text": d.text} for d in docs])
            self._apply_adds(docs)
        return [d.id for d in docs]

    def delete(self, doc_id: str) -> None:
        with self._lock:
            if not self.exists(doc_id):
                raise KeyError(doc_id)
            self._append([{"op": "delete", "id": doc_id}])
            self._apply_delete(doc_id)

    def exists(self, doc_id: str) -> bool:
        delta = self._delta
        if doc_id in delta.docs:
            return True
        return doc_id not in delta.hidden_docs and bool(self._rows_of(doc_id))

    def _append(self, entries: list[dict]) -> None:
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries))
            f.flush()
            os.fsync(f.fileno())

    def _replay(self) -> None:
        if not self.log_path.is_file():
            return
        adds: dict[str, Document] = {}
        deleted: set[str] = set()
        for lineno, line in enumerate(self.log_path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line from a crash mid-append: it was never acknowledged
            _check_entry(e, self.log_path, lineno)
            if e["op"] == "add":
                adds[e["id"]] = Document(e["id"], e.get("title", ""), e["text"])
                deleted.discard(e["id"])
            else:
                adds.pop(e["id"], None)
                deleted.add(e["id"])
        self._delta = Delta(hidden_docs=frozenset(deleted))
        if adds:
            self._apply_adds(list(adds.values()))

    def _apply_adds(self, docs: Sequence[Document]) -> None:
        old = self._delta
        all_docs = {**old.docs, **{d.id: d for d in docs}}
        kept = [r for r in old.records if r["doc_id"] not in {d.id for d in docs}]
        keep_rows = [i for i, r in enumerate(old.records) if r["doc_id"] not in {d.id for d in docs}]
        new_records, new_tokens = [], []
        cfg = self.searcher.current.blocks.config
        tokenizer = self._tokenizer()
        for doc, blocks in iter_blocks(docs, tokenizer, cfg):
            for b in blocks:
                new_records.append({"id": b.id, "doc_id": doc.id, "title": doc.title, "text": doc.text[b.char_span[0]:b.char_span[1]]})
                new_tokens.append(np.asarray(b.token_ids))
        records = tuple(kept + new_records)
        embeddings, bm25 = None, None
        if self.searcher.retriever is not None:
            r = self.searcher.retriever
            fresh = np.zeros((len(new_tokens), r.dim), np.float32)
            encode_rows(r.doc, new_tokens, np.array([len(t) for t in new_tokens]), fresh, device=r.device,
                        pad_id=tokenizer.pad_token_id or 0, show_progress=False)
            base = old.embeddings[keep_rows] if old.embeddings is not None else np.zeros((0, r.dim), np.float32)
            embeddings = np.concatenate([base, fresh])
        else:
            bm25 = BM25Index.build([f"{x['title']} {x['text']}" for x in records], show_progress=False)
        hidden = old.hidden_docs | {d.id for d in docs}  # a replaced document's main blocks go
        self._delta = Delta(records, embeddings, bm25, frozenset(hidden), all_docs)

    def _apply_delete(self, doc_id: str) -> None:
        old = self._delta
        keep = [i for i, r in enumerate(old.records) if r["doc_id"] != doc_id]
        records = tuple(old.records[i] for i in keep)
        embeddings = old.embeddings[keep] if old.embeddings is not None else None
        bm25 = BM25Index.build([f"{x['title']} {x['text']}" for x in records], show_progress=False) if old.bm25 is not None and records else None
        docs = {k: v for k, v in old.docs.items() if k != doc_id}
        self._delta = Delta(records, embeddings, bm25, old.hidden_docs | {doc_id}, docs)

    def _tokenizer(self):
        if self.searcher.retriever is not None:
            return self.searcher.retriever.tokenizer
        from ralm.retrieval.encoders import load_tokenizer

        if not hasattr(self, "_bm25_tokenizer"):
            self._bm25_tokenizer = load_tokenizer(None)
        return self._bm25_tokenizer

    def _rows_of(self, doc_id: str) -> list[int]:
        """Main-index rows of a document (map built on first use: one pass over the blocks)."""
        if self._main_rows is None:
            blocks = self.searcher.current.blocks
            rows: dict[str, list[int]] = {}
            for i in range(len(blocks)):
                rows.setdefault(blocks.record(i)["doc_id"], []).append(i)
            self._main_rows = rows
        return self._main_rows.get(doc_id, [])

    def _hidden_rows(self, snap: Snapshot) -> np.ndarray:
        if not snap.delta.hidden_docs:
            return np.zeros(0, np.int64)
        return np.array(sorted(r for d in snap.delta.hidden_docs for r in self._rows_of(d)), dtype=np.int64)

    def _hidden_count(self, snap: Snapshot) -> int:
        return len(self._hidden_rows(snap))

    # -- search ---------------------------------------------------------------------------
    def search_rows(self, queries: Sequence[str], k: int, snap: Snapshot | None = None) -> tuple[np.ndarray, np.ndarray]:
        """[Q] strings -> (scores [Q, k], rows [Q, k]) over main (minus hidden) + overlay."""
        check_k(k)
        snap = snap or self.current
        hidden = self._hidden_rows(snap)
        n_main = len(snap.version.blocks)
        main_k = min(k + len(hidden), n_main)
        m_scores, m_rows = self.searcher.search_rows(queries, main_k, snap.version)  # [Q, main_k]
        d = snap.delta
        if d.records:
            if d.embeddings is not None:
                q = self.searcher.retriever.encode_queries(list(queries)).numpy()  # [Q, D]
                o_scores = q @ d.embeddings.T  # [Q, M]
                o_rows = np.broadcast_to(np.arange(len(d.records)), o_scores.shape)
            else:
                o_scores, o_rows = d.bm25.search(list(queries), len(d.records))
            scores = np.concatenate([m_scores, o_scores], 1)
            rows = np.concatenate([m_rows, o_rows + n_main], 1)
        else:
            scores, rows = m_scores, m_rows
        scores = np.where(np.isin(rows, hidden), -np.inf, scores)
        order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        s, r = np.take_along_axis(scores, order, 1), np.take_along_axis(rows, order, 1)
        live = np.isfinite(s).all(0)  # drop columns that only hold hidden rows (tiny corpora)
        return s[:, live].astype(np.float32), r[:, live]

    def search(self, queries: Sequence[str], k: int = 5) -> list[list[Hit]]:
        snap = self.current
        scores, rows = self.search_rows(queries, k, snap)
        out = []
        for srow, rrow in zip(scores, rows):
            recs = [snap.blocks.record(int(r)) for r in rrow]
            out.append([Hit(int(r), x["id"], x["doc_id"], x["title"], x["text"], float(s)) for s, r, x in zip(srow, rrow, recs)])
        return out
