"""Query side of an index directory: text in, ranked blocks (id, title, text, score) out, over
every side the index holds (retrieval/index/kinds.py), fused (search/fusion.py), or one side.
A searcher holds a QueryConfig (search/query.py): the k, side and fusion of a search that names
none; a call may pass another whole (`query=`), as the server does per request.

The searcher follows the directory's LATEST version: `refresh()` swaps a newer version in
with one reference assignment, so a search in flight finishes on the version it started with.

What every searcher provides, the Searcher here and the LiveSearcher (search/live.py) alike:
  sides, current (a version or snapshot: .name, .manifest, .blocks, .sides), refresh(), len()
  encode(queries, side) / side_search(encoded, k, snap, side) / side_scores(...): one side
  rank(queries, k, snap, side) -> Ranked; search_rows(...) -> (scores, rows); search(...) -> Hits
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ralm.data.blocks import BlockStore
from ralm.defaults import SEARCH_K
from ralm.errors import RalmError
from ralm.renamed import renamed_keywords
from ralm.retrieval.backends.exact import check_k
from ralm.retrieval.index.kinds import Side, side_class
from ralm.retrieval.index.store import IndexDir, VersionManifest
from ralm.retrieval.index.verify import check_open
from ralm.retrieval.search.fusion import Fusion, Ranked, rank
from ralm.retrieval.search.query import QueryConfig
from ralm.runtime import Runtime


@dataclass(frozen=True)
class Hit:
    row: int
    id: str
    doc_id: str
    title: str
    text: str
    score: float
    found_by: tuple[str, ...] = ()  # the sides whose own top list held this block

    def to_json(self) -> dict:
        return {"id": self.id, "title": self.title, "score": round(self.score, 6), "text": self.text,
                "found_by": list(self.found_by)}


@dataclass(frozen=True)
class LoadedVersion:
    """One version with every side it holds (a side's own parts: its module's accessor, e.g.
    dense_side.py `dense_of`)."""
    name: str
    manifest: VersionManifest
    blocks: BlockStore
    sides: dict[str, Side]
    path: Path  # its folder, DIR/versions/<name>


def load_version(index: IndexDir, name: str, *, runtime: Runtime, models: dict[str, Any] | None = None,
                 check_model: bool = True) -> LoadedVersion:
    """Version `name` with every side it holds, memory-mapped, searched under `runtime`.
    `models`: each side's query model (dense: the retriever), checked against the version unless
    `check_model` is off."""
    manifest = index.version(name)
    path = index.version_path(name)
    check_open(path, manifest.files)  # sizes, shapes, dtypes of every file it uses (verify.py)
    blocks = index.blocks(manifest.blocks)
    if len(blocks) != manifest.count:
        raise RalmError(f"{index.version_path(name)}: index has {manifest.count} entries but its corpus has {len(blocks)} blocks")
    models = models or {}
    sides = {s: side_class(s).load(index, name, manifest, model=models.get(s), runtime=runtime,
                                   check_model=check_model and models.get(s) is not None)
             for s in manifest.sides}
    return LoadedVersion(name, manifest, blocks, sides, path)


class Searcher:
    def __init__(self, index: IndexDir, model=None, *, query: QueryConfig | None = None, runtime: Runtime | None = None,
                 check_model: bool = True, own_if_other: bool = False, device: torch.device | None = None,
                 dtype: str | torch.dtype | None = None):
        """`model`: offered to every side as its query model (`Side.query_model`: the dense side
        takes a retriever, loaded or a checkpoint, that shares the index's document tower);
        each side otherwise uses the one the index was built with. `own_if_other`: a model
        that does not fit a side gives way to the side's own instead of being refused.
        `query`: the k, side and fusion of a search that names none (None: QueryConfig()'s:
        SEARCH_K passages, every side, fused by defaults.FUSION). `runtime`: where queries are encoded and searched (None: the CPU, auto dtype; the older
        `device`/`dtype` still work, see `Runtime.of`)."""
        self.index = index
        self.runtime = Runtime.of(runtime, device=device, dtype=dtype)
        self.device, self.dtype = self.runtime.device, self.runtime.dtype  # query encoding and exact search
        self.check_model = check_model
        self.query = query or QueryConfig()
        latest = index.latest()
        manifest = index.version(latest)
        self.models = {s: side_class(s).query_model(index, manifest, model, self.runtime, own_if_other=own_if_other)
                       for s in manifest.sides}
        self.current = self._load(latest)

    @classmethod
    def open(cls, path: str | os.PathLike, model: str | os.PathLike | None = None, *, query: QueryConfig | None = None,
             runtime: Runtime | None = None, check_model: bool = True, device: torch.device | None = None,
             dtype: str | torch.dtype | None = None) -> "Searcher":
        """Open the index at `path`. Its dense side, if any, uses the retriever it was built
        with unless `model` (a retriever checkpoint) is given; that model must share its
        document tower. `query`, `runtime`: as the constructor's."""
        return cls(IndexDir(path), model, query=query, runtime=runtime, check_model=check_model, device=device, dtype=dtype)

    @property
    def fusion(self) -> Fusion:
        """How the sides' lists are fused: the query config's (search/fusion.py)."""
        return self.query.fusion

    @fusion.setter
    def fusion(self, fusion: Fusion) -> None:  # the older spelling: `searcher.fusion = Fusion("rrf")`
        self.query = replace(self.query, fusion=fusion)

    @property
    def sides(self) -> tuple[str, ...]:
        return tuple(self.current.sides)

    def _load(self, name: str) -> LoadedVersion:
        version = load_version(self.index, name, runtime=self.runtime, models=self.models, check_model=self.check_model)
        missing = [s for s in version.sides if s not in self.models]
        if missing:  # a version of more sides than the one opened (an upgrade while serving)
            raise RalmError(f"{self.index.root} ({name}) holds {', '.join(missing)}, which this searcher was not opened "
                            "with; restart to search it")
        return version

    def newer_version(self) -> LoadedVersion | None:
        """The newest complete version, loaded, if LATEST moved past the current one."""
        name = self.index.latest()
        return None if name == self.current.name else self._load(name)

    def refresh(self) -> bool:
        """Swap in the newest complete version if LATEST moved; True when it did."""
        version = self.newer_version()
        if version is not None:
            self.current = version
        return version is not None

    def __len__(self) -> int:
        return len(self.current.blocks)

    def __repr__(self) -> str:
        return f"Searcher({str(self.index.root)!r}, version={self.current.name}, sides={list(self.sides)}, blocks={len(self)})"

    # -- one side ---------------------------------------------------------------------------
    def encode(self, queries: Sequence[str], side: str) -> Any:
        """Queries in the form `side` searches with ([Q, D] query vectors for dense, the strings for BM25)."""
        check_queries(queries)
        return self.current.sides[side].encode(list(queries))

    def side_search(self, encoded: Any, k: int, snap: LoadedVersion, side: str) -> tuple[np.ndarray, np.ndarray]:
        """`encode`'s output -> (scores [Q, k], rows [Q, k]) of one side."""
        check_k(k)
        return snap.sides[side].search(encoded, k)

    def side_scores(self, encoded: Any, i: int, rows: np.ndarray, *, snap: LoadedVersion, side: str) -> np.ndarray | None:
        """Query i's scores of rows [C] on one side, or None where it cannot score any row."""
        return snap.sides[side].score_rows(encoded, i, rows)

    def is_result(self, scores: np.ndarray, snap: LoadedVersion, side: str) -> np.ndarray:
        return snap.sides[side].is_result(scores)

    # -- every side, fused ------------------------------------------------------------------
    @renamed_keywords(retriever="side")
    def rank(self, queries: Sequence[str], k: int, snap=None, side: str | None = None, *, query: QueryConfig | None = None
             ) -> Ranked:
        """The top k of each query over the side(s) and with the fusion of `query` (None: this
        searcher's) or the `side` named: every side, fused (side None), or one side."""
        check_queries(queries)
        check_k(k)
        snap = snap or self.current
        query = (query or self.query).given(side=side)
        return rank(self, list(queries), k=k, snap=snap, sides=pick_sides(tuple(snap.sides), query.side, self.index.root),
                    fusion=query.fusion)

    @renamed_keywords(retriever="side")
    def search_rows(self, queries: Sequence[str], k: int, snap=None, side: str | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
        """[Q] strings -> (scores [Q, k], block rows [Q, k])."""
        if not queries and not isinstance(queries, str):
            check_k(k)
            return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
        ranked = self.rank(queries, k, snap, side)
        return ranked.scores, ranked.rows

    @renamed_keywords(retriever="side")
    def search(self, queries: Sequence[str], k: int | None = None, side: str | None = None, *,
               query: QueryConfig | None = None) -> list[list[Hit]]:
        """The hits of each query, searched as `query` (None: this searcher's) says, or the `k` and
        `side` named (k None: SEARCH_K)."""
        snap = self.current  # one version for the whole call, even if a swap happens meanwhile
        if not queries and not isinstance(queries, str):
            return []
        query = (query or self.query).given(k=k, side=side)
        return hits(snap.blocks, self.rank(queries, query.k or SEARCH_K, snap, query=query))


def check_queries(queries: Sequence[str]) -> None:
    if isinstance(queries, str):  # would search each of its characters
        raise RalmError("search a list of queries; wrap a single query in a list")
    if any(not isinstance(q, str) or not q.strip() for q in queries):
        raise RalmError("queries must be non-empty strings")


def pick_sides(have: tuple[str, ...], side: str | None, where) -> tuple[str, ...]:
    """The sides a search uses: all of them (None, or the index's kind), or the one `side` names
    (or a kind's sides)."""
    if side is None:
        return have
    from ralm.retrieval.index.kinds import SIDES, sides_of

    want = (side,) if side in SIDES else sides_of(side)
    if not set(want) <= set(have):
        raise RalmError(f"searching {side!r} needs the {', '.join(want)} side(s), but {where} holds "
                        f"{', '.join(have)}; `ralm index upgrade {where}` adds the missing side")
    return want


def hits(blocks, ranked: Ranked) -> list[list[Hit]]:
    """Ranked results as Hits with their block's text. A block no side found (BM25's filler of
    a short list: it shares no term with the query) is not a result, so it goes."""
    out = []
    for srow, rrow, frow in zip(ranked.scores, ranked.rows, ranked.found_by):
        keep = [j for j in range(len(rrow)) if frow[j]]
        recs = [blocks.record(int(rrow[j])) for j in keep]
        out.append([Hit(int(rrow[j]), x["id"], x["doc_id"], x["title"], x["text"], float(srow[j]), frow[j])
                    for j, x in zip(keep, recs)])
    return out
