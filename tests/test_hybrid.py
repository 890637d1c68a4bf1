"""Hybrid indexes: both sides in one version, fusion maths (weighted, RRF), one side at query
time, upgrading an older index, and a new kind of side as one module plus a registry entry."""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest

from ralm.errors import RalmError
from ralm.retrieval.index import kinds
from ralm.retrieval.index.build import build_index, upgrade_index
from ralm.retrieval.index.store import IndexDir
from ralm.retrieval.search.fusion import Fusion, candidates, fuse_rrf, fuse_weighted, minmax, rank
from ralm.retrieval.search.live import LiveSearcher
from ralm.retrieval.search.searcher import Searcher
from ralm.retrieval.index.dense_side import dense_of
from conftest import DOCS

QUERIES = ["capital of France", "Who created Python?", "highest mountain"]


def test_fuse_weighted_is_a_convex_combination_of_minmax_scores_on_the_retrievers_scale():
    dense, bm25 = np.array([1.0, 3.0, 2.0]), np.array([10.0, 0.0, 5.0])
    assert np.allclose(minmax(dense), [0.0, 1.0, 0.5])
    scale = 0.25 * 2.0 + 0.75 * 10.0  # the same mix of the two score ranges
    fused = fuse_weighted({"dense": dense, "bm25": bm25}, {}, Fusion(alpha=0.25).side_weights(("dense", "bm25")))
    assert np.allclose(fused, (0.25 * np.array([0.0, 1.0, 0.5]) + 0.75 * np.array([1.0, 0.0, 0.5])) * scale)
    assert np.allclose(minmax(np.array([2.0, 2.0])), [0.0, 0.0])
    # alpha = 1 gives the dense scores up to a shift, so p(z|x) = softmax is exactly the dense one
    assert np.allclose(fuse_weighted({"dense": dense, "bm25": bm25}, {}, Fusion(alpha=1.0).side_weights(("dense", "bm25"))),
                       dense - dense.min())


def test_dense_and_bm25_fuse_as_before_weights_were_per_side():
    """The scores ralm 0.6 fused (dense alpha, BM25 1 - alpha), bit for bit, by default and with alpha."""
    dense = np.array([21.3, 19.75, 18.0, 22.125, 17.5, 20.0], np.float32)
    bm25 = np.array([7.5, 0.0, 12.25, 3.0, 0.0, 9.5], np.float32)
    assert Fusion().side_weights(("dense", "bm25")) == {"dense": 0.7, "bm25": 1 - 0.7}
    fused = fuse_weighted({"dense": dense, "bm25": bm25}, {}, Fusion().side_weights(("dense", "bm25")))
    assert fused.tolist() == [5.245264053344727, 2.3539865016937256, 2.596858263015747, 5.346607208251953, 0.0, 4.2237548828125]
    fused = fuse_weighted({"dense": dense, "bm25": bm25}, {}, Fusion(alpha=0.1).side_weights(("dense", "bm25")))
    assert fused.tolist() == [7.273683547973633, 0.5588513612747192, 10.46293830871582, 3.6806886196136475, 0.0, 8.638751029968262]


def test_weights_are_normalised_over_the_sides_fused():
    sides = ("dense", "bm25", "title")
    w = Fusion().side_weights(sides)  # a side the defaults do not name weighs an equal share, 1/3, before normalising
    assert sum(w.values()) == pytest.approx(1) and np.allclose([w[s] for s in sides], np.array([0.7, 0.3, 1 / 3]) / (4 / 3))
    x = np.array([1.0, 3.0, 2.0])
    assert np.allclose(fuse_weighted(dict.fromkeys(sides, x), {}, w), x - x.min())  # sides that agree: their own scale
    assert Fusion(alpha=1.0, weights={"title": 1.0}).side_weights(sides) == {"dense": 0.5, "bm25": 0.0, "title": 0.5}
    with pytest.raises(RalmError, match="side 'title' must be a finite number >= 0"):
        Fusion(weights={"title": float("nan")})
    with pytest.raises(RalmError, match="are all 0"):
        Fusion(weights={"dense": 0.0, "bm25": 0.0}).side_weights(("dense", "bm25"))


