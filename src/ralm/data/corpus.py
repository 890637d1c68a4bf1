"""Read and validate corpora: JSON Lines, TSV, or a folder of .txt files.

Every reader streams (a 13M-document corpus never sits in RAM) and raises `RalmError`
naming file:line for malformed input. A document whose text is empty is skipped with a
`RalmWarning` that counts them and names the first: it would become a block with a title and
no body, which holds no evidence, and one stub should not stop a 13M-document build.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import unicodedata
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator

from ralm.errors import RalmError, RalmWarning


@dataclass(frozen=True)
class Document:
    id: str
    title: str
    text: str


def decode_line(raw: bytes, path: str | os.PathLike, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RalmError(f"{path}:{lineno}: not valid UTF-8 (byte {e.start} of the line)") from None


# Characters that show nothing: a text of only these (zero-width spaces, a BOM) is empty.
_INVISIBLE = re.compile(r"[\s\u00ad\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]*")


def visible(text: str) -> str:
    """`text` stripped, or "" when it shows nothing (only whitespace and zero-width characters)."""
    text = text.strip()
    return "" if _INVISIBLE.fullmatch(text) else text


def check_unicode(value: str, where: str, key: str) -> None:
    """A lone surrogate (JSON allows "\\ud800") cannot be written as UTF-8: it is refused where
    it is read, naming the field, not when it is first written."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RalmError(f"{where}: field '{key}' holds a lone surrogate ({value[e.start]!r} at character {e.start}), "
                        "which is not valid Unicode") from None


def id_problem(doc_id: str) -> str | None:
    """Why `doc_id` cannot name a document, or None. Ids travel in URLs (DELETE /documents/ID),
    logs and JSON lines: no control characters (newline, NUL, tab), not invisible, and not
    "." or ".." (URL clients resolve those path segments away)."""
    if not visible(doc_id):
        return "is empty"
    if doc_id.strip() in (".", ".."):
        return f"is {doc_id.strip()!r}, which a URL cannot name"
    bad = next((c for c in doc_id if unicodedata.category(c) == "Cc"), None)
    return f"holds a control character ({bad!r}); ids must be printable" if bad else None


def _document(obj, where: str) -> Document:
    """A corpus record as a Document; `where` (file:line) prefixes the error."""
    if not isinstance(obj, dict):
        raise RalmError(f"{where}: expected a JSON object with 'id', 'title', 'text'")
    for key in ("id", "text"):
        if key not in obj:
            raise RalmError(f"{where}: missing field '{key}'")
    doc_id, title, text = obj["id"], obj.get("title", ""), obj["text"]
    if isinstance(doc_id, int) and not isinstance(doc_id, bool):
        doc_id = str(doc_id)
    for key, value in (("id", doc_id), ("title", title), ("text", text)):
        if not isinstance(value, str):
            raise RalmError(f"{where}: field '{key}' must be a string, got {type(value).__name__}")
        check_unicode(value, where, key)
    if (problem := id_problem(doc_id)) is not None:
        raise RalmError(f"{where}: field 'id' {problem}")
    return Document(doc_id, title.strip(), visible(text))


def iter_jsonl(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed value) of each non-blank line; errors name file:line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = decode_line(raw, path, lineno).strip()
            if not line:
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise RalmError(f"{path}:{lineno}: malformed JSON ({e.msg}, column {e.colno})") from None
            except ValueError as e:  # an integer of more than 4300 digits
                raise RalmError(f"{path}:{lineno}: unreadable JSON ({e})") from None
            except RecursionError:
                raise RalmError(f"{path}:{lineno}: JSON nested too deeply") from None


# Each reader yields (where, document): `where` is the file:line that an error or warning names.

def _read_jsonl(path: Path) -> Iterator[tuple[str, Document]]:
    for lineno, obj in iter_jsonl(path):
        where = f"{path}:{lineno}"
        yield where, _document(obj, where)


def _read_tsv(path: Path) -> Iterator[tuple[str, Document]]:
    """TSV with a header naming at least `id` and `text` columns (DPR's psgs_w100 layout works).
    A field may be as long as its line, and hold a bare carriage return."""
    with open(path, "rb") as f:
        header = decode_line(f.readline(), path, 1).rstrip("\r\n").split("\t")
        missing = {"id", "text"} - set(header)
        if missing:
            raise RalmError(f"{path}:1: TSV header must name columns id, text (and optionally title); missing {sorted(missing)}")
        cols = {name: i for i, name in enumerate(header)}
        for lineno, raw in enumerate(f, 2):
            line = decode_line(raw, path, lineno).rstrip("\r\n")
            if not line:
                continue
            where = f"{path}:{lineno}"
            fields = _tsv_fields(line, where)
            if len(fields) != len(header):
                raise RalmError(f"{where}: expected {len(header)} tab-separated fields, got {len(fields)}")
            yield where, _document({name: fields[i] for name, i in cols.items()}, where)


