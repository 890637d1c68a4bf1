"""The HTTP API: every endpoint, live documents, hot swap under load, restart replay, 4xx."""

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
from fastapi.testclient import TestClient

from pathlib import Path

from ralm.data.corpus import Document
from ralm.defaults import MAX_QUESTION_CHARS
from ralm.errors import RalmError
from ralm.retrieval.index.build import build_index
from ralm.retrieval.index.store import IndexDir
from ralm.retrieval.search.update_log import UpdateLog
from ralm.serve.app import create_app
from ralm.serve.service import ServeConfig, Service
from ralm.retrieval.index.dense_side import dense_of

from conftest import DOCS

NEW = {"id": "zanzibar", "title": "Zanzibar", "text": "Zanzibar is an archipelago off the coast of Tanzania famous for cloves."}


@pytest.fixture
def dirs(served, tmp_path):
    """Fresh copies per test: the update log is written inside the index directory."""
    for name in ("index", "dense", "bm25"):
        shutil.copytree(served / name, tmp_path / name)
    return tmp_path, served / "reader"


def service(dirs, **kw):
    root, reader = dirs
    cfg = ServeConfig(index=str(root / "index"), model=str(reader), **{"poll_seconds": 0.05, **kw})
    return Service(cfg)


def client(svc, watcher=False):
    return TestClient(create_app(svc, start_watcher=watcher), base_url="http://127.0.0.1:8000")


def test_every_endpoint(dirs):
    with client(service(dirs)) as c:
        assert c.get("/health").json()["status"] == "ok"
        stats = c.get("/stats").json()
        assert stats["corpus_blocks"] == len(DOCS) and stats["index_version"] == "v000001"
        assert set(stats["retrievers"]) == {"dense", "bm25", "hybrid"} and stats["reader_loaded"]
        for retriever in ("dense", "bm25", "hybrid"):
            hits = c.post("/search", json={"query": "capital city river", "k": 3, "retriever": retriever}).json()
            assert len(hits) == 3 and set(hits[0]) == {"id", "title", "score", "text", "found_by"}, retriever
            assert all(set(h["found_by"]) <= {"dense", "bm25"} and h["found_by"] for h in hits), retriever
        assert c.post("/search", json={"query": "Guido van Rossum", "k": 1, "retriever": "bm25"}).json()[0]["id"] == "python:0"
        answer = c.post("/ask", json={"question": "Who created Python?", "k": 2, "retriever": "bm25"}).json()
        assert set(answer) >= {"answer", "score", "evidence"} and len(answer["evidence"]) == 2
        ev = answer["evidence"][answer["best"]]
        assert {"id", "title", "text", "retrieval_score", "span"} <= set(ev)
        a, b = ev["span"]
        assert ev["text"][a:b] == answer["answer"]
        assert c.get("/documents/zanzibar").status_code == 404
        added = c.post("/documents", json={"documents": [NEW]}).json()
        assert added == {"added": ["zanzibar"], "corpus_blocks": len(DOCS) + 1, "index_version": "v000001", "blocks": len(DOCS) + 1}
        assert c.get("/documents/zanzibar").json() == {"id": "zanzibar", "documents": ["zanzibar"]}  # the web page asks before it replaces
        assert c.delete("/documents/zanzibar").json() == {"deleted": "zanzibar", "documents": ["zanzibar"], "count": 1,
                                                          "index_version": "v000001", "blocks": len(DOCS)}
        assert c.get("/documents/zanzibar").status_code == 404
        assert "ask-form" in c.get("/").text
        assert c.get("/static/app.js").status_code == 200
        assert c.get("/stats").json()["latency_ms"]["search"]["count"] == 4
        paths = c.get("/openapi.json").json()["paths"]
        assert {"/ask", "/search", "/documents", "/documents/{doc_id}", "/health", "/stats"} <= set(paths)


def test_added_document_is_found_answered_from_and_replaced(dirs):
    with client(service(dirs)) as c:
        c.post("/documents", json={"documents": [NEW]})
        hits = c.post("/search", json={"query": "archipelago cloves Tanzania", "k": 1, "retriever": "bm25"}).json()
        assert hits[0]["id"] == "zanzibar:0"
        assert "zanzibar:0" in {h["id"] for h in c.post("/search", json={"query": "Zanzibar", "k": len(DOCS) + 1}).json()}
        answer = c.post("/ask", json={"question": "Which archipelago is famous for cloves?", "k": 1, "retriever": "bm25"}).json()
        assert answer["evidence"][0]["id"] == "zanzibar:0" and answer["answer"] in NEW["text"]
        assert c.get("/stats").json()["corpus_blocks"] == len(DOCS) + 1
        # replacing a document of the main index hides its old text
        c.post("/documents", json={"documents": [{"id": "nile", "title": "Nile", "text": "The Nile now mentions walruses."}]})
        hits = c.post("/search", json={"query": "Nile walruses", "k": len(DOCS) + 2, "retriever": "bm25"}).json()
        nile = [h for h in hits if h["id"].startswith("nile:")]
        assert len(nile) == 1 and "walruses" in nile[0]["text"]
        c.delete("/documents/paris")
        ids = {h["id"] for h in c.post("/search", json={"query": "capital of France", "k": len(DOCS) + 2}).json()}
        assert "paris:0" not in ids


