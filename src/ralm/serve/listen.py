"""Binding the server's port. Kept apart from the app (FastAPI, the models) so that `ralm serve`
binds first and a busy port is one line in about a second, not after the models load."""

from __future__ import annotations

import errno
import os
import socket

from ralm.errors import RalmError


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port and listening; a port in use, or an address that is not this
    machine's, is a RalmError naming it."""
    try:
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        hint = {errno.EADDRINUSE: "; another process (a server already running?) holds it: stop it or choose another --port",
                errno.EADDRNOTAVAIL: "; --host is not an address of this machine",
                errno.EACCES: "; ports below 1024 need root: choose another --port"}.get(e.errno, "")
        reason = os.strerror(e.errno) if e.errno else str(e)  # create_server's own text repeats the address
        raise RalmError(f"cannot listen on {host}:{port}: {reason}{hint}") from None
