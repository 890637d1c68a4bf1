import json
import shutil

import numpy as np
import pytest

from ralm.errors import RalmError
from ralm.retrieval.index.build import build_index
from ralm.retrieval.towers.encoders import Retriever
from ralm.retrieval.search.searcher import Searcher
from ralm.retrieval.index.store import IndexDir
from ralm.retrieval.index.dense_side import dense_of

from conftest import DOCS


def test_dense_index_round_trips_and_search_returns_block_text(tiny_dense_index):
    s = Searcher.open(tiny_dense_index)
    hits = s.search(["capital of France", "Apollo 11"], k=3)
    assert len(hits) == 2 and all(len(h) == 3 for h in hits)
    assert hits[0][0].score >= hits[0][1].score >= hits[0][2].score
    texts = {d["id"] + ":0": d["text"] for d in DOCS}
    for h in hits[0]:
        assert texts[h.id] == h.text and h.doc_id == h.id.split(":")[0]
    # scores are inner products of the stored embeddings and the query tower's output
    version = s.current
    q = dense_of(s.current).retriever.encode_queries(["capital of France"]).numpy()
    emb = np.load(IndexDir(tiny_dense_index).version_path(version.name) / "embeddings.npy")
    np.testing.assert_allclose([h.score for h in hits[0]], np.sort(q @ emb.T)[0, ::-1][:3], rtol=1e-4)


def test_index_rejects_a_mismatched_model(tiny_dense_index, other_tiny_bert, tmp_path):
    other = Retriever.from_pretrained(other_tiny_bert, dim=16)
    other.cfg.projection_ready = True
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(RalmError, match="built with another model"):
        Searcher.open(tiny_dense_index, model=str(tmp_path / "other"))
    wrong_dim = Retriever.from_pretrained(other_tiny_bert, dim=8)
    wrong_dim.save_pretrained(tmp_path / "dim8")
    with pytest.raises(RalmError, match="built with dimension 16, but the model produces 8"):
        Searcher.open(tiny_dense_index, model=str(tmp_path / "dim8"))


def test_fine_tuned_query_tower_is_accepted(tiny_dense_index, tmp_path):
    version = IndexDir(tiny_dense_index).version_manifest(IndexDir(tiny_dense_index).latest())
    r = Retriever.from_pretrained(tiny_dense_index / version["sections"]["dense"]["retriever"])
    for p in r.query.parameters():
        p.data.add_(0.01)  # the document tower (what built the index) is unchanged
    r.save_pretrained(tmp_path / "tuned")
    assert Searcher.open(tiny_dense_index, model=str(tmp_path / "tuned")).search(["Nile"], 1)[0]


def test_index_rejects_a_mismatched_corpus(tiny_dense_index, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dense_index, copy)
    index = IndexDir(copy)
    mpath = index.version_path(index.latest()) / "manifest.json"
    manifest = json.loads(mpath.read_text())
    manifest["count"] = 99
    mpath.write_text(json.dumps(manifest))
    with pytest.raises(RalmError, match="index has 99 entries but its corpus has 6 blocks"):
        Searcher.open(copy)


def test_rebuilding_adds_a_version_and_the_searcher_swaps_to_it(tiny_bert, corpus_file, tmp_path):
    build_index(corpus_file, tmp_path / "idx", model=str(tiny_bert), dim=16, show_progress=False)
    s = Searcher.open(tmp_path / "idx")
    assert not s.refresh()
    more = DOCS + [{"id": "oslo", "title": "Oslo", "text": "Oslo is the capital of Norway."}]
    corpus_file.write_text("".join(json.dumps(d) + "\n" for d in more))
    # the retriever the first version was built with is reused for the new corpus
    model = str(tmp_path / "idx" / IndexDir(tmp_path / "idx").version_manifest("v000001")["sections"]["dense"]["retriever"])
    _, name = build_index(corpus_file, tmp_path / "idx", model=model, show_progress=False)
    old = s.current
    assert name == "v000002" and s.refresh() and len(s) == 7 and len(old.blocks) == 6
    assert "oslo:0" in {h.id for h in s.search(["Norway"], 7)[0]}


