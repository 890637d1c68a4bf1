import os

import numpy as np
import pytest
import torch

from ralm.errors import RalmError
from ralm.retrieval.backends.bm25 import BM25Index
from ralm.retrieval.backends.exact import ExactIndex, merge_topk
from ralm.retrieval.backends.faiss_index import FaissIndex


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    return rng.standard_normal((1000, 16)).astype(np.float32), rng.standard_normal((7, 16)).astype(np.float32)


@pytest.mark.parametrize("chunk_size", [64, 1000, 5000])
def test_exact_search_equals_brute_force_argsort(data, chunk_size):
    emb, q = data
    scores, ids = ExactIndex(emb, chunk_size=chunk_size).search(q, 10)
    full = q @ emb.T
    expected = np.argsort(-full, axis=1, kind="stable")[:, :10]
    np.testing.assert_array_equal(ids, expected)
    np.testing.assert_allclose(scores, np.take_along_axis(full, expected, 1), rtol=1e-5)


def test_exact_search_reads_a_memory_map_chunk_by_chunk(tmp_path, data):
    emb, q = data
    np.save(tmp_path / "e.npy", emb)
    mm = np.load(tmp_path / "e.npy", mmap_mode="r")
    np.testing.assert_array_equal(ExactIndex(mm, chunk_size=100).search(q, 5)[1], ExactIndex(emb).search(q, 5)[1])


def test_exact_k_larger_than_corpus_and_bad_k(data):
    emb, q = data
    scores, ids = ExactIndex(emb[:3]).search(q, 10)
    assert ids.shape == (7, 3) and sorted(ids[0]) == [0, 1, 2]
    for bad in (0, -1):
        with pytest.raises(RalmError, match="k must be a positive integer"):
            ExactIndex(emb).search(q, bad)
    with pytest.raises(RalmError, match=r"queries must have shape \[Q, 16\]"):
        ExactIndex(emb).search(q[:, :8], 3)


def test_merge_topk_breaks_ties_by_lower_id():
    scores = torch.tensor([[1.0, 2.0, 2.0, 0.5]])
    ids = torch.tensor([[7, 9, 3, 1]])
    s, i = merge_topk(scores, ids, 3)
    assert i.tolist() == [[3, 9, 7]] and s.tolist() == [[2.0, 2.0, 1.0]]


def test_faiss_flat_equals_exact_and_round_trips(tmp_path, data):
    emb, q = data
    exact_s, exact_i = ExactIndex(emb).search(q, 10)
    index = FaissIndex.build(emb, "Flat")
    s, i = index.search(q, 10)
    np.testing.assert_array_equal(i, exact_i)
    np.testing.assert_allclose(s, exact_s, rtol=1e-4)
    index.save(tmp_path / "f.index")
    np.testing.assert_array_equal(FaissIndex.load(tmp_path / "f.index", "Flat").search(q, 10)[1], exact_i)


@pytest.mark.skipif(os.name != "posix", reason="lists are read whole where a mapped file cannot be deleted")
def test_a_loaded_ivf_maps_its_lists_and_searches_as_built_after_its_file_is_deleted(tmp_path, data):
    from ralm.retrieval.backends.faiss_index import faiss_module

    emb, q = data
    built = FaissIndex.build(emb, "IVF16,SQ8")
    built.set_search_params(nprobe=4)
    built.save(tmp_path / "ivf.faiss")
    loaded = FaissIndex.load(tmp_path / "ivf.faiss", "IVF16,SQ8")
    loaded.set_search_params(nprobe=4)
    assert type(faiss_module().downcast_InvertedLists(loaded._ivf().invlists)).__name__ == "OnDiskInvertedLists"
    (tmp_path / "ivf.faiss").unlink()  # a version pruned while a server still searches it
    for got, want in zip(loaded.search(q, 10), built.search(q, 10)):
        np.testing.assert_array_equal(got, want)


def test_faiss_ivf_and_hnsw_find_most_exact_neighbours(data):
    emb, q = data
    _, exact = ExactIndex(emb).search(q, 10)
    for spec in ("IVF16,Flat", "HNSW16"):
        index = FaissIndex.build(emb, spec)
        index.set_search_params(nprobe=16, ef_search=128)
        _, got = index.search(q, 10)
        overlap = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got, exact)])
        assert overlap >= 0.9, spec


def test_search_params_read_back_as_set_and_only_an_ivf_index_has_lists(data):
    """The public seam a benchmark sweeps nprobe through (benchmarks/scale/scale.py), never faiss's
    objects inside the index."""
    emb, q = data
    ivf, hnsw = FaissIndex.build(emb, "IVF16,Flat"), FaissIndex.build(emb, "HNSW16")
    assert ivf.lists == 16 and hnsw.lists is None
    ivf.set_search_params(nprobe=3)
    hnsw.set_search_params(ef_search=40)
    assert ivf.search_params() == {"nprobe": 3} and hnsw.search_params() == {"ef_search": 40}
    ivf.set_search_params(**ivf.default_search_params())
    assert ivf.search_params() == ivf.default_search_params() == {"nprobe": 16}


