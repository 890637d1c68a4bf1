"""Read and validate corpora: JSON Lines, TSV, or documents as they are (.txt, Markdown, HTML,
PDF: data/formats.py), one file or a folder of them.

Every reader streams (a 13M-document corpus never sits in RAM) and raises `RalmError`
naming file:line for malformed input. A document whose text is empty is skipped with a
`RalmWarning` that counts them and names the first: it would become a block with a title and
no body, which holds no evidence, and one stub should not stop a 13M-document build.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import re
import unicodedata
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from ralm.data.formats import (
    EVERY_FILE,
    FOLDER_SUFFIXES,
    FileFilter,
    Listing,
    list_folder,
    reader_for,
    stem_title,
)
from ralm.errors import RalmError, RalmWarning, plural


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
    if bad:
        return f"holds a control character ({bad!r}); ids must be printable"
    hidden = next((c for c in doc_id if unicodedata.category(c) == "Cf" and c not in _JOINERS), None)
    if hidden:
        return (f"holds an invisible character (U+{ord(hidden):04X} {unicodedata.name(hidden, 'format character')}); "
                "an id must show all it holds")
    return None


# Format characters (Unicode category Cf) an id may hold: the zero-width non-joiner and joiner
# that Persian, Indic scripts and emoji sequences need. The others (bidi overrides and isolates,
# zero-width spaces, word joiners, a BOM, soft hyphens) are refused in ids: they change how an
# id reads without showing.
_JOINERS = frozenset("\u200c\u200d")


def file_of(doc_id: str) -> str:
    """The file whose section or page `doc_id` is: the id before its last '#' (`guide.md` of
    `guide.md#setup` and `paper.pdf#page=3`; an anchor holds no '#', a file name may:
    `C#.md#intro` is of `C#.md`); an id without one is its own file's. Deleting a file's name
    deletes every document of that file (retrieval/search/live.py `documents_named`)."""
    return doc_id.rpartition("#")[0] or doc_id


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
    with reading(path), open(path, "rb") as f:
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
    with reading(path), open(path, "rb") as f:
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


def _documents(data: bytes, path: str, rel: str) -> Iterator[Document]:
    """A .txt file is one document (id `rel`, titled by its name); a Markdown, HTML or PDF file
    one per section (id `rel` + the section's anchor). `path` names the file in errors."""
    if Path(path).suffix.lower() == ".txt":
        text = decode_line(data, path, 1)
        check_not_binary(data, path)
        yield Document(rel, stem_title(rel), visible(text))
        return
    if Path(path).suffix.lower() != ".pdf":
        check_not_binary(data, path)
    for section in reader_for(path)(data, path):
        yield Document(rel + section.anchor, section.title, visible(section.text))


def check_not_binary(data: bytes, path: str, head: int = 8192) -> None:
    """A text file (.txt, Markdown, HTML) with a NUL byte in its first `head` bytes is binary
    (the test git and grep use), refused as a binary .txt is, never indexed as junk; a UTF-16
    page (NULs between letters) is known by its byte-order mark and read."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return
    nul = data.find(b"\x00", 0, head)
    if nul >= 0:
        raise RalmError(f"{path}: a binary file, not text (a NUL byte at offset {nul})")


@contextlib.contextmanager
def reading(path: str | os.PathLike) -> Iterator[None]:
    """An OSError while reading `path` (no permission, a disk's read error, a folder by a file's
    name) as the input's error, naming the file."""
    try:
        yield
    except OSError as e:
        raise RalmError(f"{path}: cannot read it ({e.strerror or e})") from None


def read_bytes(file: Path) -> bytes:
    with reading(file):
        return file.read_bytes()


def _read_file(file: Path, rel: str) -> Iterator[tuple[str, Document]]:
    for doc in _documents(read_bytes(file), str(file), rel):
        yield f"{file}{doc.id[len(rel):]}", doc  # where: the file, and the section's anchor


def file_documents(data: bytes, name: str) -> list[Document]:
    """The documents of one file given as its bytes (an upload), `name` its path: as a folder's
    file of that name is read, the sections without text left out."""
    if (problem := id_problem(name)) is not None:
        raise RalmError(f"the file name {problem}")
    if Path(name).suffix.lower() not in FOLDER_SUFFIXES:
        raise RalmError(f"{name}: unknown format (use {', '.join(FOLDER_SUFFIXES)})")
    docs = [d for d in _documents(data, name, name) if d.text]
    if not docs:
        raise RalmError(f"{name}: no text to index (a scanned PDF has none)")
    return docs


def sectioned_files(path: str | os.PathLike, *, files: FileFilter = EVERY_FILE) -> list[str]:
    """The Markdown, HTML and PDF files of a corpus by the name their sections' ids start with
    (`guide.md` of `guide.md#setup`): paths in a folder, or the file's name."""
    path = Path(path)
    named = [rel for _, rel in list_folder(path, files).files] if path.is_dir() else [path.name]
    return [rel for rel in named if reader_for(rel) is not None]


def _read_folder(listing: Listing) -> Iterator[tuple[str, Document]]:
    """The documents of a folder's files, ids relative to the folder."""
    for file, rel in listing.files:
        try:
            rel.encode("utf-8")
        except UnicodeEncodeError:
            raise RalmError(f"{file!r}: its name, a document id, is not valid UTF-8; rename the file") from None
        if (problem := id_problem(rel)) is not None:
            raise RalmError(f"{file!r}: its name, a document id, {problem}; rename the file")
        yield from _read_file(file, rel)


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


def _corpus_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.exists():
        raise RalmError(f"corpus not found: {path}")
    if not path.is_dir() and not path.is_file():  # a FIFO or device would block or never end
        raise RalmError(f"{path}: not a regular file or a folder")
    return path


def read_corpus(path: str | os.PathLike, *, files: FileFilter = EVERY_FILE) -> Iterator[Document]:
    """Stream documents from `path`; raises RalmError on a missing, empty or malformed corpus
    and warns (RalmWarning) about documents skipped for their empty text and about the files
    of a folder that are not read (`files` picks which are)."""
    path = _corpus_path(path)
    listing = None
    if path.is_dir():
        listing = list_folder(path, files)
        if listing.skipped():
            warnings.warn(RalmWarning(f"{path}: skipped {listing.skipped()}"), stacklevel=2)
        reader = _read_folder(listing)
    elif (read := _file_reader(path)) is not None:
        reader = read(path)
    else:
        raise _unknown_format(path)
    count, empty, first_empty = 0, 0, None
    for where, doc in reader:
        if not doc.text:
            empty, first_empty = empty + 1, first_empty or where
            continue
        count += 1
        yield doc
    if count == 0:
        raise RalmError(f"{path}: the corpus is empty ({_why_empty(empty, listing)})")
    if empty:
        warnings.warn(RalmWarning(f"{path}: skipped {plural(empty, 'document')} with empty text (the first at {first_empty})"),
                      stacklevel=2)


def check_corpus(path: str | os.PathLike, *, files: FileFilter = EVERY_FILE) -> None:
    """What can be known of a corpus without reading it (that it exists, its format, that a
    folder holds a file to read), raised as `read_corpus` would: commands check it before they
    load a model."""
    path = _corpus_path(path)
    if path.is_dir():
        listing = list_folder(path, files)
        if not listing.files:
            raise RalmError(f"{path}: the corpus is empty ({_why_empty(0, listing)})")
        for file, rel in listing.files:
            _check_file_name(path, rel)
            _check_pdf_header(file)
    elif _file_reader(path) is None:
        raise _unknown_format(path)
    else:
        _check_pdf_header(path)


def _check_file_name(folder: Path, rel: str) -> None:
    """A file name that is not UTF-8 (os.listdir gives it surrogate-escaped) cannot be a
    document id, nor be written to the block store's JSON."""
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(rel).decode("utf-8", "backslashreplace")
        raise RalmError(f"{folder}: the file name '{shown}' is not UTF-8; rename it (e.g. `convmv -f latin1 -t utf8`) "
                        "or leave it out with --exclude") from None


def _check_pdf_header(file: Path) -> None:
    """A .pdf that does not start with %PDF- (PDF readers look for it in the first 1,024 bytes) is
    damaged or another format renamed: named before any model loads, not after encoding began."""
    if file.suffix.lower() != ".pdf":
        return
    with reading(file), open(file, "rb") as f:
        head = f.read(1024)
    if b"%PDF-" not in head:
        raise RalmError(f"{file}: not a readable PDF (no %PDF- header: damaged, or another format named .pdf)")


def _file_reader(path: Path) -> Callable[[Path], Iterator[tuple[str, Document]]] | None:
    if path.suffix in (".jsonl", ".json", ".ndjson"):
        return _read_jsonl
    if path.suffix in (".tsv", ".tab"):
        return _read_tsv
    if path.suffix.lower() in FOLDER_SUFFIXES:
        return lambda file: _read_file(file, file.name)
    return None


def _unknown_format(path: Path) -> RalmError:
    return RalmError(f"{path}: unknown corpus format (use .jsonl, .tsv, {', '.join(FOLDER_SUFFIXES)} or a folder of them)")


def _why_empty(empty: int, listing: Listing | None) -> str:
    why = f"no documents with text: {empty} had empty text" if empty else "no documents"
    reasons = []
    if listing is not None:
        if listing.skipped():
            reasons.append(f"skipped {listing.skipped()}")
        if listing.excluded:
            reasons.append(f"{plural(listing.excluded, 'file')} left out by the include/exclude patterns")
        if not listing.files:
            reasons.append(f"the folder holds no file to read ({', '.join(FOLDER_SUFFIXES)})")
            if listing.hidden:  # a file the user meant, named like `.notes.txt`
                reasons.append("a name starting with '.' is hidden: rename the file without it to read it")
    return "; ".join([why, *reasons])


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


def corpus_fingerprint(path: str | os.PathLike, *, files: FileFilter = EVERY_FILE) -> str:
    """sha256 of the corpus bytes (file names too for a folder, of the files `files` picks):
    an index records it."""
    path = _corpus_path(path)
    h = hashlib.sha256()
    for file, rel in list_folder(path, files).files if path.is_dir() else [(path, None)]:
        if rel is not None:
            h.update(rel.encode() + b"\0")
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]
