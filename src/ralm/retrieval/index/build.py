"""Build an index version: corpus -> block store -> each side of the index kind (dense embeddings,
BM25) -> one version, published atomically; and upgrade an index to more sides."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Callable, Iterable

import torch

from ralm.atomic import link_or_copy
from ralm.data.blocks import BlockConfig, BlockStore, ensure_block_store
from ralm.data.corpus import Document, save_documents
from ralm.data.formats import EVERY_FILE, FileFilter
from ralm.defaults import EMBED_BATCH
from ralm.distributed import DistEnv, dist_env
from ralm.errors import RalmError
from ralm.retrieval.backends.faiss_index import AUTO
from ralm.retrieval.index import kinds
from ralm.retrieval.index.kinds import BuildContext, kind_of, side_class, sides_of
from ralm.retrieval.index.live_updates import check_rebuild
from ralm.retrieval.index.store import IndexDir
from ralm.retrieval.search.update_log import UpdateLog
from ralm.runtime import Runtime

Corpus = str | os.PathLike | Iterable[Document | dict | str]  # a corpus file or folder, or the documents


def _corpus_file(corpus: Corpus, out: str | os.PathLike, kind: str, env: DistEnv) -> str | os.PathLike:
    """Documents given in memory are saved in the index directory first (by rank 0), so every
    rank and the block store read a file like any other corpus."""
    if isinstance(corpus, (str, os.PathLike)):
        return corpus
    path = str(save_documents(IndexDir.create(out, kind).root / "corpus", corpus)) if env.is_main else None
    env.barrier()
    return env.broadcast_object(path)


def version_manifest(key: str, blocks: BlockStore, sides: tuple[str, ...], sections: dict | None = None) -> dict:
    """What every version's manifest.json records (publishing adds its name and time), with
    each side's section (side -> its JSON object)."""
    return {"kind": kind_of(sides), "sides": list(sides), "count": len(blocks), "blocks": key, "corpus": blocks.manifest["corpus"],
            "sections": dict(sections or {})}


def build_index(corpus: Corpus, out: str | os.PathLike, *, kind: str | None = None, model: str | None = None,
                dim: int | None = None, faiss_spec: str | None = AUTO, batch_size: int = EMBED_BATCH,
                runtime: Runtime | None = None, block_cfg: BlockConfig = BlockConfig(), files: FileFilter = EVERY_FILE,
                show_progress: bool = True, piece_rows: int = 1 << 20,
                embeddings: str | os.PathLike | None = None, replace: bool = False,
                device: torch.device | None = None, dtype: str | torch.dtype | None = None) -> tuple[IndexDir, str]:
    """Build (or add a new version to) the index at `out`; returns (index, version name).
    `corpus`: a corpus file or folder (of a folder: the files `files` picks), or the documents
    themselves (Documents, {"id", "title", "text"} dicts or strings), which are saved in the
    index directory. `kind` names the sides
    each version holds (retrieval/index/kinds.py), published together over one block store as
    one version; None: the default kind's (kinds.DEFAULT_KIND: hybrid, a dense and a BM25 side).
    `runtime`: where blocks are encoded and the encoding's compute dtype (None: the CPU, auto
    dtype; the older `device`/`dtype` still work, see `Runtime.of`); embeddings are stored as float32.
    `embeddings`: a .npy of precomputed block embeddings [N, D] (one row per block, in the block
    store's order; `model` is the retriever that made them) imported instead of encoding.
    `faiss_spec`: a faiss index to build over the dense side; AUTO chooses from N
    (backends/faiss_index.py `auto_spec`: exact search for small indexes); None: exact.
    The version manifest records each part's seconds ("build_seconds": blocks, each side).
    Into an existing index: the new version holds the corpus alone, so a build is refused when the
    index holds live updates (adds and deletes since its last build, in the update log or folded
    by a compaction: index/live_updates.py) unless `replace`, which drops them and starts the
    log anew; one that a compaction overtakes publishes nothing (RalmError).

    Under torchrun every rank prepares its share (dense: embeds its blocks, see
    backends/sharded.py). One function on purpose: rank 0 creates, every rank prepares, rank 0
    publishes, and the barriers between those steps read in order only when they sit side by side."""
    kind = kind or kinds.DEFAULT_KIND
    sides = sides_of(kind)
    if batch_size <= 0:
        raise RalmError(f"batch size must be positive, got {batch_size}")
    replaces = check_rebuild(out, replace=replace)  # on every rank, before any work: the files agree
    env = dist_env()
    rt = Runtime.of(runtime, device=device, dtype=dtype)
    rt = dataclasses.replace(rt, device=env.device(rt.device))  # this rank's device under torchrun
    corpus = _corpus_file(corpus, out, kind, env)
    tokenizer = side_class(sides[0]).tokenizer(model)  # every side's blocks: the same wordpieces
    if env.is_main:
        index = IndexDir.create(out, kind)
        start = time.perf_counter()
        key, blocks = ensure_block_store(index.blocks_dir, corpus, tokenizer, cfg=block_cfg, files=files, show_progress=show_progress)
        seconds = {"blocks": time.perf_counter() - start}
    env.barrier()
    if not env.is_main:
        index = IndexDir(out)
        key, blocks = ensure_block_store(index.blocks_dir, corpus, tokenizer, cfg=block_cfg, files=files, show_progress=False)
    ctx = BuildContext(index=index, key=key, blocks=blocks, model=model, dim=dim, faiss_spec=faiss_spec, batch_size=batch_size,
                       runtime=rt, env=env, show_progress=show_progress, piece_rows=piece_rows,
                       embeddings=Path(embeddings) if embeddings is not None else None)
    # replace: the log starts anew with the version; else no version may come between (a compaction folding the log)
    name = _publish(ctx, sides, {}, seconds, expect=None if replace else replaces,
                    then=(lambda _: _start_log_anew(index)) if replace else None) if env.is_main else None
    if not env.is_main:
        for side in sides:
            side_class(side).builder(ctx)
    env.barrier()
    name = env.broadcast_object(name)
    if name is None:
        raise _overtaken(out, "build")
    return index, name