def test_bad_faiss_spec_is_a_clear_error(data):
    with pytest.raises(RalmError, match="bad faiss spec"):
        FaissIndex.build(data[0], "NoSuchIndex42")


def test_bm25_ranks_the_exact_term_match_first(tmp_path):
    texts = ["the cat sat on the mat", "dogs chase cars in the street", "a zebra named Quagga lives here", "stocks fell sharply"]
    index = BM25Index.build(texts, show_progress=False)
    scores, ids = index.search(["where does quagga live", "dogs and cars"], 2)
    assert ids[0, 0] == 2 and ids[1, 0] == 1
    assert scores[0, 0] > scores[0, 1]
    index.save(tmp_path / "bm25")
    again = BM25Index.load(tmp_path / "bm25", len(texts))
    np.testing.assert_array_equal(again.search(["where does quagga live"], 2)[1], ids[:1])


def test_bm25_search_scores_as_bm25s_in_the_calling_thread(monkeypatch):
    """Parity with bm25s's own retrieval (scores; ids wherever the scores are not tied), summed
    from the postings without bm25s.retrieve, which starts a thread for every call."""
    import threading

    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(300)]
    texts = [" ".join(rng.choice(words, size=int(rng.integers(5, 40)), p=np.arange(300, 0, -1) / 45150)) for _ in range(500)]
    queries = [" ".join(rng.choice(words, size=4)) for _ in range(20)] + ["w1 w1 w2"]
    index = BM25Index.build(texts, show_progress=False)
    found, expected = index.model.retrieve([q.split() for q in queries], k=50, show_progress=False, n_threads=1)
    started, start = [], threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (started.append(self), start(self))[1])
    scores, ids = index.search(queries, 50)
    assert started == []
    np.testing.assert_allclose(scores, expected, rtol=1e-6)
    for got, want, s in zip(ids, found, scores):
        above = s > s[-1]  # ranks a tie cannot reorder
        assert set(got[above]) == set(want[above])


def test_bm25_query_without_known_terms_scores_zero():
    index = BM25Index.build(["alpha beta", "gamma delta"], show_progress=False)
    scores, ids = index.search(["zzzz", "the of"], 2)
    assert (scores == 0).all() and ids.shape == (2, 2)


@pytest.mark.parametrize("n, k, group", [(5000, 8, 16), (4099, 3, 64), (100, 8, 64), (70_000, 20, 32)])
def test_grouped_topk_equals_full_topk(n, k, group):
    from ralm.retrieval.backends.exact import grouped_topk

    scores = torch.randn(5, n, generator=torch.Generator().manual_seed(n))
    ref = torch.topk(scores, min(k, n), dim=1)
    # [Q, C] and the CPU bf16 path's [C, Q] layout give the same exact top-k
    for vals, cols in (grouped_topk(scores, k, group), grouped_topk(scores.T.contiguous(), k, group, queries_last=True)):
        torch.testing.assert_close(vals, ref.values)
        torch.testing.assert_close(torch.gather(scores, 1, cols), vals)
        assert (torch.sort(cols, 1).values == torch.sort(ref.indices, 1).values).all()


def test_grouped_topk_when_the_top_k_share_one_group():
    from ralm.retrieval.backends.exact import grouped_topk

    scores = torch.zeros(1, 4096)
    scores[0, 100:108] = torch.arange(8, 0, -1).float()  # all eight winners in one group of 64
    vals, cols = grouped_topk(scores, 8, 64)
    assert cols.tolist() == [list(range(100, 108))]


def test_bf16_matrix_search_matches_fp32_except_near_ties(data):
    """The CUDA layout (bf16 matrix) run on CPU: same ids as fp32 unless scores nearly tie."""
    emb, q = data
    index = ExactIndex(emb)
    index._matrix = torch.from_numpy(emb).to(torch.bfloat16)  # what __init__ does on CUDA
    s16, i16 = index.search(q, 8)
    s32, i32 = ExactIndex(emb).search(q, 8)
    full = q @ emb.T
    for row in range(len(q)):
        for a, b in zip(i16[row], i32[row]):
            if a != b:
                assert abs(full[row, a] - full[row, b]) < 0.05 * abs(full[row]).max()


