"""Documents as people keep them: Markdown, HTML and PDF files read into titled sections, and
the walk that picks the files a corpus folder holds (data/corpus.py makes them documents).

A file becomes one document per section, so that evidence names where it stands:
  - Markdown (CommonMark, markdown-it-py) and HTML (resiliparse's DOM and main-content
    extraction): the title is the document's own (front matter `title:`, `<title>`), else its
    first heading, else the file name; each heading starts a section whose id is the file's
    plus the heading's anchor (`guide.md#installation`, as GitHub links it) and whose title is
    the heading path (`Guide › Setup › Linux`). A leading heading that no other heading
    outranks names the document; the text before the first section keeps the file's own id.
  - PDF (pypdf): one section per page, `paper.pdf#page=3` (the fragment PDF viewers open at
    that page), titled by the document's metadata title, its first line, or the file name,
    plus the outline (bookmark) entry the page falls under.
The parsers are imported when a file of their format is read, so listing a folder stays light.
"""

from __future__ import annotations

import fnmatch
import functools
import html
import io
import itertools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

from ralm.errors import RalmError, plural

PATH_SEPARATOR = " › "  # between a document's title and its section headings


@dataclass(frozen=True)
class DocumentSection:
    anchor: str  # "" for the text before the first section, else "#slug" or "#page=N"
    title: str
    text: str


# -- sections from headings (Markdown, HTML) -------------------------------------------------