def _publish(ctx: BuildContext, sides: tuple[str, ...], kept: dict, seconds: dict | None = None, *, carried: dict | None = None,
             expect: str | None = None, then: Callable[[str], None] | None = None) -> str | None:
    """Prepare each side missing from `kept` (side -> (a version folder to link its files
    from, its section)), then publish one version with all of them. `seconds`: what the build
    took before (the block store), recorded with each side's time. `carried`: fields of the version it
    replaces that stay (an upgrade keeps the update log position and counts a compaction recorded).
    `expect`, `then`: as `IndexDir.publish`'s (None returned when `expect` is not LATEST)."""
    seconds = dict(seconds or {})
    builders = {}
    for s in sides:
        if s not in kept:
            start = time.perf_counter()
            builders[s] = side_class(s).builder(ctx)
            seconds[s] = time.perf_counter() - start

    def write(tmp: Path) -> dict:
        manifest = {**(carried or {}), **version_manifest(ctx.key, ctx.blocks, sides)}
        for side, (folder, section) in kept.items():
            for f in side_class(side).files(folder):
                link_or_copy(f, tmp / f.relative_to(folder))
            manifest["sections"][side] = section
        for side, b in builders.items():
            start = time.perf_counter()
            manifest["sections"][side] = b.write(tmp)
            seconds[side] += time.perf_counter() - start
        return {**manifest, "build_seconds": {k: round(v, 2) for k, v in seconds.items()}}

    return ctx.index.publish(write, expect=expect, then=then)


def _overtaken(path: str | os.PathLike, what: str) -> RalmError:
    return RalmError(f"{path}: another version was published while this {what} ran (a compaction folding live updates, "
                     f"or another build); this {what} published nothing: run it again")


def _start_log_anew(index: IndexDir) -> None:
    """An empty update log (under the writer lock, as the version replacing its updates is published)."""
    log = UpdateLog(index.root)
    if log.path.exists():
        log.rewrite([])


def upgrade_index(path: str | os.PathLike, *, kind: str | None = None, model: str | None = None, batch_size: int = EMBED_BATCH,
                  runtime: Runtime | None = None, show_progress: bool = True,
                  device: torch.device | None = None, dtype: str | torch.dtype | None = None) -> tuple[IndexDir, str]:
    """Publish a version of the index at `path` holding `kind`'s sides: those its latest version
    has are linked from it (no re-encoding), the missing ones are built over the same block
    store (BM25: seconds; dense: the corpus is embedded with `model`). Live updates stay. The
    new version alone says what the index holds now, so a crash at any point leaves the index
    what it was or what it became. `runtime`: as `build_index`'s."""
    index = IndexDir(path)
    latest = index.latest()
    manifest = index.version(latest)
    kind = kind or kinds.DEFAULT_KIND
    have, want = manifest.sides, sides_of(kind)
    if not set(have) <= set(want):
        raise RalmError(f"{path} holds {', '.join(have)}; a {kind} index would drop a side (build a new index instead)")
    if set(have) == set(want):
        return index, latest
    rt = Runtime.of(runtime, device=device, dtype=dtype)
    ctx = BuildContext(index=index, key=manifest.blocks, blocks=index.blocks(manifest.blocks), model=model, dim=None,
                       faiss_spec=AUTO, batch_size=batch_size, runtime=rt, env=dist_env(),
                       show_progress=show_progress, piece_rows=1 << 20)
    carried = {k: v for k, v in manifest.to_json().items()
               if k not in ("version", "created", "kind", "sides", "count", "blocks", "corpus", "sections")}
    # expect: a compaction meanwhile starts the log anew, which the position carried here would not hold
    name = _publish(ctx, want, {s: (index.version_path(latest), manifest.sections[s].to_json()) for s in have},
                    carried=carried, expect=latest)
    if name is None:
        raise _overtaken(path, "upgrade")
    return index, name
