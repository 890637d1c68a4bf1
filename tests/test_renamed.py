"""Old spellings keep working after the rename pass (kind = what an index holds, side = what a query
searches, retriever = the model): `--retriever` on the command line (hidden from help), `retriever`
in HTTP requests, responses and library calls, index root manifests that name their kind only as
"retriever". Runs exported under a trainer's old name: tests/test_loop.py."""

from __future__ import annotations

import json
import shutil

import pytest
from fastapi.testclient import TestClient

from ralm.errors import RalmError
from ralm.eval.retrieval import evaluate_retrieval
from ralm.pipeline import OpenQA
from ralm.retrieval.index.store import IndexDir
from ralm.retrieval.search.searcher import Searcher
from ralm.serve.app import create_app
from ralm.serve.service import ServeConfig, Service
from ralm.data.qa import Question

QUERY = "Guido van Rossum"


def _without_timing(out: str) -> dict:
    return {k: v for k, v in json.loads(out).items() if k not in ("index", "seconds")}


def test_cli_retriever_is_a_hidden_old_spelling_of_kind_and_side(ralm, corpus_file, tmp_path):
    for command, new in ((("index", "build"), "--kind"), (("index", "upgrade"), "--kind"), (("search",), "--side"),
                         (("ask",), "--side"), (("eval", "qa"), "--side"), (("eval", "retrieval"), "--side")):
        code, out, _ = ralm(*command, "--help")
        assert code == 0 and new in out and "--retriever" not in out, command
    code, old, err = ralm("index", "build", corpus_file, "--out", tmp_path / "old", "--retriever", "bm25", "--json")
    assert code == 0, err
    code, new, err = ralm("index", "build", corpus_file, "--out", tmp_path / "new", "--kind", "bm25", "--json")
    assert code == 0, err
    assert _without_timing(old) == _without_timing(new) and json.loads(new)["kind"] == json.loads(new)["retriever"] == "bm25"
    code, out, err = ralm("index", "upgrade", tmp_path / "old", "--retriever", "bm25", "--json")
    assert code == 0 and json.loads(out)["upgraded"] is False, err

    searched = {flag: ralm("search", tmp_path / "old", QUERY, "-k", 2, flag, "bm25", "--json") for flag in ("--side", "--retriever")}
    assert searched["--side"] == searched["--retriever"] and searched["--side"][0] == 0
    assert json.loads(searched["--side"][1])[0]["id"] == "python:0"
    refused = {flag: ralm("search", tmp_path / "old", QUERY, flag, "dense") for flag in ("--side", "--retriever")}
    assert refused["--side"] == refused["--retriever"] and refused["--side"][0] == 2
    code, _, err = ralm("search", tmp_path / "old", QUERY, "--side", "bm25", "--retriever", "dense")
    assert code == 2 and "--side bm25 and --retriever dense disagree: give --side only" in err
    code, _, err = ralm("index", "build", corpus_file, "--out", tmp_path / "x", "--kind", "bm25", "--retriever", "dense")
    assert code == 2 and "--kind bm25 and --retriever dense disagree: give --kind only" in err


def test_an_index_manifest_naming_its_kind_as_retriever_still_opens(served, tmp_path):
    shutil.copytree(served / "bm25", tmp_path / "bm25")
    root = tmp_path / "bm25" / "manifest.json"
    written = json.loads(root.read_text())
    assert written["kind"] == written["retriever"] == "bm25"  # older ralm reads "retriever"
    root.write_text(json.dumps({"format": written["format"], "retriever": "bm25"}))  # as ralm wrote it before "kind"
    index = IndexDir(tmp_path / "bm25")
    assert index.created_as == index.kind == "bm25"
    assert Searcher.open(tmp_path / "bm25").search([QUERY], 1)[0][0].id == "python:0"
    root.write_text(json.dumps({"format": written["format"]}))
    with pytest.raises(RalmError, match='no valid "kind"'):
        IndexDir(tmp_path / "bm25")


def test_library_calls_with_the_old_keyword_search_the_same_side(served):
    searcher = Searcher.open(served / "index")
    assert searcher.search([QUERY], 3, retriever="bm25") == searcher.search([QUERY], 3, side="bm25")
    old, new = searcher.search_rows([QUERY], 3, retriever="dense"), searcher.search_rows([QUERY], 3, side="dense")
    assert (old[0] == new[0]).all() and (old[1] == new[1]).all()
    with pytest.raises(TypeError, match="both side= and retriever="):
        searcher.search([QUERY], 3, side="bm25", retriever="dense")
    assert OpenQA.open(served / "index", served / "reader", k=1, retriever="bm25").kind == "bm25"
    questions = [Question("q", QUERY, ("Guido van Rossum",))]
    result = evaluate_retrieval(searcher, questions, ks=(1,), show_progress=False, retriever="bm25")
    assert result["kind"] == result["retriever"] == "bm25"


def test_http_requests_take_side_or_its_old_name_retriever(served, tmp_path):
    shutil.copytree(served / "index", tmp_path / "index")
    svc = Service(ServeConfig(index=str(tmp_path / "index"), model=str(served / "reader")))
    with TestClient(create_app(svc, start_watcher=False), base_url="http://127.0.0.1:8000") as c:
        stats = c.get("/stats").json()
        assert stats["kinds"] == stats["retrievers"] == ["hybrid", "dense", "bm25"]
        by = {field: c.post("/search", json={"query": QUERY, "k": 2, field: "bm25"}).json() for field in ("side", "retriever")}
        assert by["side"] == by["retriever"] and by["side"][0]["found_by"] == ["bm25"]
        both = c.post("/search", json={"query": QUERY, "side": "bm25", "retriever": "dense"})
        assert both.status_code == 422 and "give `side` only" in both.json()["error"]
        answers = {field: c.post("/ask", json={"question": "Who created Python?", "k": 1, field: "bm25"}).json()
                   for field in ("side", "retriever")}
        assert answers["side"] == answers["retriever"] and answers["side"]["kind"] == answers["side"]["retriever"] == "bm25"
