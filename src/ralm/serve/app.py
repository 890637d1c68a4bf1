"""The HTTP API and web page. Routes validate and translate; the Service does the work.

Every bad request gets a 4xx with {"error": "..."} saying what is wrong, and the OpenAPI
schema documents each of them with the request constraints the server enforces.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import secrets
import time
from contextlib import asynccontextmanager, contextmanager
from importlib import resources
from pathlib import Path
from typing import Annotated, Callable, Iterator, Literal

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi_offline import FastAPIOffline
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from ralm.data.corpus import Document, file_documents, id_problem
from ralm.defaults import MAX_QUESTION_CHARS, READ_K, SEARCH_K
from ralm.errors import RalmError, plural
from ralm.serve.batching import MicroBatcher
from ralm.serve.guards import BodyLimit, HeaderTimeoutH11, HostGuard, OriginGuard, SecurityHeaders, allowed_hosts, error
from ralm.serve.service import Service

log = logging.getLogger("ralm.serve")


BODY_TIMEOUT = 30.0  # seconds a request body may pause before the server answers 408


def _not_blank(v: str) -> str:
    if not v.strip():
        raise ValueError("must not be empty")
    return v.strip()


def _document_id(v: str) -> str:
    """As a corpus file's ids (data/corpus.py): printable, so that DELETE /documents/ID can name
    it, and kept verbatim (not stripped), so that the id a client sent is the one it deletes."""
    if (problem := id_problem(v)) is not None:
        raise ValueError(problem)
    return v


# Not only whitespace; the schema says so with a pattern (JSON Schema patterns search, unanchored).
NonBlank = Annotated[str, AfterValidator(_not_blank), Field(json_schema_extra={"pattern": r"\S"})]
SideName = Literal["dense", "bm25", "hybrid"]


class Strict(BaseModel):
    """Request bodies: JSON types as the schema states them (no `true` for 1, no "5" for 5)."""
    model_config = ConfigDict(strict=True)


class Searching(Strict):
    """What a query searches: `side`, or `retriever`, its name in requests before the rename."""
    side: SideName | None = Field(None, description="default: every side the index holds, fused (hybrid); dense or bm25: that side alone")
    retriever: SideName | None = Field(None, description="the old name of `side`, still accepted")

    @model_validator(mode="after")
    def _one_side(self):
        if self.side is not None and self.retriever is not None and self.side != self.retriever:
            raise ValueError("give `side` only: `retriever` is its old name")
        return self

    @property
    def searched(self) -> str | None:
        return self.side or self.retriever


class AskRequest(Searching):
    question: NonBlank = Field(..., max_length=MAX_QUESTION_CHARS, description="the question")
    k: int = Field(READ_K, ge=1, le=100, description="number of passages to read")


class SearchRequest(Searching):
    query: NonBlank = Field(..., max_length=MAX_QUESTION_CHARS)
    k: int = Field(SEARCH_K, ge=1, le=100)


class DocumentIn(Strict):
    id: Annotated[str, AfterValidator(_document_id)] = Field(
        ..., max_length=500, json_schema_extra={"pattern": r"^[^\x00-\x1f\x7f]*\S[^\x00-\x1f\x7f]*$"})
    title: str = Field("", max_length=1000)
    text: NonBlank = Field(..., max_length=200_000)


class DocumentsRequest(Strict):
    documents: list[DocumentIn] = Field(..., min_length=1, max_length=1000)


class Passage(BaseModel):
    id: str
    title: str
    score: float
    text: str
    found_by: list[str] = Field(default_factory=list, description="the index's sides (dense, bm25) whose own top list held it")


class EvidenceOut(BaseModel):
    id: str
    title: str
    text: str
    retrieval_score: float
    retrieval_prob: float | None = None
    span_prob: float | None = None
    answer: str | None = None
    span: list[int] | None = Field(None, description="[start, end) of `answer` in `text`, in Unicode code points (as Python "
                                   "slices a str; a UTF-16 string such as JavaScript's holds an emoji as two units)")
    found_by: list[str] = Field(default_factory=list, description="the index's sides (dense, bm25) whose own top list held it")


class AskResponse(BaseModel):
    question: str = ""  # as asked
    answer: str  # "" when no answer is found in the corpus (confidence below the server's threshold)
    no_answer: bool = False
    guess: str = ""  # the most probable answer, also when withheld
    score: float
    confidence: float | None = None  # calibrated P(correct); None for an uncalibrated reader
    kind: str = ""  # what was searched: hybrid, dense or bm25
    retriever: str = ""  # the same, under its name before `kind`
    index_version: str = ""
    evidence: list[EvidenceOut]
    best: int | None = None


class ErrorOut(BaseModel):
    error: str


ERRORS = {
    400: "a side this server's index does not hold, or a Host header it does not answer to",
    401: "the API key is missing or wrong (writes, when the server has one)",
    404: "no document with that id",
    409: "no reader is loaded (start the server with --model)",
    413: "the request body exceeds the limit (1 MiB by default)",
    422: "the request does not match the schema; the message names the field",
    507: "the server's disk is full (a write found no room)",
}


def _errors(*codes: int) -> dict:
    """OpenAPI responses for the error statuses a route can answer; every one has the Host check's 400."""
    return {code: {"model": ErrorOut, "description": ERRORS[code]} for code in sorted({400, *codes})}


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for e in exc.errors():
        where = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
        parts.append(f"{where}: {e.get('msg', 'invalid')}")
    return "; ".join(parts)


