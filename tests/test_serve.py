"""The HTTP API: every endpoint, live documents, hot swap under load, restart replay, 4xx."""

import json
import shutil
import threading

import pytest
from fastapi.testclient import TestClient

from ralm.retrieval.build import build_index
from ralm.retrieval.store import IndexDir
from ralm.serve.app import create_app
from ralm.serve.service import ServeConfig, Service

from conftest import DOCS

NEW = {"id": "zanzibar", "title": "Zanzibar", "text": "Zanzibar is an archipelago off the coast of Tanzania famous for cloves."}


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_bert):
    """A dense index, a BM25 index over the same blocks, and a (random) tiny reader."""
    from ralm.models.reader import Reader

    root = tmp_path_factory.mktemp("serve")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    build_index(corpus, root / "dense", model=str(tiny_bert), dim=16, show_progress=False)
    build_index(corpus, root / "bm25", kind="bm25", show_progress=False)
    Reader.from_encoder(tiny_bert).save_pretrained(root / "reader")
    return root


@pytest.fixture
def dirs(built, tmp_path):
    """Fresh copies per test: the update log is written inside the index directory."""
    for name in ("dense", "bm25"):
        shutil.copytree(built / name, tmp_path / name)
    return tmp_path, built / "reader"


def service(dirs, **kw):
    root, reader = dirs
    cfg = ServeConfig(index=str(root / "dense"), model=str(reader), bm25=str(root / "bm25"), poll_seconds=0.05, **kw)
    return Service(cfg)


def client(svc, watcher=False):
    return TestClient(create_app(svc, start_watcher=watcher))


def test_every_endpoint(dirs):
    with client(service(dirs)) as c:
        assert c.get("/health").json()["status"] == "ok"
        stats = c.get("/stats").json()
        assert stats["corpus_blocks"] == len(DOCS) and stats["index_version"] == "v000001"
        assert set(stats["retrievers"]) == {"dense", "bm25", "hybrid"} and stats["reader_loaded"]
        for retriever in ("dense", "bm25", "hybrid"):
            hits = c.post("/search", json={"query": "Guido van Rossum Python", "k": 3, "retriever": retriever}).json()
            assert len(hits) == 3 and set(hits[0]) == {"id", "title", "score", "text"}, retriever
        assert c.post("/search", json={"query": "Guido van Rossum", "k": 1, "retriever": "bm25"}).json()[0]["id"] == "python:0"
        answer = c.post("/ask", json={"question": "Who created Python?", "k": 2, "retriever": "bm25"}).json()
        assert set(answer) >= {"answer", "score", "evidence"} and len(answer["evidence"]) == 2
        ev = answer["evidence"][answer["best"]]
        assert {"id", "title", "text", "retrieval_score", "span"} <= set(ev)
        a, b = ev["span"]
        assert ev["text"][a:b] == answer["answer"]
        assert c.post("/documents", json={"documents": [NEW]}).json()["added"] == ["zanzibar"]
        assert c.delete("/documents/zanzibar").json() == {"deleted": "zanzibar"}
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
    log = dirs[0] / "dense" / "updates.jsonl"
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
        index = IndexDir(root / "dense")
        model = str(index.root / index.version_manifest("v000001")["retriever"])
        corpus = root / "more.jsonl"
        corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS + [NEW]))
        build_index(corpus, root / "dense", model=model, show_progress=False)
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
    ("post", "/documents", {"documents": []}, 422, "documents"),
    ("post", "/documents", {"documents": [{"id": "a", "text": ""}]}, 422, "text"),
    ("delete", "/documents/no-such-doc", None, 404, "no-such-doc"),
])
def test_bad_requests_get_a_4xx_with_a_json_error(dirs, method, path, body, status, needle):
    with client(service(dirs)) as c:
        r = getattr(c, method)(path, json=body) if body is not None else getattr(c, method)(path)
        assert r.status_code == status, r.text
        assert needle in r.json()["error"]


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
        assert r.status_code == 400 and "--bm25" in r.json()["error"]
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
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await asyncio.gather(*(c.post("/search", json={"query": q, "k": 1, "retriever": "bm25"}) for q in queries))

    responses = asyncio.run(burst())
    assert all(r.status_code == 200 for r in responses)
    assert [r.json()[0]["id"] for r in responses] == [expected[q] for q in queries]
    assert sum(calls) == len(queries) and len(calls) < len(queries)  # fewer model calls than requests


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