def _tsv_fields(line: str, where: str) -> list[str]:
    """One TSV line's fields: split on tabs, or read by the csv module where a field is quoted."""
    if '"' not in line:
        return line.split("\t")
    limit = csv.field_size_limit()
    csv.field_size_limit(max(limit, len(line)))  # the module's 131,072-character default would refuse a long passage
    try:
        return next(csv.reader([line], delimiter="\t", lineterminator="\n"))
    except csv.Error as e:
        raise RalmError(f"{where}: not a TSV line ({e})") from None
    finally:
        csv.field_size_limit(limit)


def txt_files(folder: Path) -> tuple[list[Path], list[Path]]:
    """(the regular .txt files under `folder`, sorted; the other entries named *.txt: a FIFO,
    a device, a folder, which reading would hang on or fail at)."""
    found = sorted(folder.rglob("*.txt"))
    return [f for f in found if f.is_file()], [f for f in found if not f.is_file()]


def _read_txt_dir(path: Path) -> Iterator[tuple[str, Document]]:
    """One document per .txt file: id = path relative to the folder (under the ids' rules),
    title = file stem. Entries that are not regular files are skipped with a warning."""
    files, skipped = txt_files(path)
    if skipped:
        warnings.warn(RalmWarning(f"{path}: skipped {len(skipped)} entr{'y' if len(skipped) == 1 else 'ies'} named *.txt that "
                                  f"{'is' if len(skipped) == 1 else 'are'} not a regular file (the first: {skipped[0]})"), stacklevel=3)
    for file in files:
        rel = file.relative_to(path).as_posix()
        try:
            rel.encode("utf-8")
        except UnicodeEncodeError:
            raise RalmError(f"{file!r}: its name, a document id, is not valid UTF-8; rename the file") from None
        if (problem := id_problem(rel)) is not None:
            raise RalmError(f"{file!r}: its name, a document id, {problem}; rename the file")
        text = decode_line(file.read_bytes(), file, 1)
        yield str(file), Document(rel, file.stem.replace("_", " "), visible(text))


def _corpus_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.exists():
        raise RalmError(f"corpus not found: {path}")
    if not path.is_dir() and not path.is_file():  # a FIFO or device would block or never end
        raise RalmError(f"{path}: not a regular file or a folder")
    return path


def read_corpus(path: str | os.PathLike) -> Iterator[Document]:
    """Stream documents from `path`; raises RalmError on a missing, empty or malformed corpus
    and warns (RalmWarning) about documents skipped for their empty text."""
    path = _corpus_path(path)
    if path.is_dir():
        reader = _read_txt_dir(path)
    elif path.suffix in (".jsonl", ".json", ".ndjson"):
        reader = _read_jsonl(path)
    elif path.suffix in (".tsv", ".tab"):
        reader = _read_tsv(path)
    else:
        raise RalmError(f"{path}: unknown corpus format (use .jsonl, .tsv or a folder of .txt files)")
    count, empty, first_empty = 0, 0, None
    for where, doc in reader:
        if not doc.text:
            empty, first_empty = empty + 1, first_empty or where
            continue
        count += 1
        yield doc
    if count == 0:
        raise RalmError(f"{path}: the corpus is empty (no documents{f' with text: {empty} had empty text' if empty else ''})")
    if empty:
        warnings.warn(RalmWarning(f"{path}: skipped {empty} document(s) with empty text (the first at {first_empty})"), stacklevel=2)


def as_documents(items: Iterable[Document | dict | str]) -> list[Document]:
    """Documents given in memory: Documents, dicts shaped like a JSONL corpus line, or strings
    (texts without a title, with their position as id), checked as a corpus file's lines are."""
    if isinstance(items, (str, dict, Document)):
        raise RalmError("documents must be a list (of Documents, {'id', 'title', 'text'} dicts or strings)")
    docs = [_document({"id": str(i), "text": item} if isinstance(item, str) else
                      asdict(item) if isinstance(item, Document) else item, f"documents[{i}]")
            for i, item in enumerate(items)]
    if not docs:
        raise RalmError("no documents given")
    return docs


Documents = Iterable[Document | dict | str]  # a corpus given in memory (see `as_documents`)


def jsonl_lines(docs: Iterable[Document]) -> str:
    """Documents as the lines of a JSONL corpus file (what `read_corpus` reads back)."""
    return "".join(json.dumps(asdict(d), ensure_ascii=False) + "\n" for d in docs)


def save_documents(folder: str | os.PathLike, docs: Documents) -> Path:
    """In-memory documents as a JSONL corpus file in `folder`, named by its content, so that
    what reads a corpus (block stores, trainers, a resumed run) reads them like any other file."""
    from ralm.atomic import write_text

    lines = jsonl_lines(as_documents(docs))
    path = Path(folder) / f"{hashlib.sha256(lines.encode()).hexdigest()[:16]}.jsonl"
    if not path.is_file():
        write_text(path, lines)
    return path


def corpus_fingerprint(path: str | os.PathLike) -> str:
    """sha256 of the corpus bytes (file names too for a folder): an index records it."""
    path = _corpus_path(path)
    h = hashlib.sha256()
    files = txt_files(path)[0] if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            h.update(file.relative_to(path).as_posix().encode() + b"\0")
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]