def test_restart_replays_added_and_deleted_documents(dirs):
    with client(service(dirs)) as c:
        c.post("/documents", json={"documents": [NEW]})
        c.delete("/documents/tokyo")
    log = dirs[0] / "index" / "updates.jsonl"
    with open(log, "a") as f:
        f.write('{"op": "add", "id": "torn"')  # a crash mid-append: never acknowledged
    with client(service(dirs)) as c:  # a new process reads the same directory
        ids = {h["id"] for h in c.post("/search", json={"query": "archipelago", "k": 10, "retriever": "bm25"}).json()}
        assert "zanzibar:0" in ids and "tokyo:0" not in ids and not any(i.startswith("torn") for i in ids)
        assert c.delete("/documents/tokyo").status_code == 404


def test_hot_swap_under_concurrent_requests_has_zero_failures(dirs, tiny_bert):
    root, _ = dirs
    svc = service(dirs)
    failures, done, stop = [], [], threading.Event()
    with client(svc, watcher=True) as c:
        def hammer():
            while not stop.is_set():
                r = c.post("/search", json={"query": "capital city", "k": 3})
                if r.status_code != 200 or len(r.json()) != 3:
                    failures.append(r.text)
                done.append(r.json())

        threads = [threading.Thread(target=hammer) for _ in range(4)]
        for t in threads:
            t.start()
        index = IndexDir(root / "index")
        model = str(index.root / index.version_manifest("v000001")["sections"]["dense"]["retriever"])
        corpus = root / "more.jsonl"
        corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS + [NEW]))
        build_index(corpus, root / "index", model=model, show_progress=False)
        deadline = __import__("time").time() + 30
        while c.get("/health").json()["index_version"] != "v000002":
            assert __import__("time").time() < deadline, "the server never swapped"
            __import__("time").sleep(0.05)
        before = len(done)
        while len(done) < before + 8:  # keep serving after the swap
            __import__("time").sleep(0.02)
        stop.set()
        for t in threads:
            t.join()
    assert not failures and len(done) > 8
    assert svc.swaps >= 1


@pytest.mark.parametrize("method, path, body, status, needle", [
    ("post", "/ask", {"question": "   ", "k": 2}, 422, "question"),
    ("post", "/ask", {"question": "x", "k": 0}, 422, "k"),
    ("post", "/ask", {"question": "x", "k": 1000}, 422, "k"),
    ("post", "/ask", {"question": "x", "k": "many"}, 422, "k"),
    ("post", "/ask", {"k": 2}, 422, "question"),
    ("post", "/search", {"query": "x", "retriever": "magic"}, 422, "retriever"),
    ("post", "/search", {"query": 42}, 422, "query"),
    ("post", "/ask", {"question": "x" * (MAX_QUESTION_CHARS + 1)}, 422, f"at most {MAX_QUESTION_CHARS} characters"),
    ("post", "/search", {"query": "x" * (MAX_QUESTION_CHARS + 1)}, 422, f"at most {MAX_QUESTION_CHARS} characters"),
    ("post", "/documents", {"documents": []}, 422, "documents"),
    ("post", "/documents", {"documents": [{"id": "a", "text": ""}]}, 422, "text"),
    ("delete", "/documents/no-such-doc", None, 404, "no-such-doc"),
])
def test_bad_requests_get_a_4xx_with_a_json_error(dirs, method, path, body, status, needle):
    with client(service(dirs)) as c:
        r = getattr(c, method)(path, json=body) if body is not None else getattr(c, method)(path)
        assert r.status_code == status, r.text
        assert needle in r.json()["error"]


