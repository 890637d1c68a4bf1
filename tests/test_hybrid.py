"""Hybrid BM25 + dense retrieval: fusion maths, limits (alpha 0 / 1), same-blocks check."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ralm.errors import RalmError
from ralm.retrieval.index.build import build_index
from ralm.retrieval.search.hybrid import HybridSearcher, fuse, minmax
from ralm.retrieval.search.searcher import Searcher
from conftest import DOCS


@pytest.fixture(scope="module")
def bm25_index(tmp_path_factory, tiny_bert):
    root = tmp_path_factory.mktemp("bm25")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))  # same bytes as the dense index's corpus
    build_index(corpus, root / "bm25", kind="bm25", model=str(tiny_bert), show_progress=False)
    return root / "bm25"


def test_fuse_is_a_convex_combination_of_minmax_scores_on_the_retrievers_scale():
    dense, bm25 = np.array([1.0, 3.0, 2.0]), np.array([10.0, 0.0, 5.0])
    assert np.allclose(minmax(dense), [0.0, 1.0, 0.5])
    scale = 0.25 * 2.0 + 0.75 * 10.0  # the same mix of the two score ranges
    assert np.allclose(fuse(dense, bm25, 0.25), (0.25 * np.array([0.0, 1.0, 0.5]) + 0.75 * np.array([1.0, 0.0, 0.5])) * scale)
    assert np.allclose(minmax(np.array([2.0, 2.0])), [0.0, 0.0])
    # alpha = 1 gives the dense scores up to a shift, so p(z|x) = softmax is exactly the dense one
    assert np.allclose(fuse(dense, bm25, 1.0), dense - dense.min())


def test_alpha_one_is_dense_and_alpha_zero_is_bm25(tiny_dense_index, bm25_index):
    dense, bm25 = Searcher.open(tiny_dense_index), Searcher.open(bm25_index)
    queries = ["capital of France", "programming language Python"]
    _, d_rows = dense.search_rows(queries, 3)
    _, h_rows = HybridSearcher(dense, bm25, alpha=1.0).search_rows(queries, 3)
    assert np.array_equal(d_rows, h_rows)
    b_scores, b_rows = bm25.search_rows(queries, 1)
    _, h_rows = HybridSearcher(dense, bm25, alpha=0.0).search_rows(queries, 1)
    assert np.array_equal(b_rows[:, 0], h_rows[:, 0])


def test_fused_ranking_and_hits(tiny_dense_index, bm25_index):
    hybrid = HybridSearcher(Searcher.open(tiny_dense_index), Searcher.open(bm25_index), alpha=0.5)
    scores, rows = hybrid.search_rows(["Who created Python?"], 4)
    assert np.all(np.diff(scores[0]) <= 0) and scores[0, -1] >= 0.0
    hits = hybrid.search(["Who created Python?"], 4)[0]
    assert [h.row for h in hits] == rows[0].tolist()
    assert hits[0].title == "Python (language)"  # BM25 alone finds it; fusion keeps it first
    assert hybrid.current.blocks.record(hits[0].row)["text"] == hits[0].text


def test_rejects_indexes_over_different_blocks(tiny_dense_index, tmp_path, tiny_bert):
    corpus = tmp_path / "other.jsonl"
    corpus.write_text(json.dumps(DOCS[0]) + "\n")
    build_index(corpus, tmp_path / "other", kind="bm25", model=str(tiny_bert), show_progress=False)
    with pytest.raises(RalmError, match="different block stores"):
        HybridSearcher(Searcher.open(tiny_dense_index), Searcher.open(tmp_path / "other"))
    with pytest.raises(RalmError, match="a dense index and a BM25 index"):
        HybridSearcher(Searcher.open(tiny_dense_index), Searcher.open(tiny_dense_index))
    with pytest.raises(RalmError, match="alpha"):
        HybridSearcher(Searcher.open(tiny_dense_index), Searcher.open(tmp_path / "other"), alpha=2.0)


def test_queries_are_encoded_once_and_dense_scores_are_exact(tiny_dense_index, bm25_index):
    dense = Searcher.open(tiny_dense_index)
    hybrid = HybridSearcher(dense, Searcher.open(bm25_index), alpha=1.0, depth=1)
    calls = []
    real = dense.retriever.encode_queries
    dense.retriever.encode_queries = lambda texts, **kw: (calls.append(len(texts)), real(texts, **kw))[1]
    queries = ["capital of France", "Who created Python?"]
    scores, rows = hybrid.search_rows(queries, 2)
    assert calls == [2]
    # alpha 1: fused = dense - min over the candidates; every candidate's dense score is exact
    q = real(queries).numpy()
    emb = np.load(next((tiny_dense_index / "versions").iterdir()) / "embeddings.npy")
    exact = np.take_along_axis(q @ emb.T, rows, 1)
    np.testing.assert_allclose(scores[:, 0] - scores[:, 1], exact[:, 0] - exact[:, 1], rtol=1e-4)
