"""Query side of an index directory: text in, ranked blocks (id, title, text, score) out.

The searcher follows the directory's LATEST version: `refresh()` swaps a newer version in
with one reference assignment, so a search in flight finishes on the version it started with.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ralm.data.blocks import BlockStore
from ralm.distributed import dist_env
from ralm.errors import RalmError
from ralm.retrieval.backends.bm25 import BM25Index
from ralm.retrieval.towers.encoders import Retriever
from ralm.retrieval.backends.exact import ExactIndex, check_k
from ralm.retrieval.backends.faiss_index import FaissIndex
from ralm.retrieval.backends.sharded import ShardedExactIndex
from ralm.retrieval.index.store import IndexDir
from ralm.runtime import resolve_dtype


@dataclass(frozen=True)
class Hit:
    row: int
    id: str
    doc_id: str
    title: str
    text: str
    score: float

    def to_json(self) -> dict:
        return {"id": self.id, "title": self.title, "score": round(self.score, 6), "text": self.text}


@dataclass(frozen=True)
class LoadedVersion:
    name: str
    manifest: dict
    blocks: BlockStore
    index: ExactIndex | ShardedExactIndex | FaissIndex | BM25Index
    embeddings: np.ndarray | None = None  # [N, D] float32, memory-mapped (dense)


def load_version(index: IndexDir, name: str, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> LoadedVersion:
    manifest = index.version_manifest(name)
    path = index.version_path(name)
    blocks = index.blocks(manifest["blocks"])
    if len(blocks) != manifest["count"]:
        raise RalmError(f"{path}: index has {manifest['count']} entries but its corpus has {len(blocks)} blocks")
    if manifest["kind"] == "bm25":
        return LoadedVersion(name, manifest, blocks, BM25Index.load(path / "bm25", manifest["count"]))
    # Copy-on-write: pages load lazily as with "r", but torch can view them without a copy.
    emb = index.embeddings(name, manifest, mmap_mode="c")
    if manifest.get("faiss"):
        ann = FaissIndex.load(path / "faiss.index", manifest["faiss"])
        ann.set_search_params(**manifest.get("faiss_params", {}))
        return LoadedVersion(name, manifest, blocks, ann, emb)
    env = dist_env()
    if env.active:  # under torchrun each rank holds and searches its shard of the rows
        exact = ShardedExactIndex(emb, env, env.device(device or torch.device("cpu")), dtype)
    else:
        exact = ExactIndex(emb, device, dtype=dtype)
    return LoadedVersion(name, manifest, blocks, exact, emb)


def check_retriever(retriever: Retriever, manifest: dict, where: str) -> None:
    """An index only answers queries from the model family whose document tower built it."""
    if retriever.dim != manifest["dim"]:
        raise RalmError(f"{where} was built with dimension {manifest['dim']}, but the model produces {retriever.dim}")
    fp = retriever.doc_fingerprint()
    if fp != manifest["doc_fingerprint"]:
        raise RalmError(f"{where} was built with another model (document tower {manifest['doc_fingerprint']}, "
                        f"this model {fp}); rebuild the index with this model or pass the model it was built with")


class Searcher:
    def __init__(self, index: IndexDir, retriever: Retriever | None, device: torch.device | None = None,
                 check_model: bool = True, dtype: str | torch.dtype | None = None):
        self.index = index
        self.retriever = retriever
        self.device = device or torch.device("cpu")
        self.dtype = resolve_dtype(dtype, self.device)  # query encoding and exact search
        self.check_model = check_model
        self.current = self._load(index.latest())

    @classmethod
    def open(cls, path: str | os.PathLike, model: str | None = None, device: torch.device | None = None,
             check_model: bool = True, dtype: str | torch.dtype | None = None) -> "Searcher":
        """Open the index at `path`. A dense index uses the retriever it was built with unless
        `model` (a retriever checkpoint) is given; that model must share its document tower."""
        index = IndexDir(path)
        device = device or torch.device("cpu")
        retriever = None
        if index.kind == "dense":
            manifest = index.version_manifest(index.latest())
            source = model or str(index.root / manifest["retriever"])
            retriever = Retriever.from_pretrained(source).to(device).eval()
        return cls(index, retriever, device, check_model, dtype)

    def _load(self, name: str) -> LoadedVersion:
        version = load_version(self.index, name, self.device, self.dtype)
        if version.manifest["kind"] == "dense" and self.check_model:
            check_retriever(self.retriever, version.manifest, f"index {self.index.root} ({name})")
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
        model = "bm25" if self.retriever is None else f"dense dim {self.retriever.dim}"
        return f"Searcher({str(self.index.root)!r}, version={self.current.name!r}, blocks={len(self)}, {model}, device={self.device})"

    def encode(self, queries: Sequence[str]) -> torch.Tensor | list[str]:
        """Queries in the form the index searches: [Q, D] query vectors (dense) or the strings (BM25)."""
        if isinstance(queries, str):  # would search each of its characters
            raise RalmError("search a list of queries; wrap a single query in a list")
        if any(not isinstance(q, str) or not q.strip() for q in queries):
            raise RalmError("queries must be non-empty strings")
        return list(queries) if self.retriever is None else self.retriever.encode_queries(list(queries), dtype=self.dtype)

    def search_encoded(self, encoded: torch.Tensor | list[str], k: int, version: LoadedVersion | None = None
                       ) -> tuple[np.ndarray, np.ndarray]:
        """`encode`'s output -> (scores [Q, k], block rows [Q, k])."""
        check_k(k)
        return (version or self.current).index.search(encoded, k)

    def search_rows(self, queries: Sequence[str], k: int, version: LoadedVersion | None = None) -> tuple[np.ndarray, np.ndarray]:
        """[Q] strings -> (scores [Q, k], block rows [Q, k])."""
        check_k(k)
        if not queries:
            return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
        return self.search_encoded(self.encode(queries), k, version)

    def exact_scores(self, qvec: np.ndarray, rows: np.ndarray, version: LoadedVersion) -> np.ndarray:
        """Dense: [D] query vector, [C] rows -> [C] inner products with the stored float32
        embeddings (whatever the search index approximates or stores in bf16)."""
        return np.asarray(version.embeddings[rows], dtype=np.float32) @ qvec

    def match_rows(self, rows: np.ndarray, other: LoadedVersion, version: LoadedVersion) -> np.ndarray:
        """Rows of another searcher's version as rows of `version`: over the same block store
        (which hybrid search checks) a row is the same block in both."""
        return rows

    def search(self, queries: Sequence[str], k: int = 5) -> list[list[Hit]]:
        version = self.current  # one version for the whole call, even if a swap happens meanwhile
        scores, rows = self.search_rows(queries, k, version)
        return hits(version.blocks, scores, rows, bm25=self.retriever is None)


def hits(blocks, scores: np.ndarray, rows: np.ndarray, bm25: bool = False) -> list[list[Hit]]:
    """search_rows' output as Hits with their block's text. BM25 fills a list up to k with
    blocks that share no term with the query (score 0); they are not results, so they go."""
    out = []
    for srow, rrow in zip(scores, rows):
        keep = srow > 0 if bm25 else np.ones(len(srow), dtype=bool)
        recs = [blocks.record(int(r)) for r in rrow[keep]]
        out.append([Hit(int(r), x["id"], x["doc_id"], x["title"], x["text"], float(s)) for s, r, x in zip(srow[keep], rrow[keep], recs)])
    return out
