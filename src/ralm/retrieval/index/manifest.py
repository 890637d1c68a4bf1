"""An index directory's own manifest.json (its format and kind), read without the heavy imports:
the CLI checks an index path with it before loading torch, and IndexDir opens with it; and the
field check every typed manifest object (a version's, a side's section) runs when read."""

from __future__ import annotations

import os
import re

from ralm.atomic import read_manifest
from ralm.errors import RalmError

FORMAT = "ralm.index/2"
OLD_FORMATS = ("ralm.index/1",)  # one side per index: still read, as that side alone
VERSION_NAME = re.compile(r"^v(\d{6})$")  # a version's folder under versions/, as LATEST names it


def read_index_manifest(root: str | os.PathLike) -> dict:
    return read_manifest(root, (FORMAT, *OLD_FORMATS), "index directory", "; build one with `ralm index build`")


def check_fields(raw: dict, types: dict[str, tuple[type, ...]], *, required: tuple[str, ...] = (), where, prefix: str = "") -> None:
    """Refuse a manifest object `raw` missing a `required` field or holding one of another JSON
    type than `types` names (bools are not numbers); `prefix` names the object inside the file."""
    def fail(name: str, what: str) -> None:
        raise RalmError(f"{where}: {prefix + name!r} must be {what}, got {raw.get(name)!r}; the index is damaged: rebuild it")

    for name in required:
        if raw.get(name) is None:
            fail(name, "present")
    for name, allowed in types.items():
        value = raw.get(name)
        if value is not None and (not isinstance(value, allowed) or isinstance(value, bool)):
            fail(name, " or ".join(t.__name__ for t in allowed))
