"""The server under hostile clients: concurrent deletes, odd API keys, stalled requests, an
update log that is not a file, /docs without a network, and what it logs."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import socket
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from conftest import DOCS
from ralm.errors import RalmError
from ralm.retrieval.index.build import build_index
from ralm.serve.app import create_app, serve_forever, serve_in_background
from ralm.serve.service import ServeConfig, Service


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening")
    build_index(DOCS, root / "bm25", kind="bm25", show_progress=False)
    return root


@pytest.fixture
def index(built, tmp_path):
    shutil.copytree(built / "bm25", tmp_path / "bm25")  # the update log is written inside
    return tmp_path / "bm25"


def _service(index, **kw) -> Service:
    return Service(ServeConfig(index=str(index), **kw))


def test_concurrent_deletes_of_one_id_give_one_200_and_404s(index):
    app = create_app(_service(index, api_key="k"), start_watcher=False)

    async def race():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
            return await asyncio.gather(*(c.delete("/documents/paris", headers={"X-API-Key": "k"}) for _ in range(4)))

    statuses = sorted(r.status_code for r in asyncio.run(race()))
    assert statuses == [200, 404, 404, 404]


def test_api_keys_beyond_ascii(index):
    body = {"documents": [{"id": "zz", "text": "zanzibar cloves"}]}
    with TestClient(create_app(_service(index, api_key="k"), start_watcher=False), base_url="http://127.0.0.1") as c:
        r = c.post("/documents", json=body, headers={"X-API-Key": "sécret".encode()})
        assert r.status_code == 401 and "error" in r.json()
    with TestClient(create_app(_service(index, api_key="sécret"), start_watcher=False), base_url="http://127.0.0.1") as c:
        assert c.post("/documents", json=body, headers={"X-API-Key": "sécret".encode()}).status_code == 200
        assert c.post("/documents", json=body, headers={"X-API-Key": "secret"}).status_code == 401


@pytest.mark.parametrize("doc, needle", [
    ({"id": "a\nb", "text": "x"}, "control character"),
    ({"id": "a\u0000b", "text": "x"}, "control character"),
    ({"id": "\u200b", "text": "x"}, "empty"),
    ({"id": "a", "text": "x \ud800"}, "unicode string"),  # pydantic's strict str refuses lone surrogates
    ({"id": "a", "title": "\udfff", "text": "x"}, "unicode string"),
])
def test_documents_that_could_not_be_deleted_or_logged_are_422(index, doc, needle):
    with TestClient(create_app(_service(index), start_watcher=False), base_url="http://127.0.0.1") as c:
        r = c.post("/documents", content=json.dumps({"documents": [doc]}), headers={"Content-Type": "application/json"})
        assert r.status_code == 422 and needle in r.json()["error"]


def test_an_update_log_that_is_not_a_file_is_refused_at_start(index):
    (index / "updates.jsonl").mkdir()
    with pytest.raises(RalmError, match="updates.jsonl is not a regular file"):
        _service(index)


def test_a_stalled_body_gets_408(index, monkeypatch):
    import ralm.serve.app as app_module

    monkeypatch.setattr(app_module, "BODY_TIMEOUT", 0.3)
    app = create_app(_service(index), start_watcher=False)

    async def stalled():
        yield b'{"query": "cap'
        await asyncio.sleep(3)
        yield b'ital"}'

    async def send():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
            return await c.post("/search", content=stalled(), headers={"Content-Type": "application/json"})

    start = time.perf_counter()
    r = asyncio.run(send())
    assert r.status_code == 408 and "stopped arriving" in r.json()["error"] and time.perf_counter() - start < 3


def test_half_sent_headers_are_cut_off(index, monkeypatch):
    from ralm.serve.guards import HeaderTimeoutH11

    monkeypatch.setattr(HeaderTimeoutH11, "timeout", 0.5)
    with serve_in_background(_service(index)) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the blank line
            start = time.perf_counter()
            assert s.recv(1024) == b""  # closed by the server
            assert time.perf_counter() - start < 5
        assert httpx.get(f"{url}/health").status_code == 200


def test_docs_work_offline(index):
    with TestClient(create_app(_service(index), start_watcher=False), base_url="http://127.0.0.1") as c:
        page = c.get("/docs").text
        assert "cdn." not in page and "swagger-ui-bundle.js" in page
        js = next(part.split('"')[0] for part in page.split('src="')[1:] if "swagger-ui-bundle.js" in part)
        assert c.get(js).status_code == 200 and len(c.get(js).content) > 100_000


def test_serving_on_is_said_only_once_the_port_is_bound(index):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        said = []
        with pytest.raises(RalmError, match="cannot listen on 127.0.0.1"):
            serve_forever(_service(index), "127.0.0.1", taken.getsockname()[1], announce=lambda: said.append(1))
        assert not said


def test_deletions_and_swaps_are_logged(index, caplog):
    svc = _service(index, api_key="k")
    with caplog.at_level(logging.INFO, logger="ralm"), \
            TestClient(create_app(svc, start_watcher=False), base_url="http://127.0.0.1") as c:
        assert c.delete("/documents/paris", headers={"X-API-Key": "k"}).status_code == 200
        build_index(DOCS[:3], index, kind="bm25", show_progress=False)
        assert svc.refresh()
    text = caplog.text
    assert "deleted document 'paris'" in text and "swapped" in text
