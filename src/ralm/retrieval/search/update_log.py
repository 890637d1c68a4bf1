"""The log of live document updates beside an index's versions, shared by every process that
opens the index (`ralm serve`, `ralm index add/delete/compact`, `ralm search`, ...):

  DIR/updates.jsonl      a header {"op": "log", "id", "checksums": "crc32"}, then one record per update:
                         {"op": "add", "id", "title", "text", "blocks": [[start, end], ...],
                          "state": {"offset", "sizes": {side: bytes}, "crc32"}} or {"op": "delete", "id"}
  DIR/updates-<id>.bin   what each side keeps of an added document's blocks (dense: their
                         embeddings; BM25: their terms' hashes), at the offset its record
                         names: opening reads it back instead of recomputing it

Every line ends in `, "crc": "<8 hex digits>"}`, the CRC-32 of the line as it would read
without it, and a record's "crc32" is that of the state bytes it names: a flipped byte, or a
text edited by hand, is an error naming file:line (or the state file) when the log is read,
never a document replayed with another text or the embedding of another block. A log whose
header has no "checksums" was written before them (ralm <= 0.5): its lines are read as before,
checked where they carry a checksum, and the next compaction writes it anew with them.

One writer at a time: a writer holds the index's lock (`IndexDir.lock`) while it catches up
with the log and appends; a reader holds it shared while it reads, and never modifies the log.
The records of one append are one batch: each but the last carries "more": true, and readers
apply whole batches only, so an append cut off by a crash is never half applied. A batch is
acknowledged once it is fsync'd (its states first, then its records); what a killed writer
left past the last whole batch is cut by the next writer, which alone can know it is dead.

A compaction (search/compaction.py) folds the log into a new index version that records the
log's id and the offset it holds, then `rewrite`s the log under a new id with what was appended
after that offset. A log without a header was written by ralm <= 0.4: it is read as before,
and the first writer rewrites it in this form.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import secrets
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ralm.atomic import atomic_path
from ralm.errors import RalmError

LOG = "updates.jsonl"
RECORD_START = b'{"op": '  # how json.dumps begins every record; inside a string value the quotes are escaped
CHECKSUMS = "crc32"  # the header's "checksums": every line carries its own
_CRC_START = b', "crc": "'
_CRC_LEN = len(_CRC_START) + 8 + 2  # a line ends in , "crc": "0123abcd"}
log = logging.getLogger("ralm.live")


@dataclass(frozen=True)
class Entry:
    """One update to append: its record ({"op": "add", "id", "title", "text", "blocks"} or
    {"op": "delete", "id"}) and, for an add, the bytes each side keeps of its blocks."""
    record: dict
    state: dict[str, bytes] = field(default_factory=dict)


@dataclass
class LogRead:
    """Whole batches of the log from byte `start` to `end`, and the states they name."""
    id: str | None  # None: no log yet, or one written by ralm <= 0.4 (no header)
    start: int
    end: int  # just past the last whole batch; appends go here
    lines: int  # lines up to `end` (error messages name file:line)
    records: list[dict]
    size: int  # the file's size when read: bytes past `end` are a batch in progress or cut off
    states: mmap.mmap | None = None  # the log's state file, mapped
    state_file: Path | None = None
    checksums: bool = False  # its header says every line carries a checksum (False: written before them)

    def state(self, record: dict) -> dict[str, bytes] | None:
        """Each side's bytes of an add `record`, or None (none stored, or past the state file's
        end); bytes that differ from the record's checksum are the state file's damage."""
        where = record.get("state")
        if where is None or self.states is None:
            return None
        out, at, crc = {}, where["offset"], 0
        for side, size in where["sizes"].items():
            if at + size > len(self.states):
                return None
            out[side] = self.states[at:at + size]
            crc = zlib.crc32(out[side], crc)  # the CRC of the sides' bytes one after another
            at += size
        if "crc32" in where and crc != where["crc32"]:
            raise RalmError(f"{self.state_file} is damaged (the state of {record['id']!r} at byte {where['offset']} differs "
                            "from its checksum); remove it and run `ralm index compact`, which computes the logged "
                            "documents' blocks anew")
        return out


class UpdateLog:
    def __init__(self, index_root: str | os.PathLike):
        self.root = Path(index_root)
        self.path = self.root / LOG

    def state_path(self, log_id: str) -> Path:
        return self.root / f"updates-{log_id}.bin"

    def _check_file(self) -> None:
        # a folder, a FIFO, a link to elsewhere: refused when an index opens, not at the first write
        if self.path.is_symlink() or (self.path.exists() and not self.path.is_file()):
            raise RalmError(f"{self.path} is not a regular file; move it away (it should hold the live updates)")

    def head(self) -> tuple[str | None, int]:
        """(the log's id, its size in bytes): enough to tell whether it changed since a read."""
        self._check_file()
        try:
            with open(self.path, "rb") as f:
                return self._header(f.readline(4096))[0], os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            return None, 0

    def _header(self, line: bytes) -> tuple[str | None, bool]:
        """(the log's id, whether its lines carry checksums) from its first line."""
        try:
            return _header(line)
        except ValueError:
            raise RalmError(f"{self.path}:1: the log's header differs from its checksum (damaged); "
                            "the index's live updates cannot be read: restore the file or rebuild the index") from None

    def read(self, start: int = 0, *, line: int | None = 0) -> LogRead:
        """The whole batches from byte `start` (0, the `end` of an earlier read of this log, or
        where a compaction stopped), without modifying the file; a cut-off batch is left out.
        `line`: the lines before `start` (None: counted)."""
        self._check_file()
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                log_id, checksums = self._header(f.readline(4096))
                if line is None:
                    f.seek(0)
                    line = f.read(start).count(b"\n")
                f.seek(start)
                data = f.read(max(0, size - start))
        except FileNotFoundError:
            return LogRead(None, 0, 0, 0, [], 0)
        records, pending = [], []
        end, end_line, lineno, pos = start, line, line, 0
        while (nl := data.find(b"\n", pos)) >= 0:  # bytes: a text may hold U+2028, a line break to str.splitlines
            raw, pos = data[pos:nl], nl + 1
            lineno += 1
            if start == 0 and lineno == 1 and log_id is not None:  # the header
                end, end_line = pos, lineno
                continue
            if not raw.strip():
                if not pending:
                    end, end_line = start + pos, lineno
                continue
            body, crc = _unsealed(raw.rstrip(b" \t\r"))
            if crc is None and checksums:
                raise RalmError(f"{self.path}:{lineno}: a record without its checksum in a log whose lines all carry one "
                                "(damaged, or written by hand); restore the file, or remove the line and what follows")
            if crc is not None and zlib.crc32(body) != crc:
                raise RalmError(f"{self.path}:{lineno}: the record differs from its checksum (damaged, or edited by hand); "
                                "restore the file, or remove the line and what follows")
            record = _record(body)
            if record is None:  # ralm <= 0.2.0 appended onto a torn record: the acknowledged one ends the line
                at = raw.rfind(RECORD_START) if crc is None else -1
                record = _record(raw[at:]) if at > 0 else None
                if record is None:
                    # written by hand or another program: replaying around it could drop or resurrect documents
                    raise RalmError(f'{self.path}:{lineno}: not an update record ({{"op": "add", "id", "title", "text"}} '
                                    f'or {{"op": "delete", "id"}}); fix or remove the line')
                log.warning("%s:%d: skipped a torn record before the update of %r", self.path, lineno, record["id"])
            pending.append(record)
            if not record.pop("more", False):
                records += pending
                pending = []
                end, end_line = start + pos, lineno
        return LogRead(log_id, start, end, end_line, records, size, self._map(log_id),
                       self.state_path(log_id) if log_id else None, checksums)

    def _map(self, log_id: str | None) -> mmap.mmap | None:
        if log_id is None:
            return None
        try:
            with open(self.state_path(log_id), "rb") as f:
                return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(f.fileno()).st_size else None
        except FileNotFoundError:
            return None

    def check(self) -> LogRead:
        """The whole log read as an open reads it (every record parses), and every state it
        names inside its state file (`ralm index check`)."""
        read = self.read()
        for r in read.records:
            if "state" in r and read.state(r) is None:
                raise RalmError(f"{self.state_path(read.id or '')} is damaged (it ends before the state of {r['id']!r}); "
                                "`ralm index compact` folds the log into a version (recomputing what is missing)")
        return read

    # -- writing: the caller holds the index's writer lock ---------------------------------
    def append(self, entries: Sequence[Entry], *, log_id: str, at: int) -> int:
        """Append `entries` as one batch at byte `at`, the end of the log's last whole batch as
        the caller read it under the writer lock (what lies past it was left by a killed writer
        and is cut); durable when this returns. Returns the new end."""
        if not entries:
            return at
        lines, states = self._encode(entries, offset=self._state_size(log_id))
        if states:
            with open(self.state_path(log_id), "ab") as f:
                f.write(states)
                f.flush()
                os.fsync(f.fileno())
        with open(self.path, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            if size > at:
                log.warning("%s: cut %d bytes past the last whole batch (an append a killed writer never finished)",
                            self.path, size - at)
                f.truncate(at)
            f.seek(at)
            f.write(lines)
            f.flush()
            os.fsync(f.fileno())
        return at + len(lines)

    def rewrite(self, entries: Sequence[Entry]) -> str:
        """Replace the log by a new one (a new id) holding `entries`; returns its id. Readers see
        the old log or the new one; the old one's state file goes."""
        log_id = secrets.token_hex(8)
        lines, states = self._encode(entries, offset=0)
        with atomic_path(self.state_path(log_id)) as tmp:
            tmp.write_bytes(states)
        with atomic_path(self.path) as tmp:
            tmp.write_bytes(_sealed(json.dumps({"op": "log", "id": log_id, "checksums": CHECKSUMS}).encode()) + lines)
        for old in self.root.glob("updates-*.bin"):
            if old.name != self.state_path(log_id).name:
                old.unlink(missing_ok=True)
        return log_id

    def restart(self, log_id: str, *, after: int) -> str:
        """Start the log anew (a new id) with the batches appended after byte `after` of log
        `log_id`, which a compaction holds up to there, their states carried over (the writer
        lock held); returns the new id."""
        read = self.read(after, line=None)
        if read.id != log_id:  # only a compaction starts a log anew, and one runs at a time
            raise RalmError(f"{self.path} changed while it was compacted; run `ralm index compact` again")
        return self.rewrite([Entry({k: v for k, v in r.items() if k != "state"}, read.state(r) or {}) for r in read.records])

    def _state_size(self, log_id: str) -> int:
        try:
            return self.state_path(log_id).stat().st_size
        except FileNotFoundError:
            return 0

    @staticmethod
    def _encode(entries: Sequence[Entry], *, offset: int) -> tuple[bytes, bytes]:
        """(the batch's lines, its states) with each add's states placed from `offset` on."""
        lines, states = [], []
        for i, e in enumerate(entries):
            record = dict(e.record)
            if e.state:
                data = b"".join(e.state.values())
                record["state"] = {"offset": offset, "sizes": {side: len(b) for side, b in e.state.items()},
                                   "crc32": zlib.crc32(data)}
                states.append(data)
                offset += len(data)
            if i < len(entries) - 1:
                record["more"] = True
            lines.append(_sealed(json.dumps(record, ensure_ascii=False).encode("utf-8")))
        return b"".join(lines), b"".join(states)


def fold(records: Sequence[dict]) -> tuple[list[dict], set[str]]:
    """(the last add record of each id, in live order: a document sits where its last add put
    it; the ids deleted since their last add)."""
    adds: dict[str, dict] = {}
    deleted: set[str] = set()
    for e in records:
        adds.pop(e["id"], None)
        if e["op"] == "add":
            adds[e["id"]] = e
            deleted.discard(e["id"])
        else:
            deleted.add(e["id"])
    return list(adds.values()), deleted


def _sealed(body: bytes) -> bytes:
    """`body` (a JSON object) as a log line ending in its own CRC-32."""
    return body[:-1] + _CRC_START + b"%08x" % zlib.crc32(body) + b'"}\n'


def _unsealed(line: bytes) -> tuple[bytes, int | None]:
    """(the line as it read before its checksum was added, the checksum), or (line, None)
    when it ends in none. Byte slicing, no JSON: a replay checks every line."""
    tail = line[-_CRC_LEN:]
    if len(line) <= _CRC_LEN or not (tail.startswith(_CRC_START) and tail.endswith(b'"}')):
        return line, None
    try:
        return line[:-_CRC_LEN] + b"}", int(tail[len(_CRC_START):-2], 16)
    except ValueError:
        return line, None


def _header(line: bytes) -> tuple[str | None, bool]:
    """(id, checksums) of a header line; (None, False) when the line is none; ValueError when
    it carries a checksum it differs from."""
    body, crc = _unsealed(line.rstrip(b" \t\r\n"))
    try:
        head = json.loads(body)
    except ValueError:
        return None, False
    if not (isinstance(head, dict) and head.get("op") == "log" and isinstance(head.get("id"), str)):
        return None, False
    if crc is not None and zlib.crc32(body) != crc:
        raise ValueError("checksum")
    return head["id"], head.get("checksums") == CHECKSUMS


_DECODER = json.JSONDecoder()


def _record(line: bytes) -> dict | None:
    """A log line's update record, or None when it is not one. What it says of its blocks
    and their states is dropped when malformed: that document's blocks are then recomputed."""
    try:
        # json.loads without its per-call encoding sniff and whitespace regex (a third of a
        # replay's parse); as strict: UTF-8, one value on the line
        text = line.decode().strip(" \t\r\n")
        e, end = _DECODER.raw_decode(text)
    except (ValueError, RecursionError):  # also a UnicodeDecodeError; nested too deeply
        return None
    if end != len(text):
        return None
    if not isinstance(e, dict) or not isinstance(e.get("id"), str) or not isinstance(e.get("more", False), bool):
        return None
    if e.get("op") == "delete":
        return e
    if e.get("op") != "add" or not isinstance(e.get("text"), str) or not isinstance(e.get("title", ""), str):
        return None
    if not (_spans_ok(e.get("blocks"), len(e["text"])) and _state_ok(e.get("state"))):
        e.pop("blocks", None)
        e.pop("state", None)
    return e


def _spans_ok(spans, n: int) -> bool:
    # a loop, not all() over generators: a replay checks every logged document's spans
    if type(spans) is not list:
        return False
    for s in spans:
        if type(s) is not list or len(s) != 2:
            return False
        a, b = s
        if type(a) is not int or type(b) is not int or not 0 <= a <= b <= n:  # type(): a bool is not an offset
            return False
    return True


def _count(x) -> bool:
    return type(x) is int and x >= 0


def _state_ok(state) -> bool:
    if state is None:
        return True
    if type(state) is not dict or not _count(state.get("offset")) or type(state.get("sizes")) is not dict:
        return False
    if "crc32" in state and not _count(state["crc32"]):
        return False
    for k, v in state["sizes"].items():
        if type(k) is not str or not _count(v):
            return False
    return True