def test_bm25_index_through_the_same_searcher(tiny_bert, corpus_file, tmp_path):
    build_index(corpus_file, tmp_path / "bm25", kind="bm25", model=str(tiny_bert), show_progress=False)
    searcher = Searcher.open(tmp_path / "bm25")
    hits = searcher.search(["Guido van Rossum"], 2)[0]
    assert hits[0].id == "python:0"
    assert dense_of(searcher.current, optional=True) is None
    with pytest.raises(RalmError, match=f"index {tmp_path / 'bm25'} \\(v000001\\) holds bm25 and no dense side"):
        dense_of(searcher.current)


def test_faiss_flat_version_matches_exact(tiny_bert, corpus_file, tmp_path):
    build_index(corpus_file, tmp_path / "f", model=str(tiny_bert), dim=16, faiss_spec="Flat", show_progress=False)
    build_index(corpus_file, tmp_path / "e", model=str(tiny_bert), dim=16, show_progress=False)
    a = Searcher.open(tmp_path / "f").search(["river in Africa"], 6)[0]
    b = Searcher.open(tmp_path / "e").search(["river in Africa"], 6)[0]
    assert [h.id for h in a] == [h.id for h in b]


def test_ivf_version_is_searched_with_its_recorded_nprobe(tiny_bert, corpus_file, tmp_path):
    index, name = build_index(corpus_file, tmp_path / "ivf", model=str(tiny_bert), dim=16, faiss_spec="IVF2,Flat",
                              show_progress=False)
    assert index.version_manifest(name)["sections"]["dense"]["faiss_params"] == {"nprobe": 2}
    import faiss

    assert faiss.extract_index_ivf(dense_of(Searcher.open(tmp_path / "ivf").current).index.index).nprobe == 2


def test_empty_query_is_rejected(tiny_dense_index):
    with pytest.raises(RalmError, match="non-empty strings"):
        Searcher.open(tiny_dense_index).search(["  "], 2)


def test_projecting_pooled_vectors_equals_encoding_again(tiny_bert, tmp_path):
    """The small-corpus shortcut (PCA sample = whole corpus) gives the same embeddings."""
    from ralm.data.blocks import BlockConfig, ensure_block_store
    from ralm.retrieval.index.dense_side import embed_blocks
    from ralm.retrieval.towers.projection import init_projection
    from ralm.runtime import Runtime

    r = Retriever.from_pretrained(tiny_bert, dim=16).eval()
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    _, blocks = ensure_block_store(tmp_path / "blocks", corpus, r.tokenizer, cfg=BlockConfig(), show_progress=False)
    cpu = Runtime.resolve("cpu")
    pooled = init_projection(r, blocks, runtime=cpu, show_progress=False)
    assert pooled is not None
    a = embed_blocks(r, blocks, tmp_path / "a.npy", cpu, show_progress=False, pooled=pooled)
    b = embed_blocks(r, blocks, tmp_path / "b.npy", cpu, show_progress=False)
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_bm25_lists_only_blocks_that_share_a_term_with_the_query(tiny_bert, corpus_file, tmp_path):
    build_index(corpus_file, tmp_path / "bm25", kind="bm25", model=str(tiny_bert), show_progress=False)
    s = Searcher.open(tmp_path / "bm25")
    assert [h.id for h in s.search(["Guido van Rossum"], 5)[0]] == ["python:0"]
    assert s.search(["zzzz"], 5) == [[]]
    assert s.search_rows(["Guido van Rossum"], 5)[0].shape == (1, 5)  # rows for the reader keep their k


