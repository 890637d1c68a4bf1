"""`ralm index add` / `ralm index delete` / `ralm index upgrade`: the server's crash-safe update
log without a server, seen by every command and every side of the index."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from conftest import DOCS

from ralm.data.corpus import Document
from ralm.errors import RalmError
from ralm.retrieval.index import bm25_side, dense_side
from ralm.retrieval.index.store import IndexDir
from ralm.retrieval.search.live import LiveSearcher
from ralm.retrieval.search.update_log import UpdateLog

NEW = [{"id": "zanzibar", "title": "Zanzibar", "text": "Zanzibar is an archipelago famous for cloves."},
       {"id": "kili", "title": "Kilimanjaro", "text": "Kilimanjaro is a dormant volcano in Tanzania."}]


def _ids(ralm, index, query, retriever, k=10):
    code, out, err = ralm("search", index, query, "-k", k, "--retriever", retriever, "--json")
    assert code == 0, err
    return [h["id"] for h in json.loads(out)]


def test_add_then_delete_reach_both_sides_and_every_command(ralm, tiny_hybrid_index, tmp_path):
    index = tmp_path / "idx"
    shutil.copytree(tiny_hybrid_index, index)
    docs = tmp_path / "new.jsonl"
    docs.write_text("".join(json.dumps(d) + "\n" for d in NEW))
    code, out, err = ralm("index", "add", index, docs, "--json")
    assert code == 0, err
    assert json.loads(out) == {"index": str(index), "added": 2, "deleted": 0, "blocks": len(DOCS) + 2,
                               "index_version": "v000001"}
    assert _ids(ralm, index, "archipelago cloves", "bm25", k=1) == ["zanzibar:0"]
    assert {"zanzibar:0", "kili:0"} <= set(_ids(ralm, index, "anything", "dense"))
    code, out, err = ralm("index", "delete", index, "zanzibar", "paris", "--json")
    assert code == 0 and json.loads(out)["deleted"] == 2 and json.loads(out)["blocks"] == len(DOCS)
    for side in ("dense", "bm25", "hybrid"):
        found = _ids(ralm, index, "archipelago cloves capital of France", side)
        assert "zanzibar:0" not in found and "paris:0" not in found, side
    code, out, err = ralm("index", "delete", index, "zanzibar")
    assert code == 2 and "holds no document 'zanzibar'" in err


def test_a_crash_between_two_adds_keeps_the_first_and_drops_the_torn_second(ralm, tiny_hybrid_index, tmp_path):
    index = tmp_path / "idx"
    shutil.copytree(tiny_hybrid_index, index)
    first = tmp_path / "first.jsonl"
    first.write_text(json.dumps(NEW[0]) + "\n")
    assert ralm("index", "add", index, first)[0] == 0
    with open(index / "updates.jsonl", "ab") as f:  # the second add killed mid-append: never acknowledged
        f.write(json.dumps({"op": "add", **NEW[1]}).encode()[:30])
    assert _ids(ralm, index, "archipelago cloves", "bm25", k=1) == ["zanzibar:0"]
    assert "kili:0" not in _ids(ralm, index, "dormant volcano Tanzania", "bm25")
    second = tmp_path / "second.jsonl"
    second.write_text(json.dumps(NEW[1]) + "\n")
    assert ralm("index", "add", index, second)[0] == 0  # the retry lands on a line of its own
    assert _ids(ralm, index, "dormant volcano Tanzania", "bm25", k=1) == ["kili:0"]
    lines = (index / "updates.jsonl").read_text().splitlines()  # the torn bytes are gone: a header, then one line each
    assert [json.loads(line).get("op") for line in lines] == ["log", "add", "add"]
    assert [r["id"] for r in UpdateLog(index).read().records] == ["zanzibar", "kili"]


def test_upgrade_a_dense_index_from_the_command_line(ralm, tiny_dense_index, tmp_path):
    index = tmp_path / "old"
    shutil.copytree(tiny_dense_index, index)
    code, out, err = ralm("search", index, "capital", "--retriever", "bm25")
    assert code == 2 and f"ralm index upgrade {index}" in err
    code, out, err = ralm("ask", "What is the capital?", "--index", index, "--hybrid", index)
    assert code == 2 and "--hybrid is no longer needed" in err and "ralm index upgrade" in err
    code, out, err = ralm("index", "upgrade", index, "--json")
    assert code == 0 and json.loads(out)["retriever"] == "hybrid" and json.loads(out)["version"] == "v000002"
    assert json.loads(out)["upgraded"] is True
    assert _ids(ralm, index, "Guido van Rossum", "bm25", k=1) == ["python:0"]
    code, out, err = ralm("index", "upgrade", index)  # already hybrid: said, not "upgraded in 0.0 s"
    assert code == 0 and out.strip() == f"nothing to do: {index} (v000002) already holds every side of a hybrid index (hybrid)"


def test_counts_are_singular_where_they_are_one(ralm, tiny_hybrid_index, tmp_path):
    index = tmp_path / "idx"
    shutil.copytree(tiny_hybrid_index, index)
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps(NEW[0]) + "\n")
    code, out, err = ralm("index", "add", index, one)
    assert code == 0 and out.strip() == f"added 1 document to {index}: {len(DOCS) + 1} blocks searchable", err
    for doc in DOCS[1:]:
        ralm("index", "delete", index, doc["id"])
    code, out, err = ralm("index", "delete", index, DOCS[0]["id"])
    assert code == 0 and out.strip() == f"deleted 1 document from {index}: 1 block searchable", err


def test_deleting_many_documents_takes_one_pass_and_one_log_append(tiny_hybrid_index, tmp_path, monkeypatch):
    index = tmp_path / "idx"
    shutil.copytree(tiny_hybrid_index, index)
    live = LiveSearcher.open(index)
    live.add([Document(d["id"], d["title"], d["text"]) for d in NEW])
    appends, snapshots = [], []
    append, snapshot = UpdateLog.append, LiveSearcher._snapshot
    monkeypatch.setattr(UpdateLog, "append", lambda self, entries, **kw: appends.append(entries) or append(self, entries, **kw))
    monkeypatch.setattr(LiveSearcher, "_snapshot", lambda self, *a: snapshots.append(a) or snapshot(self, *a))
    with pytest.raises(KeyError, match="nowhere"):
        live.delete(["paris", "nowhere"])
    assert live.exists("paris") and appends == [] and snapshots == []  # all or nothing
    with pytest.raises(RalmError, match="list of document ids"):
        live.delete("paris")
    live.delete(["zanzibar", "paris", "tokyo", "paris"])
    assert [[e.record["id"] for e in batch] for batch in appends] == [["zanzibar", "paris", "tokyo"]] and len(snapshots) == 1
    assert len(live) == len(DOCS) - 1  # 6 + kili - paris - tokyo, one block each
    for searcher in (live, LiveSearcher.open(index)):  # the log replays to the same documents
        assert [i for i in ("zanzibar", "paris", "tokyo", "kili", "nile") if searcher.exists(i)] == ["kili", "nile"]
        found = {h.doc_id for h in searcher.search(["capital archipelago cloves volcano"], 10)[0]}
        assert found == {d["id"] for d in DOCS} - {"paris", "tokyo"} | {"kili"}


def test_after_many_deletes_a_search_finds_the_best_documents_left_from_a_short_list(tiny_bert, tmp_path, monkeypatch):
    """Hidden rows crowding the main index's list make it ask for more, as often as needed; a
    list they do not crowd is not asked for longer than 2k."""
    import numpy as np

    from ralm.retrieval.index.build import build_index
    from ralm.retrieval.search.searcher import Searcher

    rng = np.random.default_rng(0)
    words = [f"word{i}" for i in range(30)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "title": f"Doc {i}", "text": " ".join(rng.choice(words, 8))}) + "\n"
                              for i in range(60)))
    build_index(corpus, tmp_path / "idx", model=str(tiny_bert), dim=16, show_progress=False)
    live = LiveSearcher.open(tmp_path / "idx")
    query = ["word1 word2 word3"]
    before = {side: [h.doc_id for h in live.search(query, 60, retriever=side)[0]] for side in ("dense", "bm25")}
    gone = set(before["dense"][:10]) | set(before["bm25"][:10])
    live.delete(sorted(gone))
    asked = []
    side_search = Searcher.side_search
    monkeypatch.setattr(Searcher, "side_search", lambda self, enc, k, *a: asked.append(k) or side_search(self, enc, k, *a))
    for side in ("dense", "bm25"):
        asked.clear()
        assert [h.doc_id for h in live.search(query, 3, retriever=side)[0]] == [d for d in before[side] if d not in gone][:3]
        assert asked[0] == 6 and len(asked) > 1, side  # crowded out: asked again, for more
    asked.clear()
    live.search(["Doc 59"], 3, retriever="bm25")
    assert len(gone) + 3 > 6 and asked == [6]  # a list no deleted document crowds: 2k rows, not k + every hidden one


def test_the_live_blocks_best_k_are_a_stable_sorts_first_k_ties_included():
    """Found by partition, the overlay's best k are the blocks a full stable sort puts first
    (a tie goes to the earlier block), with scores that tie often (BM25) or never (dense)."""
    import numpy as np

    from ralm.retrieval.search.live import _best

    rng = np.random.default_rng(0)
    for trial in range(200):
        q, m, k = rng.integers(1, 4), rng.integers(1, 60), rng.integers(1, 20)
        scores = rng.integers(0, 4, (q, m)).astype(np.float32) if trial % 2 else rng.random((q, m)).astype(np.float32)
        best, cols = _best(scores, k)
        want = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        np.testing.assert_array_equal(np.take_along_axis(cols, np.argsort(-best, axis=1, kind="stable"), 1), want)
        np.testing.assert_array_equal(best, np.take_along_axis(scores, cols, 1))


# -- files read by sections: a file's name names every section and page of it ----------------

ABOUT = """# About the club

