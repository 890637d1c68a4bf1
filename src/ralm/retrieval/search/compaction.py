"""Compaction: the update log folded into a new index version, so that opening an index reads
a short log however many updates it has taken.

The new version holds the current version's blocks minus the hidden (deleted or replaced)
documents, then the live documents' blocks, in a new block store (DIR/blocks/compacted-<key>).
Each side writes its files from what it has (`Side.write_compacted`): the dense side carries
the stored embeddings over, nothing is embedded again; BM25 is indexed anew, its statistics
being the whole corpus's. The version records the log's id and the byte offset it holds, and
how many documents live updates added and deleted since the last build ("folded", summed over
compactions), so that a build into the index refuses to drop them (index/live_updates.py).
Publishing it and starting the log anew with what was appended after that offset happen under
the writer lock, so every process sees the old version with the whole log or the new one with
the rest; a crash between the two is read as the new version and the old log from that offset.
Killed at any other point, it leaves the index as it was. One compaction runs at a time
(DIR/.compact.lock), and one is abandoned when another version was published meanwhile
(`ralm index build`).

`ralm index compact DIR` runs it; `ralm serve` runs it in the background once the log holds more
than `ralm.defaults.COMPACT_AFTER` update records (`--compact-after`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from dataclasses import asdict, dataclass

import numpy as np

from ralm.atomic import file_lock
from ralm.data.blocks import compact_block_store, iter_blocks
from ralm.distributed import dist_env
from ralm.retrieval.index.build import version_manifest
from ralm.retrieval.index.kinds import BuildContext
from ralm.retrieval.index.live_updates import folded_counts
from ralm.retrieval.search.live import LiveSearcher, Snapshot
from ralm.retrieval.search.overlay import split_docs

PREFIX = "compacted-"  # the block stores compactions write, removed once no version uses them
_COMMON = ("version", "created", "kind", "sides", "count", "blocks", "corpus", "files", "log", "folded", "step", "seconds",
           "sections")


@dataclass(frozen=True)
class Compaction:
    index: str
    version: str | None  # the version published; None: nothing to fold, or abandoned for a newer version
    folded: int  # update records folded into it
    blocks: int  # blocks searchable after it
    seconds: float

    def to_json(self) -> dict:
        return asdict(self)


def compact_index(index: LiveSearcher | str | os.PathLike, *, wait: bool = True, show_progress: bool = False) -> Compaction | None:
    """Fold the update log of `index` (a path, or an open LiveSearcher, which then serves the
    new version) into a new version and start the log anew. Returns None when `wait` is off and
    another process is compacting."""
    start = time.perf_counter()
    live = index if isinstance(index, LiveSearcher) else LiveSearcher.open(index)
    index = live.index
    with file_lock(index.root / ".compact.lock", blocking=wait) as held:
        if not held:
            return None
        snap = live.sync(writer=True)  # a log of ralm <= 0.4 is written in the current form first
        if snap.log.records == 0:
            return Compaction(str(index.root), None, 0, len(live), round(time.perf_counter() - start, 3))
        name = _publish(live, snap, show_progress=show_progress)
        used = {index.version(v).blocks for v in index.versions()}
        for path in index.blocks_dir.glob(PREFIX + "*"):  # those of versions publishing has pruned
            if path.name not in used:
                shutil.rmtree(path, ignore_errors=True)
    live.sync()
    return Compaction(str(index.root), name, snap.log.records if name else 0, len(live), round(time.perf_counter() - start, 3))


def _publish(live: LiveSearcher, snap: Snapshot, *, show_progress: bool) -> str | None:
    """Write and publish the compacted version of `snap`; None when a newer version came first."""
    index, version = live.index, snap.version
    keep = np.setdiff1d(np.arange(len(version.blocks), dtype=np.int64), snap.hidden_rows)  # [N'] ascending
    docs = list(snap.delta.docs.values())
    tokenizer = next(iter(version.sides.values())).block_tokenizer()
    split = list(iter_blocks([d.doc for d in docs], tokenizer, version.blocks.config))  # the blocks' wordpieces
    stale = [i for i, (d, (_, blocks)) in enumerate(zip(docs, split)) if tuple(b.char_span for b in blocks) != d.spans]
    if stale:  # logged when the index split documents otherwise: their states are computed anew
        fresh = split_docs([docs[i].doc for i in stale], tokenizer=tokenizer, block_cfg=version.blocks.config, sides=version.sides)
        for i, d in zip(stale, fresh):
            docs[i] = d
    held = {"id": snap.log.id, "offset": snap.log.end}
    # counted so that a build over the index knows what it would drop (index/live_updates.py)
    folded = folded_counts(version.manifest, added=len(snap.delta.docs), deleted=len(snap.delta.hidden_docs - snap.delta.docs.keys()))
    key = PREFIX + hashlib.sha256(f"{version.manifest.blocks} {held}".encode()).hexdigest()[:16]
    blocks = compact_block_store(version.blocks, keep, split, index.blocks_dir / key,
                                 origin={"blocks": version.manifest.blocks, "log": held})
    # each side compacts from its own loaded version and section: the context holds nothing side-specific
    ctx = BuildContext(index=index, key=key, blocks=blocks, model=None, dim=None, faiss_spec=None, batch_size=64,
                       runtime=live.runtime, env=dist_env(), show_progress=show_progress, piece_rows=1 << 20)
    carried = {k: v for k, v in version.manifest.to_json().items() if k not in _COMMON}

    def write(tmp) -> dict:
        sections = {name: {**version.manifest.sections[name].to_json(),
                           **side.write_compacted(tmp, ctx, keep=keep, live=[s for d in docs for s in d.states[name]])}
                    for name, side in version.sides.items()}
        return {**carried, **version_manifest(key, blocks, version.manifest.sides, sections), "log": held,
                **({"folded": folded} if folded else {})}

    name = index.publish(write, expect=version.name, then=lambda _: live.updates.restart(snap.log.id, after=snap.log.end))
    if name is None:
        shutil.rmtree(index.blocks_dir / key, ignore_errors=True)
    return name