def test_rrf_sums_reciprocal_ranks_and_a_row_outside_a_list_adds_nothing():
    ranks = {"dense": np.array([0, 2, -1]), "bm25": np.array([1, -1, 0])}
    expected = 1000 * np.array([1 / 61 + 1 / 62, 1 / 63, 1 / 61])
    assert np.allclose(fuse_rrf({}, ranks, {}), expected)


def test_a_default_build_publishes_one_version_with_both_sides(tiny_hybrid_index):
    index = IndexDir(tiny_hybrid_index)
    assert index.kind == "hybrid" and index.versions() == ["v000001"]
    manifest = index.version_manifest("v000001")
    assert manifest["sides"] == ["dense", "bm25"] and manifest["kind"] == "hybrid"
    version = index.version_path("v000001")
    assert (version / "embeddings.npy").is_file() and (version / "bm25").is_dir()
    assert Searcher.open(tiny_hybrid_index).sides == ("dense", "bm25")


def test_alpha_one_is_dense_alpha_zero_is_bm25_and_one_side_searches_alone(tiny_hybrid_index):
    s = Searcher.open(tiny_hybrid_index)
    d = s.rank(QUERIES, 3, retriever="dense")
    assert np.array_equal(rank(s, QUERIES, k=3, snap=s.current, sides=("dense", "bm25"), fusion=Fusion(alpha=1.0)).rows, d.rows)
    b = s.rank(QUERIES, 1, retriever="bm25")
    assert np.array_equal(rank(s, QUERIES, k=1, snap=s.current, sides=("dense", "bm25"), fusion=Fusion(alpha=0.0)).rows[:, 0],
                          b.rows[:, 0])
    assert all(f == [("dense",)] * 3 for f in d.found_by)


def test_fused_results_say_which_side_found_them_and_read_block_text(tiny_hybrid_index):
    s = Searcher.open(tiny_hybrid_index)
    ranked = s.rank(["Who created Python?"], 4)
    assert np.all(np.diff(ranked.scores[0]) <= 0)
    bm25_rows = s.rank(["Who created Python?"], 100, retriever="bm25")
    bm25_found = {int(r) for r, f in zip(bm25_rows.rows[0], bm25_rows.found_by[0]) if f}
    for row, found in zip(ranked.rows[0], ranked.found_by[0]):
        assert "dense" in found  # every dense candidate is in the dense list (depth >= corpus)
        assert ("bm25" in found) == (int(row) in bm25_found)
    hits = s.search(["Who created Python?"], 4)[0]
    assert [h.row for h in hits] == ranked.rows[0].tolist()
    assert s.current.blocks.record(hits[0].row)["text"] == hits[0].text
    assert 0 <= ranked.agreement[0] <= 1 and set(ranked.top) == {"dense", "bm25"}


def test_queries_are_encoded_once_per_side_and_dense_scores_are_exact(tiny_hybrid_index):
    s = Searcher.open(tiny_hybrid_index)
    calls = []
    retriever = dense_of(s.current).retriever
    real = retriever.encode_queries
    retriever.encode_queries = lambda texts, **kw: (calls.append(len(texts)), real(texts, **kw))[1]
    ranked = rank(s, QUERIES, k=2, snap=s.current, sides=("dense", "bm25"), fusion=Fusion(alpha=1.0))
    assert calls == [3]
    q = real(QUERIES).numpy()
    emb = np.load(IndexDir(tiny_hybrid_index).version_path("v000001") / "embeddings.npy")
    exact = q @ emb.T  # alpha 1: fused = dense - its minimum over the candidates
    for i in range(len(QUERIES)):
        assert np.allclose(ranked.scores[i], exact[i, ranked.rows[i]] - exact[i].min(), atol=1e-4)


def test_a_side_the_index_lacks_is_a_clear_error_naming_the_upgrade(tiny_dense_index):
    with pytest.raises(RalmError, match="ralm index upgrade"):
        Searcher.open(tiny_dense_index).search(QUERIES, 2, retriever="bm25")
    with pytest.raises(RalmError, match="unknown index kind"):
        Searcher.open(tiny_dense_index).search(QUERIES, 2, retriever="colbert")


