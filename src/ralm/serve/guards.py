"""Checks that run before a request reaches a route (ASGI middleware), answering in the API's
error shape, {"error": "..."}.

HostGuard: a page on another site can make a browser send requests to a loopback server under
a host name it controls (DNS rebinding); such requests name that host in their Host header.
BodyLimit: counts the body bytes actually received, so a chunked body (no Content-Length) is
held to the limit too, and answers 408 when a body stops arriving for `timeout` seconds.
HeaderTimeoutH11: uvicorn's HTTP/1.1 protocol, closing a connection whose request headers do
not all arrive within `timeout` seconds (uvicorn waits forever for them: a few slow clients
would hold every connection).
"""

from __future__ import annotations

import asyncio

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
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


def host_name(header: str) -> str:
    """The host of a Host header, without its port: 'localhost:8000' -> 'localhost', '[::1]:80' -> '[::1]'."""
    if header.startswith("["):
        return header[: header.find("]") + 1].lower()
    return header.rsplit(":", 1)[0].lower()


class HostGuard:
    def __init__(self, app: ASGIApp, allowed: frozenset[str] | None):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.allowed is not None:
            header = Headers(scope=scope).get("host", "")
            if host_name(header) not in self.allowed:
                message = (f"Host header {header!r} is not allowed: this server answers to {', '.join(sorted(self.allowed))} "
                           "(start it with --allowed-host NAME to add one)")
                return await error(400, message)(scope, receive, send)
        await self.app(scope, receive, send)


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