def slug(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def sectioned(parts: Iterable[tuple[int, str]], *, title: str, fallback: str) -> list[DocumentSection]:
    """Sections of a document given as (heading level 1-6, heading text) and (0, body text)
    parts. `title` is the document's own (may be empty); `fallback` names it otherwise."""
    parts = [(level, text.strip()) for level, text in parts if text.strip()]
    levels = [level for level, _ in parts if level]
    if parts and parts[0][0] and levels.count(min(levels)) == 1 and parts[0][0] == min(levels):
        heading = parts.pop(0)[1]  # the document's own heading, not a section
        title = title or heading
    title = title or fallback
    sections: list[tuple[str, list[str], list[str]]] = [("", [], [])]  # (anchor, heading path, body)
    stack: list[tuple[int, str]] = []
    used: set[str] = set()
    for level, text in parts:
        if not level:
            sections[-1][2].append(text)
            continue
        while stack and stack[-1][0] >= level:
            stack.pop()
        stack.append((level, text))
        base = slug(text) or "section"
        anchor = next(a for a in (base if n == 0 else f"{base}-{n}" for n in itertools.count()) if a not in used)
        used.add(anchor)  # "Care", "Care", "Care 1": care, care-1, care-1-1 (ids are unique)
        sections.append((f"#{anchor}", [t for _, t in stack], []))
    # a heading with no text of its own lives on in its subsections' titles
    return [DocumentSection(anchor, PATH_SEPARATOR.join([title, *path]), "\n".join(body)) for anchor, path, body in sections if body]


def decode_utf8(data: bytes, name: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise RalmError(f"{name}: not valid UTF-8 (byte {e.start})") from None


_FRONT_MATTER = re.compile(r"\A---[ \t]*\r?\n(.*?)\r?\n(?:---|\.\.\.)[ \t]*(?:\r?\n|\Z)", re.DOTALL)


def markdown_sections(data: bytes, name: str) -> list[DocumentSection]:
    """CommonMark (plus tables) rendered to plain text: markup, link targets and raw HTML
    tags dropped, list items one a line, code kept as written."""
    source = decode_utf8(data, name)
    title = ""
    if m := _FRONT_MATTER.match(source):  # YAML front matter (Jekyll, Hugo, MkDocs): its title, not text
        title = next((v.strip().strip("'\"") for k, _, v in (line.partition(":") for line in m.group(1).splitlines())
                      if k.strip() == "title"), "")
        source = source[m.end():]
    tokens = _markdown_parser().parse(source)
    parts: list[tuple[int, str]] = []
    level, prefix = 0, ""  # the level of the heading being read (0: body); a list item's marker
    cells: list[str] | None = None  # the cells of the table row being read
    for tok in tokens:
        if tok.type == "heading_open":
            level = int(tok.tag[1])
        elif tok.type == "heading_close":
            level = 0
        elif tok.type == "list_item_open":
            prefix = f"{tok.info}. " if tok.info else "- "
        elif tok.type == "tr_open":
            cells = []
        elif tok.type == "tr_close":
            parts.append((0, " | ".join(cells or [])))
            cells = None
        elif tok.type == "inline" and cells is not None:
            cells.append(_inline_text(tok.children or []))
        elif tok.type == "inline":
            parts.append((level, prefix + _inline_text(tok.children or [])))
            prefix = ""
        elif tok.type in ("fence", "code_block"):
            parts.append((0, tok.content))
        elif tok.type == "html_block":
            parts.append((0, _strip_tags(tok.content)))
    return sectioned(parts, title=title, fallback=stem_title(name))


@functools.cache
def _markdown_parser():
    """One parser for every file: building its rule chains costs more than parsing a page."""
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").enable("table")


def _inline_text(children) -> str:
    out = []
    for c in children:
        if c.type in ("text", "code_inline"):
            out.append(c.content)
        elif c.type in ("softbreak", "hardbreak"):
            out.append("\n")
        elif c.type == "image":
            out.append(_inline_text(c.children or []))
    return "".join(out)


def _strip_tags(markup: str) -> str:
    return html.unescape(re.sub(r"<[^>]*>", "", markup))


# Elements that are never a page's content, skipped inside a <main> or <article> too.
_BOILERPLATE = ["nav", "header", "footer", "aside", "form", "[role=navigation]", "[role=banner]", "[role=contentinfo]"]
_HEADING = re.compile(r"<h([1-6])>(.*?)</h\1>", re.DOTALL)


def html_sections(data: bytes, name: str) -> list[DocumentSection]:
    """The page's main content with its headings: the <main>, <article> or role=main element
    where the page marks one (its navigation, header, footer and asides dropped), else
    resiliparse's main-content heuristics (which also drop link lists)."""
    from resiliparse.extract.html2text import extract_plain_text
    from resiliparse.parse.encoding import bytes_to_str, detect_encoding
    from resiliparse.parse.html import HTMLTree

    tree = HTMLTree.parse(bytes_to_str(data, detect_encoding(data)))
    main = tree.body.query_selector("main, article, [role=main]") if tree.body else None
    if main is not None:
        markup = extract_plain_text(main.html, preserve_formatting="minimal_html", skip_elements=_BOILERPLATE)
    else:
        markup = extract_plain_text(tree, preserve_formatting="minimal_html", main_content=True)
    parts: list[tuple[int, str]] = []
    at = 0
    for m in _HEADING.finditer(markup):
        parts += [(0, _html_text(markup[at:m.start()])), (int(m.group(1)), _html_text(m.group(2)))]
        at = m.end()
    parts.append((0, _html_text(markup[at:])))
    return sectioned(parts, title=" ".join((tree.title or "").split()), fallback=stem_title(name))


def _html_text(markup: str) -> str:
    lines = (" ".join(line.split()) for line in _strip_tags(markup).splitlines())
    return "\n".join(line for line in lines if line)


def pdf_sections(data: bytes, name: str) -> list[DocumentSection]:
    """One section per page (empty for a page without a text layer: a scan, which the corpus
    reader counts and names)."""
    from pypdf import PdfReader
    from pypdf.errors import PdfReadError

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise RalmError(f"{name}: the PDF is encrypted; decrypt it first")
        texts = [page.extract_text() or "" for page in reader.pages]
        meta_title = (reader.metadata.title if reader.metadata else None) or ""
    except (PdfReadError, ValueError, KeyError, TypeError) as e:  # pypdf's errors on damaged files are not all its own
        raise RalmError(f"{name}: not a readable PDF ({type(e).__name__}: {e})") from None
    first_line = next((line.strip() for text in texts for line in text.splitlines() if line.strip()), "")
    title = " ".join(meta_title.split()) or first_line[:200] or stem_title(name)
    chapters = _outline(reader)
    sections = []
    for i, text in enumerate(texts):
        chapter = next((t for page, t in reversed(chapters) if page <= i), None)
        sections.append(DocumentSection(f"#page={i + 1}", title + (PATH_SEPARATOR + chapter if chapter else ""), text))
    return sections


def _outline(reader) -> list[tuple[int, str]]:
    """(0-based page, bookmark title) of the outline's entries, in page order; [] when the PDF
    has none or a damaged one (the pages are read all the same)."""
    entries = []

    def walk(items):
        for item in items:
            if isinstance(item, list):
                walk(item)
            else:
                page = reader.get_destination_page_number(item)
                if page is not None and page >= 0 and (item.title or "").strip():
                    entries.append((page, " ".join(item.title.split())))
    try:
        walk(reader.outline)
    except Exception:  # noqa: BLE001 - a broken outline costs the chapter names, not the document
        return []
    return sorted(entries, key=lambda e: e[0])


def stem_title(name: str) -> str:
    return Path(name).stem.replace("_", " ")


# suffix -> the reader of a file's bytes (name: the file's name or path, for titles and errors)
READERS: dict[str, Callable[[bytes, str], list[DocumentSection]]] = {
    ".md": markdown_sections, ".markdown": markdown_sections,
    ".html": html_sections, ".htm": html_sections, ".xhtml": html_sections,
    ".pdf": pdf_sections,
}
FOLDER_SUFFIXES = (".txt", *READERS)  # what a corpus folder's files are read as; anything else is skipped, named


def reader_for(name: str) -> Callable[[bytes, str], list[DocumentSection]] | None:
    return READERS.get(Path(name).suffix.lower())


# -- folders ------------------------------------------------------------------------------

@dataclass(frozen=True)
class FileFilter:
    """Which files of a folder are read: glob patterns on the path relative to the folder
    (a pattern without '/' also matches the file name alone, at any depth)."""
    include: tuple[str, ...] = ()  # none: every file of a readable format
    exclude: tuple[str, ...] = ()

    def picks(self, rel: str) -> bool:
        return (not self.include or _matches(rel, self.include)) and not _matches(rel, self.exclude)


EVERY_FILE = FileFilter()


def _matches(rel: str, patterns: Sequence[str]) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatchcase(rel, p) or ("/" not in p and fnmatch.fnmatchcase(name, p)) for p in patterns)


@dataclass
class Listing:
    """The files of a corpus folder that are read, in order, and those that are not, by why."""
    files: list[tuple[Path, str]] = field(default_factory=list)  # (file, path relative to the folder)
    unknown: list[str] = field(default_factory=list)  # of no readable format
    hidden: list[str] = field(default_factory=list)  # names starting with '.' (a folder counts once)
    special: list[str] = field(default_factory=list)  # not a regular file (a FIFO, a socket, a broken link)
    excluded: int = 0  # left out by the include/exclude patterns: the user's choice, not warned about

    def skipped(self) -> str:
        """What was left out unasked, for a warning or an empty corpus's error; "" when nothing."""
        clauses = [f"{plural(len(names), *what)} ({_first(names)})" for names, what in
                   ((self.unknown, ("file of unknown format", "files of unknown format")),
                    (self.hidden, ("hidden entry", "hidden entries")),
                    (self.special, ("entry that is not a regular file", "entries that are not regular files"))) if names]
        return "; ".join(clauses)


def _first(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (", …" if len(names) > shown else "")


def list_folder(root: Path, files: FileFilter = EVERY_FILE) -> Listing:
    """Walk `root` recursively, in name order, following links to folders once each."""
    listing = Listing()
    seen = set()
    for folder, dirs, names in os.walk(root, followlinks=True):
        here = Path(folder)
        if os.path.realpath(here) in seen:  # a link back up the tree
            dirs.clear()
            continue
        seen.add(os.path.realpath(here))
        dirs.sort()
        rel_dir = here.relative_to(root).as_posix()
        for d in [d for d in dirs if d.startswith(".")]:
            dirs.remove(d)
            listing.hidden.append(_join(rel_dir, d) + "/")
        for name in sorted(names):
            rel, path = _join(rel_dir, name), here / name
            if not files.picks(rel):
                listing.excluded += 1
            elif name.startswith("."):
                listing.hidden.append(rel)
            elif Path(name).suffix.lower() not in FOLDER_SUFFIXES:
                listing.unknown.append(rel)
            elif not path.is_file():
                listing.special.append(rel)
            else:
                listing.files.append((path, rel))
    listing.files.sort(key=lambda f: Path(f[1]).parts)  # as sorted(rglob()) did: a folder's ids and fingerprint keep their order
    return listing


def _join(rel_dir: str, name: str) -> str:
    return name if rel_dir == "." else f"{rel_dir}/{name}"
