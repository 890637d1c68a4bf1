"""Index directories: versioned, published by atomic rename, safe to read while a new
version is being written (by `ralm index build` or the pre-training refresher).

  DIR/manifest.json         {"format", "kind": "hybrid" | "dense" | "bm25" | ...}: the kind it was
                            created as (also written as "retriever", which older ralm reads and
                            older indexes hold alone); what it holds now is its latest version's
                            "sides", and its kind is their name (retrieval/index/kinds.py)
  DIR/blocks/<key>/         block stores, keyed by corpus + tokenizer + block config
  DIR/sentences/<key>/      spaCy sentence passes over them (pre-training)
  DIR/retriever/<fp>/       the retriever checkpoint a dense version was built with
  DIR/corpus/<sha>.jsonl    documents given in memory to build_index, saved as a corpus file
  DIR/versions/v000007/     manifest.json (`VersionManifest`, validated when read and when
                            published) + each side's files: embeddings.npy [+ faiss.index]
                            (dense), bm25/ (BM25); retrieval/index/kinds.py lists the sides;
                            each side's fields are its section of the manifest
  DIR/LATEST                name of the newest complete version (replaced atomically)
  DIR/updates.jsonl         live document updates, replayed over every side (search/update_log.py),
  DIR/updates-<id>.bin      with what each side keeps of their blocks
  DIR/.lock                 the writer lock: held by whoever appends to the log or publishes

A build publishes its corpus alone, so it refuses an index holding live updates, logged or
folded by a compaction, unless told to replace them (live_updates.py).

A version directory is complete before it gets its name, and LATEST moves only after that,
so a reader never sees a partial version. The name and LATEST move under the writer lock,
so a process that reads LATEST and the update log under it (shared) sees them agree. A version is written in `versions/.building-<pid>@...`
(see ralm.atomic); one left by a killed build is removed by the next publish.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, ClassVar

from ralm.atomic import file_lock, fsync_tree, manifest_file, read_json, remove_stale_temps, temp_dir, write_json, write_text
from ralm.data.blocks import BlockStore
from ralm.errors import RalmError
from ralm.retrieval.index.kinds import kind_of, side_class, sides_of
from ralm.retrieval.index.manifest import FORMAT, VERSION_NAME, check_fields, read_index_manifest
from ralm.retrieval.index.verify import CHECKSUM, FILES, inventory, manifest_checksum, used_folders

KEEP_VERSIONS = 3  # the newest versions a publish leaves; older ones are removed


@dataclass(frozen=True)
class VersionManifest:
    """versions/vN/manifest.json: what one published version holds, read, validated and written
    by itself (`IndexDir.version`, `IndexDir.publish`). The build records the common fields,
    each side its own section (retrieval/index/kinds.py `Section`), `publish` the file
    inventory (verify.py) and the manifest's own checksum; keys this ralm does not know are kept in `extra`:

      {"version", "sides": ["dense", "bm25"], "count", "blocks", "created", "corpus", "files", ...,
       "sections": {"dense": {"dim", "retriever", "doc_fingerprint", "dtype", "faiss", ...}, "bm25": {}}}

    Compatibility: a version written before "sides" holds its index's kind; one written before
    "sections" (ralm <= 0.4: the dense side's fields at the top level) is read into them."""

    version: str
    sides: tuple[str, ...]  # retrieval/index/kinds.py
    count: int  # blocks
    blocks: str  # the key of its block store, DIR/blocks/<key>
    sections: dict = field(default_factory=dict)  # side -> its Section
    created: float | None = None  # time.time() at publishing
    corpus: str | None = None  # the fingerprint of the corpus its blocks came from
    step: int | None = None  # a pre-training refresh: the step of the towers
    seconds: float | None = None  # and how long it took
    files: dict | None = None  # verify.py's inventory; None: published before inventories existed
    log: dict | None = None  # a compaction: {"id", "offset"}, the update log it holds up to that byte
    folded: dict | None = None  # and {"added", "deleted"}: documents live updates changed since the last build (live_updates.py)
    extra: dict = field(default_factory=dict)

    TYPES: ClassVar[dict[str, tuple[type, ...]]] = {
        "version": (str,), "count": (int,), "blocks": (str,), "sections": (dict,), "created": (int, float), "corpus": (str,),
        "step": (int,), "seconds": (int, float), "files": (dict,), "log": (dict,), "folded": (dict,)}

    @classmethod
    def from_json(cls, raw: dict, where: str | os.PathLike, sides: tuple[str, ...] = ()) -> VersionManifest:
        """Validated fields of `raw` (`sides`: what a version without the field holds)."""
        def fail(name: str, what: str) -> None:
            raise RalmError(f"{where}: {name!r} must be {what}, got {raw.get(name)!r}; the index is damaged: rebuild it")

        held = raw.get("sides", list(sides))
        if not isinstance(held, list) or not held or not all(isinstance(s, str) for s in held):
            fail("sides", "a list of side names")
        check_fields(raw, cls.TYPES, required=("version", "count", "blocks"), where=where)
        if not VERSION_NAME.match(raw["version"]):
            fail("version", "a version name like v000001")
        log = raw.get("log")
        if log is not None and not (isinstance(log.get("id"), str) and isinstance(log.get("offset"), int) and log["offset"] >= 0):
            fail("log", 'an object {"id": str, "offset": int}')
        folded = raw.get("folded")
        if folded is not None and not all(isinstance(folded.get(k), int) and folded[k] >= 0 for k in ("added", "deleted")):
            fail("folded", 'an object {"added": int, "deleted": int}')
        if raw["count"] < 0:
            fail("count", "positive")
        classes = {s: side_class(s).Section for s in held}
        if raw.get("sections") is not None:
            if set(raw["sections"]) - set(held):
                fail("sections", f"an object of the sides it holds ({', '.join(held)})")
            sections = {s: c.from_json(raw["sections"].get(s, {}), where, s) for s, c in classes.items()}
            legacy = set()
        else:  # written before sections: each side's fields at the top level
            legacy = {name for c in classes.values() for name in c.names()}
            sections = {s: c.from_json({k: raw[k] for k in c.names() if k in raw}, where, s) for s, c in classes.items()}
        known = {f.name for f in fields(cls)} - {"sides", "sections", "extra"}
        return cls(sides=tuple(held), sections=sections, **{k: v for k, v in raw.items() if k in known},
                   extra={k: v for k, v in raw.items() if k not in known | legacy | {"sides", "sections", CHECKSUM}})

    def to_json(self) -> dict:
        """The manifest.json object (unset fields left out)."""
        typed = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("sides", "sections", "extra")}
        return {**self.extra, **{k: v for k, v in typed.items() if v not in (None, {})}, "sides": list(self.sides),
                "sections": {s: section.to_json() for s, section in self.sections.items()}}

    @classmethod
    def read(cls, version_dir: Path, sides: tuple[str, ...] = ()) -> VersionManifest:
        return cls.from_json(read_json(manifest_file(version_dir)), manifest_file(version_dir), sides)

    @property
    def kind(self) -> str:
        return kind_of(self.sides)


