"""One way to write anything a crash could half-write: write beside the target, fsync,
then rename over it. Readers see the old file or the new one, never a mix."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush a file, or every file under a folder, to disk before it is renamed into place."""
    for f in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `target`; on success it replaces `target` atomically.

    Works for files and for directories (a directory target must not exist yet, or is
    replaced by a rename-aside so a reader never sees it missing for longer than a rename).
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    # mkdtemp made a directory; callers writing a file get the path of a file inside it.
    inner = tmp / target.name
    try:
        yield inner
        if not inner.exists():
            raise FileNotFoundError(f"nothing was written to {inner}")
        fsync_tree(inner)
        if inner.is_dir() and target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.rename(target, old)
            os.rename(inner, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(inner, target)
        _fsync_dir(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_text(target: str | os.PathLike, text: str) -> None:
    with atomic_path(target) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(target: str | os.PathLike, obj) -> None:
    write_text(target, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_model_dir(out: str | os.PathLike, tensors: dict, tokenizer, fmt: str, config: dict) -> None:
    """A model directory (config.json with its format tag, model.safetensors, tokenizer),
    published atomically: what every ralm model's `save_pretrained` writes."""
    from safetensors.torch import save_file

    with atomic_path(out) as tmp:
        tmp.mkdir()
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": fmt})
        tokenizer.save_pretrained(str(tmp))
        (tmp / "config.json").write_text(json.dumps({"format": fmt, **config}, indent=2) + "\n")


def read_json(path: str | os.PathLike):
    with open(path, encoding="utf-8") as f:
        return json.load(f)