The Riverside Chess Club welcomes players of every level.

## Where we meet

We meet in the library hall every Tuesday evening.

## Fees

Membership costs twelve pounds a year, paid in banana bread.

## Contact

Write to the secretary, who keeps a pet penguin.
"""
ABOUT_IDS = ["about.md", "about.md#where-we-meet", "about.md#fees", "about.md#contact"]
# the file edited: its last section gone, its fees changed
CHANGED = ABOUT.split("## Contact")[0].replace("costs twelve pounds a year, paid in banana bread", "is now free for volcano researchers")


def make_files(folder, *, about: str = ABOUT, pages: int = 2):
    """A Markdown file of a preamble and three sections, a PDF of `pages` pages and a .txt file."""
    from test_formats import write_pdf

    folder.mkdir()
    (folder / "about.md").write_text(about)
    write_pdf(folder / "handbook.pdf", [("Rules", "Every game starts with a tractor joke."),
                                        ("Ratings", "Ratings are updated after each saxophone concert.")][:pages], title="Handbook")
    (folder / "notes.txt").write_text("Tea is served at nine.")
    return folder


@pytest.fixture(scope="module")
def filed_index(tmp_path_factory, tiny_bert):
    """A hybrid index over a folder of about.md (4 documents), handbook.pdf (2 pages), notes.txt: a block each."""
    from ralm.retrieval.index.build import build_index

    root = tmp_path_factory.mktemp("filed")
    build_index(make_files(root / "files"), root / "idx", model=str(tiny_bert), dim=16, show_progress=False)
    return root / "idx"


def _holding(ralm, index, word):
    """The blocks holding `word` that a search finds."""
    code, out, err = ralm("search", index, word, "-k", 20, "--side", "bm25", "--json")
    assert code == 0, err
    return [h["id"] for h in json.loads(out) if word in h["text"].lower()]


def test_deleting_a_files_name_deletes_its_every_section_and_page(ralm, filed_index, tmp_path):
    index = tmp_path / "idx"
    shutil.copytree(filed_index, index)
    assert _holding(ralm, index, "penguin") == ["about.md#contact:0"] and _holding(ralm, index, "saxophone") == ["handbook.pdf#page=2:0"]
    code, out, err = ralm("index", "delete", index, "about.md#fees", "--json")  # a section's id: that section alone
    assert code == 0 and (json.loads(out)["deleted"], json.loads(out)["documents"]) == (1, ["about.md#fees"]), err
    assert _holding(ralm, index, "banana") == [] and _holding(ralm, index, "penguin") == ["about.md#contact:0"]
    assert ralm("index", "compact", index)[0] == 0  # the rest found in a compacted version's block store too
    code, out, err = ralm("index", "delete", index, "about.md")
    assert code == 0 and out.strip() == f"deleted 3 documents from {index} (every section of about.md): 3 blocks searchable", err
    code, out, err = ralm("index", "delete", index, "handbook.pdf", "--json")  # pages only, no document of the name itself
    assert code == 0, err
    assert json.loads(out) == {"index": str(index), "deleted": 2, "blocks": 1, "index_version": "v000002",
                               "documents": ["handbook.pdf#page=1", "handbook.pdf#page=2"]}
    for word in ("chess", "library", "penguin", "tractor", "saxophone"):  # the last section's word too: nothing left to serve
        assert _holding(ralm, index, word) == [], word
    assert _holding(ralm, index, "tea") == ["notes.txt:0"]
    code, out, err = ralm("index", "delete", index, "about.md")
    assert code == 2 and "holds no document 'about.md'" in err


def test_adding_a_changed_file_again_replaces_its_every_section_in_one_log_batch(ralm, filed_index, tmp_path):
    index = tmp_path / "idx"
    shutil.copytree(filed_index, index)
    changed = make_files(tmp_path / "changed", about=CHANGED, pages=1)
    code, out, err = ralm("index", "add", index, changed, "--json")
    assert code == 0, err
    assert (json.loads(out)["added"], json.loads(out)["deleted"], json.loads(out)["blocks"]) == (5, 2, 5)
    assert _holding(ralm, index, "penguin") == [] and _holding(ralm, index, "saxophone") == []  # the sections it lost
    assert _holding(ralm, index, "banana") == [] and _holding(ralm, index, "volcano") == ["about.md#fees:0"]  # the new text only
    lines = (index / "updates.jsonl").read_text().splitlines()[1:]
    assert [json.loads(line).get("more", False) for line in lines] == [True] * (len(lines) - 1) + [False]  # one batch
    assert {json.loads(line)["id"] for line in lines if json.loads(line)["op"] == "delete"} == {"about.md#contact", "handbook.pdf#page=2"}


def test_a_crash_while_a_changed_file_is_added_again_leaves_it_whole_as_it_was_or_as_it_is(ralm, filed_index, tmp_path):
    """`ralm index add IDX about.md` killed at any byte of its append: a reader finds the file
    whole, every section as it was (the append never acknowledged) or as it is now."""
    written, crashed = tmp_path / "written", tmp_path / "crashed"
    shutil.copytree(filed_index, written)
    shutil.copytree(filed_index, crashed)
    (tmp_path / "about.md").write_text(CHANGED)
    assert ralm("index", "add", written, tmp_path / "about.md")[0] == 0
    header, *lines = (written / "updates.jsonl").read_bytes().splitlines(keepends=True)
    for state in written.glob("updates-*.bin"):  # written and fsync'd before the records
        shutil.copy(state, crashed)
    appended = b"".join(lines)
    cuts = [sum(map(len, lines[:n])) for n in range(len(lines))] + [len(appended) - 3, len(appended)]
    for cut in cuts:
        (crashed / "updates.jsonl").write_bytes(header + appended[:cut])
        live = LiveSearcher.open(crashed)
        texts = " ".join(h.text for h in live.search(["penguin banana volcano"], 20, retriever="bm25")[0])
        held = [i for i in ABOUT_IDS if live.exists(i)]
        if cut < len(appended):
            assert held == ABOUT_IDS and "banana" in texts and "volcano" not in texts, cut
        else:
            assert held == ABOUT_IDS[:3] and "volcano" in texts and "banana" not in texts and "penguin" not in texts


# -- several processes sharing one index -----------------------------------------------------

def test_a_reader_opening_while_another_process_appends_never_cuts_its_record(tiny_hybrid_index, tmp_path):
    index = tmp_path / "idx"
    shutil.copytree(tiny_hybrid_index, index)
    record = (json.dumps({"op": "add", **NEW[0]}) + "\n").encode()
    with open(index / "updates.jsonl", "ab") as writer:  # another process, half way through its append
        writer.write(record[:25])
        writer.flush()
        reader = LiveSearcher.open(index)  # a command opening the index meanwhile
        assert (index / "updates.jsonl").stat().st_size == 25 and not reader.exists("zanzibar")  # it modified nothing
        writer.write(record[25:])
        writer.flush()
        os.fsync(writer.fileno())  # the writer acknowledges its record
    assert LiveSearcher.open(index).exists("zanzibar")


def test_opening_an_index_reads_logged_documents_back_without_embedding_them(ralm, tiny_hybrid_index, tmp_path, monkeypatch):
    index = tmp_path / "idx"
    shutil.copytree(tiny_hybrid_index, index)
    docs = tmp_path / "new.jsonl"
    docs.write_text("".join(json.dumps(d) + "\n" for d in NEW))
    assert ralm("index", "add", index, docs)[0] == 0
    writer = LiveSearcher.open(index)
    writer.delete(["paris"])
    before = {r: writer.search(["archipelago volcano capital"], 8, retriever=r)[0] for r in ("dense", "bm25", "hybrid")}

    def embedding(*args, **kwargs):
        raise AssertionError("an open embedded a logged document again")

    monkeypatch.setattr(dense_side, "encode_rows", embedding)
    monkeypatch.setattr(bm25_side, "tokens_of", embedding)
    reader = LiveSearcher.open(index)
    assert {r: reader.search(["archipelago volcano capital"], 8, retriever=r)[0] for r in before} == before


def test_add_takes_a_sides_states_computed_elsewhere_and_the_log_keeps_them(tiny_hybrid_index, tmp_path, monkeypatch):
    """`add(docs, states={side: fn})`: fn of the new blocks' records gives that side's states in
    place of its own (imported vectors: nothing is embedded); a side the index lacks, or a count
    other than the blocks', is refused before anything is logged."""
    index = tmp_path / "idx"
    shutil.copytree(tiny_hybrid_index, index)
    live = LiveSearcher.open(index)
    vec = np.zeros(live.current.version.sides["dense"].embeddings.shape[1], np.float32)
    vec[0] = 1.0
    seen = []

    def given(records):
        seen.extend(r["doc_id"] for r in records)
        return [vec for _ in records]

    def embedding(*args, **kwargs):
        raise AssertionError("a block with given states was embedded")

    monkeypatch.setattr(dense_side, "encode_rows", embedding)
    with pytest.raises(RalmError, match="nosuch"):
        live.add([Document(**NEW[0])], states={"nosuch": given})
    with pytest.raises(RalmError, match="for 1 blocks"):
        live.add([Document(**NEW[0])], states={"dense": lambda records: []})
    assert not LiveSearcher.open(index).exists("zanzibar")
    live.add([Document(**NEW[0])], states={"dense": given})
    assert seen == ["zanzibar"]
    for searcher in (live, LiveSearcher.open(index)):  # the log keeps the given state
        state = searcher.current.delta.state
        assert len(state["dense"]) == 1 and np.array_equal(state["dense"][0], vec) and len(state["bm25"]) == 1