def test_upgrade_links_the_dense_side_adds_bm25_and_keeps_live_updates(tiny_dense_index, tmp_path):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(tiny_dense_index, old)
    LiveSearcher.open(old).add([__import__("ralm.data.corpus", fromlist=["Document"]).Document("zanzibar", "Zanzibar",
                                                                                                "Zanzibar is famous for cloves.")])
    before = Searcher.open(old).search(QUERIES, 3)
    index, name = upgrade_index(old, show_progress=False)
    assert (index.kind, name) == ("hybrid", "v000002")
    a, b = (index.version_path(v) / "embeddings.npy" for v in ("v000001", "v000002"))
    assert os.stat(a).st_ino == os.stat(b).st_ino  # linked, not re-encoded
    assert [[h.id for h in q] for q in Searcher.open(old).search(QUERIES, 3, retriever="dense")] == [[h.id for h in q] for q in before]
    live = LiveSearcher.open(old)
    assert live.search(["Zanzibar cloves"], 1, retriever="bm25")[0][0].id == "zanzibar:0"  # the log replays on the new side
    assert upgrade_index(old, show_progress=False)[1] == "v000002"  # nothing to add: no new version


def test_an_index_of_the_first_format_opens_as_its_one_side(tiny_dense_index, tmp_path):
    import shutil

    old = tmp_path / "v1"
    shutil.copytree(tiny_dense_index, old)
    (old / "manifest.json").write_text(json.dumps({"format": "ralm.index/1", "retriever": "dense"}))
    m = json.loads((old / "versions" / "v000001" / "manifest.json").read_text())
    for key in ("sides",):
        m.pop(key)
    (old / "versions" / "v000001" / "manifest.json").write_text(json.dumps(m))
    s = Searcher.open(old)
    assert s.sides == ("dense",) and len(s.search(QUERIES, 2)[0]) == 2
    with pytest.raises(RalmError, match="ralm index upgrade"):
        IndexDir.create(old, "hybrid")


# -- a new kind of side: one module (tests/toy_side.py) and one registry entry ---------------

TOY = "toy_side:TitleSide"


def test_a_new_side_is_a_module_and_a_registry_entry(monkeypatch, tmp_path, tiny_bert):
    monkeypatch.setitem(kinds.SIDES, "title", TOY)
    monkeypatch.setitem(kinds.KINDS, "title+dense", ("dense", "title"))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    build_index(corpus, tmp_path / "idx", kind="title+dense", model=str(tiny_bert), dim=16, show_progress=False)
    s = LiveSearcher.open(tmp_path / "idx")
    assert s.sides == ("dense", "title")
    top = s.search(["tell me about Mount Everest"], 1, retriever="title")[0][0]
    assert top.title == "Mount Everest" and top.found_by == ("title",)
    fused = s.search(["tell me about Mount Everest"], 3)[0]
    assert any(h.title == "Mount Everest" and "title" in h.found_by for h in fused)


def test_a_third_side_joins_the_hybrid_fused_with_weights_summing_to_one(monkeypatch, tmp_path, tiny_bert):
    """Dense, BM25 and the toy side in one index: the fused scores are the convex combination of
    the three (weights 0.7, 0.3 and an equal share 1/3, normalised), and agreement is the mean
    over the three pairs of sides."""
    monkeypatch.setitem(kinds.SIDES, "title", TOY)
    monkeypatch.setitem(kinds.KINDS, "hybrid+title", ("dense", "bm25", "title"))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    build_index(corpus, tmp_path / "idx", kind="hybrid+title", model=str(tiny_bert), dim=16, show_progress=False)
    s = Searcher.open(tmp_path / "idx")
    queries, k = ["tell me about Mount Everest", "Who created Python?", "the Moon and Paris"], 3
    ranked = s.rank(queries, k)
    w = np.array([0.7, 0.3, 1 / 3]) / (0.7 + 0.3 + 1 / 3)
    encoded = {side: s.encode(queries, side) for side in s.sides}
    lists = {side: s.side_search(encoded[side], 100, s.current, side) for side in s.sides}
    agreements = []
    for i in range(len(queries)):
        c = candidates(s, encoded, lists, i=i, snap=s.current)
        norm = [(c.scores[side] - c.scores[side].min()) / max(np.ptp(c.scores[side]), 1e-30) for side in s.sides]
        fused = sum(wi * n for wi, n in zip(w, norm)) * sum(wi * np.ptp(c.scores[side]) for wi, side in zip(w, s.sides))
        assert np.allclose(ranked.scores[i], np.sort(fused)[::-1][:k], atol=1e-5)
        tops = [set(c.listed[side][:k].tolist()) for side in s.sides]
        agreements.append(np.mean([len(a & b) / max(min(len(a), len(b)), 1) for a, b in itertools.combinations(tops, 2)]))
    assert np.allclose(ranked.agreement, agreements) and len(set(agreements)) > 1


