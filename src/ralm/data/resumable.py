"""A build folder that survives a crash and publishes atomically (RETRO chunk DB, kNN-LM
datastore): work happens in `.NAME.partial/` beside the target, large arrays are filled in
blocks with the number of finished rows recorded after each block, and the folder is renamed
to NAME only when complete. A rerun with the same inputs continues where the last one stopped;
with different inputs it starts over.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from ralm.atomic import _fsync_dir, atomic_path, fsync_tree, manifest_file, read_json, write_json
from ralm.errors import RalmError
from ralm.progress import progress_bar


def partial_path(out: str | os.PathLike) -> Path:
    """The folder an unfinished build of `out` works in."""
    return Path(out).with_name(f".{Path(out).name}.partial")


def build_hint(out: str | os.PathLike, command: str) -> str:
    """How to make the missing `out`: finish its unfinished build, or build it with `command`."""
    partial = partial_path(out)
    if partial.exists():
        return f" (an unfinished build is at {partial}; rerun `{command}` to finish it)"
    return f"; build one with `{command}`"


class PartialBuild:
    def __init__(self, out: str | os.PathLike, signature: dict):
        self.out = Path(out)
        if self.out.exists():
            raise RalmError(f"{self.out} already exists; choose a new output directory or remove it")
        self.path = partial_path(self.out)
        sig = self.path / "signature.json"
        if self.path.is_dir() and (not sig.is_file() or read_json(sig) != json.loads(json.dumps(signature))):
            shutil.rmtree(self.path)  # a leftover of a build with other inputs
        self.path.mkdir(parents=True, exist_ok=True)
        write_json(sig, signature)

    def stage(self, name: str, write: Callable[[Path], None]) -> Path:
        """Write the file or folder `name` once, atomically: `write(tmp_path)`; skipped on resume."""
        target = self.path / name
        if not target.exists():
            with atomic_path(target) as tmp:
                write(tmp)
        return target

    def fill(self, name: str, shape: tuple[int, ...], dtype, compute: Callable[[int, int], np.ndarray],
             *, block: int = 4096, show_progress: bool = True, description: str = "building") -> np.ndarray:
        """Fill the .npy `name` [shape] by rows: `compute(start, end)` -> rows [end - start, ...].
        Finished rows are recorded after each block, so a crash loses at most one block."""
        target, done_file = self.path / name, self.path / f"{name}.rows"
        done = read_json(done_file)["rows"] if done_file.is_file() and target.is_file() else 0
        arr = np.lib.format.open_memmap(target, mode="r+" if done else "w+", dtype=dtype, shape=shape)
        if arr.shape != tuple(shape):
            raise RalmError(f"{target}: shape {arr.shape} does not match {tuple(shape)}; delete {self.path}")
        with progress_bar(show_progress) as bar:
            task = bar.add_task(description, total=shape[0], completed=done)
            for start in range(done, shape[0], block):
                end = min(start + block, shape[0])
                arr[start:end] = compute(start, end)
                arr.flush()
                write_json(done_file, {"rows": end})
                bar.advance(task, end - start)
        return arr

    def publish(self, manifest: dict) -> Path:
        """Write manifest.json, flush everything and rename the folder into place."""
        write_json(manifest_file(self.path), manifest)
        for f in self.path.glob("*.rows"):
            f.unlink()
        (self.path / "signature.json").unlink()
        fsync_tree(self.path)
        os.rename(self.path, self.out)
        _fsync_dir(self.out.parent)
        return self.out