def test_live_bm25_scores_a_text_as_one_more_block_of_the_index(tmp_path):
    """Parity: scored with the index's statistics, a text gets the score bm25s gives it as a block of the index."""
    from ralm.retrieval.backends.bm25 import LiveBM25, term_hashes, tokens_of

    texts = ["the cat sat on the mat", "dogs chase cars in the street", "a zebra named Quagga lives here with a zebra",
             "stocks fell sharply", "the cat and the dog"]
    index = BM25Index.build(texts, show_progress=False)
    index.save(tmp_path / "bm25")
    index = BM25Index.load(tmp_path / "bm25", len(texts))  # the average length is saved with it
    queries = ["where does the zebra quagga live", "cat dog", "cat cat"]
    full, ids = index.search(queries, len(texts))
    by_row = np.take_along_axis(full, np.argsort(ids, 1), 1)  # [Q, N] in row order
    live_terms = [term_hashes(t) for t in tokens_of(texts[2:])]  # each block's terms, as the update log keeps them
    np.testing.assert_allclose(LiveBM25(index, live_terms).scores(queries), by_row[:, 2:], rtol=1e-5)
    unseen, rare, common = index.idf(["okapi", "quagga", "cat"])  # a word the index lacks counts as the rarest
    assert unseen > rare > common > 0 and LiveBM25(index, [term_hashes(["okapi"])]).scores(["okapi"])[0, 0] > 0
    # a block with no term (all stop words) keeps its place: the next block's scores stay its own
    shifted = LiveBM25(index, [term_hashes([]), *live_terms]).scores(queries)
    assert not shifted[:, 0].any()
    np.testing.assert_allclose(shifted[:, 1:], by_row[:, 2:], rtol=1e-5)


def test_live_bm25_scores_alike_before_and_after_it_sorts_its_terms(tmp_path):
    """Its first lookups scan every term; later ones search the terms it sorted: the same scores."""
    from ralm.retrieval.backends.bm25 import LiveBM25, term_hashes, tokens_of

    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(40)]
    texts = [" ".join(rng.choice(words, 12)) for _ in range(30)]
    index = BM25Index.build(texts[:10], show_progress=False)
    live = LiveBM25(index, [term_hashes(t) for t in tokens_of(texts[10:])])
    queries = [" ".join(rng.choice(words, 3)) for _ in range(20)]  # 60 lookups: fewer than SORT_AFTER
    scanned = live.scores(queries)
    assert live._sorted is None
    live.SORT_AFTER = 0
    live.scores(queries[:1])
    assert live._sorted is not None  # the lookups below are binary searches
    np.testing.assert_array_equal(live.scores(queries), scanned)
    assert (scanned > 0).mean() > 0.2  # the queries find blocks: the comparison is not of zeros


def test_the_bm25_side_logs_a_blocks_terms_as_hashes_and_reads_the_text_form_of_ralm_0_4():
    from ralm.retrieval.backends.bm25 import term_hashes
    from ralm.retrieval.index.bm25_side import BM25Side

    side = BM25Side(None, None)  # a state's bytes need neither the index nor its blocks
    records = [{"title": "Zanzibar", "text": "cloves and spices"}, {"title": "", "text": "the of a"}]
    states = side.live_state([], records)
    assert [len(s) for s in states] == [3, 0]  # `the of a`: stop words and a single letter, no term
    data = side.encode_state(states)
    for got, want in zip(side.decode_state(data, 2), states):
        np.testing.assert_array_equal(got, want)
    (one,) = side.decode_state(side.encode_state(states[:1]), 1)
    np.testing.assert_array_equal(one, states[0])
    legacy = b"zanzibar cloves spices\n"  # one line of terms a block
    for got, want in zip(side.decode_state(legacy, 2), [term_hashes(["zanzibar", "cloves", "spices"]), term_hashes([])]):
        np.testing.assert_array_equal(got, want)
    assert side.decode_state(data, 3) is None and side.decode_state(data[:-1], 2) is None  # damaged: split again
    assert side.decode_state(legacy, 3) is None


def _recall(got: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(got.tolist(), truth.tolist())]))


def test_faiss_rescores_its_shortlist_exactly_from_the_source_vectors(data):
    """Coarse codes (4 bits a dimension) rank roughly; given the float32 vectors, the index rescores
    its best k + RESCORE exactly: exact scores of the rows it returns, and the exact top k back."""
    emb, q = data
    coarse = FaissIndex.build(emb, "IVF8,SQ4")
    coarse.set_search_params(nprobe=8)
    rough_s, rough_i = coarse.search(q, 10)
    s, i = FaissIndex(coarse.index, coarse.spec, source=emb).search(q, 10)
    _, exact_i = ExactIndex(emb).search(q, 10)
    np.testing.assert_allclose(s, np.einsum("qd,qkd->qk", q, emb[i]), rtol=1e-5)
    assert np.all(np.diff(s, axis=1) <= 0)
    assert not np.allclose(rough_s, np.einsum("qd,qkd->qk", q, emb[rough_i]), rtol=1e-3)  # the codes alone: approximate
    assert _recall(i, exact_i) == 1.0 > _recall(rough_i, exact_i)