def create_app(service: Service, start_watcher: bool = True) -> FastAPI:
    """The HTTP API. Long on purpose: the routes are closures over `service`, its lock and
    batchers (FastAPI's pattern), one short handler each, so they live in this one function."""
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        if start_watcher:
            service.start()
        yield
        service.stop()

    # FastAPIOffline: /docs and /redoc serve Swagger UI and ReDoc from the package, not a CDN
    app = FastAPIOffline(title="ralm", version=__import__("ralm").__version__, lifespan=lifespan,
                  description="Retrieval-augmented question answering with evidence, live document updates and hot index swap.")
    # Reads: concurrent /search and /ask requests with the same settings share one model call,
    # one batch at a time, on snapshots that writes never disturb. Writes: one at a time.
    lock = asyncio.Lock()

    def run_batch(key, items):
        endpoint, k, side = key
        return (service.search if endpoint == "search" else service.ask)(items, k, side)

    batcher = MicroBatcher(run_batch)

    async def batched(endpoint: str, text: str, k: int, side: str | None):
        start = time.perf_counter()
        try:
            return await batcher.submit((endpoint, k, side), text)
        finally:
            service.record_latency(endpoint, time.perf_counter() - start)

    # the last added runs first: security headers on every answer, then Host, Origin, body size
    hosts = allowed_hosts(service.cfg.host, service.cfg.allowed_hosts)
    app.add_middleware(BodyLimit, limit=service.cfg.body_limit, timeout=BODY_TIMEOUT)
    app.add_middleware(OriginGuard, allowed=hosts)
    app.add_middleware(HostGuard, allowed=hosts)
    app.add_middleware(SecurityHeaders, inline_pages=("/docs", "/redoc", app.swagger_ui_oauth2_redirect_url))

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, exc: RequestValidationError):
        return error(422, _validation_message(exc))

    @app.exception_handler(RalmError)
    async def ralm_error(_: Request, exc: RalmError):
        return error(400, str(exc))

    @app.exception_handler(StarletteHTTPException)  # ours and the framework's (unknown path, wrong method)
    async def http_error(_: Request, exc: StarletteHTTPException):
        return error(exc.status_code, str(exc.detail), exc.headers)

    @app.exception_handler(OSError)
    async def os_error(request: Request, exc: OSError):
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # a write the disk had no room for: not a bug, not the client's
            log.error("disk full: %s", exc)
            return error(507, f"the server's disk is full ({exc.strerror or exc})")
        return await server_error(request, exc)

    @app.exception_handler(Exception)
    async def server_error(_: Request, exc: Exception):
        log.error("internal error", exc_info=exc)
        return error(500, f"internal error: {type(exc).__name__}")

    async def run(fn, *args):
        async with lock:
            return await asyncio.to_thread(fn, *args)

    def require_key(x_api_key: str | None = Header(None), authorization: str | None = Header(None)):
        if service.cfg.api_key is None:
            return
        given = x_api_key or (authorization[7:] if authorization and authorization.startswith("Bearer ") else None)
        # bytes: compare_digest refuses non-ASCII str; header values arrive decoded as latin-1
        if given is None or not secrets.compare_digest(given.encode("latin-1"), service.cfg.api_key.encode()):
            raise HTTPException(401, "this server protects writes: send the API key in the X-API-Key header")

    @app.post("/ask", response_model=AskResponse, summary="Answer a question with evidence", responses=_errors(409, 413, 422))
    async def ask(req: AskRequest):
        try:
            return await batched("ask", req.question, req.k, req.searched)
        except LookupError as e:
            raise HTTPException(409, str(e)) from None

    @app.post("/search", response_model=list[Passage], summary="Retrieve passages", responses=_errors(413, 422))
    async def search(req: SearchRequest):
        hits = await batched("search", req.query, req.k, req.searched)
        return [h.to_json() for h in hits]

    async def index_after() -> dict:
        """What a write left: the index version answering now and its block count (the web page reports both)."""
        stats = await run(service.stats)
        return {"index_version": stats["index_version"], "blocks": stats["corpus_blocks"]}

    @app.post("/documents", dependencies=[Depends(require_key)], summary="Add or replace documents (durable, live)",
              responses=_errors(401, 413, 422, 507))
    async def add_documents(req: DocumentsRequest):
        docs = [Document(d.id, d.title.strip(), d.text.strip()) for d in req.documents]
        ids = await run(service.add, docs)
        log.info("added %d document(s): %s", len(ids), ", ".join(map(repr, ids[:5])) + (" ..." if len(ids) > 5 else ""))
        after = await index_after()
        return {"added": ids, "corpus_blocks": after["blocks"], **after}

    @app.post("/documents/file", dependencies=[Depends(require_key)], responses=_errors(401, 413, 422, 507),
              summary="Add or replace the documents of a Markdown, HTML, PDF or .txt file, sent as the request body",
              openapi_extra={"requestBody": {"required": True, "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}})
    async def add_file(request: Request, name: str = Query(..., min_length=1, max_length=500, description=(
            "the file's name or path: its suffix picks the format, and it is the documents' id (a section's anchor "
            "appended: guide.md#setup, paper.pdf#page=3)"))):
        docs = await asyncio.to_thread(file_documents, await request.body(), name)
        ids, gone = await run(service.add_file, docs, name)
        log.info("added %s from %s%s", plural(len(ids), "document"), name, f", deleted {len(gone)} it no longer holds" if gone else "")
        after = await index_after()
        return {"added": ids, "deleted": gone, "corpus_blocks": after["blocks"], **after}

    @app.get("/documents", summary="The index's files, a page at a time (what the web page lists)", responses=_errors(422))
    async def list_files(offset: int = Query(0, ge=0, description="files to skip"),
                         limit: int = Query(20, ge=1, le=100, description="files to list")):
        return await asyncio.to_thread(service.files, offset, limit)  # a snapshot's answer: no wait behind writes

    @app.get("/documents/{doc_id:path}", summary="Whether a document exists (before replacing it), and what a delete of the id deletes",
             responses=_errors(404, 422))
    async def get_document(doc_id: str):
        named = await asyncio.to_thread(service.documents_named, doc_id)  # a snapshot's answer: no wait behind writes
        if not named:
            raise HTTPException(404, f"no document with id {doc_id!r}")
        return {"id": doc_id, "documents": named}

    @app.delete("/documents/{doc_id:path}", dependencies=[Depends(require_key)],
                summary="Delete a document, or every section and page of a file by its name", responses=_errors(401, 404, 422, 507))
    async def delete_document(doc_id: str):
        deleted = await run(delete_if_present, doc_id)
        if not deleted:
            raise HTTPException(404, f"no document with id {doc_id!r}")
        whole = "" if deleted == [doc_id] else f" ({plural(len(deleted), 'document')}: every section of the file)"
        log.info("deleted document %r%s", doc_id, whole)
        return {"deleted": doc_id, "documents": deleted, "count": len(deleted), **await index_after()}

    def delete_if_present(doc_id: str) -> list[str]:
        """Check and delete under one lock: of two concurrent DELETEs of an id, the second gets
        404, as does one of an id another process deleted (the delete checks the log again).
        The ids deleted; [] when it names none."""
        if not service.documents_named(doc_id):
            return []
        try:
            return service.delete(doc_id)
        except KeyError:
            return []

    @app.get("/health", responses=_errors())
    async def health():
        return {"status": "ok", "index_version": service.live.current.name}

    @app.get("/stats", responses=_errors())
    async def stats():
        return await run(service.stats)

    static = Path(str(resources.files("ralm.serve") / "static"))
    app.mount("/static", StaticFiles(directory=static), name="static")

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(static / "index.html")

    return app


def _server(app: FastAPI, host: str, port: int):
    import uvicorn

    # HeaderTimeoutH11 closes connections whose request head never completes (guards.py)
    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", http=HeaderTimeoutH11,
                                         timeout_keep_alive=5))


def serve_forever(service: Service, host: str, port: int, announce: Callable[[], None], *, sock=None) -> None:
    """Bind host:port (unless `sock`, from serve.listen, is bound already), then `announce()`
    (only now is "serving on ..." true), then serve until interrupted. The server logs, on
    stderr, index swaps, refused swaps and document writes."""
    from ralm.serve.listen import listen

    sock = sock or listen(host, port)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("ralm").addHandler(handler)
    logging.getLogger("ralm").setLevel(logging.INFO)
    announce()
    _server(create_app(service), host, port).run(sockets=[sock])


@contextmanager
def serve_in_background(service: Service) -> Iterator[str]:
    """Serve `service` on a free loopback port from a background thread (load tests, browser
    tests, screenshots); yields the base URL and stops the server on exit."""
    import socket
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = _server(create_app(service), "127.0.0.1", port)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the server did not start on 127.0.0.1:{port}")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