class IndexDir:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.manifest = read_index_manifest(self.root)
        self.created_as = self.manifest.get("kind", self.manifest.get("retriever"))  # "retriever": written before "kind"
        try:
            sides_of(self.created_as)
        except RalmError as e:
            raise RalmError(f"{manifest_file(self.root)}: no valid \"kind\" ({e}); the index is damaged: rebuild it") from None
        if self.manifest.get("retriever", self.created_as) != self.created_as:  # written as a copy of "kind": a changed one is damage
            raise RalmError(f"{manifest_file(self.root)}: \"retriever\" ({self.manifest['retriever']!r}) differs from \"kind\" "
                            f"({self.created_as!r}), which it copies; the index is damaged: rebuild it")

    @classmethod
    def create(cls, root: str | os.PathLike, kind: str) -> "IndexDir":
        kind = kind_of(sides_of(kind))  # its name as the index records it
        root = Path(root)
        if root.exists() and not root.is_dir():
            raise RalmError(f"{root} is a file; an index is a directory (new, empty, or an index of the same kind)")
        if manifest_file(root).is_file():
            index = cls(root)
            if set(index.sides) != set(sides_of(kind)):
                hint = (f"; `ralm index upgrade {root}` adds the sides it lacks" if set(index.sides) < set(sides_of(kind))
                        else " (choose another directory)")
                raise RalmError(f"{root} holds a {index.kind} index; cannot add a {kind} version{hint}")
            return index
        if root.exists() and any(root.iterdir()):
            raise RalmError(f"{root} exists and is not an index directory; choose an empty or new directory")
        root.mkdir(parents=True, exist_ok=True)
        write_json(manifest_file(root), {"format": FORMAT, "kind": kind, "retriever": kind})
        return cls(root)

    @property
    def kind(self) -> str:
        """The name of what its latest version holds (hybrid, dense, bm25, or sides joined:
        retrieval/index/kinds.py `kind_of`)."""
        return kind_of(self.sides)

    @property
    def sides(self) -> tuple[str, ...]:
        """What its latest version's manifest holds, so that a crash after publishing a version
        of other sides (an upgrade) leaves nothing to disagree; the sides of the kind it was
        created as until a version is published."""
        try:
            return self.version(self.latest()).sides
        except RalmError:  # no version yet, or LATEST damaged (a build into the directory repairs it)
            return sides_of(self.created_as)

    def lock(self, *, shared: bool = False, blocking: bool = True):
        """The writer lock (see the module's docstring): exclusive to publish or append to the
        update log, shared to read LATEST and the log together."""
        return file_lock(self.root / ".lock", shared=shared, blocking=blocking)

    def __repr__(self) -> str:
        versions = self.versions()
        return f"IndexDir({str(self.root)!r}, kind={self.kind!r}, versions={len(versions)}, latest={versions[-1] if versions else None!r})"

    # -- versions ----------------------------------------------------------------------------
    def versions(self) -> list[str]:
        vdir = self.root / "versions"
        return sorted(p.name for p in vdir.iterdir() if VERSION_NAME.match(p.name)) if vdir.is_dir() else []

    def latest(self) -> str:
        f = self.root / "LATEST"
        if not f.is_file():
            raise RalmError(f"{self.root}: no complete index version yet")
        name = None
        for _ in range(3):  # a publish may prune the version LATEST named a moment ago: read it again
            previous, name = name, f.read_text(errors="replace").strip()
            if VERSION_NAME.match(name) and manifest_file(self.version_path(name)).is_file():
                return name
            if name == previous:
                break
        raise RalmError(f"{f} names {name[:40]!r}, which is not a version of this index; the index is damaged: "
                        "rebuild it (`ralm index build` into the same directory publishes a new version)")

    def version_path(self, name: str) -> Path:
        return self.root / "versions" / name

    def version(self, name: str) -> VersionManifest:
        """Version `name`'s manifest, validated (one from before "sides": its kind's sides)."""
        path = self.version_path(name)
        raw = read_json(manifest_file(path))
        return VersionManifest.from_json(raw, manifest_file(path), sides_of(raw.get("kind", self.created_as)))

    def version_manifest(self, name: str) -> dict:
        """Version `name`'s manifest as its JSON object, validated; "sides" lists what it holds."""
        return self.version(name).to_json()

    def summary(self, name: str) -> dict:
        """What a build reports of version `name`: the common fields, then each side's (the keys
        builds have always reported are there, null where no side sets them)."""
        m = self.version(name)
        out = {"index": str(self.root), "version": name, "kind": m.kind, "retriever": m.kind, "blocks": m.count, "dim": None, "faiss": None,
               "dtype": None}
        for section in m.sections.values():
            out.update(section.summary())
        return out

    def publish(self, write: Callable[[Path], dict], keep: int = KEEP_VERSIONS, *, expect: str | None = None,
                then: Callable[[str], None] | None = None) -> str | None:
        """Call `write(tmp_dir) -> manifest`, then give the folder the next version name and
        point LATEST at it, under the writer lock. `expect`: publish only if LATEST still names
        that version (None returned otherwise); `then(name)` runs under the same lock (a
        compaction starts the update log anew there). Older versions beyond `keep` are removed."""
        vdir = self.root / "versions"
        vdir.mkdir(exist_ok=True)
        remove_stale_temps(vdir)
        tmp = temp_dir(vdir, "building")
        try:
            manifest = write(tmp)
            manifest = {**manifest, FILES: inventory(tmp, used_folders(self.root, manifest))}  # see verify.py
            fsync_tree(tmp)
            with self.lock():
                if expect is not None and self.latest() != expect:
                    return None
                while True:
                    existing = self.versions()
                    name = f"v{int(existing[-1][1:]) + 1 if existing else 1:06d}"
                    checked = VersionManifest.from_json({**manifest, "version": name, "created": time.time()}, tmp,
                                                        sides_of(manifest.get("kind", self.created_as)))
                    raw = checked.to_json()
                    raw[CHECKSUM] = manifest_checksum(raw)  # the one file the inventory cannot hold (verify.py)
                    manifest_file(tmp).write_text(json.dumps(raw, indent=2) + "\n")
                    try:
                        os.rename(tmp, vdir / name)  # fails if a publisher of ralm <= 0.4 (no lock) took the name
                        break
                    except OSError:
                        if not (vdir / name).exists():
                            raise
                write_text(self.root / "LATEST", name + "\n")
                if then is not None:
                    then(name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
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
