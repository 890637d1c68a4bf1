"""The log of live document updates, `DIR/updates.jsonl` beside an index's versions: every add
and delete is appended and fsync'd before it is applied, and replayed when a server opens the
index, so an acknowledged update survives a crash or restart.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from ralm.data.corpus import Document
from ralm.errors import RalmError

LOG = "updates.jsonl"
RECORD_START = b'{"op": '  # how json.dumps begins every record; inside a string value the quotes are escaped
log = logging.getLogger("ralm.live")


class UpdateLog:
    def __init__(self, index_root: str | os.PathLike):
        self.path = Path(index_root) / LOG

    def append(self, entries: list[dict]) -> None:
        """Durably append {"op": "add", "id", "title", "text"} / {"op": "delete", "id"} records."""
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries))
            f.flush()
            os.fsync(f.fileno())

    def replay(self) -> tuple[list[Document], set[str]]:
        """(the documents added, in live order: a document sits where its last add put it;
        the ids deleted since their last add)."""
        adds: dict[str, Document] = {}
        deleted: set[str] = set()
        for e in self._records():
            adds.pop(e["id"], None)
            if e["op"] == "add":
                adds[e["id"]] = Document(e["id"], e.get("title", ""), e["text"])
                deleted.discard(e["id"])
            else:
                deleted.add(e["id"])
        return list(adds.values()), deleted

    def _records(self) -> list[dict]:
        """The log's records, after cutting a torn last record (a crash mid-append: it was never
        acknowledged) so that the next append starts on a line of its own."""
        if not self.path.exists():
            return []
        if not self.path.is_file():  # a folder, a FIFO: refused when the server starts, not at the first write
            raise RalmError(f"{self.path} is not a regular file; move it away (it should hold the live updates)")
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
            log.warning("%s: cut a torn last record (%d bytes, never acknowledged) left by a crash mid-write",
                        self.path, len(data) - end)
        records = []
        for lineno, line in enumerate(data[:end].split(b"\n")[:-1], 1):  # bytes: a text may hold U+2028
            if not line.strip():
                continue
            record = _record(line)
            if record is None:  # ralm <= 0.2.0 appended onto a torn record: the acknowledged one ends the line
                start = line.rfind(RECORD_START)
                record = _record(line[start:]) if start > 0 else None
                if record is None:
                    # written by hand or another program: replaying around it could drop or resurrect documents
                    raise RalmError(f'{self.path}:{lineno}: not an update record ({{"op": "add", "id", "title", "text"}} '
                                    f'or {{"op": "delete", "id"}}); fix or remove the line')
                log.warning("%s:%d: skipped a torn record before the update of %r", self.path, lineno, record["id"])
            records.append(record)
        return records


def _record(line: bytes) -> dict | None:
    """A log line's update record, or None when it is not one."""
    try:
        e = json.loads(line)
    except (ValueError, RecursionError):  # also a UnicodeDecodeError; nested too deeply
        return None
    add = isinstance(e, dict) and e.get("op") == "add" and isinstance(e.get("text"), str) and isinstance(e.get("title", ""), str)
    ok = isinstance(e, dict) and isinstance(e.get("id"), str) and (add or e.get("op") == "delete")
    return e if ok else None
