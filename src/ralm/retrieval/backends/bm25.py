"""BM25 (bm25s) behind the same search interface as the dense indexes, but over text queries.

`LiveBM25` scores texts outside an index (documents added while it is served) with the
index's own statistics, so that their scores and the index's are on one scale.
"""

from __future__ import annotations

import collections
import itertools
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from ralm.atomic import read_json, write_json
from ralm.errors import RalmError
from ralm.progress import library_bars_enabled
from ralm.retrieval.backends.exact import check_k

STATS = "ralm.json"  # beside bm25s's files: what bm25s does not save (the average length)


def tokens_of(texts: Sequence[str], show_progress: bool = False) -> list[list[str]]:
    import bm25s

    return bm25s.tokenize(list(texts), stopwords="en", return_ids=False, show_progress=show_progress)


def lucene_idf(count, df):
    """log(1 + (N - df + 0.5) / (df + 0.5)) of N = `count` blocks: the idf bm25s indexes with."""
    return np.log1p((count - df + 0.5) / (df + 0.5))


class BM25Index:
    def __init__(self, model, count: int, avgdl: float | None):
        self.model = model
        self.count = count
        self.avgdl = avgdl  # mean block length in terms; None for indexes built by ralm <= 0.2.0

    def __repr__(self) -> str:
        return f"BM25Index(rows={self.count}, k1={self.model.k1}, b={self.model.b}, avgdl={self.avgdl})"

    @classmethod
    def build(cls, texts: Sequence[str], k1: float = 0.9, b: float = 0.4, show_progress: bool = True) -> "BM25Index":
        """Pyserini's defaults (k1=0.9, b=0.4), which are strong for passage retrieval."""
        import bm25s

        show_progress = library_bars_enabled(show_progress)  # bm25s draws its own (tqdm) bars
        tokens = tokens_of(texts, show_progress)
        if not any(tokens):  # bm25s would fail on an empty vocabulary
            raise RalmError(f"the corpus has no word BM25 can index in its {len(texts)} block(s): every word is an English "
                            "stop word or a single character; index it with --kind dense")
        model = bm25s.BM25(k1=k1, b=b)
        model.index(tokens, show_progress=show_progress)
        return cls(model, len(texts), float(np.mean([len(t) for t in tokens])))

    def search(self, queries: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """[Q] query strings -> (scores [Q, k] float32, row ids [Q, k] int64), best first.
        Blocks that share no term with a query score 0; they fill its list up to k."""
        check_k(k)
        if isinstance(queries, str):
            raise RalmError("BM25 search takes a list of query strings")
        k = min(k, self.count)
        vocab = self.model.vocab_dict
        toks = [[vocab[t] for t in q if t in vocab] for q in tokens_of(queries)]
        scores = np.zeros((len(toks), k), dtype=np.float32)
        ids = np.tile(np.arange(k, dtype=np.int64), (len(toks), 1))
        for i, terms in enumerate(toks):
            if terms:
                ids[i], scores[i] = self._top(terms, k)
        return scores, ids

    def _top(self, terms: list[int], k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k best blocks for term ids `terms` -> (rows [k], scores [k]): bm25s's scoring, summed
        from the memory-mapped postings in this thread (bm25s.retrieve starts a thread per call)."""
        data, indices, indptr = self.model.scores["data"], self.model.scores["indices"], self.model.scores["indptr"]
        scores = np.zeros(self.count, dtype=np.float32)  # [N]
        for t in terms:  # a repeated query term counts again, as in bm25s
            start, end = int(indptr[t]), int(indptr[t + 1])
            scores[indices[start:end]] += data[start:end]  # a term's postings name each block once
        top = np.argpartition(-scores, k - 1)[:k] if k < self.count else np.arange(self.count)
        top = top[np.argsort(-scores[top], kind="stable")]
        return top.astype(np.int64), scores[top]

    def idf(self, terms: Sequence[str]) -> np.ndarray:
        """[T] terms -> Lucene's idf, log(1 + (N - df + 0.5) / (df + 0.5)), the variant bm25s
        indexes with by default, from this index's document frequencies (0 for an unseen term)."""
        indptr, vocab = self.model.scores["indptr"], self.model.vocab_dict  # term t's blocks: indptr[t]:indptr[t+1]
        # bm25s's vocabulary may name a term with no postings column ("" past the last): unseen
        df = np.array([indptr[vocab[t] + 1] - indptr[vocab[t]] if vocab.get(t, len(indptr)) + 1 < len(indptr) else 0
                       for t in terms], dtype=np.float64)
        return lucene_idf(self.count, df)

    def save(self, folder: str | os.PathLike) -> None:
        """Writes bm25s's npy/json files into `folder` (the caller publishes it atomically)."""
        self.model.save(str(folder), show_progress=False)
        write_json(Path(folder) / STATS, {"avgdl": self.avgdl})

    @classmethod
    def load(cls, folder: str | os.PathLike, count: int) -> "BM25Index":
        import bm25s

        folder = Path(folder)
        if not folder.is_dir():
            raise RalmError(f"BM25 index not found: {folder}")
        avgdl = read_json(folder / STATS)["avgdl"] if (folder / STATS).is_file() else None
        return cls(bm25s.BM25.load(str(folder), mmap=True, show_progress=False), count, avgdl)


class LiveBM25:
    """BM25 over blocks that are not in `index` (live documents), with the index's statistics
    (block count, document frequencies, average length, k1, b): each block scores as it would
    as one more block of the index, so live and indexed blocks rank on one scale. A term the
    index has never seen counts as rare (df 0), so a live document is found by its new words.

    Shapes: M blocks, P (block, term) postings."""

    def __init__(self, index: BM25Index, terms: Sequence[str]):
        """`terms`: each block's terms (`tokens_of` its `title text`) joined by spaces, as the
        update log keeps them (a term is word characters)."""
        self.count = len(terms)
        # one split of everything, then each term's id in one pass of C (map over a defaultdict
        # whose factory counts): a Python loop over the ~4.5M terms of 100,000 logged documents
        # took seconds of the first search. split(" "), not split(): block i is exactly its
        # count(" ") + 1 pieces, or none when it has no term
        joined = " ".join(t for t in terms if t)
        flat = joined.split(" ") if joined else []
        self.term_of: dict[str, int] = collections.defaultdict(itertools.count().__next__)
        term_ids = np.fromiter(map(self.term_of.__getitem__, flat), dtype=np.int64, count=len(flat))
        self.term_of = dict(self.term_of)  # a lookup of an unknown query term must not add it
        vocab = list(self.term_of)  # in id order
        lengths = np.fromiter((t.count(" ") + 1 if t else 0 for t in terms), dtype=np.int64, count=self.count)
        rows = np.repeat(np.arange(self.count, dtype=np.int64), lengths)
        # one posting per (term, block), sorted by term: its term frequency counts the pairs
        pairs, tf = np.unique(term_ids * max(self.count, 1) + rows, return_counts=True)  # [P]
        term, row = pairs // max(self.count, 1), pairs % max(self.count, 1)
        k1, b = index.model.k1, index.model.b
        norm = k1 * (1 - b + b * lengths / index.avgdl)  # [M]
        idf = index.idf(vocab)  # [V], in id order
        self.rows = row
        self.weights = (idf[term] * tf / (tf + norm[row])).astype(np.float32)
        self.bounds = np.searchsorted(term, np.arange(len(vocab) + 1)).tolist()  # term i's postings: bounds[i]:bounds[i + 1]

    def scores(self, queries: Sequence[str]) -> np.ndarray:
        """[Q] query strings -> [Q, M] scores of every block (0 where it shares no term)."""
        out = np.zeros((len(queries), self.count), dtype=np.float32)
        for i, query in enumerate(tokens_of(queries)):
            for term in query:  # a repeated query term counts again, as in bm25s
                t = self.term_of.get(term)
                if t is not None:
                    a, b = self.bounds[t], self.bounds[t + 1]
                    out[i, self.rows[a:b]] += self.weights[a:b]
        return out
