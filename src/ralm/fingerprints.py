"""Content fingerprints of input files and folders, so a run is recognised by what it reads,
not by the path it was given: a run started from one folder resumes from another, or with its
corpus copied elsewhere.

A file up to 64 MiB is hashed whole; a larger one by its size and 64 pieces of 64 KiB spread
evenly over it (an edit that changes no size and falls between pieces goes unseen, the price
of fingerprinting a 13 GB corpus in milliseconds). A folder is the names and sizes of all its
files (hidden ones, such as a write in progress, left out) and the contents of up to 64 of them.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

WHOLE = 64 << 20
PIECES, PIECE = 64, 64 << 10
FOLDER_FILES = 64


def _file_digest(path: Path, h) -> None:
    size = path.stat().st_size
    h.update(f"{size}\0".encode())
    with open(path, "rb") as f:
        if size <= WHOLE:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
            return
        for i in range(PIECES):
            f.seek(i * (size - PIECE) // (PIECES - 1))
            h.update(f.read(PIECE))


def fingerprint(path: str | os.PathLike) -> str | None:
    """"sha256:<hex>" of a file's or folder's content; None when the path does not exist."""
    root = Path(path)
    h = hashlib.sha256()
    if root.is_file():
        _file_digest(root, h)
    elif root.is_dir():
        files = sorted(p for p in root.rglob("*")
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts))
        for p in files:
            h.update(f"{p.relative_to(root).as_posix()}\0{p.stat().st_size}\0".encode())
        for p in files[:: max(1, len(files) // FOLDER_FILES)][:FOLDER_FILES]:
            _file_digest(p, h)
    else:
        return None
    return "sha256:" + h.hexdigest()
