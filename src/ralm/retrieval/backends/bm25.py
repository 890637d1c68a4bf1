"""BM25 (bm25s) behind the same search interface as the dense indexes, but over text queries.

`LiveBM25` scores texts outside an index (documents added while it is served) with the
index's own statistics, so that their scores and the index's are on one scale.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from ralm.atomic import damaged_file, read_json, write_json
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
    def __init__(self, model, count: int, avgdl: float | None, folder: Path | None = None):
        self.model = model
        self.count = count
        self.avgdl = avgdl  # mean block length in terms; None for indexes built by ralm <= 0.2.0
        self.folder = folder  # where it was loaded from (named in errors)

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
            try:
                scores[indices[start:end]] += data[start:end]  # a term's postings name each block once
            except IndexError:  # a block past the index: the arrays' damage (`ralm index check` names the file)
                raise RalmError(f"{self.folder or 'the BM25 index'}: indices.csc.index.npy is damaged (a posting "
                                f"past its {self.count} blocks); run `ralm index check`, then rebuild the index") from None
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
        try:
            model = bm25s.BM25.load(str(folder), mmap=True, show_progress=False)
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # a damaged params or vocab file, named
            raise damaged_file(sorted(folder.glob("*.index.json")) or [folder / "params.index.json"], e) from None
        try:  # a term id past the postings would be an IndexError in mid-search
            ids = np.fromiter(model.vocab_dict.values(), dtype=np.int64, count=len(model.vocab_dict))
            sound = not len(ids) or (ids.min() >= 0 and ids.max() < len(model.scores["indptr"]))
        except (TypeError, ValueError, OverflowError):
            sound = False
        if not sound:
            raise RalmError(f"{folder / 'vocab.index.json'} is damaged (a term id that is not one of the index's terms); "
                            "rebuild the index")
        return cls(model, count, avgdl, folder)


class LiveBM25:
    """BM25 over blocks that are not in `index` (live documents), with the index's statistics
    (block count, document frequencies, average length, k1, b): each block scores as it would
    as one more block of the index, so live and indexed blocks rank on one scale. A term the
    index has never seen counts as rare (df 0), so a live document is found by its new words.

    It keeps each block's terms as `term_hashes`, in one flat array, and finds a query term's
    blocks by comparing its hash with all of them: building it is a concatenation, so a
    restart after many logged documents, or a snapshot after each update, answers without
    first indexing them. After `SORT_AFTER` such scans (about what one sort costs), it sorts
    the hashes once and looks terms up by binary search.

    Shapes: M blocks, P terms of all of them (a repeated term once per occurrence)."""

    SORT_AFTER = 64

    def __init__(self, index: BM25Index, blocks: Sequence[np.ndarray]):
        """`blocks`: each block's terms (`tokens_of` its `title text`) as `term_hashes`."""
        self.index = index
        self.count = len(blocks)
        lengths = np.fromiter(map(len, blocks), dtype=np.int64, count=self.count)  # [M]
        self.terms = np.concatenate(blocks).astype(np.int64, copy=False) if self.count else np.zeros(0, np.int64)  # [P]
        self.block = np.repeat(np.arange(self.count, dtype=np.int32), lengths)  # [P] the block of each term
        k1, b = index.model.k1, index.model.b
        self.norm = (k1 * (1 - b + b * lengths / index.avgdl)).astype(np.float32)  # [M]
        self._scans = 0
        self._sorted: tuple[np.ndarray, np.ndarray] | None = None  # (order [P], terms[order])

    def _occurrences(self, term: int) -> np.ndarray:
        """The block of each occurrence of the term with hash `term`, ascending."""
        found = self._sorted
        if found is None:
            self._scans += 1
            if self._scans > self.SORT_AFTER:  # two threads may both sort: the same arrays either way
                order = np.argsort(self.terms, kind="stable")
                found = self._sorted = (order, self.terms[order])
            else:
                return self.block[self.terms == term]
        order, terms = found
        a, b = np.searchsorted(terms, term, "left"), np.searchsorted(terms, term, "right")
        return self.block[order[a:b]]

    def scores(self, queries: Sequence[str]) -> np.ndarray:
        """[Q] query strings -> [Q, M] scores of every block (0 where it shares no term)."""
        out = np.zeros((len(queries), self.count), dtype=np.float32)
        for i, query in enumerate(tokens_of(queries)):
            idf = self.index.idf(query)  # [T]
            for term, weight in zip(term_hashes(query).tolist(), idf):  # a repeated query term counts again, as in bm25s
                rows, tf = np.unique(self._occurrences(term), return_counts=True)
                out[i, rows] += weight * tf / (tf + self.norm[rows])
        return out


def term_hashes(terms: Sequence[str]) -> np.ndarray:
    """[T] terms -> int64 [T]: a stable 64-bit hash of each (blake2b), the form the update log
    keeps a live block's terms in. Two distinct terms share one with odds of about 1e-19 a pair."""
    return np.frombuffer(b"".join(hashlib.blake2b(t.encode(), digest_size=8).digest() for t in terms), "<i8").astype(np.int64)