def test_the_server_and_the_command_line_hold_questions_to_one_limit(tmp_path):
    """MAX_QUESTION_CHARS (src/ralm/defaults.py) is the one home of the limit: set to 50 before
    ralm is imported, /ask's and /search's schemas, `ralm ask`, `ralm search` and a question
    file all allow 50 characters, and no other number."""
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question": "x" * 51, "answers": ["a"]}) + "\n")
    code = ("import json, sys\nimport ralm.defaults\nralm.defaults.MAX_QUESTION_CHARS = 50\n"
            "from ralm.serve.app import AskRequest, SearchRequest\nfrom ralm.cli import main\n"
            "schema = {'ask': AskRequest.model_json_schema()['properties']['question']['maxLength'],\n"
            "          'search': SearchRequest.model_json_schema()['properties']['query']['maxLength']}\n"
            "print(json.dumps(schema))\n"
            "for argv in (['ask', 'x' * 51, '--index', 'none'], ['search', 'none', 'x' * 51], ['ask', 'x' * 50, '--index', 'none'],\n"
            "             ['eval', 'qa', '--index', 'none', '--questions', sys.argv[1]]):\n"
            "    sys.argv = ['ralm', *argv]\n    try:\n        main()\n    except SystemExit as e:\n        print(e.code)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    proc = subprocess.run([sys.executable, "-c", code, str(questions)], capture_output=True, text=True, env=env, timeout=120)
    lines = proc.stdout.splitlines()
    assert json.loads(lines[0]) == {"ask": 50, "search": 50}, proc.stderr
    assert lines[1:] == ["2"] * 4, proc.stderr
    errors = proc.stderr.splitlines()
    assert [e.endswith("holds at most 50") for e in errors] == [True, True, False, True], proc.stderr
    assert "not an index directory" in errors[2]  # 50 characters passed the limit, on to the next check


def test_oversized_body_unavailable_retriever_missing_reader_and_api_key(dirs):
    root, _ = dirs
    with client(service(dirs, max_body_bytes=1000)) as c:
        r = c.post("/documents", json={"documents": [{"id": "big", "text": "x" * 5000}]})
        assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]
        r = c.post("/search", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 422
    only_dense = Service(ServeConfig(index=str(root / "dense")))
    with client(only_dense) as c:
        r = c.post("/search", json={"query": "x", "retriever": "hybrid"})
        assert r.status_code == 400 and "ralm index upgrade" in r.json()["error"]
        r = c.post("/ask", json={"question": "x"})
        assert r.status_code == 409 and "--model" in r.json()["error"]
    with client(service(dirs, api_key="s3cret")) as c:
        assert c.post("/documents", json={"documents": [NEW]}).status_code == 401
        assert c.delete("/documents/paris").status_code == 401
        assert c.post("/documents", json={"documents": [NEW]}, headers={"X-API-Key": "s3cret"}).status_code == 200
        assert c.post("/search", json={"query": "x"}).status_code == 200  # reads stay open


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(dirs):
    import asyncio

    import httpx

    svc = service(dirs)
    calls = []
    real = svc.search
    svc.search = lambda queries, k, retriever: (calls.append(len(queries)), real(queries, k, retriever))[1]
    app = create_app(svc, start_watcher=False)
    queries = ["Guido van Rossum", "Neil Armstrong Apollo", "Seine Eiffel", "Nepal China mountain"] * 4
    expected = {"Guido van Rossum": "python:0", "Neil Armstrong Apollo": "moon:0", "Seine Eiffel": "paris:0",
                "Nepal China mountain": "everest:0"}

    async def burst():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            return await asyncio.gather(*(c.post("/search", json={"query": q, "k": 1, "retriever": "bm25"}) for q in queries))

    responses = asyncio.run(burst())
    assert all(r.status_code == 200 for r in responses)
    assert [r.json()[0]["id"] for r in responses] == [expected[q] for q in queries]
    assert sum(calls) == len(queries) and len(calls) < len(queries)  # fewer model calls than requests


def _hits(c, query, retriever, k=20):
    return [(h["id"], h["text"]) for h in c.post("/search", json={"query": query, "k": k, "retriever": retriever}).json()]


@pytest.mark.parametrize("torn", ['{"op": "add", "id": "torn", "te'.encode(), '{"op": "add", "id": "café'.encode()[:-1]])
def test_an_update_acknowledged_after_a_crash_mid_append_survives_a_restart(dirs, torn):
    log = dirs[0] / "index" / "updates.jsonl"
    log.write_bytes(torn)  # a crash mid-append (the second one even inside a UTF-8 character)
    with client(service(dirs)) as c:
        assert c.post("/documents", json={"documents": [NEW]}).status_code == 200
    with client(service(dirs)) as c:  # a new process reads the same directory
        assert ("zanzibar:0", NEW["text"]) in _hits(c, "archipelago cloves", "dense")
    assert b"torn" not in log.read_bytes()  # written anew in the current form, without it
    assert [{k: r[k] for k in NEW} for r in UpdateLog(log.parent).read().records] == [NEW]


def test_a_log_damaged_by_an_older_ralm_gives_back_its_acknowledged_updates(dirs):
    """ralm <= 0.2.0 appended onto a torn record; and a text may hold U+2028, a line break to str.splitlines."""
    kili = {"op": "add", "id": "kili", "title": "Kilimanjaro", "text": "Kilimanjaro is a volcano\u2028in Tanzania."}
    for name in ("index",):
        (dirs[0] / name / "updates.jsonl").write_text('{"op": "add", "id": "torn", "te' + json.dumps({"op": "add", **NEW}) + "\n"
                                                      + json.dumps(kili, ensure_ascii=False) + "\n", encoding="utf-8")
    with client(service(dirs)) as c:
        ids = [i for i, _ in _hits(c, "Zanzibar Kilimanjaro volcano archipelago", "bm25")]
        assert {"zanzibar:0", "kili:0"} <= set(ids) and not any(i.startswith("torn") for i in ids)
        assert c.delete("/documents/kili").status_code == 200


def test_the_same_id_twice_in_one_request_keeps_the_last_and_a_restart_changes_nothing(dirs):
    first, last = NEW | {"text": "Zanzibar grows cloves."}, NEW | {"text": "Zanzibar now grows nutmeg instead."}
    queries = {"dense": "Zanzibar cloves nutmeg", "bm25": "Zanzibar cloves nutmeg", "hybrid": "Zanzibar cloves nutmeg"}
    with client(service(dirs)) as c:
        assert c.post("/documents", json={"documents": [first, last]}).json()["added"] == ["zanzibar"]
        before = {r: _hits(c, q, r) for r, q in queries.items()}
    assert [h for h in before["bm25"] if h[0].startswith("zanzibar")] == [("zanzibar:0", last["text"])]
    with client(service(dirs)) as c:
        assert {r: _hits(c, q, r) for r, q in queries.items()} == before


def test_one_update_log_serves_both_sides_and_a_restart_finds_every_write_in_both(dirs):
    root, _ = dirs
    with client(service(dirs)) as c:
        assert c.get("/stats").json()["retrievers"] == ["hybrid", "dense", "bm25"]
        c.post("/documents", json={"documents": [NEW]})
        c.delete("/documents/paris")
    assert not (root / "index" / "versions" / "v000001" / "updates.jsonl").exists()
    assert len(UpdateLog(root / "index").read().records) == 2  # one log, both sides replay it
    with client(service(dirs)) as c:
        for retriever in ("dense", "bm25", "hybrid"):
            ids = [h["id"] for h in c.post("/search", json={"query": "Zanzibar archipelago cloves Tanzania", "k": len(DOCS) + 1,
                                                              "retriever": retriever}).json()]
            assert "zanzibar:0" in ids and "paris:0" not in ids, retriever
        hits = {h["id"]: h for h in c.post("/search", json={"query": "Zanzibar archipelago cloves", "k": 3}).json()}
        assert "bm25" in hits["zanzibar:0"]["found_by"]  # the live block, scored by the BM25 side of the fusion


def test_hybrid_is_one_implementation_for_the_server_and_the_cli(dirs):
    """The server searches the same LiveSearcher as `ralm search` / `ralm ask`: with no live
    documents it ranks and scores exactly as they do."""
    from ralm.retrieval.search.live import LiveSearcher

    root, _ = dirs
    svc = service(dirs)
    cli = LiveSearcher.open(root / "index")
    queries = ["capital city on a river", "Who created Python?", "highest mountain", "Apollo mission to the Moon"]
    for retriever in (None, "hybrid", "dense", "bm25"):
        for server_hits, cli_hits in zip(svc.search(queries, 4, retriever), cli.search(queries, 4, retriever)):
            assert [(h.id, round(h.score, 5)) for h in server_hits] == [(h.id, round(h.score, 5)) for h in cli_hits]
    with client(svc) as c:  # /ask offers hybrid too
        answer = c.post("/ask", json={"question": "Who created Python?", "k": 2, "retriever": "hybrid"})
        assert answer.status_code == 200 and len(answer.json()["evidence"]) == 2
        assert answer.json()["retriever"] == "hybrid" and answer.json()["index_version"] == "v000001"


def test_live_bm25_documents_score_on_the_index_scale_and_bm25_lists_only_matches(dirs):
    with client(service(dirs)) as c:
        assert [i for i, _ in _hits(c, "Guido van Rossum", "bm25", k=5)] == ["python:0"]  # no 0-score padding
        c.post("/documents", json={"documents": [NEW]})
        hits = c.post("/search", json={"query": "capital of Zanzibar, the archipelago famous for cloves", "k": 3,
                                       "retriever": "bm25"}).json()
        assert hits[0]["id"] == "zanzibar:0" and hits[0]["score"] > 2 * hits[1]["score"]


def test_a_chunked_body_is_held_to_the_limit(dirs):
    body = json.dumps({"documents": [{"id": "big", "text": "x" * 5000}]}).encode()
    with client(service(dirs, max_body_bytes=1000)) as c:
        r = c.post("/documents", content=iter([body[i:i + 100] for i in range(0, len(body), 100)]),
                   headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json() == {"error": "request body exceeds the limit of 1000 bytes"}
        assert c.post("/documents", json={"documents": [NEW]}).status_code == 200


def test_one_error_shape_strict_types_and_an_openapi_that_documents_them(dirs):
    with client(service(dirs)) as c:
        assert c.get("/no-such-page").json() == {"error": "Not Found"}
        r = c.put("/ask", json={})
        assert r.json() == {"error": "Method Not Allowed"} and r.headers["allow"] == "POST"
        for k in (True, "5", 2.0):
            r = c.post("/search", json={"query": "x", "k": k})
            assert r.status_code == 422 and "k" in r.json()["error"], k
        spec = c.get("/openapi.json").json()
    assert "HTTPValidationError" not in json.dumps(spec)  # the framework's {"detail": ...} shape is nowhere
    ask = spec["paths"]["/ask"]["post"]["responses"]
    assert set(ask) == {"200", "400", "409", "413", "422"}
    assert ask["422"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorOut"}
    # writes can find the disk full: 507
    assert set(spec["paths"]["/documents"]["post"]["responses"]) == {"200", "400", "401", "413", "422", "507"}
    assert set(spec["paths"]["/documents/{doc_id}"]["delete"]["responses"]) == {"200", "400", "401", "404", "422", "507"}
    assert set(spec["paths"]["/documents/{doc_id}"]["get"]["responses"]) == {"200", "400", "404", "422"}
    question = spec["components"]["schemas"]["AskRequest"]["properties"]["question"]
    assert question["pattern"] == r"\S" and question["maxLength"] == 2000
    k = spec["components"]["schemas"]["AskRequest"]["properties"]["k"]
    assert (k["minimum"], k["maximum"], k["type"]) == (1, 100, "integer")


@pytest.mark.parametrize("bound, extra, host, ok", [
    ("127.0.0.1", (), "127.0.0.1:8000", True),
    ("127.0.0.1", (), "localhost:8000", True),
    ("127.0.0.1", (), "[::1]:8000", True),
    ("127.0.0.1", (), "attacker.example:8000", False),  # DNS rebinding: an outside name pointing at loopback
    ("127.0.0.1", ("ralm.internal",), "ralm.internal", True),
    ("10.0.0.5", (), "10.0.0.5:8000", True),
    ("0.0.0.0", (), "10.0.0.5:8000", False),  # a wildcard bind has no name of its own: name it with --allowed-host
    ("0.0.0.0", ("*",), "anything.example", True),
])
def test_the_host_header_must_name_this_server(dirs, bound, extra, host, ok):
    with TestClient(create_app(service(dirs, host=bound, allowed_hosts=extra), start_watcher=False), base_url=f"http://{host}") as c:
        r = c.post("/documents", json={"documents": [NEW]})
        assert r.status_code == (200 if ok else 400), r.text
        assert ok or "--allowed-host" in r.json()["error"]


def test_stats_show_no_file_paths(dirs):
    with client(service(dirs)) as c:
        stats = c.get("/stats").text
    assert str(dirs[0]) not in stats and str(dirs[1]) not in stats


def test_a_live_search_encodes_its_queries_once_and_hiding_reads_only_the_deleted_documents_records(dirs):
    from ralm.data.blocks import BlockStore

    svc = service(dirs)
    reads, locked = [], []
    real_record = BlockStore.record

    def record(self, i):
        reads.append(i)
        locked.append(svc.live._lock.locked())
        return real_record(self, i)

    BlockStore.record = record
    try:
        svc.delete("paris")  # finds the document's rows by the hash of its id (doc_hash.npy)
    finally:
        BlockStore.record = real_record
    # the id's hash finds its rows; a read of its first record confirms it (existence, then hiding):
    # no map of every document, which under the writer lock would stall writers on a large corpus
    assert 0 < len(reads) <= 2 and sum(locked) <= 2
    svc.add([Document(NEW["id"], NEW["title"], NEW["text"])])
    retriever = dense_of(svc.live.searcher.current).retriever
    calls = []
    real = retriever.encode_queries
    retriever.encode_queries = lambda texts, **kw: (calls.append(len(texts)), real(texts, **kw))[1]
    svc.search(["archipelago", "river"], 3, "dense")
    svc.search(["archipelago", "river"], 3, "hybrid")
    assert calls == [2, 2]


def test_a_bm25_index_without_its_average_length_measures_it(dirs, caplog):
    """BM25 indexes built by ralm 0.2.0 lack ralm.json; on a small corpus the measure is exact."""
    from ralm.retrieval.backends.bm25 import STATS

    root, _ = dirs
    doc = Document(NEW["id"], NEW["title"], NEW["text"])

    def live_score():
        svc = Service(ServeConfig(index=str(root / "bm25")))
        svc.add([doc])
        score = svc.search(["Zanzibar cloves"], 1)[0][0].score
        svc.delete(doc.id)
        return score

    recorded = live_score()
    version = next((root / "bm25" / "versions").iterdir())
    (version / "bm25" / STATS).unlink()
    manifest = json.loads((version / "manifest.json").read_text())
    del manifest["files"]  # as then: no file inventory either (retrieval/index/verify.py)
    (version / "manifest.json").write_text(json.dumps(manifest))
    assert live_score() == pytest.approx(recorded) and "measured it on 6 blocks" in caplog.text


@pytest.mark.parametrize("line", ["not json", json.dumps({"op": "delete", "id": "x"}) + " [1]"])
def test_a_log_line_that_is_no_update_record_is_a_clear_error(dirs, line):
    """Also a record followed by more on its line: one value a line, as json.loads reads it."""
    root, _ = dirs
    (root / "index" / "updates.jsonl").write_text(json.dumps({"op": "add", **NEW}) + f"\n{line}\n")
    with pytest.raises(RalmError, match=r"updates.jsonl:2: not an update record"):
        service(dirs)


def test_a_failing_swap_is_logged_once_not_at_every_poll(dirs, caplog):
    svc = service(dirs)
    latest = dirs[0] / "index" / "LATEST"
    latest.write_text("v000042\n")  # damaged: names a version that does not exist
    with caplog.at_level("WARNING", logger="ralm.serve"):
        for _ in range(3):
            assert not svc.refresh()
        latest.write_text("v000001\n")
        svc.refresh()
        latest.write_text("v000042\n")
        svc.refresh()
    failures = [r for r in caplog.records if "not swapping" in r.getMessage()]
    assert len(failures) == 2 and "v000042" in failures[0].getMessage()  # once, then again after a recovery


def test_ask_withholds_answers_below_the_confidence_threshold(dirs, tmp_path):
    from ralm.models.reader import write_calibration

    root, reader = dirs
    shutil.copytree(reader, tmp_path / "calibrated")
    write_calibration(tmp_path / "calibrated", {"raw": [0.0, 1.0], "confidence": [0.0, 0.5]})  # confidence <= 0.5
    for threshold, withheld in ((0.0, False), (0.6, True)):
        with client(service((root, tmp_path / "calibrated"), min_confidence=threshold)) as c:
            r = c.post("/ask", json={"question": "Who created Python?", "k": 2, "retriever": "bm25"}).json()
            assert r["no_answer"] == withheld and (r["answer"] == "") == withheld and 0 <= r["confidence"] <= 0.5
            assert r["evidence"][r["best"]]["answer"]  # the evidence and its best span stay


def test_a_bad_min_confidence_fails_at_start_up_not_on_the_first_ask(tmp_path):
    from typer.testing import CliRunner

    from ralm.cli import app

    with pytest.raises(RalmError, match=r"min_confidence must be in \[0, 1\]"):
        ServeConfig(index=str(tmp_path), min_confidence=1.5)
    for command in (["serve", "--index", str(tmp_path)], ["ask", "who?", "--index", str(tmp_path)]):
        result = CliRunner().invoke(app, [*command, "--min-confidence", "1.5"])
        assert result.exit_code == 2 and "--min-confidence" in result.output


def test_a_file_posted_as_the_body_becomes_its_sections(dirs):
    guide = b"# Cogs\n\nCogs are made of brass in Sheffield.\n\n## Sizes\n\nCogs come in twelve sizes.\n"
    with client(service(dirs)) as c:
        added = c.post("/documents/file", params={"name": "kb/cogs.md"}, content=guide).json()
        assert added["added"] == ["kb/cogs.md", "kb/cogs.md#sizes"] and added["blocks"] == len(DOCS) + 2
        hit = c.post("/search", json={"query": "twelve sizes", "k": 1, "retriever": "bm25"}).json()[0]
        assert (hit["id"], hit["title"]) == ("kb/cogs.md#sizes:0", "Cogs › Sizes")
        edited = c.post("/documents/file", params={"name": "kb/cogs.md"}, content=b"# Cogs\n\nCogs are brass.\n").json()
        assert (edited["added"], edited["deleted"], edited["blocks"]) == (["kb/cogs.md"], ["kb/cogs.md#sizes"], len(DOCS) + 1)
        c.post("/documents/file", params={"name": "kb/cogs.md"}, content=guide)
        assert c.delete("/documents/kb/cogs.md%23sizes").json()["deleted"] == "kb/cogs.md#sizes"
        c.post("/documents/file", params={"name": "kb/cogs.md"}, content=guide)
        gone = c.delete("/documents/kb/cogs.md").json()  # the file's name: the live file, every section of it
        assert (gone["documents"], gone["count"], gone["blocks"]) == (["kb/cogs.md", "kb/cogs.md#sizes"], 2, len(DOCS))
        for params, body, message in (({"name": "a.docx"}, b"x", "unknown format"), ({"name": "s.pdf"}, b"%PDF-1.4 x", "not a readable PDF"),
                                      ({}, guide, "name")):
            answer = c.post("/documents/file", params=params, content=body)
            assert answer.status_code in (400, 422) and message in answer.json()["error"], answer.json()


def test_the_index_lists_its_files_a_page_at_a_time_the_last_changed_first(dirs):
    guide = b"# Cogs\n\n## Sizes\n\nTwelve sizes.\n\n## Teeth\n\nForty teeth.\n"
    with client(service(dirs)) as c:
        listed = c.get("/documents", params={"limit": 4}).json()
        assert (listed["total"], listed["offset"], listed["limit"], listed["index_version"]) == (len(DOCS), 0, 4, "v000001")
        assert listed["files"] == [{"name": d["id"], "title": d["title"], "documents": 1} for d in DOCS[:4]]
        assert [f["name"] for f in c.get("/documents", params={"offset": 4}).json()["files"]] == [d["id"] for d in DOCS[4:]]
        c.post("/documents/file", params={"name": "kb/cogs.md"}, content=guide)
        c.post("/documents", json={"documents": [{"id": "nile", "title": "Nile", "text": "The Nile, replaced."}]})
        files = c.get("/documents").json()["files"]
        assert files[:2] == [{"name": "nile", "title": "Nile", "documents": 1},  # replaced last: listed first
                             {"name": "kb/cogs.md", "title": "Cogs › Sizes", "documents": 2}]
        assert [f["name"] for f in files[2:]] == [d["id"] for d in DOCS if d["id"] != "nile"]
        c.delete("/documents/kb/cogs.md")
        c.delete("/documents/paris")
        assert c.get("/documents").json()["total"] == len(DOCS) - 1
        for params in ({"limit": 0}, {"limit": 101}, {"offset": -1}, {"limit": "all"}):
            assert c.get("/documents", params=params).status_code == 422, params


def test_deleting_a_files_name_deletes_its_every_section_and_page_and_a_new_version_replaces_them(tmp_path, tiny_bert):
    from test_index_updates import ABOUT, ABOUT_IDS, CHANGED, make_files

    build_index(make_files(tmp_path / "files"), tmp_path / "idx", model=str(tiny_bert), dim=16, show_progress=False)

    def holding(c, word):
        return [h["id"] for h in c.post("/search", json={"query": word, "k": 20, "side": "bm25"}).json() if word in h["text"].lower()]

    with client(Service(ServeConfig(index=str(tmp_path / "idx")))) as c:
        assert holding(c, "penguin") == ["about.md#contact:0"]
        assert c.get("/documents/handbook.pdf").json() == {"id": "handbook.pdf", "documents": ["handbook.pdf#page=1", "handbook.pdf#page=2"]}
        assert c.get("/documents/about.md").json()["documents"] == ABOUT_IDS
        assert c.get("/documents/about.md%23fees").json()["documents"] == ["about.md#fees"]
        one = c.delete("/documents/about.md%23fees").json()  # a section's id: that section alone
        assert (one["deleted"], one["documents"], one["count"], one["blocks"]) == ("about.md#fees", ["about.md#fees"], 1, 6)
        assert holding(c, "banana") == [] and holding(c, "penguin") == ["about.md#contact:0"]
        whole = c.delete("/documents/about.md").json()
        assert (whole["deleted"], whole["documents"], whole["count"], whole["blocks"]) == ("about.md", ABOUT_IDS[:2] + ABOUT_IDS[3:], 3, 3)
        pages = c.delete("/documents/handbook.pdf")  # pages only, no document of the name itself: not a 404
        assert pages.status_code == 200 and pages.json()["count"] == 2
        for word in ("chess", "library", "penguin", "tractor", "saxophone"):
            assert holding(c, word) == [], word
        assert c.delete("/documents/about.md").status_code == 404 and c.get("/documents/about.md").status_code == 404
        c.post("/documents/file", params={"name": "about.md"}, content=ABOUT.encode())  # back, live
        edited = c.post("/documents/file", params={"name": "about.md"}, content=CHANGED.encode()).json()
        assert (edited["added"], edited["deleted"], edited["blocks"]) == (ABOUT_IDS[:3], ["about.md#contact"], 4)
        assert holding(c, "penguin") == [] and holding(c, "banana") == [] and holding(c, "volcano") == ["about.md#fees:0"]
    index = tmp_path / "idx"
    shutil.rmtree(index)
    build_index(make_files(tmp_path / "again"), index, model=str(tiny_bert), dim=16, show_progress=False)
    with client(Service(ServeConfig(index=str(index)))) as c:  # over the sections of the index itself, in one log batch
        edited = c.post("/documents/file", params={"name": "about.md"}, content=CHANGED.encode()).json()
        assert (edited["added"], edited["deleted"], edited["blocks"]) == (ABOUT_IDS[:3], ["about.md#contact"], 6)
        assert holding(c, "penguin") == [] and holding(c, "banana") == [] and holding(c, "volcano") == ["about.md#fees:0"]
    lines = (index / "updates.jsonl").read_text().splitlines()[1:]
    assert [json.loads(line).get("more", False) for line in lines] == [True] * 3 + [False]


def _visible_within(c, path: str, status: int, seconds: float) -> float:
    """How long until GET `path` answers `status` (asserted to be within `seconds`)."""
    start = time.perf_counter()
    while c.get(path).status_code != status:
        assert time.perf_counter() - start < seconds, f"{path} did not answer {status} within {seconds} s"
        time.sleep(0.02)
    return time.perf_counter() - start


def test_the_server_sees_command_line_adds_and_deletes_and_they_see_its_writes(dirs, ralm):
    root, _ = dirs
    docs = root / "new.jsonl"
    docs.write_text(json.dumps(NEW) + "\n")
    with client(service(dirs, poll_seconds=0.25), watcher=True) as c:
        assert ralm("index", "add", root / "index", docs)[0] == 0
        _visible_within(c, "/documents/zanzibar", 200, 2.0)  # within a second when not contended; 2 s on a busy CI box
        assert c.post("/search", json={"query": "archipelago cloves", "k": 1, "retriever": "bm25"}).json()[0]["id"] == "zanzibar:0"
        assert ralm("index", "delete", root / "index", "zanzibar", "paris")[0] == 0
        _visible_within(c, "/documents/paris", 404, 2.0)
        assert c.delete("/documents/zanzibar").status_code == 404
        assert c.post("/documents", json={"documents": [NEW | {"id": "pemba"}]}).status_code == 200
        code, out, err = ralm("search", root / "index", "archipelago cloves", "-k", 1, "--retriever", "bm25", "--json")
        assert code == 0 and json.loads(out)[0]["id"] == "pemba:0", err
        assert ralm("index", "delete", root / "index", "pemba")[0] == 0  # the server's own write, deleted by the command line
        _visible_within(c, "/documents/pemba", 404, 2.0)


def test_the_server_compacts_its_log_once_it_passes_the_bound(dirs):
    with client(service(dirs, compact_after=3), watcher=True) as c:
        for i in range(4):
            assert c.post("/documents", json={"documents": [NEW | {"id": f"z{i}", "text": f"Island {i} grows cloves zq{i}."}]}).status_code == 200
        start = time.perf_counter()
        while c.get("/health").json()["index_version"] == "v000001":
            assert time.perf_counter() - start < 30, "no compaction"
            time.sleep(0.1)
        assert c.get("/stats").json()["corpus_blocks"] == len(DOCS) + 4
        assert c.post("/search", json={"query": "zq2", "k": 1, "retriever": "bm25"}).json()[0]["id"] == "z2:0"
    assert len(UpdateLog(dirs[0] / "index").read().records) == 0


def test_one_openqa_answers_every_ask_each_side_at_its_own_maps_threshold_and_follows_the_index(dirs):
    """The server holds one OpenQA: each /ask passes its request's k and side, and, with no
    --min-confidence, withholds at the map of the side it searched (the dense map's 0.6 withholds
    a confidence of 0.5, the BM25 map's 0.4 gives it); a new version is what the next /ask reads."""
    from ralm.models.confidence import Calibrations
    from test_openqa import _constant_map

    by_kind = {"by_kind": {"dense": _constant_map(0.5, 0.6), "bm25": _constant_map(0.5, 0.4), "hybrid": _constant_map(0.5)}}
    for min_confidence, withheld in ((None, {"dense": True, "bm25": False}), (0.0, {"dense": False, "bm25": False})):
        svc = service(dirs, min_confidence=min_confidence)
        qa = svc.qa
        qa.calibrations = Calibrations.from_json(by_kind, "the test's maps")
        with client(svc) as c:
            def ask(side):
                return c.post("/ask", json={"question": "Who created Python?", "k": 2, "side": side}).json()

            for side, no_answer in withheld.items():
                r = ask(side)
                assert (r["kind"], r["confidence"], r["no_answer"]) == (side, 0.5, no_answer), (min_confidence, r)
                assert len(r["evidence"]) == 2 and r["guess"]
            before = svc.live.current.name
            assert c.post("/documents", json={"documents": [NEW]}).status_code == 200
            svc.compact()  # publishes the log as a new version, which the live searcher serves
            assert ask("bm25")["index_version"] == svc.live.current.name != before
        assert svc.qa is qa