def test_a_third_side_in_the_default_kind_withholds_answers_by_the_fallback_map(monkeypatch, tmp_path, tiny_bert):
    """The toy side joins the default kind: it is built and fused with dense and BM25, its own
    section is in the manifest, its top score is a confidence feature (`top_title`), and the
    fallback map ("*", the only one the reader has) withholds the answer to a question whose
    blocks it does not find, but not to one it does."""
    from ralm.models.confidence import Calibrations, SelectiveCalibration
    from ralm.models.reader import Reader
    from ralm.pipeline import OpenQA

    monkeypatch.setitem(kinds.SIDES, "title", TOY)
    monkeypatch.setattr(kinds, "DEFAULT_KIND", "bm25+dense+title")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    index, name = build_index(corpus, tmp_path / "idx", model=str(tiny_bert), dim=16, show_progress=False)
    assert index.kind == "bm25+dense+title" and index.version_manifest(name)["sections"]["title"] == {"file": "titles.json"}
    searcher = Searcher.open(tmp_path / "idx")
    found = searcher.rank(["Where is Mount Everest?"], 3).found_by[0]
    assert any("title" in f and len(f) > 1 for f in found)  # fused: the title side agrees with another on a block
    # P(right) = sigmoid(6 (top_title - 0.5)): 0.95 when a title is in the question, 0.05 otherwise
    cal = SelectiveCalibration(("top_title",), (0.5,), (1.0,), (6.0,), 0.0, 100)
    qa = OpenQA(Reader.from_encoder(tiny_bert, max_len=96, max_query_len=16), searcher, k=3, min_confidence=0.5)
    qa.calibrations = Calibrations({"*": cal})
    named, unnamed = qa.answer(["Where is Mount Everest?", "Which river flows north?"])
    assert named.confidence == pytest.approx(1 / (1 + np.exp(-3))) and not named.no_answer
    assert unnamed.confidence == pytest.approx(1 / (1 + np.exp(3))) and unnamed.no_answer and unnamed.answer == ""


def test_a_kind_is_named_by_its_registered_alias_else_by_its_sides_joined(monkeypatch):
    """kind_of names a side set (the alias registered for it, else its sides joined by "+" in
    alphabetical order); sides_of reads either name back, in the registry's order."""
    monkeypatch.setitem(kinds.SIDES, "title", TOY)
    assert kinds.kind_of(("bm25", "dense")) == "hybrid" and kinds.kind_of(("dense",)) == "dense"
    assert kinds.kind_of(("title", "dense", "bm25")) == "bm25+dense+title" and kinds.kind_of(("title",)) == "title"
    assert kinds.sides_of("title+bm25+dense") == kinds.sides_of("bm25+dense+title") == ("dense", "bm25", "title")
    assert kinds.sides_of("hybrid") == ("dense", "bm25")
    for bad in ("dense+dense", "dense+colbert", "", "+"):
        with pytest.raises(RalmError, match="unknown index kind"):
            kinds.sides_of(bad)
    with pytest.raises(RalmError, match="unknown: colbert"):
        kinds.kind_of(("dense", "colbert"))


