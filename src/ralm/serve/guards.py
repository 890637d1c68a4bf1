"""Checks that run before a request reaches a route (ASGI middleware), answering in the API's
error shape, {"error": "..."}.

HostGuard: a page on another site can make a browser send requests to a loopback server under
a host name it controls (DNS rebinding); such requests name that host in their Host header.
OriginGuard: a page on another site can make a browser send a write (a "simple" POST needs no
CORS preflight) to a server it cannot read from (CSRF); the browser names that page's origin.
SecurityHeaders: what a browser may load into the server's pages, and that no other site may
frame them or have their responses sniffed into scripts.
BodyLimit: counts the body bytes actually received, so a chunked body (no Content-Length) is
held to the limit too, and answers 408 when a body stops arriving for `timeout` seconds.
HeaderTimeoutH11: uvicorn's HTTP/1.1 protocol, closing a connection whose request headers do
not all arrive within `timeout` seconds (uvicorn waits forever for them: a few slow clients
would hold every connection).
"""

from __future__ import annotations

import asyncio
import ipaddress
import re

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

LOOPBACK = ("localhost", "127.0.0.1", "[::1]")
ANY_ADDRESS = ("0.0.0.0", "::", "")


def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": message}, headers=headers)


def allowed_hosts(host: str, extra: tuple[str, ...]) -> frozenset[str] | None:
    """Host header names a server bound to `host` accepts: loopback names, the bound address
    (unless it is a wildcard: its names cannot be known) and `extra`; None when `extra` has "*"."""
    if "*" in extra:
        return None
    bound = () if host in ANY_ADDRESS else (f"[{host}]" if ":" in host else host,)
    return frozenset(h.lower() for h in (*LOOPBACK, *bound, *extra))


# RFC 3986 host [":" port]: a bracketed IPv6 literal, or a reg-name / IPv4 address of letters,
# digits, "-" and "."; the port digits only. Nothing else ('[::1]evil.com', 'localhost:80@evil.com').
AUTHORITY = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(?::([0-9]{1,5}))?")
DEFAULT_PORTS = {"http": 80, "https": 443}
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")  # every other method changes state (or may: POST /search)


def parse_authority(text: str) -> tuple[str, int | None] | None:
    """(host, port) of a Host header or a URL's authority, the host lower-cased: 'localhost:8000' ->
    ('localhost', 8000), '[::1]' -> ('[::1]', None); None when it is not host [":" port]."""
    match = AUTHORITY.fullmatch(text)
    if match is None:
        return None
    host, port = match[1].lower(), match[2]
    if host.startswith("["):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return None
    if port is not None and int(port) > 65535:
        return None
    return host, None if port is None else int(port)