def test_a_replay_holds_the_cycle_collector_off_and_leaves_it_as_it_found_it(tiny_hybrid_index, tmp_path, monkeypatch):
    import gc

    from ralm.retrieval.search import live

    index = tmp_path / "idx"
    shutil.copytree(tiny_hybrid_index, index)
    LiveSearcher.open(index).add([Document(**NEW[0])])
    seen, fold = [], live.fold
    monkeypatch.setattr(live, "fold", lambda records: seen.append(gc.isenabled()) or fold(records))
    assert gc.isenabled() and LiveSearcher.open(index).exists("zanzibar") and seen == [False] and gc.isenabled()
    gc.disable()
    try:
        LiveSearcher.open(index)
        assert not gc.isenabled()  # a caller that paused it keeps it paused
    finally:
        gc.enable()
    monkeypatch.setattr(live, "fold", lambda records: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        LiveSearcher.open(index)
    assert gc.isenabled()


def test_a_searcher_follows_what_another_process_writes_and_deletes_its_documents(tiny_hybrid_index, tmp_path):
    index = tmp_path / "idx"
    shutil.copytree(tiny_hybrid_index, index)
    server, cli = LiveSearcher.open(index), LiveSearcher.open(index)
    cli.add([Document(**NEW[0])])
    assert not server.exists("zanzibar") and server.refresh() is False and server.exists("zanzibar")
    assert server.search(["archipelago cloves"], 1, retriever="bm25")[0][0].id == "zanzibar:0"
    server.delete(["zanzibar"])  # a writer catches up with the log before it checks and appends
    with pytest.raises(KeyError, match="zanzibar"):
        cli.delete(["zanzibar"])  # deleted by the other process meanwhile
    assert not cli.exists("zanzibar")


def test_compact_folds_the_log_into_a_version_that_searches_the_same(ralm, tiny_hybrid_index, tmp_path):
    from ralm.retrieval.search.compaction import compact_index

    index = tmp_path / "idx"
    shutil.copytree(tiny_hybrid_index, index)
    live = LiveSearcher.open(index)
    live.add([Document(**d) for d in NEW])
    live.add([Document("paris", "Paris", "Paris now mentions cloves and a dormant volcano.")])
    live.delete(["tokyo", "kili"])
    queries = ["archipelago cloves", "dormant volcano", "capital of Japan"]
    before = {r: [[(h.id, h.text) for h in hs] for hs in live.search(queries, 10, retriever=r)] for r in ("dense", "bm25")}
    dense = [[round(h.score, 5) for h in hs] for hs in live.search(queries, 10, retriever="dense")]
    code, out, err = ralm("index", "compact", index, "--json")
    assert code == 0, err
    done = json.loads(out)
    assert done["version"] == "v000002" and done["folded"] == 5 and done["blocks"] == len(DOCS)  # +zanzibar -tokyo
    compacted = LiveSearcher.open(index)
    assert compacted.current.log.records == 0 and len(compacted.current.delta.docs) == 0
    after = {r: [[(h.id, h.text) for h in hs] for hs in compacted.search(queries, 10, retriever=r)] for r in before}
    assert after["dense"] == before["dense"]  # the same embeddings, carried over
    assert [[round(h.score, 5) for h in hs] for hs in compacted.search(queries, 10, retriever="dense")] == dense
    assert [set(hs) for hs in after["bm25"]] == [set(hs) for hs in before["bm25"]]  # statistics of the new corpus: same blocks
    assert live.refresh() is True and live.current.name == "v000002"  # an open searcher swaps to it
    assert json.loads(ralm("index", "compact", index, "--json")[1])["version"] is None  # nothing left to fold
    live.add([Document("kili", "Kilimanjaro", "Kilimanjaro is back.")])
    assert ralm("index", "compact", index)[0] == 0
    code, out, err = ralm("index", "check", index, "--json")
    assert code == 0 and json.loads(out)["logged_updates"] == 0, err
    for i in range(2):  # versions 4 and 5: the 2nd is pruned, and the block store it compacted into goes with it
        live.add([Document(f"extra{i}", "Extra", "One more document.")])
        compact_index(live)
    kept = {IndexDir(index).version(v).blocks for v in IndexDir(index).versions()}
    assert IndexDir(index).versions() == ["v000003", "v000004", "v000005"]
    assert {p.name for p in (index / "blocks").iterdir() if p.name.startswith("compacted-")} == kept
    assert LiveSearcher.open(index).exists("kili") and not LiveSearcher.open(index).exists("tokyo")


def test_a_compaction_killed_between_publishing_and_restarting_the_log_loses_and_doubles_nothing(tiny_hybrid_index, tmp_path,
                                                                                                  monkeypatch):
    from ralm.retrieval.search.compaction import compact_index

    index = tmp_path / "idx"
    shutil.copytree(tiny_hybrid_index, index)
    live = LiveSearcher.open(index)
    live.add([Document(**d) for d in NEW])
    live.delete(["paris"])
    blocks = len(live)

    def killed(self, log_id, *, after):
        raise KeyboardInterrupt  # as a kill -9 right after LATEST moved

    with monkeypatch.context() as m:
        m.setattr(UpdateLog, "restart", killed)
        with pytest.raises(KeyboardInterrupt):
            compact_index(LiveSearcher.open(index))
    assert (index / "LATEST").read_text().strip() == "v000002" and len(UpdateLog(index).read().records) == 3
    reopened = LiveSearcher.open(index)  # the new version, and the old log from the offset it holds
    assert len(reopened) == blocks and reopened.current.log.records == 0 and not reopened.exists("paris")
    live.add([Document("paris", "Paris", "Paris is back.")])  # the old searcher catches up first: it swaps, then appends
    assert live.current.name == "v000002" and LiveSearcher.open(index).exists("paris")
    assert compact_index(LiveSearcher.open(index)).folded == 1 and len(LiveSearcher.open(index)) == blocks + 1


def test_a_killed_upgrade_leaves_an_index_of_the_kind_its_latest_version_holds(ralm, tiny_dense_index, corpus_file, tmp_path):
    index = tmp_path / "idx"
    shutil.copytree(tiny_dense_index, index)
    assert ralm("index", "upgrade", index)[0] == 0
    root = json.loads((index / "manifest.json").read_text())
    (index / "manifest.json").write_text(json.dumps({**root, "retriever": "dense"}))  # what ralm <= 0.4 left when killed there
    assert IndexDir(index).kind == "hybrid"
    code, out, err = ralm("index", "check", index, "--json")
    assert code == 0 and json.loads(out)["retriever"] == "hybrid", err
    assert ralm("index", "upgrade", index, "--json")[0] == 0
    assert _ids(ralm, index, "Guido van Rossum", "bm25", k=1) == ["python:0"]
    code, out, err = ralm("index", "build", corpus_file, "--out", index, "--model", IndexDir(index).root / "retriever" /
                          next(p.name for p in (index / "retriever").iterdir()), "--json")
    assert code == 0 and json.loads(out)["retriever"] == "hybrid", err  # a hybrid build into it is one more version


def test_a_searcher_that_cannot_load_a_compacted_version_keeps_what_it_served(tiny_hybrid_index, tmp_path, monkeypatch):
    from ralm.retrieval.search.compaction import compact_index
    from ralm.retrieval.search.searcher import Searcher

    index = tmp_path / "idx"
    shutil.copytree(tiny_hybrid_index, index)
    server = LiveSearcher.open(index)
    server.add([Document(**NEW[0])])
    server.delete(["paris"])
    compact_index(index)  # v2 holds the log so far; the log starts anew, empty
    load = Searcher._load

    def refusing(self, name):
        if name == "v000002":
            raise RalmError("built with another document tower")
        return load(self, name)

    monkeypatch.setattr(Searcher, "_load", refusing)
    with pytest.raises(RalmError, match="another document tower"):
        server.refresh()
    assert server.current.name == "v000001" and server.exists("zanzibar") and not server.exists("paris")  # not the new log over v1
    with pytest.raises(RalmError, match="cannot be searched here"):
        server.add([Document(**NEW[1])])


THREE = [*NEW, {"id": "serengeti", "title": "Serengeti", "text": "The Serengeti is a plain where wildebeest migrate."}]


def _added_three(ralm, tiny_hybrid_index, tmp_path, *, compacted: bool):
    index = tmp_path / "idx"
    shutil.copytree(tiny_hybrid_index, index)
    docs = tmp_path / "three.jsonl"
    docs.write_text("".join(json.dumps(d) + "\n" for d in THREE))
    assert ralm("index", "add", index, docs)[0] == 0
    if compacted:  # what a server does by itself every 10,000 updates
        assert ralm("index", "compact", index)[0] == 0
    return index


@pytest.mark.parametrize("compacted", [False, True], ids=["logged", "compacted"])
def test_a_build_over_live_updates_is_refused_whether_or_not_a_compaction_folded_them(ralm, tiny_hybrid_index, tiny_bert,
                                                                                       corpus_file, tmp_path, monkeypatch,
                                                                                       compacted):
    from ralm.retrieval.index import build

    index = _added_three(ralm, tiny_hybrid_index, tmp_path, compacted=compacted)
    latest = (index / "LATEST").read_text()
    monkeypatch.setattr(build, "ensure_block_store", lambda *a, **k: pytest.fail("refused only after reading the corpus"))
    code, _, err = ralm("index", "build", corpus_file, "--out", index, "--model", tiny_bert, "--dim", 16)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "3 documents added and 0 deleted by live updates" in err and "--replace" in err and "new directory" in err
    assert (index / "LATEST").read_text() == latest  # nothing published
    assert all(LiveSearcher.open(index).exists(d["id"]) for d in THREE)
    with pytest.raises(RalmError, match="3 documents added"):  # the Python API refuses the same
        build.build_index(corpus_file, index, model=str(tiny_bert), dim=16, show_progress=False)


@pytest.mark.parametrize("compacted", [False, True], ids=["logged", "compacted"])
def test_a_build_with_replace_holds_its_corpus_alone_and_starts_the_log_anew(ralm, tiny_hybrid_index, tiny_bert, corpus_file,
                                                                             tmp_path, compacted):
    index = _added_three(ralm, tiny_hybrid_index, tmp_path, compacted=compacted)
    code, _, err = ralm("index", "build", corpus_file, "--out", index, "--model", tiny_bert, "--dim", 16, "--replace")
    assert code == 0, err
    live = LiveSearcher.open(index)
    assert len(live) == len(DOCS) and not any(live.exists(d["id"]) for d in THREE)
    assert live.current.log.records == 0 and UpdateLog(index).read().records == []
    code, _, err = ralm("index", "build", corpus_file, "--out", index, "--model", tiny_bert, "--dim", 16)
    assert code == 0, err  # nothing live left: a plain rebuild goes on


def test_deletes_count_and_an_upgrade_keeps_what_a_compaction_folded(ralm, tiny_dense_index, corpus_file, tmp_path):
    index = tmp_path / "idx"
    shutil.copytree(tiny_dense_index, index)
    assert ralm("index", "delete", index, "paris", "tokyo")[0] == 0
    assert ralm("index", "compact", index)[0] == 0
    assert ralm("index", "delete", index, "nile")[0] == 0  # one folded, one in the log
    assert ralm("index", "upgrade", index)[0] == 0  # the upgraded version still holds the folded deletes
    code, _, err = ralm("index", "build", corpus_file, "--out", index)
    assert code == 2 and "0 documents added and 3 deleted" in err, err


def test_a_build_that_a_compaction_overtook_publishes_nothing_and_keeps_the_folded_documents(tiny_hybrid_index, tiny_bert,
                                                                                             corpus_file, tmp_path, monkeypatch):
    from ralm.retrieval.index import build
    from ralm.retrieval.search.compaction import compact_index

    index = tmp_path / "idx"
    shutil.copytree(tiny_hybrid_index, index)
    blocks = build.ensure_block_store

    def meanwhile(*args, **kwargs):  # a server adds and compacts while the build runs
        live = LiveSearcher.open(index)
        live.add([Document(**NEW[0])])
        compact_index(live)
        return blocks(*args, **kwargs)

    monkeypatch.setattr(build, "ensure_block_store", meanwhile)
    with pytest.raises(RalmError, match="published while this build ran"):
        build.build_index(corpus_file, index, model=str(tiny_bert), dim=16, show_progress=False)
    assert (index / "LATEST").read_text().strip() == "v000002" and LiveSearcher.open(index).exists("zanzibar")
