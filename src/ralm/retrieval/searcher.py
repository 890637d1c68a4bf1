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

from ralm.atomic import read_npy
from ralm.data.blocks import BlockStore
from ralm.distributed import dist_env
from ralm.errors import RalmError
from ralm.retrieval.bm25 import BM25Index
from ralm.retrieval.encoders import Retriever
from ralm.retrieval.exact import ExactIndex, check_k
from ralm.retrieval.faiss_index import FaissIndex
from ralm.retrieval.sharded import ShardedExactIndex
from ralm.retrieval.store import IndexDir


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


def load_version(index: IndexDir, name: str, device: torch.device | None = None) -> LoadedVersion:
    manifest = index.version_manifest(name)
    path = index.version_path(name)
    blocks = index.blocks(manifest["blocks"])
    if len(blocks) != manifest["count"]:
        raise RalmError(f"{path}: index has {manifest['count']} entries but its corpus has {len(blocks)} blocks")
    if manifest["kind"] == "bm25":
        return LoadedVersion(name, manifest, blocks, BM25Index.load(path / "bm25", manifest["count"]))
    if manifest.get("faiss"):
        ann = FaissIndex.load(path / "faiss.index", manifest["faiss"])
        ann.set_search_params(**manifest.get("faiss_params", {}))
        return LoadedVersion(name, manifest, blocks, ann)
    # Copy-on-write: pages load lazily as with "r", but torch can view them without a copy.
    emb = read_npy(path / "embeddings.npy", mmap_mode="c")
    if emb.shape != (manifest["count"], manifest["dim"]):
        raise RalmError(f"{path}: embeddings have shape {emb.shape}, manifest says {(manifest['count'], manifest['dim'])}")
    env = dist_env()
    if env.active:  # under torchrun each rank holds and searches its shard of the rows
        return LoadedVersion(name, manifest, blocks, ShardedExactIndex(emb, env, env.device(device or torch.device("cpu"))))
    return LoadedVersion(name, manifest, blocks, ExactIndex(emb, device))


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
                 check_model: bool = True):
        self.index = index
        self.retriever = retriever
        self.device = device or torch.device("cpu")
        self.check_model = check_model
        self.current = self._load(index.latest())

    @classmethod
    def open(cls, path: str | os.PathLike, model: str | None = None, device: torch.device | None = None,
             check_model: bool = True) -> "Searcher":
        """Open the index at `path`. A dense index uses the retriever it was built with unless
        `model` (a retriever checkpoint) is given; that model must share its document tower."""
        index = IndexDir(path)
        device = device or torch.device("cpu")
        retriever = None
        if index.kind == "dense":
            manifest = index.version_manifest(index.latest())
            source = model or str(index.root / manifest["retriever"])
            retriever = Retriever.from_pretrained(source).to(device).eval()
        return cls(index, retriever, device, check_model)

    def _load(self, name: str) -> LoadedVersion:
        version = load_version(self.index, name, self.device)
        if version.manifest["kind"] == "dense" and self.check_model:
            check_retriever(self.retriever, version.manifest, f"index {self.index.root} ({name})")
        return version

    def refresh(self) -> bool:
        """Swap in the newest complete version if LATEST moved; True when it did."""
        name = self.index.latest()
        if name == self.current.name:
            return False
        self.current = self._load(name)
        return True

    def __len__(self) -> int:
        return len(self.current.blocks)

    def search_rows(self, queries: Sequence[str], k: int, version: LoadedVersion | None = None) -> tuple[np.ndarray, np.ndarray]:
        """[Q] strings -> (scores [Q, k], block rows [Q, k])."""
        check_k(k)
        version = version or self.current
        if not queries:
            return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
        if any(not isinstance(q, str) or not q.strip() for q in queries):
            raise RalmError("queries must be non-empty strings")
        if isinstance(version.index, BM25Index):
            return version.index.search(list(queries), k)
        return version.index.search(self.retriever.encode_queries(list(queries)), k)

    def search(self, queries: Sequence[str], k: int = 5) -> list[list[Hit]]:
        version = self.current  # one version for the whole call, even if a swap happens meanwhile
        scores, rows = self.search_rows(queries, k, version)
        return [[_hit(version.blocks, int(r), float(s)) for s, r in zip(srow, rrow)] for srow, rrow in zip(scores, rows)]


def _hit(blocks: BlockStore, row: int, score: float) -> Hit:
    rec = blocks.record(row)
    return Hit(row, rec["id"], rec["doc_id"], rec["title"], rec["text"], score)
