"""What live updates an index holds since its last build, and what a build over them does.

Live updates (`ralm index add/delete`, a server's writes) sit in the update log until a
compaction folds them into a version (search/compaction.py), which records how many documents
they added (or replaced) and deleted since the last build, adding up over compactions ("folded").
A build publishes its corpus alone and cannot tell which should win where the two differ: a
logged add replayed over a newer corpus would overwrite its text, and what a compaction folded
would be lost. So a build into an index holding live updates is refused unless told to
`replace` them, whether or not a compaction has folded them yet (a server compacts by itself,
so a user cannot tell). Read from the files alone, without torch: the command line refuses in
about a second.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ralm.atomic import manifest_file, read_json
from ralm.errors import RalmError, plural
from ralm.retrieval.index.manifest import VERSION_NAME
from ralm.retrieval.search.update_log import UpdateLog, fold


@dataclass(frozen=True)
class LiveUpdates:
    """The live updates of an index directory since its last build."""

    latest: str | None  # the version they apply to; None: no complete version (a new index, a damaged LATEST)
    added: int  # documents added or replaced: still in the log, or folded by a compaction
    deleted: int
    folded_by: str | None = None  # the compacted version holding some of them
    uncounted: bool = False  # folded by a compaction of an earlier ralm, which did not count them

    def __bool__(self) -> bool:
        return bool(self.added or self.deleted or self.uncounted)

    def describe(self) -> str:
        counts = "live updates of uncounted documents" if self.uncounted else \
            f"{plural(self.added, 'document')} added and {self.deleted:,} deleted by live updates"
        return counts + " since its last build" + (f" (some folded into {self.folded_by} by a compaction)" if self.folded_by else "")


def live_updates(root: str | os.PathLike) -> LiveUpdates:
    """The live updates the index at `root` holds: those its latest version folded (a
    compaction), plus those its update log holds past it."""
    root = Path(root)
    latest, manifest = _latest(root)
    held, folded = manifest.get("log"), manifest.get("folded")
    log = UpdateLog(root)
    log_id, _ = log.head()
    at = held.get("offset", 0) if isinstance(held, dict) and held.get("id") == log_id else 0  # as a searcher replays it
    adds, deleted = fold(log.read(at, line=None).records)
    counted = folded if isinstance(folded, dict) else {}
    return LiveUpdates(latest, counted.get("added", 0) + len(adds), counted.get("deleted", 0) + len(deleted),
                       folded_by=latest if held else None, uncounted=bool(held) and not counted)


def check_rebuild(root: str | os.PathLike, *, replace: bool) -> str | None:
    """Refuse a build into `root` that would drop live updates (see the module's docstring);
    returns the latest version the build replaces (None: none), for it to publish only if no
    other version came meanwhile (a compaction folding what was logged since)."""
    if not manifest_file(root).is_file():
        return None  # a new index
    live = live_updates(root)
    if live and not replace:
        raise RalmError(f"{root} holds {live.describe()}, which a build of its corpus alone would drop: "
                        "build into a new directory, or rebuild with replace (--replace) to drop them")
    return live.latest


def folded_counts(manifest, *, added: int, deleted: int) -> dict | None:
    """The "folded" field of a compaction of the version of `manifest` (a VersionManifest) that
    folds a log adding (or replacing) `added` and deleting `deleted` documents; None where the
    version was compacted by a ralm that did not count."""
    if manifest.log is not None and manifest.folded is None:
        return None
    before = manifest.folded or {"added": 0, "deleted": 0}
    return {"added": before["added"] + added, "deleted": before["deleted"] + deleted}


def _latest(root: Path) -> tuple[str | None, dict]:
    """(LATEST's version, its manifest as written); (None, {}) when there is none or it is
    damaged, which a build into the directory repairs."""
    try:
        name = (root / "LATEST").read_text(errors="replace").strip()
        if not VERSION_NAME.match(name):
            return None, {}
        return name, read_json(manifest_file(root / "versions" / name))
    except (OSError, RalmError):
        return None, {}