def test_precomputed_embeddings_are_imported_not_encoded(tiny_bert, corpus_file, tmp_path):
    """`embeddings=`: the vectors given (row i = block i, any float dtype) become the dense side
    as float32, and the query tower searches them: the block given the query's direction wins."""
    retriever = Retriever.from_pretrained(tiny_bert)  # its own vectors, no projection
    given = np.random.default_rng(0).standard_normal((len(DOCS), retriever.dim))
    given[3] = retriever.encode_queries(["capital of France"]).numpy()[0] * 10  # DOCS[3] is Everest
    np.save(tmp_path / "emb.npy", given)
    index, name = build_index(corpus_file, tmp_path / "idx", model=str(tiny_bert), embeddings=tmp_path / "emb.npy",
                              show_progress=False)
    stored = np.load(index.version_path(name) / "embeddings.npy")
    assert stored.dtype == np.float32 and np.array_equal(stored, given.astype(np.float32))
    assert Searcher.open(tmp_path / "idx").search(["capital of France"], 1, retriever="dense")[0][0].id == "everest:0"
    assert set(index.version(name).extra["build_seconds"]) == {"blocks", "dense", "bm25"}


@pytest.mark.parametrize("make, message", [
    (lambda n, d: np.zeros((n + 1, d), np.float32), r"shape \(7, 32\); the index needs float vectors of shape \(6, 32\)"),
    (lambda n, d: np.zeros((n, d), np.int64), "int64 array"),
    (lambda n, d: np.where(np.arange(n)[:, None] == 4, np.inf, np.zeros((n, d), np.float32)), "row 4 holds NaN or infinite"),
    (lambda n, d: np.where(np.arange(n)[:, None] == 2, 0, np.ones((n, d), np.float32)), "row 2 is all zeros"),
])
def test_precomputed_embeddings_of_the_wrong_shape_or_values_are_refused(tiny_bert, corpus_file, tmp_path, make, message):
    np.save(tmp_path / "emb.npy", make(len(DOCS), 32))
    with pytest.raises(RalmError, match=message):
        build_index(corpus_file, tmp_path / "idx", model=str(tiny_bert), embeddings=tmp_path / "emb.npy", show_progress=False)
    assert IndexDir(tmp_path / "idx").versions() == []
    with pytest.raises(RalmError, match="fresh, untrained projection"):
        build_index(corpus_file, tmp_path / "idx", model=str(tiny_bert), dim=16, embeddings=tmp_path / "emb.npy",
                    show_progress=False)


def test_large_indexes_get_ivf_by_default_and_small_ones_stay_exact(tiny_bert, corpus_file, tmp_path, monkeypatch):
    from ralm.errors import RalmWarning
    from ralm.retrieval.backends import faiss_index

    index, name = build_index(corpus_file, tmp_path / "small", model=str(tiny_bert), show_progress=False)
    assert index.version(name).sections["dense"].faiss is None
    monkeypatch.setattr(faiss_index, "APPROX_MIN_BLOCKS", len(DOCS))  # this corpus counts as large
    with pytest.warns(RalmWarning, match="cannot train 8 clusters"):
        index, name = build_index(corpus_file, tmp_path / "large", model=str(tiny_bert), show_progress=False)
    assert index.version(name).sections["dense"].faiss == "IVF1,SQ8"
    queries = ["river in Africa", "capital of Japan", "programming language"]
    large = Searcher.open(tmp_path / "large")
    scores, rows = large.search_rows(queries, 6, retriever="dense")
    # rescored from the float32 vectors: each row's exact score, in the exact order (the tiny model's near-ties aside)
    q = dense_of(large.current).retriever.encode_queries(queries).numpy()
    np.testing.assert_allclose(scores, np.einsum("qd,qkd->qk", q, dense_of(large.current).embeddings[rows]), rtol=1e-5)
    np.testing.assert_allclose(scores, Searcher.open(tmp_path / "small").search_rows(queries, 6, retriever="dense")[0], rtol=1e-5)
