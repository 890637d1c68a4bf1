"""Index versions that verify themselves (as Lucene's CheckIndex does for its segments).

A published version's manifest records, under "files", every file the version uses: its own
(embeddings, faiss index, BM25 arrays) and those it shares with other versions in the index
directory (the block store, the retriever checkpoint), each with its size and sha256, and for
a .npy array its shape and dtype. Keys are paths relative to the version directory, so a
shared file is "../../blocks/<key>/tokens/values.bin".

  check_open: sizes, shapes and dtypes (reads only .npy headers): every time a version opens
  check_full: also the checksums, and NaN or inf in float arrays: `ralm index check`

The manifest, which cannot list itself, carries its own "checksum": the sha256 of its JSON
without that key (`check_manifest`, by `ralm index check`). A mismatch is a RalmError naming
the file. Versions built before inventories existed have no "files" key, and those before
manifest checksums no "checksum": they open as before and `check` reports them as unverified.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from ralm.errors import RalmError

FILES = "files"  # the version manifest's key
CHECKSUM = "checksum"  # and its own
SKIP = {"manifest.json"}  # a version's own manifest holds the inventory: it cannot list itself
_CHUNK = 1 << 22  # bytes hashed, or array rows scanned, at a time


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def npy_header(path: Path) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) from a .npy file's header, without reading its data."""
    with open(path, "rb") as f:
        major, _ = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(f)
    return tuple(shape), dtype


def used_folders(root: Path, manifest: dict) -> list[Path]:
    """The index directory's shared folders a version manifest names: its block store
    ("blocks": key) and any value, at its top level or in a side's section, that is a folder
    path inside the index (the dense side's retriever)."""
    names = [Path("blocks") / v for k, v in manifest.items() if k == "blocks" and isinstance(v, str)]
    sections = manifest.get("sections")
    values = [*manifest.values(), *(v for s in (sections.values() if isinstance(sections, dict) else ()) if isinstance(s, dict)
                                    for v in s.values())]
    names += [Path(v) for v in values if isinstance(v, str) and "/" in v and not os.path.isabs(v)]
    found = []
    for name in names:
        path = (root / name).resolve()
        if path.is_dir() and path.is_relative_to(root.resolve()) and path not in found:
            found.append(path)
    return found


def _entry(path: Path) -> dict:
    entry = {"size": path.stat().st_size, "sha256": sha256(path)}
    if path.suffix == ".npy":
        shape, dtype = npy_header(path)
        entry.update(shape=list(shape), dtype=dtype.str)
    return entry


def inventory(version_dir: str | os.PathLike, uses: list[Path] = ()) -> dict:
    """{path relative to the version: {size, sha256[, shape, dtype]}} of every file under
    `version_dir` and under the shared folders `uses` (its manifest excepted)."""
    version_dir = Path(version_dir)
    files = {}
    for folder in (version_dir, *uses):
        for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
            key = os.path.relpath(path, version_dir)
            if key not in SKIP:
                files[Path(key).as_posix()] = _entry(path)
    return files


def manifest_checksum(raw: dict) -> str:
    """The sha256 of a version manifest's JSON object without its "checksum" (keys sorted)."""
    body = {k: v for k, v in raw.items() if k != CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def check_manifest(path: str | os.PathLike, raw: dict) -> bool:
    """Whether the manifest `raw`, read from `path`, carries a checksum (False: written before
    them); one it differs from is the file's damage."""
    if CHECKSUM not in raw:
        return False
    if raw[CHECKSUM] != manifest_checksum(raw):
        raise _damaged(Path(path), "its contents differ from the checksum it was published with")
    return True


def _damaged(path: Path, what: str) -> RalmError:
    return RalmError(f"{path} is damaged ({what}); rebuild the index (`ralm index build` publishes a new version)")


def check_open(version_dir: str | os.PathLike, files: dict | None) -> None:
    """Cheap: every file of the inventory `files` (the manifest's; None for an unverified
    version) is there with its size, and each .npy its shape and dtype."""
    version_dir = Path(version_dir)
    for key, entry in (files or {}).items():
        path = version_dir / key
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise _damaged(path, "missing") from None
        if not path.is_file():
            raise _damaged(path, "not a file")
        if size != entry["size"]:
            raise _damaged(path, f"{size} bytes, the version's manifest says {entry['size']}")
        if "shape" in entry:
            try:
                shape, dtype = npy_header(path)
            except (ValueError, EOFError) as e:
                raise _damaged(path, f"not a readable .npy array ({e})") from None
            if list(shape) != entry["shape"] or dtype.str != entry["dtype"]:
                raise _damaged(path, f"array {list(shape)} {dtype.str}, the version's manifest says "
                                     f"{entry['shape']} {entry['dtype']}")


def _finite(path: Path) -> bool:
    arr = np.load(path, mmap_mode="r", allow_pickle=False)
    if arr.dtype.kind not in "fc" or arr.size == 0:
        return True
    rows = arr.reshape(arr.shape[0], -1) if arr.ndim else arr.reshape(1, 1)
    step = max(1, _CHUNK // max(1, rows.shape[1]))
    return all(np.isfinite(rows[i:i + step]).all() for i in range(0, rows.shape[0], step))


def check_corpus_copies(root: str | os.PathLike) -> int:
    """The corpus files an index saved from documents given in memory (index/build.py, read by
    rebuilds and upgrades): each is named by the sha256 of its bytes, which is its checksum;
    returns the files checked."""
    copies = sorted((Path(root) / "corpus").glob("*.jsonl"))
    for path in copies:
        if not sha256(path).startswith(path.stem):
            raise _damaged(path, "its contents differ from the checksum it is named by")
    return len(copies)


def check_full(version_dir: str | os.PathLike, files: dict | None) -> int:
    """check_open, then every checksum, then NaN/inf in float arrays; returns the files checked."""
    version_dir = Path(version_dir)
    check_open(version_dir, files)
    files = files or {}
    for key, entry in files.items():
        path = version_dir / key
        if "shape" in entry and not _finite(path):
            raise _damaged(path, "holds NaN or infinite values")
        if sha256(path) != entry["sha256"]:
            raise _damaged(path, "checksum differs from the one recorded when the version was published")
    return len(files)