def test_faiss_rescoring_skips_the_rows_a_short_list_lacks(data):
    emb, q = data
    index = FaissIndex.build(emb, "IVF8,Flat")
    index.set_search_params(nprobe=1)  # one list of ~125 rows: fewer than k + RESCORE candidates for some queries
    s, i = FaissIndex(index.index, index.spec, source=emb).search(q, 200)
    real = i >= 0
    assert not real.all() and np.isneginf(s[~real]).all()
    np.testing.assert_allclose(s[real], np.einsum("qd,qkd->qk", q, emb[np.maximum(i, 0)])[real], rtol=1e-5, atol=1e-5)


def test_auto_spec_keeps_small_indexes_exact_and_sizes_ivf_lists_from_n():
    from ralm.retrieval.backends.faiss_index import APPROX_MIN_BLOCKS, auto_spec

    assert auto_spec(10_000) is None and auto_spec(APPROX_MIN_BLOCKS - 1) is None
    assert auto_spec(APPROX_MIN_BLOCKS) == "IVF2048,SQ8"
    assert auto_spec(1_000_000) == "IVF4096,SQ8" and auto_spec(10_000_000) == "IVF16384_HNSW32,SQ8"
    index = FaissIndex.build(np.random.default_rng(0).standard_normal((2000, 16), dtype=np.float32), "IVF16_HNSW32,SQ8")
    assert index.default_search_params() == {"nprobe": 16}  # the lists' graph is not the index's: no ef_search


def test_an_ivf_of_many_lists_trains_on_enough_vectors_for_each_list():
    from ralm.retrieval.backends.faiss_index import POINTS_PER_CLUSTER, TRAIN_VECTORS, faiss_module, training_count

    faiss = faiss_module()
    # 16,384 lists (what --faiss auto builds at 10M blocks) on the default sample would be 16 points a list
    assert training_count(faiss.index_factory(8, "IVF16384_HNSW32,SQ8", faiss.METRIC_INNER_PRODUCT)) == POINTS_PER_CLUSTER * 16_384
    assert training_count(faiss.index_factory(8, "IVF4096,SQ8", faiss.METRIC_INNER_PRODUCT)) == TRAIN_VECTORS
    assert training_count(faiss.index_factory(8, "HNSW32", faiss.METRIC_INNER_PRODUCT)) == TRAIN_VECTORS


def test_many_lists_train_by_two_level_kmeans_and_find_the_exact_neighbours(monkeypatch):
    from faiss.contrib import clustering

    from ralm.retrieval.backends import faiss_index as fi

    rng = np.random.default_rng(0)
    centres = rng.standard_normal((40, 32)).astype(np.float32)
    emb = centres[rng.integers(0, 40, 6000)] + 0.3 * rng.standard_normal((6000, 32), dtype=np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    queries = emb[rng.choice(6000, 50, replace=False)] + 0.05 * rng.standard_normal((50, 32), dtype=np.float32)
    truth = np.argsort(-queries @ emb.T, axis=1)[:, :10]
    calls = []
    real = clustering.two_level_clustering
    monkeypatch.setattr(clustering, "two_level_clustering", lambda *a, **k: calls.append(a[1:3]) or real(*a, **k))
    recall = {}
    for lists in (fi.TWO_LEVEL_LISTS, 64):  # the real threshold (one-level here), then 64 lists counted as many
        monkeypatch.setattr(fi, "TWO_LEVEL_LISTS", lists)
        index = fi.FaissIndex.build(emb, "IVF64,Flat")
        assert index._ivf().quantizer.ntotal == 64
        index.set_search_params(nprobe=8)
        got = index.search(queries, 10)[1]
        recall[lists] = np.mean([len(set(g) & set(t)) / 10 for g, t in zip(got, truth)])
    assert calls == [(8, 64)]  # sqrt(64) first-level clusters, split into 64 lists
    assert recall[64] >= 0.9 and recall[64] >= recall[fi.TWO_LEVEL_LISTS] - 0.05


def test_an_hnsw_graph_of_the_lists_places_vectors_with_a_wide_search_and_saves_it(tmp_path):
    from ralm.retrieval.backends import faiss_index as fi

    faiss = fi.faiss_module()
    emb = np.random.default_rng(0).standard_normal((3000, 16), dtype=np.float32)
    index = fi.FaissIndex.build(emb, "IVF32_HNSW32,SQ8")
    index.save(tmp_path / "ivf.faiss")
    loaded = fi.FaissIndex.load(tmp_path / "ivf.faiss", "IVF32_HNSW32,SQ8")
    for ivf in (index._ivf(), loaded._ivf()):  # faiss's default, 16, misplaced 9% of 10M vectors
        assert faiss.downcast_index(ivf.quantizer).hnsw.efSearch == fi.QUANTIZER_EF_SEARCH > 16
