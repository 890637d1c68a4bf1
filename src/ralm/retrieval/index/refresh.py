"""The index builder of REALM pre-training: re-embed the corpus with a newer document tower
and publish it as a new index version, while the trainer keeps training.

The trainer hands over its retriever through a snapshot folder:
  SNAPSHOTS/step-000040/   a Retriever checkpoint (Retriever.save_pretrained)
  SNAPSHOTS/LATEST         name of the newest complete snapshot (replaced atomically)

The builder (`python -m ralm.retrieval.index.refresh --index DIR --snapshots DIR`, a separate OS
process started by the trainer) loops: load the newest snapshot, embed every block, publish a
version whose manifest records the snapshot's `step` and the build `seconds`. Versions are
published with IndexDir.publish (a complete folder renamed into place, then LATEST moved), so
a trainer calling Searcher.refresh() between steps never sees a partial version, and killing
the builder at any moment leaves the previous versions intact. The synchronous mode of the
trainer calls `publish_embeddings` in-process instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from ralm.atomic import write_text
from ralm.configs import DTYPES
from ralm.data.blocks import BlockStore
from ralm.errors import RalmError
from ralm.retrieval.index.build import version_manifest
from ralm.retrieval.index.dense_side import dense_manifest, dense_sections, embed_blocks, embeddings_file, section_of
from ralm.retrieval.towers.encoders import Retriever
from ralm.retrieval.index.store import KEEP_VERSIONS, IndexDir
from ralm.runtime import Runtime, dtype_name, resolve_dtype


def publish_embeddings(index: IndexDir, retriever: Retriever, *, blocks_key: str, blocks: BlockStore, step: int,
                       runtime: Runtime, batch_size: int = 64, keep: int = KEEP_VERSIONS, show_progress: bool = False) -> str:
    """Embed every block with `retriever`'s document tower (on the runtime's device, in its
    dtype) and publish a new version built at training step `step`; returns its name. The retriever is saved with the index so that the
    version is searchable on its own (`ralm search`)."""
    start = time.perf_counter()
    was_training = retriever.training
    retriever.eval()
    rpath = index.retriever_path(retriever.doc_fingerprint())
    if not (rpath / "config.json").is_file():
        retriever.save_pretrained(rpath)

    def write(tmp: Path) -> dict:
        embed_blocks(retriever, blocks, embeddings_file(tmp), runtime, batch_size=batch_size, show_progress=show_progress)
        sections = dense_sections(dense_manifest(index, rpath, retriever.dim, runtime))
        return {**version_manifest(blocks_key, blocks, tuple(sections), sections), "step": step,
                "seconds": round(time.perf_counter() - start, 3)}

    try:
        name = index.publish(write, keep=keep)
    finally:
        retriever.train(was_training)
    _prune_retrievers(index)
    return name


def _prune_retrievers(index: IndexDir) -> None:
    """Remove saved retrievers that no remaining version refers to."""
    used = set()
    for name in index.versions():
        try:
            manifest = index.version(name)
        except (OSError, RalmError):
            continue  # pruned by a concurrent publisher meanwhile
        dense = section_of(manifest)
        if dense is not None:
            used.add(Path(dense.retriever).name)
    root = index.root / "retriever"
    for path in root.iterdir() if root.is_dir() else []:
        if path.is_dir() and not path.name.startswith(".") and path.name not in used:
            shutil.rmtree(path, ignore_errors=True)


# -- snapshots: the trainer's side of the hand-over -------------------------------------------

class Snapshots:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def write(self, retriever: Retriever, step: int, keep: int = 2) -> Path:
        """Save the retriever at `step`, point LATEST at it, drop all but the last `keep`."""
        name = f"step-{step:06d}"
        retriever.save_pretrained(self.root / name)
        write_text(self.root / "LATEST", name + "\n")
        for old in sorted(p for p in self.root.glob("step-*") if p.is_dir())[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        return self.root / name

    def latest(self) -> tuple[int, Path] | None:
        f = self.root / "LATEST"
        if not f.is_file():
            return None
        name = f.read_text().strip()
        return int(name.split("-")[1]), self.root / name


# -- the builder process ---------------------------------------------------------------------

def _alive(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_refresher(index_path: str | os.PathLike, snapshots: str | os.PathLike, *, runtime: Runtime,
                  batch_size: int = 64, poll_s: float = 1.0, parent_pid: int | None = None,
                  max_versions: int | None = None, log=None) -> int:
    """Publish a version for every new snapshot, embedded under `runtime` (resolved once, by
    `main`, not per version), until the parent process is gone (or `max_versions` were
    published); returns the number published. `log(dict)` gets one record per version."""
    index = IndexDir(index_path)
    snaps = Snapshots(snapshots)
    built_at = index.version(index.latest()).step if (index.root / "LATEST").is_file() else None
    done_step = -1 if built_at is None else built_at
    published = 0
    while _alive(parent_pid) and (max_versions is None or published < max_versions):
        latest = snaps.latest()
        if latest is None or latest[0] <= done_step:
            time.sleep(poll_s)
            continue
        step, path = latest
        try:
            retriever = Retriever.from_pretrained(path).to(runtime.device)
        except (OSError, RalmError, ValueError) as e:  # pruned or replaced while loading: take the next one
            if log:
                log({"event": "skipped", "snapshot": str(path), "error": str(e)})
            time.sleep(poll_s)
            continue
        key = index.version(index.latest()).blocks
        start = time.perf_counter()
        name = publish_embeddings(index, retriever, blocks_key=key, blocks=index.blocks(key), step=step, runtime=runtime,
                                  batch_size=batch_size)
        done_step = step
        published += 1
        if log:
            log({"event": "published", "version": name, "step": step, "seconds": round(time.perf_counter() - start, 2)})
    return published


def start_refresher(index_path: str | os.PathLike, snapshots: str | os.PathLike, log_file: str | os.PathLike,
                    *, runtime: Runtime, batch_size: int = 64, threads: int = 1) -> subprocess.Popen:
    """Start the builder as a separate OS process that exits when this one does, embedding
    under `runtime` (passed on as its --device and --dtype)."""
    cmd = [sys.executable, "-m", "ralm.retrieval.index.refresh", "--index", str(index_path), "--snapshots", str(snapshots),
           "--device", str(runtime.device), "--batch-size", str(batch_size), "--threads", str(threads),
           "--dtype", dtype_name(runtime.dtype), "--parent-pid", str(os.getpid())]
    with open(log_file, "ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "RALM_NO_PROGRESS": "1"})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ralm.retrieval.index.refresh", description=__doc__.splitlines()[0])
    p.add_argument("--index", required=True)
    p.add_argument("--snapshots", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="encoding compute dtype")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (leave cores to the trainer)")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    p.add_argument("--max-versions", type=int, default=None)
    p.add_argument("--poll", type=float, default=1.0, help="seconds between looks at the snapshot folder")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    def log(record: dict) -> None:
        print(json.dumps({"time": round(time.time(), 3), **record}), flush=True)

    try:
        runtime = Runtime(torch.device(args.device), resolve_dtype(args.dtype, torch.device(args.device)))  # this process's entry
        run_refresher(args.index, args.snapshots, runtime=runtime, batch_size=args.batch_size, poll_s=args.poll,
                      parent_pid=args.parent_pid, max_versions=args.max_versions, log=log)
    except RalmError as e:
        log({"event": "error", "error": str(e)})
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
