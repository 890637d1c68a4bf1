"""Index directories: versioned, published by atomic rename, safe to read while a new
version is being written (by `ralm index build` or the pre-training refresher).

  DIR/manifest.json         {"format", "retriever": "hybrid" | "dense" | "bm25"} (the index kind)
  DIR/blocks/<key>/         block stores, keyed by corpus + tokenizer + block config
  DIR/sentences/<key>/      spaCy sentence passes over them (pre-training)
  DIR/retriever/<fp>/       the retriever checkpoint a dense version was built with
  DIR/corpus/<sha>.jsonl    documents given in memory to build_index, saved as a corpus file
  DIR/versions/v000007/     manifest.json + each side's files: embeddings.npy [+ faiss.index]
                            (dense), bm25/ (BM25); retrieval/index/kinds.py lists the sides
  DIR/LATEST                name of the newest complete version (replaced atomically)
  DIR/updates.jsonl         live document updates, replayed over every side (search/update_log.py)

A version directory is complete before it gets its name, and LATEST moves only after that,
so a reader never sees a partial version. A version is written in `versions/.building-<pid>@...`
(see ralm.atomic); one left by a killed build is removed by the next publish.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ralm.atomic import fsync_tree, manifest_file, read_json, read_manifest, read_npy, remove_stale_temps, temp_dir, write_json, write_text
from ralm.data.blocks import BlockStore
from ralm.errors import RalmError
from ralm.retrieval.index.kinds import KINDS, kind_of, sides_of
from ralm.retrieval.index.verify import FILES, inventory, used_folders

FORMAT = "ralm.index/2"
OLD_FORMATS = ("ralm.index/1",)  # one side per index: still read, as that side alone
_VERSION = re.compile(r"^v(\d{6})$")


def embeddings_file(version_dir: Path) -> Path:
    """Where a dense version keeps its float32 block embeddings [N, D], also while it is written."""
    return version_dir / "embeddings.npy"


class IndexDir:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.manifest = read_manifest(self.root, (FORMAT, *OLD_FORMATS), "index directory", "; build one with `ralm index build`")
        if self.manifest.get("retriever") not in KINDS:
            raise RalmError(f"{manifest_file(self.root)}: no valid \"retriever\" (the index kind: {', '.join(KINDS)}); "
                            "the index is damaged: rebuild it")

    @classmethod
    def create(cls, root: str | os.PathLike, kind: str) -> "IndexDir":
        sides_of(kind)
        root = Path(root)
        if root.exists() and not root.is_dir():
            raise RalmError(f"{root} is a file; an index is a directory (new, empty, or an index of the same kind)")
        if manifest_file(root).is_file():
            index = cls(root)
            if index.kind != kind:
                hint = (f"; `ralm index upgrade {root}` adds the sides it lacks" if set(index.sides) < set(sides_of(kind))
                        else " (choose another directory)")
                raise RalmError(f"{root} holds a {index.kind} index; cannot add a {kind} version{hint}")
            return index
        if root.exists() and any(root.iterdir()):
            raise RalmError(f"{root} exists and is not an index directory; choose an empty or new directory")
        root.mkdir(parents=True, exist_ok=True)
        write_json(manifest_file(root), {"format": FORMAT, "retriever": kind})
        return cls(root)

    @property
    def kind(self) -> str:
        """hybrid, dense or bm25: which sides its versions hold (retrieval/index/kinds.py)."""
        return self.manifest["retriever"]

    @property
    def sides(self) -> tuple[str, ...]:
        return sides_of(self.kind)

    def set_kind(self, kind: str) -> None:
        """Record that new versions hold `kind`'s sides (an upgrade, after publishing one)."""
        sides_of(kind)
        write_json(manifest_file(self.root), {**self.manifest, "format": FORMAT, "retriever": kind})
        self.manifest = read_json(manifest_file(self.root))

    def __repr__(self) -> str:
        versions = self.versions()
        return f"IndexDir({str(self.root)!r}, kind={self.kind!r}, versions={len(versions)}, latest={versions[-1] if versions else None!r})"

    # -- versions ----------------------------------------------------------------------------
    def versions(self) -> list[str]:
        vdir = self.root / "versions"
        return sorted(p.name for p in vdir.iterdir() if _VERSION.match(p.name)) if vdir.is_dir() else []

    def latest(self) -> str:
        f = self.root / "LATEST"
        if not f.is_file():
            raise RalmError(f"{self.root}: no complete index version yet")
        name = None
        for _ in range(3):  # a publish may prune the version LATEST named a moment ago: read it again
            previous, name = name, f.read_text(errors="replace").strip()
            if _VERSION.match(name) and manifest_file(self.version_path(name)).is_file():
                return name
            if name == previous:
                break
        raise RalmError(f"{f} names {name[:40]!r}, which is not a version of this index; the index is damaged: "
                        "rebuild it (`ralm index build` into the same directory publishes a new version)")

    def version_path(self, name: str) -> Path:
        return self.root / "versions" / name

    def version_manifest(self, name: str) -> dict:
        """Version `name`'s manifest; "sides" lists what it holds (older versions: their kind)."""
        m = read_json(manifest_file(self.version_path(name)))
        if "sides" not in m:
            m["sides"] = list(sides_of(m.get("kind", self.kind)))
        return m

    def summary(self, name: str) -> dict:
        """What a build reports of version `name`."""
        m = self.version_manifest(name)
        return {"index": str(self.root), "version": name, "retriever": kind_of(m["sides"]), "blocks": m["count"],
                "dim": m.get("dim"), "faiss": m.get("faiss"), "dtype": m.get("dtype")}

    def embeddings(self, name: str, manifest: dict, mmap_mode: str = "r") -> np.ndarray:
        """Dense version `name`'s embeddings [N, D], memory-mapped, checked against its manifest."""
        emb = read_npy(embeddings_file(self.version_path(name)), mmap_mode)
        if emb.shape != (manifest["count"], manifest["dim"]):
            raise RalmError(f"{self.version_path(name)}: embeddings have shape {emb.shape}, "
                            f"manifest says {(manifest['count'], manifest['dim'])}")
        return emb

    def publish(self, write: Callable[[Path], dict], keep: int = 3) -> str:
        """Call `write(tmp_dir) -> manifest`, then give the folder the next version name and
        point LATEST at it. Older versions beyond `keep` are removed."""
        vdir = self.root / "versions"
        vdir.mkdir(exist_ok=True)
        remove_stale_temps(vdir)
        tmp = temp_dir(vdir, "building")
        try:
            manifest = write(tmp)
            manifest = {**manifest, FILES: inventory(tmp, used_folders(self.root, manifest))}  # see verify.py
            fsync_tree(tmp)
            while True:
                existing = self.versions()
                name = f"v{int(existing[-1][1:]) + 1 if existing else 1:06d}"
                manifest = {**manifest, "version": name, "created": time.time()}
                manifest_file(tmp).write_text(json.dumps(manifest, indent=2) + "\n")
                try:
                    os.rename(tmp, vdir / name)  # fails if a concurrent publisher took the name
                    break
                except OSError:
                    if not (vdir / name).exists():
                        raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        write_text(self.root / "LATEST", name + "\n")
        self._prune(keep)
        return name

    def _prune(self, keep: int) -> None:
        latest = self.latest()
        for name in self.versions()[:-keep]:
            if name != latest:
                shutil.rmtree(self.version_path(name), ignore_errors=True)

    # -- blocks and retrievers ---------------------------------------------------------------
    @property
    def blocks_dir(self) -> Path:
        """The block stores (data/blocks.py `ensure_block_store`)."""
        return self.root / "blocks"

    @property
    def sentences_dir(self) -> Path:
        """The spaCy sentence passes over them (data/masking.py `corpus_sentences`)."""
        return self.root / "sentences"

    def blocks(self, key: str) -> BlockStore:
        path = self.blocks_dir / key
        if not path.is_dir():
            raise RalmError(f"{self.root}: block store {key} is missing; rebuild the index")
        return BlockStore(path)

    def retriever_path(self, fingerprint: str) -> Path:
        return self.root / "retriever" / fingerprint
