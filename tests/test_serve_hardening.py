"""The server under hostile clients: concurrent deletes, odd API keys, stalled requests, an
update log that is not a file, /docs without a network, and what it logs; malformed Host
headers, writes from another origin's page (CSRF) and the security headers on every answer."""

from __future__ import annotations

import asyncio
import json
import logging
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


@pytest.fixture
def index(bm25_index):
    return bm25_index


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
        build_index(DOCS[:3], index, kind="bm25", show_progress=False, replace=True)  # over the delete: replace it
        assert svc.refresh()
    text = caplog.text
    assert "deleted document 'paris'" in text and "swapped" in text


@pytest.mark.parametrize("extra", [(), ("*",)])
@pytest.mark.parametrize("host", ["[::1]evil.com", "localhost:80@evil.com", "localhost:abc", "", "localhost:",
                                  "[::1", "[fe80::1%eth0]", "local host", "localhost:99999", "127.0.0.1:8000/x"])
def test_a_host_header_that_is_not_host_and_port_is_refused(index, host, extra):
    """RFC 3986 host [":" port] only: a loopback name followed by anything else is no loopback name."""
    with TestClient(create_app(_service(index, allowed_hosts=extra), start_watcher=False), base_url="http://127.0.0.1") as c:
        r = c.get("/health", headers={"Host": host})
        assert r.status_code == 400 and f"Host header {host!r} is not" in r.json()["error"], r.text
        assert c.get("/health", headers={"Host": "[::1]:8000"}).status_code == 200


FILE = "/documents/file?name=csrf.txt"  # a .txt file's document id is its name
PLAIN = {"Content-Type": "text/plain"}  # a "simple" request: a browser sends it cross-origin without asking first


@pytest.mark.parametrize("headers", [
    {"Origin": "http://evil.example"},
    {"Origin": "http://127.0.0.1:8001"},  # another port of this machine is another origin
    {"Origin": "http://localhost:8000@evil.example"},
    {"Origin": "null"},  # a sandboxed frame, a file:// page
    {"Origin": "ftp://127.0.0.1:8000"},
    {"Referer": "http://evil.example/page.html"},  # no Origin: the Referer's origin
    {"Origin": "http://127.0.0.1:8000", "Sec-Fetch-Site": "cross-site"},
])
def test_writes_from_another_origin_are_refused_and_write_nothing(index, headers):
    with TestClient(create_app(_service(index), start_watcher=False), base_url="http://127.0.0.1:8000") as c:
        r = c.post(FILE, content=b"Zanzibar is famous for cloves.", headers={**PLAIN, **headers})
        assert r.status_code == 403 and "refused" in r.json()["error"], r.text
        assert c.post("/documents", json={"documents": [{"id": "zz", "text": "cloves"}]}, headers=headers).status_code == 403
        assert c.delete("/documents/paris", headers=headers).status_code == 403
        assert c.get("/documents/csrf.txt").status_code == 404 and c.get("/documents/zz").status_code == 404
        assert c.get("/documents/paris").status_code == 200
        assert not any(h["id"].startswith("csrf.txt") for h in c.post("/search", json={"query": "zanzibar cloves"}).json())
        assert c.get("/health", headers=headers).status_code == 200  # reads stay open


@pytest.mark.parametrize("base, extra, headers", [
    ("http://127.0.0.1:8000", (), {"Origin": "http://127.0.0.1:8000"}),  # the server's own page
    ("http://127.0.0.1:8000", (), {"Origin": "http://localhost:8000", "Sec-Fetch-Site": "same-site"}),  # another loopback name
    ("http://127.0.0.1:8000", (), {"Referer": "http://127.0.0.1:8000/"}),
    ("http://127.0.0.1", (), {"Origin": "http://127.0.0.1"}),  # no port: the scheme's own
    ("http://ralm.internal", ("ralm.internal",), {"Origin": "https://ralm.internal"}),  # an --allowed-host behind TLS
    ("http://anything.example:8000", ("*",), {"Origin": "http://anything.example:8000"}),  # any host: the one named
    ("http://127.0.0.1:8000", (), {}),  # curl, Python, the CLI: no Origin, no Referer
])
def test_writes_from_the_servers_own_origin_or_no_page_are_accepted(index, base, extra, headers):
    with TestClient(create_app(_service(index, allowed_hosts=extra), start_watcher=False), base_url=base) as c:
        r = c.post(FILE, content=b"Zanzibar is famous for cloves.", headers={**PLAIN, **headers})
        assert r.status_code == 200 and r.json()["added"] == ["csrf.txt"], r.text
        assert c.get("/documents/csrf.txt").status_code == 200
        assert any(h["id"].startswith("csrf.txt") for h in c.post("/search", json={"query": "zanzibar cloves"}).json())


def test_any_host_still_refuses_an_origin_other_than_the_host_named(index):
    with TestClient(create_app(_service(index, allowed_hosts=("*",)), start_watcher=False), base_url="http://ralm.example") as c:
        r = c.post(FILE, content=b"cloves", headers={**PLAIN, "Origin": "http://evil.example"})
        assert r.status_code == 403 and "ralm.example" in r.json()["error"]


def test_every_answer_carries_the_security_headers(index):
    with TestClient(create_app(_service(index), start_watcher=False), base_url="http://127.0.0.1") as c:
        answers = {"page": c.get("/"), "static file": c.get("/static/app.js"), "API": c.get("/health"),
                   "404": c.get("/nowhere"), "403": c.post(FILE, content=b"x", headers={"Origin": "http://evil.example"}),
                   "400": c.get("/health", headers={"Host": "evil.example"}), "docs": c.get("/docs")}
    for what, r in answers.items():
        assert r.headers.get("X-Frame-Options") == "DENY", what
        assert r.headers.get("X-Content-Type-Options") == "nosniff", what
        assert r.headers.get("Referrer-Policy") == "same-origin", what
        assert "frame-ancestors 'none'" in r.headers.get("Content-Security-Policy", ""), what
    page = answers["page"].headers["Content-Security-Policy"]
    assert "default-src 'none'" in page and "script-src 'self';" in page and "unsafe-inline" not in page
    assert "<script>" not in answers["page"].text and " style=" not in answers["page"].text  # the policy lets the page work
    assert "script-src 'self' 'unsafe-inline'" in answers["docs"].headers["Content-Security-Policy"]  # Swagger UI's inline start
