"""Hybrid retrieval: BM25 and dense scores fused, behind the Searcher's search interface.

Both indexes must cover the same block store (same corpus, tokenizer and block config), so a
row means the same block in each. For a query, the union of each side's top `depth` rows is
scored by both: the dense score exactly (query · embeddings.npy row), the BM25 score from its
list, or for a row outside BM25's top `depth`, that list's lowest score (an upper bound).
Each score is min-max normalised over the union, then
    fused = (alpha · dense + (1 - alpha) · bm25) · (alpha · range(dense) + (1 - alpha) · range(bm25)),
the last factor putting fused scores back on the retrievers' own scale (it matters for p(z|x)).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ralm.errors import RalmError
from ralm.retrieval.exact import check_k
from ralm.retrieval.searcher import Hit, LoadedVersion, Searcher


def minmax(x: np.ndarray) -> np.ndarray:
    """Scale a score vector to [0, 1] (all zeros when it is constant)."""
    span = x.max() - x.min()
    return (x - x.min()) / span if span > 0 else np.zeros_like(x)


def fuse(dense: np.ndarray, bm25: np.ndarray, alpha: float) -> np.ndarray:
    """Convex combination of min-max normalised scores over one query's candidates [C], scaled
    back to the same mix of the two score ranges. The scale keeps the ranking but matters for
    p(z|x) = softmax(scores): on [0, 1] it would be near uniform over the top k, and the reader
    would ignore how far apart the retrievers put the blocks."""
    span = alpha * np.ptp(dense) + (1 - alpha) * np.ptp(bm25)
    return (alpha * minmax(dense) + (1 - alpha) * minmax(bm25)) * span


class HybridSearcher:
    def __init__(self, dense: Searcher, bm25: Searcher, alpha: float = 0.5, depth: int = 100):
        if not 0.0 <= alpha <= 1.0:
            raise RalmError(f"hybrid weight alpha must be in [0, 1], got {alpha}")
        if dense.index.kind != "dense" or bm25.index.kind != "bm25":
            raise RalmError(f"hybrid search needs a dense index and a BM25 index, got {dense.index.root} "
                            f"({dense.index.kind}) and {bm25.index.root} ({bm25.index.kind})")
        if dense.current.manifest["blocks"] != bm25.current.manifest["blocks"]:
            raise RalmError(f"{dense.index.root} and {bm25.index.root} were built over different block stores "
                            "(corpus, tokenizer or block size differ); build both from the same corpus with the same model")
        check_k(depth)
        self.dense, self.bm25, self.alpha, self.depth = dense, bm25, alpha, depth

    @property
    def current(self) -> LoadedVersion:
        """The dense side's version; its block store is the BM25 side's too."""
        return self.dense.current

    @property
    def index(self):
        return self.dense.index

    def __len__(self) -> int:
        return len(self.dense)

    def _embeddings(self, version: LoadedVersion) -> np.ndarray:
        path = self.dense.index.version_path(version.name) / "embeddings.npy"
        return np.load(path, mmap_mode="r", allow_pickle=False)

    def search_rows(self, queries: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """[Q] strings -> (fused scores [Q, k], block rows [Q, k]), best first."""
        check_k(k)
        version = self.dense.current
        depth = max(k, self.depth)
        b_scores, b_rows = self.bm25.search_rows(queries, depth)  # [Q, depth]
        _, d_rows = self.dense.search_rows(queries, depth, version)
        qvecs = self.dense.encode_queries(queries)  # [Q, D]
        emb = self._embeddings(version)
        k = min(k, len(version.blocks))
        out_s = np.zeros((len(queries), k), np.float32)
        out_r = np.zeros((len(queries), k), np.int64)
        for i in range(len(queries)):
            rows = np.union1d(b_rows[i], d_rows[i])  # [C]
            dense = np.asarray(emb[rows], dtype=np.float32) @ qvecs[i]  # [C]
            bm25_of = dict(zip(b_rows[i].tolist(), b_scores[i].tolist()))
            floor = float(b_scores[i].min())
            bm25 = np.array([bm25_of.get(int(r), floor) for r in rows], dtype=np.float32)
            fused = fuse(dense, bm25, self.alpha)
            top = np.argsort(-fused, kind="stable")[:k]
            out_s[i], out_r[i] = fused[top], rows[top]
        return out_s, out_r

    def search(self, queries: Sequence[str], k: int = 5) -> list[list[Hit]]:
        scores, rows = self.search_rows(queries, k)
        blocks = self.current.blocks
        hits = []
        for srow, rrow in zip(scores, rows):
            recs = [blocks.record(int(r)) for r in rrow]
            hits.append([Hit(int(r), rec["id"], rec["doc_id"], rec["title"], rec["text"], float(s)) for s, r, rec in zip(srow, rrow, recs)])
        return hits

