"""Live knowledge updates: documents added, replaced or deleted while an index is in use, by
this process or any other sharing the index directory.

An overlay (search/overlay.py) sits on top of the searcher's current index version:
  - added documents are split into blocks, and each side keeps what it needs of them (dense:
    their document-tower embeddings; BM25: their terms, scored with the version's statistics),
    searched beside the version;
  - replaced and deleted documents hide their main-index blocks (tombstones).
A file read by sections (`guide.md`, `guide.md#setup`, `paper.pdf#page=2`: data/corpus.py
`file_of`) is one thing to a user: deleting its name deletes its every section and page
(`documents_named`, found by the hash of their file's name), and adding it again
(`replace_files`) deletes the sections it lost in the same log batch as it adds the rest.
Every change goes to the index's one update log (search/update_log.py), with what each side
keeps of its blocks, before it is applied; opening replays the log without recomputing any of
it. A writer appends under the index's writer lock after catching up with the log, and
`refresh` follows new versions and what other processes append, so every process holding the
index sees the log's replay (`ralm index add` is live in a running server at its next poll).
Rows >= len(main) name overlay blocks; a snapshot (`current`) keeps a search consistent across
a concurrent update or index swap. `ralm index add/delete` and the server's /documents write
through it; every command that opens an index searches through it; search/compaction.py folds
the log into a new version.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Callable, Container, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

from ralm.data.blocks import DocumentRows
from ralm.data.corpus import Document, file_of
from ralm.errors import RalmError
from ralm.retrieval.backends.exact import check_k
from ralm.retrieval.index.store import VersionManifest
from ralm.retrieval.search.overlay import (
    Delta,
    LiveDoc,
    OverlayBlocks,
    applied,
    split_docs,
)
from ralm.retrieval.search.query import QueryConfig
from ralm.retrieval.search.searcher import LoadedVersion, Searcher
from ralm.retrieval.search.update_log import Entry, LogRead, UpdateLog, fold
from ralm.runtime import Runtime

log = logging.getLogger("ralm.live")


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cycle collector held off while a replay builds ~10 containers per logged update,
    none of them in a cycle: its passes over the growing heap took a third of an open after
    100,000 updates. Left as it was found (a caller may have paused it too)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@dataclass(frozen=True)
class LogPosition:
    """How much of the update log a snapshot holds."""
    id: str | None  # the log's id (None: none yet, or written by ralm <= 0.4)
    end: int  # bytes read: the next batch starts here
    lines: int
    records: int  # update records replayed over the version: what a compaction would fold


@dataclass(frozen=True)
class Snapshot:
    """An index version with the overlay on top; what it needs of the version is computed once."""
    version: LoadedVersion
    delta: Delta
    hidden_rows: np.ndarray  # sorted main-index rows of the hidden documents
    log: LogPosition
    scorers: dict = field(default_factory=dict, repr=False, compare=False)  # side -> OverlayScorer, built by `scorer`

    def scorer(self, side: str):
        """The overlay blocks' scorer on `side`, on this version's scale; built at the first
        search, so the snapshots a writer passes through on its way to an append cost none."""
        found = self.scorers.get(side)
        if found is None:  # two threads may both build it: the same scorer either way
            found = self.scorers[side] = self.version.sides[side].overlay_scorer(self.delta.state.get(side, []), self.delta.records)
        return found

    @property
    def blocks(self) -> OverlayBlocks:
        return OverlayBlocks(self.version.blocks, self.delta)

    @cached_property
    def files(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """(file name, its documents' ids) of every file (data/corpus.py `file_of`: a document
        posted by id is a file of one), what `LiveSearcher.files` pages through: the files of live
        documents first, the last changed first, then the index's in index order. Built at the
        first listing, once per snapshot: a pass over the version's document ids (read once, a
        record per document, and kept by its DocumentRows)."""
        hidden = self.delta.hidden_docs
        docs: dict[str, list[str]] = {}
        for doc_id in self.version.blocks.document_rows():
            if doc_id not in hidden:
                docs.setdefault(file_of(doc_id), []).append(doc_id)
        changed: dict[str, None] = {}  # the files of live documents, in the order they last changed
        for doc_id in self.delta.docs:  # in live order: a replaced document is at the end
            name = file_of(doc_id)
            docs.setdefault(name, []).append(doc_id)
            changed.pop(name, None)
            changed[name] = None
        order = [*reversed(changed), *(name for name in docs if name not in changed)]
        return tuple((name, tuple(docs[name])) for name in order)

    @property
    def name(self) -> str:
        return self.version.name

    @property
    def manifest(self) -> VersionManifest:
        return self.version.manifest

    @property
    def sides(self) -> dict:
        return self.version.sides

    @property
    def path(self) -> Path:
        return self.version.path


class LiveSearcher(Searcher):
    """A Searcher plus live document updates, with the same search interface."""

    def __init__(self, searcher: Searcher):
        self.searcher = searcher
        self.updates = UpdateLog(searcher.index.root)
        self._lock = threading.Lock()  # one thread of this process at a time moves the snapshot
        self._refused: tuple[str, Exception] | None = None  # a newer version that will not load here, and why
        self._behind: Exception | None = None  # why the snapshot is on an older version than LATEST
        self._snap: Snapshot | None = None
        with self._synced(exclusive=False):
            pass

    @classmethod
    def open(cls, path, model: str | None = None, *, query: QueryConfig | None = None, runtime: Runtime | None = None,
             check_model: bool = True, device: torch.device | None = None, dtype: str | torch.dtype | None = None
             ) -> "LiveSearcher":
        """`Searcher.open`'s searcher, live; `query` and the rest as its."""
        return cls(Searcher.open(path, model, query=query, runtime=runtime, check_model=check_model, device=device, dtype=dtype))

    def __getattr__(self, name: str):
        """What a live searcher does not hold itself (index, device, dtype, models, query, ...) is
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
        """Follow the index: swap in a newer version, if any, and apply what other processes
        appended to the log. True when the version changed; a newer version that cannot be
        searched here (another document tower, a side this searcher lacks, damaged) raises,
        after the log was followed on the current one, which keeps serving."""
        before = self._snap.name
        self.sync()
        if self._behind is not None:
            raise self._behind
        return self._snap.name != before

    def sync(self, *, writer: bool = False) -> Snapshot:
        """The snapshot caught up with LATEST and the log, as `refresh` makes it. `writer`: under
        the writer lock, and with a log of ralm <= 0.4 (or none) written anew in the current form."""
        with self._synced(exclusive=writer) as snap:
            return snap

    @contextlib.contextmanager
    def _synced(self, *, exclusive: bool) -> Iterator[Snapshot]:
        """Hold this process's lock and the index's (exclusive: to append), with the snapshot
        caught up with LATEST and the log. A newer version loads with no lock held; one that
        will not load here leaves the current version serving (`_behind` says why)."""
        loaded, failed, tries = None, None, 0  # failed: (version, why) this call gave up loading
        while True:
            with self._lock, self.index.lock(shared=not exclusive):
                latest = self.index.latest()
                current = self._snap.version if self._snap is not None else self.searcher.current
                if self._refused is not None and self._refused[0] == latest:
                    failed = self._refused
                if latest == current.name:
                    target = current
                elif loaded is not None and loaded.name == latest:
                    target = loaded
                else:
                    target = current if failed is not None and failed[0] == latest else None
                if target is not None:
                    self._behind = failed[1] if target.name != latest else None
                    self._snap = self._caught_up(target, exclusive=exclusive)
                    if exclusive and self._snap.log.id is None:
                        self._snap = replace(self._snap, log=self._rewritten(self._snap))
                    self.searcher.current = target
                    yield self._snap
                    return
            try:
                loaded = self.searcher._load(latest)
                if self._snap is not None and (self._snap.delta.hidden_docs or self._snap.log.records):
                    self._rows_by_doc(loaded)  # a scan of the version, done before any lock is taken
            except RalmError as e:  # another document tower, a side this searcher lacks, damaged: for good
                self._refused = (latest, e)
            except OSError as e:  # gone while it loaded (a publish pruned it): LATEST is read again, thrice
                tries += 1
                failed = (latest, e) if tries >= 3 else None

    @_gc_paused()
    def _caught_up(self, version: LoadedVersion, *, exclusive: bool) -> Snapshot:
        """The snapshot on `version` holding all of the log (the index lock held): the batches
        appended since the last read applied, or, on another version or log, the log replayed.
        Behind a LATEST that folded a log into itself (a compaction), a log started anew is that
        version's, not this one's: the snapshot stays as it was, and a writer or an open stop."""
        snap = self._snap
        log_id, size = self.updates.head()
        if snap is not None and version is snap.version and log_id == snap.log.id and size >= snap.log.end:
            if size == snap.log.end:
                return snap
            read = self.updates.read(snap.log.end, line=snap.log.lines)
            position = LogPosition(log_id, read.end, read.lines, snap.log.records + len(read.records))
            if not read.records:
                return replace(snap, log=position)
            adds, deleted = fold(read.records)
            return self._snapshot(version, applied(snap.delta, self._live_docs(read, adds, version), deleted), position)
        if self._behind is not None and self._latest_is_compacted():
            if snap is not None and version is snap.version and not exclusive:
                return snap
            raise RalmError(f"{self.index.root}: its newest version cannot be searched here ({self._behind}) and holds the "
                            "update log so far; restart with a model that can search it")
        held = version.manifest.log  # a compaction of this log holds it up to an offset
        read = self.updates.read(held["offset"] if held and held["id"] == log_id else 0, line=None)
        adds, deleted = fold(read.records)
        position = LogPosition(read.id, read.end, read.lines, len(read.records))
        return self._snapshot(version, applied(Delta(), self._live_docs(read, adds, version), deleted), position)

    def _latest_is_compacted(self) -> bool:
        try:
            return self.index.version(self.index.latest()).log is not None
        except RalmError:  # a damaged manifest: as if it were
            return True

    def _rewritten(self, snap: Snapshot) -> LogPosition:
        """Write the log anew (the writer lock held) as `snap`'s overlay: a delete of each
        hidden document, then an add of each live one, with its states."""
        docs = self._entries(list(snap.delta.docs.values()), snap.version)
        gone = [Entry({"op": "delete", "id": i}) for i in sorted(snap.delta.hidden_docs - snap.delta.docs.keys())]
        self.updates.rewrite(gone + docs)
        log_id, size = self.updates.head()
        return LogPosition(log_id, size, 1 + len(gone + docs), len(gone + docs))

    def _snapshot(self, version: LoadedVersion, delta: Delta, position: LogPosition) -> Snapshot:
        hidden = self._rows_by_doc(version).rows_of(delta.hidden_docs) if delta.hidden_docs else np.zeros(0, np.int64)
        return Snapshot(version, delta, hidden, position)

    def _rows_by_doc(self, version: LoadedVersion) -> DocumentRows:
        """Main-index rows of each document (doc id -> range), once per version: a lookup in the
        block store's document hashes (data/blocks.py DocumentRows). Writers build it before
        they take the lock; for a store without the hashes that reads a record per document."""
        return version.blocks.document_rows()

    # -- the log's documents ----------------------------------------------------------------
    def _live_docs(self, read: LogRead, records: Sequence[dict], version: LoadedVersion) -> list[LiveDoc]:
        """The documents of add `records`, from what the log stores of their blocks; those
        it stores nothing (or nothing valid for this version) of are split and computed anew."""
        out: list[LiveDoc | None] = []
        for r in records:
            doc = Document(r["id"], r.get("title", ""), r["text"])
            out.append(_stored(doc, r.get("blocks"), read.state(r), version.sides))
        todo = [i for i, d in enumerate(out) if d is None]
        if todo:
            fresh = self._split([Document(records[i]["id"], records[i].get("title", ""), records[i]["text"]) for i in todo], version)
            for i, d in zip(todo, fresh):
                out[i] = d
        return out

    def _split(self, docs: Sequence[Document], version: LoadedVersion, given: Mapping | None = None) -> list[LiveDoc]:
        tokenizer = next(iter(version.sides.values())).block_tokenizer()  # every side's blocks: the same wordpieces
        return split_docs(docs, tokenizer=tokenizer, block_cfg=version.blocks.config, sides=version.sides, given=given)

    def _entries(self, docs: Sequence[LiveDoc], version: LoadedVersion) -> list[Entry]:
        return [Entry({"op": "add", "id": d.doc.id, "title": d.doc.title, "text": d.doc.text, "blocks": [list(s) for s in d.spans]},
                      {name: side.encode_state(d.states[name]) for name, side in version.sides.items()}) for d in docs]

    # -- updates --------------------------------------------------------------------------
    def add(self, docs: Sequence[Document], *, states: Mapping[str, Callable[[Sequence[dict]], list]] | None = None) -> list[str]:
        """Add or replace documents; durable (logged + fsync'd) before they are searchable.
        An id given twice keeps its last version, as a replay of the log would. The blocks are
        embedded before the writer lock is taken. `states`: side -> a function of the new
        blocks' records ({"id", "doc_id", "title", "text"}, in order) returning what that side
        keeps of each, as its own `live_state` would (the dense side: an embedding [D]), for
        states computed elsewhere, e.g. imported vectors; the other sides compute their own."""
        latest, live, version = self._prepared(docs, states)
        self._write(self._entries(live, version), adds=live, version=version)
        return [d.id for d in latest]

    def replace_files(self, docs: Sequence[Document], names: Iterable[str]) -> tuple[list[str], list[str]]:
        """Add `docs`, read from the files `names` (a section's id is its file's name, '#' and its
        anchor: data/formats.py), and delete every document of those files that `docs` do not
        hold (a heading or page an edited file lost), in one durable update: a crash leaves each
        file as it was or as it is now, never a mix. Returns (the ids added, the ids deleted)."""
        latest, live, version = self._prepared(docs)
        self._rows_by_doc(version).file_index()  # outside the lock
        gone = self._write(self._entries(live, version), adds=live, files=list(dict.fromkeys(names)), version=version)
        return [d.id for d in latest], gone

    def _prepared(self, docs: Sequence[Document], given: Mapping | None = None) -> tuple[list[Document], list[LiveDoc], LoadedVersion]:
        """(the last version of each id, their blocks and states, the version they were split
        for): the work of an add done before the writer lock is taken."""
        for d in docs:
            if not d.id.strip() or not d.text.strip():
                raise RalmError("a document needs a non-empty 'id' and 'text'")
        latest = list({d.id: d for d in docs}.values())
        version = self._snap.version
        live = self._split(latest, version, given)
        self._rows_by_doc(version)  # outside the lock
        return latest, live, version

    def delete(self, doc_ids: Sequence[str]) -> list[str]:
        """Delete what each id names (`documents_named`: its document, and a file's every section
        and page), all or none (KeyError names the first id that names nothing), in one pass over
        the overlay and one durable log append however many there are. Returns the ids deleted."""
        if isinstance(doc_ids, str):  # would delete each of its characters
            raise RalmError("delete() takes a list of document ids; wrap a single id in a list")
        ids = list(dict.fromkeys(doc_ids))
        self._rows_by_doc(self._snap.version).file_index()  # outside the lock
        return self._write([], named=ids)

    def documents_named(self, doc_id: str) -> list[str]:
        """What a delete of `doc_id` deletes, as the current snapshot holds it: the document of
        that id, and every document of the file it names (`guide.md`: `guide.md#setup`,
        `guide.md#faq`; `paper.pdf`: `paper.pdf#page=1` ...; data/corpus.py `file_of`), the
        document first, then the index's, then the live ones; [] when it names none. A
        section's id names that section alone."""
        snap = self._snap
        return _named(snap, doc_id, self._rows_by_doc(snap.version))

    def files(self, offset: int = 0, limit: int | None = None) -> tuple[int, list[ListedFile]]:
        """(how many files the current snapshot holds, those from `offset`, at most `limit`):
        each file's name is what a delete of it deletes (`documents_named`), in the order of
        `Snapshot.files` (live files first, the last changed first)."""
        snap = self._snap
        rows = self._rows_by_doc(snap.version)
        page = snap.files[offset:None if limit is None else offset + limit]
        return len(snap.files), [ListedFile(name, _title(snap, ids[0], rows), len(ids)) for name, ids in page]

    def _write(self, entries: list[Entry], *, adds: Sequence[LiveDoc] = (), named: Sequence[str] = (),
               files: Sequence[str] = (), version: LoadedVersion | None = None) -> list[str]:
        """Append to the log, as one batch, a delete of every document that the ids `named` name
        (a KeyError names the first that names none) and of each document of `files` that
        `adds` do not replace, then `entries`; and apply them. Under the writer lock, after
        catching up with what others appended, so what is deleted is what the log holds then.
        Returns the ids deleted."""
        with self._synced(exclusive=True) as snap:
            if version is not None and not snap.version.sides.keys() <= version.sides.keys():
                raise RalmError(f"{self.index.root}: a version with more sides was published meanwhile; add the documents again")
            rows = self._rows_by_doc(snap.version)
            gone: dict[str, None] = {}
            for doc_id in named:
                found = _named(snap, doc_id, rows)
                if not found:
                    raise KeyError(doc_id)
                gone.update(dict.fromkeys(found))
            added = {a.doc.id for a in adds}
            for name in files:
                gone.update(dict.fromkeys(i for i in _named(snap, name, rows) if i not in added))
            entries = [Entry({"op": "delete", "id": i}) for i in gone] + entries
            position = snap.log
            end = self.updates.append(entries, log_id=position.id, at=position.end)
            delta = applied(snap.delta, adds, gone)
            self._snap = self._snapshot(snap.version, delta, LogPosition(position.id, end, position.lines + len(entries),
                                                                          position.records + len(entries)))
            return list(gone)

    def exists(self, doc_id: str) -> bool:
        """Whether a document of this very id is searchable (a file's name whose sections are
        but whose own text is not: False; `documents_named` finds those)."""
        snap = self._snap
        return _exists(snap, doc_id, self._rows_by_doc(snap.version))

    # -- search: the overlay on each side -------------------------------------------------
    def side_search(self, encoded, k: int, snap: Snapshot, side: str) -> tuple[np.ndarray, np.ndarray]:
        """`encode`'s output -> (scores [Q, k], rows [Q, k]) over main (minus hidden) + overlay."""
        check_k(k)
        n_main = len(snap.version.blocks)
        m_scores, m_rows = self._main_search(encoded, k, snap, side)  # [Q, K]: each query's best k unhidden rows among them
        if snap.delta.records:
            o_scores, o_rows = _best(snap.scorer(side).scores(encoded), k)  # [Q, min(k, M)] of [Q, M]
            scores = np.concatenate([m_scores, o_scores], 1)
            rows = np.concatenate([m_rows, o_rows + n_main], 1)
        else:
            scores, rows = m_scores, m_rows
        order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        s, r = np.take_along_axis(scores, order, 1), np.take_along_axis(rows, order, 1)
        live = ~np.isneginf(s).any(0)  # drop columns that only hold hidden rows (tiny corpora); a NaN is reported (fusion.py)
        return s[:, live].astype(np.float32), r[:, live]

    def _main_search(self, encoded, k: int, snap: Snapshot, side: str) -> tuple[np.ndarray, np.ndarray]:
        """The main index's best rows, hidden ones scored -inf (only main rows are ever hidden),
        enough that each query's list holds its best k that are not: 2k first, more while hidden
        rows crowd a list out, at most k + every hidden row (always enough). After many deletes,
        a search does not ask for a list that long."""
        n_main, hidden = len(snap.version.blocks), snap.hidden_rows
        enough = min(k + len(hidden), n_main)
        want = min(2 * k, enough)
        while True:
            scores, rows = self.searcher.side_search(encoded, want, snap.version, side)  # [Q, want]
            is_hidden = np.isin(rows, hidden)
            crowded = int(is_hidden.sum(1).max(initial=0))  # the most hidden rows in one list
            if want == enough or rows.shape[1] - crowded >= k:
                return np.where(is_hidden, -np.inf, scores), rows
            want = min(max(2 * want, k + 2 * crowded), enough)

    def side_scores(self, encoded, i: int, rows: np.ndarray, *, snap: Snapshot, side: str) -> np.ndarray | None:
        """Query i's scores of rows [C] (main and overlay) on one side, or None."""
        n_main = len(snap.version.blocks)
        main = rows < n_main
        a = self.searcher.side_scores(encoded, i, rows[main], snap=snap.version, side=side)
        b = snap.scorer(side).score_rows(encoded, i, rows[~main] - n_main) if not main.all() else np.zeros(0, np.float32)
        if a is None or b is None:
            return None
        out = np.zeros(len(rows), np.float32)
        out[main], out[~main] = a, b
        return out


def _best(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """[Q, M] -> (scores [Q, k'], columns [Q, k']), k' = min(k, M): each row's k best, a tie
    going to the lower column, as a stable sort's first k, in column order; found by partition,
    not by sorting all M (tens of thousands of live blocks after many logged updates)."""
    q, m = scores.shape
    if m <= k:
        return scores, np.broadcast_to(np.arange(m), scores.shape)
    if np.isnan(scores).any():  # a NaN (damaged) sorts last, as it always has
        cols = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    else:
        kth = -np.partition(-scores, k - 1, axis=1)[:, k - 1]  # [Q] each row's k-th best score
        cols = np.empty((q, k), np.int64)
        for i, (row, v) in enumerate(zip(scores, kth)):
            above = np.flatnonzero(row > v)
            cols[i] = np.concatenate([above, np.flatnonzero(row == v)[:k - len(above)]])
    cols.sort(axis=1)
    return np.take_along_axis(scores, cols, 1), cols


@dataclass(frozen=True)
class ListedFile:
    """One entry of `LiveSearcher.files`."""
    name: str  # a document's id, or the name of a file read by sections: what a delete of it deletes
    title: str  # its first document's
    documents: int  # 1, or the file's sections and pages


def _title(snap: Snapshot, doc_id: str, rows: DocumentRows) -> str:
    if doc_id in snap.delta.docs:
        return snap.delta.docs[doc_id].doc.title
    return snap.version.blocks.record(rows.get(doc_id).start).get("title", "")


def _exists(snap: Snapshot, doc_id: str, rows_of: Container[str]) -> bool:
    return doc_id in snap.delta.docs or (doc_id not in snap.delta.hidden_docs and doc_id in rows_of)


def _named(snap: Snapshot, doc_id: str, rows: DocumentRows) -> list[str]:
    """`LiveSearcher.documents_named` on `snap`: the index's documents of the file `doc_id`
    (by the hashes of their files' names) not hidden, its live ones, and, where its own file is
    another (`C#.md` is of `C`), the document of that id."""
    hidden = snap.delta.hidden_docs
    found = dict.fromkeys(i for i in rows.of_file(doc_id) if i not in hidden)
    found.update(dict.fromkeys(snap.delta.files.get(doc_id, ())))
    if doc_id not in found and file_of(doc_id) != doc_id and _exists(snap, doc_id, rows):
        found[doc_id] = None
    if doc_id in found:  # the document first, as a folder lists a file's text before its sections
        return [doc_id, *(i for i in found if i != doc_id)]
    return list(found)


def _stored(doc: Document, spans: list | None, state: dict | None, sides: dict) -> LiveDoc | None:
    """A logged document's blocks from what the log stores of them, or None where it stores
    nothing for a side, or what it stores no longer holds (see `Side.decode_state`)."""
    if spans is None or state is None:
        return None
    states = {}
    for name, side in sides.items():
        data = state.get(name)
        states[name] = side.decode_state(data, len(spans)) if data is not None else None
        if states[name] is None:
            return None
    return LiveDoc(doc, tuple((a, b) for a, b in spans), states)