def test_hybrid_indexes_of_ralm_04_open_unchanged_when_a_third_side_joins_the_default(monkeypatch, tmp_path, tiny_bert,
                                                                                       tiny_hybrid_index):
    """The default kind gains the toy side: a default build holds dense, BM25 and title, named by
    its sides ("bm25+dense+title"), and reads the map keyed by that name, else the fallback. A
    hybrid index laid out as ralm 0.4 wrote it (tests/fixtures) opens by the sides its manifest
    holds: still "hybrid", read with the hybrid map, its results what they were before."""
    import shutil

    from conftest import lay_out_as_ralm_04
    from ralm.models.confidence import Calibrations, SelectiveCalibration
    from ralm.models.reader import Reader
    from ralm.pipeline import OpenQA
    from ralm.serve.service import ServeConfig, Service

    old = tmp_path / "old"
    shutil.copytree(tiny_hybrid_index, old)
    lay_out_as_ralm_04(old)

    def results(path):
        return [[(h.id, h.score, h.found_by) for h in q] for q in Searcher.open(path).search(QUERIES, 3)]

    before = results(old)
    monkeypatch.setitem(kinds.SIDES, "title", TOY)
    monkeypatch.setattr(kinds, "DEFAULT_KIND", "bm25+dense+title")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    new, _ = build_index(corpus, tmp_path / "new", model=str(tiny_bert), dim=16, show_progress=False)
    assert new.sides == ("dense", "bm25", "title") and new.kind == "bm25+dense+title"
    assert json.loads((tmp_path / "new" / "manifest.json").read_text())["kind"] == "bm25+dense+title"
    assert (IndexDir(old).kind, IndexDir(old).sides) == ("hybrid", ("dense", "bm25")) and results(old) == before

    hybrid_map, joined_map, fallback = (SelectiveCalibration(("logit_score",), (0.0,), (1.0,), (w,), 0.0, 100)
                                        for w in (1.0, 2.0, 3.0))
    reader = Reader.from_encoder(tiny_bert, max_len=96, max_query_len=16)

    def map_read(path, maps, side=None):
        qa = OpenQA(reader, Searcher.open(path), k=3, side=side)
        qa.calibrations = Calibrations(maps)
        return qa.kind, qa.calibration

    maps = {"hybrid": hybrid_map, "*": fallback}
    assert map_read(old, maps) == ("hybrid", hybrid_map)
    assert map_read(tmp_path / "new", maps) == ("bm25+dense+title", fallback)
    assert map_read(tmp_path / "new", {**maps, "bm25+dense+title": joined_map}) == ("bm25+dense+title", joined_map)
    assert map_read(tmp_path / "new", maps, side="hybrid") == ("hybrid", hybrid_map)
    assert Service(ServeConfig(index=str(tmp_path / "new"))).kinds() == ["bm25+dense+title", "hybrid", "dense", "bm25", "title"]


def test_a_version_with_its_dense_side_searched_exactly_ranks_as_an_exact_index(tmp_path, tiny_bert):
    """`DenseSide.exactly()` in place of a faiss-searched side (what a benchmark measures an
    approximate index's recall against) ranks fused and dense-only as the same index built for
    exact search, and leaves the searcher's own side as it was."""
    from dataclasses import replace

    from ralm.retrieval.backends.exact import ExactIndex
    from ralm.retrieval.backends.faiss_index import FaissIndex

    build_index(DOCS, tmp_path / "approx", model=str(tiny_bert), dim=16, faiss_spec="HNSW8", show_progress=False)
    build_index(DOCS, tmp_path / "exact", model=str(tiny_bert), dim=16, faiss_spec=None, show_progress=False)
    approx, exact = Searcher.open(tmp_path / "approx"), Searcher.open(tmp_path / "exact")
    dense = dense_of(approx.current)
    snap = replace(approx.current, sides={**approx.current.sides, dense.name: dense.exactly()})
    assert isinstance(dense.index, FaissIndex) and isinstance(dense_of(snap).index, ExactIndex)
    for side in (None, dense.name):
        want = exact.rank(QUERIES, 5, side=side)
        got = approx.rank(QUERIES, 5, snap, side=side)
        assert (got.rows == want.rows).all() and np.allclose(got.scores, want.scores, atol=1e-5)
