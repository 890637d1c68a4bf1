"""BM25 (bm25s) behind the same search interface as the dense indexes, but over text queries."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np

from ralm.errors import RalmError
from ralm.progress import progress_enabled
from ralm.retrieval.exact import check_k


def _tokens(texts: Sequence[str], show_progress: bool = False) -> list[list[str]]:
    import bm25s

    return bm25s.tokenize(list(texts), stopwords="en", return_ids=False, show_progress=show_progress)


class BM25Index:
    def __init__(self, model, count: int):
        self.model = model
        self.count = count

    @classmethod
    def build(cls, texts: Sequence[str], k1: float = 0.9, b: float = 0.4, show_progress: bool = True) -> "BM25Index":
        """Pyserini's defaults (k1=0.9, b=0.4), which are strong for passage retrieval."""
        import bm25s

        show_progress = progress_enabled(show_progress)  # bm25s draws its own (tqdm) bars
        model = bm25s.BM25(k1=k1, b=b)
        model.index(_tokens(texts, show_progress), show_progress=show_progress)
        return cls(model, len(texts))

    def search(self, queries: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """[Q] query strings -> (scores [Q, k] float32, row ids [Q, k] int64), best first.
        A query with no indexed term scores 0 everywhere."""
        check_k(k)
        if isinstance(queries, str):
            raise RalmError("BM25 search takes a list of query strings")
        k = min(k, self.count)
        vocab = self.model.vocab_dict
        toks = [[t for t in q if t in vocab] for q in _tokens(queries)]
        scores = np.zeros((len(toks), k), dtype=np.float32)
        ids = np.tile(np.arange(k, dtype=np.int64), (len(toks), 1))
        live = [i for i, t in enumerate(toks) if t]
        if live:
            found, s = self.model.retrieve([toks[i] for i in live], k=k, show_progress=False, n_threads=1)
            ids[live], scores[live] = found.astype(np.int64), s.astype(np.float32)
        return scores, ids

    def save(self, folder: str | os.PathLike) -> None:
        """Writes bm25s's npy/json files into `folder` (the caller publishes it atomically)."""
        self.model.save(str(folder), show_progress=False)

    @classmethod
    def load(cls, folder: str | os.PathLike, count: int) -> "BM25Index":
        import bm25s

        if not Path(folder).is_dir():
            raise RalmError(f"BM25 index not found: {folder}")
        return cls(bm25s.BM25.load(str(folder), mmap=True, show_progress=False), count)
