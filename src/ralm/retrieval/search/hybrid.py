"""Hybrid retrieval: BM25 and dense scores fused, behind the Searcher's search interface.

Both indexes must cover the same block store (same corpus, tokenizer and block config), so a
row means the same block in each; live documents (ralm.retrieval.search.live), which each side
numbers in its own overlay, are matched by block id. For a query, the union of each side's
top `depth` rows is scored by both: the dense score exactly (query · the stored embedding),
the BM25 score from its list, or for a row outside BM25's top `depth`, that list's lowest
score (an upper bound). Each score is min-max normalised over the union, then
    fused = (alpha · dense + (1 - alpha) · bm25) · (alpha · range(dense) + (1 - alpha) · range(bm25)),
the last factor putting fused scores back on the retrievers' own scale (it matters for p(z|x)).
The same class serves the CLI (two Searchers) and the server (two LiveSearchers).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ralm.defaults import HYBRID_ALPHA
from ralm.errors import RalmError
from ralm.retrieval.backends.exact import check_k
from ralm.retrieval.search.searcher import Hit, hits


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
    def __init__(self, dense, bm25, alpha: float = HYBRID_ALPHA, depth: int = 100):
        """`dense` and `bm25`: two Searchers, or two LiveSearchers."""
        if not 0.0 <= alpha <= 1.0:
            raise RalmError(f"hybrid weight alpha must be in [0, 1], got {alpha}")
        if dense.index.kind != "dense" or bm25.index.kind != "bm25":
            raise RalmError(f"hybrid search needs a dense index and a BM25 index, got {dense.index.root} "
                            f"({dense.index.kind}) and {bm25.index.root} ({bm25.index.kind})")
        _check_same_blocks(dense.current, bm25.current, dense, bm25)
        check_k(depth)
        self.dense, self.bm25, self.alpha, self.depth = dense, bm25, alpha, depth

    @property
    def current(self):
        """The dense side's version (or snapshot); hits are read from its blocks."""
        return self.dense.current

    @property
    def index(self):
        return self.dense.index

    def __len__(self) -> int:
        return len(self.dense)

    def __repr__(self) -> str:
        return f"HybridSearcher(alpha={self.alpha}, depth={self.depth}, dense={self.dense!r}, bm25={self.bm25!r})"

    def candidates(self, queries: Sequence[str], depth: int, snap=None) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per query: (rows of the dense side's `snap` [C], the union of each side's top `depth`;
        their dense scores [C]; their BM25 scores [C], a row outside BM25's list at its floor)."""
        d_snap, b_snap = snap or self.dense.current, self.bm25.current
        _check_same_blocks(d_snap, b_snap, self.dense, self.bm25)
        b_scores, b_rows = self.bm25.search_rows(queries, depth, b_snap)  # [Q, depth]
        b_rows = self.dense.match_rows(b_rows, b_snap, d_snap)  # -1: a block the dense side does not hold
        qvecs = self.dense.encode(queries)  # [Q, D], once for the search and the exact scores
        _, d_rows = self.dense.search_encoded(qvecs, depth, d_snap)
        out = []
        for i, qvec in enumerate(qvecs.numpy()):
            rows = np.union1d(b_rows[i][b_rows[i] >= 0], d_rows[i])  # [C]
            dense = self.dense.exact_scores(qvec, rows, d_snap)  # [C]
            bm25_of = dict(zip(b_rows[i].tolist(), b_scores[i].tolist()))
            floor = float(b_scores[i].min()) if b_scores.shape[1] else 0.0
            out.append((rows, dense, np.array([bm25_of.get(int(r), floor) for r in rows], dtype=np.float32)))
        return out

    def search_rows(self, queries: Sequence[str], k: int, snap=None) -> tuple[np.ndarray, np.ndarray]:
        """[Q] strings -> (fused scores [Q, k'], rows of the dense side's `snap` [Q, k']), best
        first; k' = k unless fewer blocks are live."""
        check_k(k)
        fused_rows = []
        for rows, dense, bm25 in self.candidates(queries, max(k, self.depth), snap):
            fused = fuse(dense, bm25, self.alpha)
            top = np.argsort(-fused, kind="stable")[:k]
            fused_rows.append((fused[top], rows[top]))
        k = min([k] + [len(r) for _, r in fused_rows])
        return (np.array([s[:k] for s, _ in fused_rows], dtype=np.float32).reshape(len(queries), k),
                np.array([r[:k] for _, r in fused_rows], dtype=np.int64).reshape(len(queries), k))

    def search(self, queries: Sequence[str], k: int = 5) -> list[list[Hit]]:
        snap = self.current
        scores, rows = self.search_rows(queries, k, snap)
        return hits(snap.blocks, scores, rows)


def _check_same_blocks(d_version, b_version, dense, bm25) -> None:
    if d_version.manifest["blocks"] != b_version.manifest["blocks"]:
        raise RalmError(f"{dense.index.root} ({d_version.name}) and {bm25.index.root} ({b_version.name}) were built over "
                        "different block stores (corpus, tokenizer or block size differ); build both from the same corpus "
                        "with the same model")
