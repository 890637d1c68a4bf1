"""`ralm index add` / `ralm index delete` / `ralm index upgrade`: the server's crash-safe update
log without a server, seen by every command and every side of the index."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import DOCS

from ralm.data.corpus import Document
from ralm.errors import RalmError
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
    assert json.loads(out) == {"index": str(index), "added": 2, "blocks": len(DOCS) + 2, "index_version": "v000001"}
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
    assert _ids(ralm, index, "Guido van Rossum", "bm25", k=1) == ["python:0"]


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
