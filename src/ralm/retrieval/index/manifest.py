"""An index directory's own manifest.json (its format and kind), read without the heavy imports:
the CLI checks an index path with it before loading torch, and IndexDir opens with it."""

from __future__ import annotations

import os

from ralm.atomic import read_manifest

FORMAT = "ralm.index/2"
OLD_FORMATS = ("ralm.index/1",)  # one side per index: still read, as that side alone


def read_index_manifest(root: str | os.PathLike) -> dict:
    return read_manifest(root, (FORMAT, *OLD_FORMATS), "index directory", "; build one with `ralm index build`")