def parse_origin(url: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an Origin header or a Referer URL, the port explicit: 'http://localhost'
    -> ('http', 'localhost', 80); None for 'null', a scheme other than http(s) or a malformed authority."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in DEFAULT_PORTS:
        return None
    authority = parse_authority(re.split(r"[/?#]", rest, maxsplit=1)[0])
    if authority is None:
        return None
    host, port = authority
    return scheme, host, DEFAULT_PORTS[scheme] if port is None else port


class HostGuard:
    def __init__(self, app: ASGIApp, allowed: frozenset[str] | None):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = Headers(scope=scope).get("host", "")
            authority = parse_authority(header)
            if self.allowed is None and authority is None:
                return await error(400, f"Host header {header!r} is not a host name or address with an optional :port")(scope, receive, send)
            if self.allowed is not None and (authority is None or authority[0] not in self.allowed):
                message = (f"Host header {header!r} is not allowed: this server answers to {', '.join(sorted(self.allowed))} "
                           "(start it with --allowed-host NAME to add one)")
                return await error(400, message)(scope, receive, send)
        await self.app(scope, receive, send)


class OriginGuard:
    """Refuses (403) a state-changing request from a browser page of another origin: one whose
    Origin header (without one, its Referer's origin) is not http(s) on a host HostGuard allows and
    the port the Host header names, or that the browser marks Sec-Fetch-Site: cross-site. A request
    with neither Origin nor Referer (curl, Python clients, the CLI) names no page and passes.
    Install inside HostGuard: the Host header is checked first."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str] | None):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] not in SAFE_METHODS:
            refused = self.refusal(Headers(scope=scope))
            if refused is not None:
                return await error(403, f"{refused}: send writes from this server's own page, or from a client "
                                        "that sends no Origin header (curl, Python, ralm)")(scope, receive, send)
        await self.app(scope, receive, send)

    def refusal(self, headers: Headers) -> str | None:
        """Why the request comes from another site's page, or None when it does not."""
        if headers.get("sec-fetch-site") == "cross-site":
            return "cross-site request refused (Sec-Fetch-Site: cross-site)"
        name, sent = ("Origin", headers["origin"]) if "origin" in headers else ("Referer", headers.get("referer"))
        if sent is None:
            return None
        host, port = parse_authority(headers.get("host", "")) or ("", None)
        hosts = self.allowed if self.allowed is not None else frozenset({host})
        origin = parse_origin(sent)
        if origin is not None:
            scheme, origin_host, origin_port = origin
            if origin_host in hosts and origin_port == (DEFAULT_PORTS[scheme] if port is None else port):
                return None
        where = f"port {port}" if port is not None else "the default port"
        return f"cross-origin request refused: {name} {sent!r} is not this server (http or https on {', '.join(sorted(hosts))}, {where})"


# The server's pages load their scripts and styles from /static and talk to the API only: no
# inline script or style, nothing from elsewhere, no framing.
PAGE_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
               "form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
# Swagger UI (/docs) and ReDoc (/redoc) start from an inline script and style themselves inline
# (and ReDoc searches in a blob: worker); their scripts are the package's own (fastapi-offline).
INLINE_POLICY = ("default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
                 "img-src 'self' data:; worker-src 'self' blob:; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")


class SecurityHeaders:
    """Adds to every response (page, static file, API answer, a guard's refusal; not the 500 that
    Starlette's outermost error middleware sends) the Content-Security-Policy (INLINE_POLICY for the
    paths in `inline_pages`, PAGE_POLICY elsewhere), X-Frame-Options: DENY, X-Content-Type-Options:
    nosniff and Referrer-Policy: same-origin, unless the route set them. Install outermost."""

    def __init__(self, app: ASGIApp, inline_pages: tuple[str, ...] = ()):
        self.app, self.inline_pages = app, inline_pages

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        policy = INLINE_POLICY if scope["path"] in self.inline_pages else PAGE_POLICY

        async def with_headers(message):
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in (("Content-Security-Policy", policy), ("X-Frame-Options", "DENY"),
                                    ("X-Content-Type-Options", "nosniff"), ("Referrer-Policy", "same-origin")):
                    headers.setdefault(name, value)
            await send(message)

        await self.app(scope, receive, with_headers)


class BodyLimit:
    def __init__(self, app: ASGIApp, limit: int, timeout: float):
        self.app, self.limit, self.timeout = app, limit, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = f"request body exceeds the limit of {self.limit} bytes"
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:  # refused before it is read
            return await error(413, too_large)(scope, receive, send)
        received, body_done = 0, False

        async def counted():
            nonlocal received, body_done
            if body_done:  # after the body, receive() waits for a disconnect: no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout)
            except TimeoutError:  # raised inside the route's body read: the app's handler answers
                raise HTTPException(408, f"the request body stopped arriving (nothing for {self.timeout:g} s)") from None
            body_done = not message.get("more_body", False)
            received += len(message.get("body", b""))
            if received > self.limit:
                raise HTTPException(413, too_large)
            return message

        await self.app(scope, counted, send)


class HeaderTimeoutH11(H11Protocol):
    timeout = 10.0  # seconds from the connection (or the last response) to a complete request head

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def _arm(self) -> None:
        waiting_for = self.cycle  # a new request replaces the cycle once its headers are complete
        self.loop.call_later(self.timeout, lambda: self.cycle is waiting_for and self.transport.close())
