"""Live knowledge updates: documents added, replaced or deleted while an index is served.

An overlay sits on top of the searcher's current index version:
  - added documents are split into blocks and embedded with the document tower (dense) or
    scored with the BM25 index's statistics (bm25), and searched beside the main index;
  - replaced and deleted documents hide their main-index blocks (tombstones).
Every change is appended to `DIR/updates.jsonl` and fsync'd before it is applied, and the log
is replayed when the overlay opens, so an acknowledged update survives a crash or restart.
Rows >= len(main) name overlay blocks; a snapshot (`current`) keeps a search consistent
across a concurrent update or index swap.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ralm.data.blocks import BlockStore, iter_blocks
from ralm.data.corpus import Document
from ralm.errors import RalmError
from ralm.retrieval.bm25 import LiveBM25, _tokens
from ralm.retrieval.encoding import encode_rows
from ralm.retrieval.exact import check_k
from ralm.retrieval.searcher import Hit, LoadedVersion, Searcher, hits

LOG = "updates.jsonl"
RECORD_START = b'{"op": '  # how json.dumps begins every record; inside a string value the quotes are escaped
log = logging.getLogger("ralm.live")


@dataclass(frozen=True)
class Delta:
    """The overlay's documents at one moment (immutable; an update makes a new one)."""
    records: tuple[dict, ...] = ()  # {"id", "doc_id", "title", "text"} per overlay block
    embeddings: np.ndarray | None = None  # [M, D] (dense)
    hidden_docs: frozenset[str] = frozenset()  # doc ids whose main-index blocks are hidden
    docs: dict = field(default_factory=dict)  # doc id -> Document, the overlay's documents
    row_of: dict = field(default_factory=dict)  # block id -> its index in `records`


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
        self.log_path = Path(searcher.index.root) / LOG
        self._lock = threading.Lock()  # serialises writers; readers use snapshots
        self._doc_rows: tuple[str, dict[str, range]] | None = None  # (version name, map), built on first use
        self._snap = self._snapshot(searcher.current, self._replay())

    # -- snapshots ------------------------------------------------------------------------
    @property
    def current(self) -> Snapshot:
        return self._snap

    def __len__(self) -> int:
        snap = self._snap
        return len(snap.blocks) - len(snap.hidden_rows)

    def refresh(self) -> bool:
        """Swap in a newer index version (the overlay stays on top of it)."""
        with self._lock:
            if not self.searcher.refresh():
                return False
            self._snap = self._snapshot(self.searcher.current, self._snap.delta)
            return True

    def _snapshot(self, version: LoadedVersion, delta: Delta) -> Snapshot:
        hidden = sorted(r for d in delta.hidden_docs for r in self._rows_of(d, version)) if delta.hidden_docs else []
        bm25 = None
        if self.searcher.retriever is None and delta.records:
            if version.index.avgdl is None:
                version.index.avgdl = _measured_avgdl(version.blocks)
            bm25 = LiveBM25(version.index, [f"{r['title']} {r['text']}" for r in delta.records])
        return Snapshot(version, delta, np.array(hidden, dtype=np.int64), bm25)

    def _rows_of(self, doc_id: str, version: LoadedVersion) -> range:
        """Main-index rows of a document. A document's blocks are consecutive rows, so the map
        reads one record per document (once per version)."""
        if self._doc_rows is None or self._doc_rows[0] != version.name:
            blocks = version.blocks
            starts = np.flatnonzero(np.diff(blocks.doc_index, prepend=-1))  # first row of each document
            ends = np.append(starts[1:], len(blocks))
            self._doc_rows = (version.name, {blocks.record(int(s))["doc_id"]: range(int(s), int(e)) for s, e in zip(starts, ends)})
        return self._doc_rows[1].get(doc_id, range(0))

    # -- updates --------------------------------------------------------------------------
    def add(self, docs: Sequence[Document]) -> list[str]:
        """Add or replace documents; durable (logged + fsync'd) before they are searchable.
        An id given twice keeps its last version, as a replay of the log would."""
        for d in docs:
            if not d.id.strip() or not d.text.strip():
                raise RalmError("a document needs a non-empty 'id' and 'text'")
        latest = list({d.id: d for d in docs}.values())
        with self._lock:
            snap = self._snapshot(self._snap.version, self._with_adds(self._snap.delta, latest))
            self._append([{"op": "add", "id": d.id, "title": d.title, "text": d.text} for d in latest])
            self._snap = snap
        return [d.id for d in latest]

    def delete(self, doc_id: str) -> None:
        with self._lock:
            if not self.exists(doc_id):
                raise KeyError(doc_id)
            snap = self._snapshot(self._snap.version, _without(self._snap.delta, doc_id))
            self._append([{"op": "delete", "id": doc_id}])
            self._snap = snap

    def exists(self, doc_id: str) -> bool:
        snap = self._snap
        if doc_id in snap.delta.docs:
            return True
        return doc_id not in snap.delta.hidden_docs and bool(self._rows_of(doc_id, snap.version))

    def _append(self, entries: list[dict]) -> None:
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries))
            f.flush()
            os.fsync(f.fileno())

    def _replay(self) -> Delta:
        """The overlay the log describes. Its order is the live one: a document sits where its
        last add put it."""
        adds: dict[str, Document] = {}
        deleted: set[str] = set()
        for e in self._read_log():
            adds.pop(e["id"], None)
            if e["op"] == "add":
                adds[e["id"]] = Document(e["id"], e.get("title", ""), e["text"])
                deleted.discard(e["id"])
            else:
                deleted.add(e["id"])
        return self._with_adds(Delta(hidden_docs=frozenset(deleted)), list(adds.values()))

    def _read_log(self) -> list[dict]:
        """The log's records, after cutting a torn last record (a crash mid-append: it was never
        acknowledged) so that the next append starts on a line of its own."""
        if not self.log_path.is_file():
            return []
        data = self.log_path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            with open(self.log_path, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
            log.warning("%s: cut a torn last record (%d bytes, never acknowledged) left by a crash mid-write",
                        self.log_path, len(data) - end)
        records = []
        for lineno, line in enumerate(data[:end].split(b"\n")[:-1], 1):  # bytes: a text may hold U+2028
            if not line.strip():
                continue
            record = _record(line)
            if record is None:  # ralm <= 0.2.0 appended onto a torn record: the acknowledged one ends the line
                start = line.rfind(RECORD_START)
                record = _record(line[start:]) if start > 0 else None
                if record is None:
                    # written by hand or another program: replaying around it could drop or resurrect documents
                    raise RalmError(f'{self.log_path}:{lineno}: not an update record ({{"op": "add", "id", "title", "text"}} '
                                    f'or {{"op": "delete", "id"}}); fix or remove the line')
                log.warning("%s:%d: skipped a torn record before the update of %r", self.log_path, lineno, record["id"])
            records.append(record)
        return records

    def _with_adds(self, old: Delta, docs: Sequence[Document]) -> Delta:
        """`old` with `docs` (unique ids) added at the end, replacing their earlier versions."""
        if not docs:
            return old
        ids = {d.id for d in docs}
        keep = [i for i, r in enumerate(old.records) if r["doc_id"] not in ids]
        new_records, new_tokens = [], []
        for doc, blocks in iter_blocks(docs, self._tokenizer(), self.searcher.current.blocks.config):
            for b in blocks:
                new_records.append({"id": b.id, "doc_id": doc.id, "title": doc.title, "text": doc.text[b.char_span[0]:b.char_span[1]]})
                new_tokens.append(np.asarray(b.token_ids))
        records = tuple([old.records[i] for i in keep] + new_records)
        embeddings = None
        if self.searcher.retriever is not None:
            r = self.searcher.retriever
            fresh = np.zeros((len(new_tokens), r.dim), np.float32)
            encode_rows(r.doc, new_tokens, np.array([len(t) for t in new_tokens]), fresh, device=r.device,
                        pad_id=r.tokenizer.pad_token_id or 0, show_progress=False, dtype=self.searcher.dtype)
            base = old.embeddings[keep] if old.embeddings is not None else np.zeros((0, r.dim), np.float32)
            embeddings = np.concatenate([base, fresh])
        docs_by_id = {**{k: v for k, v in old.docs.items() if k not in ids}, **{d.id: d for d in docs}}
        # a replaced document's main-index blocks go
        return _delta(records, embeddings, old.hidden_docs | ids, docs_by_id)

    def _tokenizer(self):
        if self.searcher.retriever is not None:
            return self.searcher.retriever.tokenizer
        from ralm.retrieval.loading import load_tokenizer

        if not hasattr(self, "_bm25_tokenizer"):
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


def _record(line: bytes) -> dict | None:
    """A log line's update record, or None when it is not one."""
    try:
        e = json.loads(line)
    except ValueError:  # also a UnicodeDecodeError
        return None
    add = isinstance(e, dict) and e.get("op") == "add" and isinstance(e.get("text"), str) and isinstance(e.get("title", ""), str)
    ok = isinstance(e, dict) and isinstance(e.get("id"), str) and (add or e.get("op") == "delete")
    return e if ok else None


def _delta(records: tuple[dict, ...], embeddings: np.ndarray | None, hidden: frozenset[str], docs: dict) -> Delta:
    return Delta(records, embeddings, frozenset(hidden), docs, {r["id"]: i for i, r in enumerate(records)})


def _without(old: Delta, doc_id: str) -> Delta:
    keep = [i for i, r in enumerate(old.records) if r["doc_id"] != doc_id]
    embeddings = old.embeddings[keep] if old.embeddings is not None else None
    docs = {k: v for k, v in old.docs.items() if k != doc_id}
    return _delta(tuple(old.records[i] for i in keep), embeddings, old.hidden_docs | {doc_id}, docs)


def _measured_avgdl(blocks: BlockStore, sample: int = 10_000) -> float:
    """The average block length of a BM25 index built by ralm <= 0.2.0, which did not record
    it: measured on up to `sample` evenly spaced blocks (all of them in a smaller corpus)."""
    rows = np.unique(np.linspace(0, len(blocks) - 1, min(sample, len(blocks))).astype(np.int64))
    texts = [f"{r['title']} {r['text']}" for r in blocks.records(rows)]
    log.warning("the BM25 index does not record its average block length (built by ralm <= 0.2.0); measured it "
                "on %d blocks for scoring live documents: rebuild it for the exact figure", len(rows))
    return float(np.mean([len(t) for t in _tokens(texts)]))
