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
A section's text says what its structure means, one line per unit, since a QA reader's answer
never crosses a line break or a "; " (data/reader_features.py):
  - a table row is `<first cell>: <header 2> <cell 2>; <header 3> <cell 3>.` (Markdown, HTML, and
    PDF tables that layout-mode text shows as aligned columns), an empty cell left out with its
    header, a cell under an empty header alone; a table without a header row joins a row's cells
    by "; ", a one-column table is a line per cell, an HTML <caption> a line before the rows;
  - a list item is a line, an ordered one keeping its number (`4. Restart`), and an HTML
    definition list a line per term (`Term: definition; another definition`);
  - a paragraph is a line, broken only where its source breaks it (a Markdown hard line break,
    an HTML <br>, or soft breaks between `key: value` lines), so `key: value` lines stay lines and
    prose wrapped at 80 columns does not; all else on a PDF page is pypdf's plain text.
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
from collections import Counter, deque
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
    anchors = _Anchors()
    for level, text in parts:
        if not level:
            sections[-1][2].append(text)
            continue
        while stack and stack[-1][0] >= level:
            stack.pop()
        stack.append((level, text))
        sections.append((f"#{anchors.new(slug(text) or 'section')}", [t for _, t in stack], []))
    # a heading with no text of its own lives on in its subsections' titles
    return [DocumentSection(anchor, PATH_SEPARATOR.join([title, *path]), "\n".join(body)) for anchor, path, body in sections if body]


class _Anchors:
    """Unique anchors: a slug as it is, else with the first free number ("Care", "Care",
    "Care 1": care, care-1, care-1-1). Each slug remembers the number it reached, so 20,000
    identical headings cost 20,000 steps, not a scan of every earlier number each."""

    def __init__(self) -> None:
        self.used: set[str] = set()
        self.tried: dict[str, int] = {}  # slug -> the number its last anchor took (0: the slug itself)

    def new(self, base: str) -> str:
        n = self.tried.get(base, 0)  # the numbers below it were taken when it was reached, and stay taken
        anchor = base if n == 0 else f"{base}-{n}"
        while anchor in self.used:
            n += 1
            anchor = f"{base}-{n}"
        self.tried[base] = n
        self.used.add(anchor)
        return anchor


# -- structure as lines: tables, definition lists ------------------------------------------

_TERMINAL = (".", "!", "?", "…")


def cell_text(text: str) -> str:
    """A cell (or a term, a definition) as one line: whitespace runs as one space, and a "; " of
    the source as ", ", since "; " is the separator between cells."""
    return re.sub(r" ?; ", ", ", " ".join(text.split()))


def table_lines(header: Sequence[str] | None, rows: Sequence[Sequence[str]], *, caption: str = "") -> list[str]:
    """A table as lines that say what each cell means: the caption, then a line per row,
    `<first cell>: <header 2> <cell 2>; <header 3> <cell 3>.` (an empty cell left out with its
    header, a cell under an empty header alone). Without a header (None or all cells empty) a
    row's cells are joined by "; "; a one-column table is a line per cell, header included; a
    header without rows is read as a row."""
    header = [cell_text(h) for h in header or ()]
    rows = [[cell_text(c) for c in row] for row in rows]
    if not any(header):
        header = []
    if not rows:
        rows, header = [header], []
    lines = [caption] if (caption := cell_text(caption)) else []
    if max(map(len, [header, *rows])) <= 1:
        return lines + [c for row in [header, *rows] for c in row if c]
    for row in rows:
        if header:
            label = row[0].rstrip(":") if row else ""
            cells = [f"{h} {c}" if h else c for h, c in itertools.zip_longest(header[1:], row[1:], fillvalue="") if c]
            text = "; ".join(cells)
            text = f"{label}: {text}" if label and text else label or text
        else:
            text = "; ".join(c for c in row if c)
        if text:
            lines.append(text if text.endswith(_TERMINAL) else text + ".")
    return lines


def definition_line(terms: Sequence[str], definitions: Sequence[str]) -> str:
    """`Term: definition; another definition` (several terms of one definition joined by ", ")."""
    term = ", ".join(t for t in map(cell_text, terms) if t).rstrip(":")
    definition = "; ".join(d for d in map(cell_text, definitions) if d)
    return f"{term}: {definition}" if term and definition else term or definition


def parser_errors(what: str) -> Callable:
    """A reader whose parser's own exceptions on a damaged or hostile file (pypdf's
    LimitReachedError on a deflate bomb, NotImplementedError on a filter it lacks, a
    RecursionError) are the input's error, naming the file: a bad upload is a 400, not a 500."""
    def wrap(read: Callable[[bytes, str], list[DocumentSection]]) -> Callable[[bytes, str], list[DocumentSection]]:
        @functools.wraps(read)
        def reader(data: bytes, name: str) -> list[DocumentSection]:
            try:
                return read(data, name)
            except (RalmError, MemoryError):
                raise
            except Exception as e:  # noqa: BLE001 - the libraries raise anything on what they cannot read
                detail = " ".join(str(e).split())[:200]
                raise RalmError(f"{name}: not {what} ({type(e).__name__}{': ' + detail if detail else ''})") from None
        return reader
    return wrap


def decode_utf8(data: bytes, name: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise RalmError(f"{name}: not valid UTF-8 (byte {e.start})") from None


_FRONT_MATTER = re.compile(r"\A---[ \t]*\r?\n(.*?)\r?\n(?:---|\.\.\.)[ \t]*(?:\r?\n|\Z)", re.DOTALL)


@parser_errors("readable Markdown")
def markdown_sections(data: bytes, name: str) -> list[DocumentSection]:
    """CommonMark (plus tables) rendered to plain text: markup, link targets and raw HTML
    tags dropped, code kept as written, list items and table rows one a line (table_lines)."""
    source = decode_utf8(data, name)
    title = ""
    if m := _FRONT_MATTER.match(source):  # YAML front matter (Jekyll, Hugo, MkDocs): its title, not text
        title = next((v.strip().strip("'\"") for k, _, v in (line.partition(":") for line in m.group(1).splitlines())
                      if k.strip() == "title"), "")
        source = source[m.end():]
    tokens = _markdown_parser().parse(source)
    parts: list[tuple[int, str]] = []
    level, prefix = 0, ""  # the level of the heading being read (0: body); an ordered list item's number

    def add(text: str) -> None:  # a block's text, the first of a list item's with its number
        nonlocal prefix
        parts.append((level, prefix + text))
        prefix = ""

    header: list[str] = []  # the header cells of the table being read
    rows: list[list[str]] = []  # its body rows
    cells: list[str] | None = None  # the cells of the row being read
    in_head = False  # whether that row is the header
    for tok in tokens:
        if tok.type == "heading_open":
            level = int(tok.tag[1])
        elif tok.type == "heading_close":
            level = 0
        elif tok.type == "list_item_open":
            prefix = f"{tok.info}. " if tok.info else ""
        elif tok.type == "list_item_close":
            prefix = ""
        elif tok.type in ("thead_open", "thead_close"):
            in_head = tok.type == "thead_open"
        elif tok.type == "tr_open":
            cells = []
        elif tok.type == "tr_close":
            if in_head:
                header = cells or []
            else:
                rows.append(cells or [])
            cells = None
        elif tok.type == "table_close":
            add("\n".join(table_lines(header, rows)))
            header, rows = [], []
        elif tok.type == "inline" and cells is not None:
            cells.append(_inline_text(tok.children or []))
        elif tok.type == "inline":
            add(_inline_text(tok.children or []))
        elif tok.type in ("fence", "code_block"):
            add(tok.content)
        elif tok.type == "html_block":
            add(_strip_tags(tok.content))
    return sectioned(parts, title=title, fallback=stem_title(name))


@functools.cache
def _markdown_parser():
    """One parser for every file: building its rule chains costs more than parsing a page."""
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").enable("table")


_SOFT = "\x00"  # a soft line break, until the paragraph says whether it is a line of its own
_KEY_VALUE = re.compile(r"[^\s:][^:\n]{0,60}:(\s|$)")


def _inline_text(children) -> str:
    """A paragraph's text. Its source's hard breaks stay line breaks; its soft breaks too when
    every line of it is a `key: value` line, and are spaces otherwise: prose wrapped at 80
    columns is one line, so an answer may run across the wrap."""
    out = []
    for c in children:
        if c.type in ("text", "code_inline"):
            out.append(c.content)
        elif c.type == "softbreak":
            out.append(_SOFT)
        elif c.type == "hardbreak":
            out.append("\n")
        elif c.type == "image":
            out.append(_inline_text(c.children or []))
    text = "".join(out)
    if _SOFT not in text:
        return text
    lines = re.split(f"[{_SOFT}\n]", text)
    return text.replace(_SOFT, "\n" if all(_KEY_VALUE.match(line) for line in lines) else " ")


def _strip_tags(markup: str) -> str:
    # past the last ">" no tag ends: searched there, each "<" would scan to the end (quadratic)
    end = markup.rfind(">") + 1
    return html.unescape(re.sub(r"<[^>]*>", "", markup[:end]) + markup[end:])


# Elements that are never a page's content, skipped inside a <main> or <article> too.
_BOILERPLATE = ["nav", "header", "footer", "aside", "form", "[role=navigation]", "[role=banner]", "[role=contentinfo]"]
_HEADING = re.compile(r"<h([1-6])>(.*?)</h\1>", re.DOTALL)


@parser_errors("readable HTML")
def html_sections(data: bytes, name: str) -> list[DocumentSection]:
    """The page's main content with its headings: the <main>, <article> or role=main element
    where the page marks one (its navigation, header, footer and asides dropped), else
    resiliparse's main-content heuristics (which also drop link lists)."""
    from resiliparse.extract.html2text import extract_plain_text
    from resiliparse.parse.encoding import bytes_to_str, detect_encoding
    from resiliparse.parse.html import HTMLTree

    from ralm.data.html_depth import bounded_markup, check_tree_depth

    # lexbor's time grows with the tree's depth: a tree no page needs is refused before it is built
    tree = HTMLTree.parse(bounded_markup(bytes_to_str(data, detect_encoding(data)), name))
    check_tree_depth(tree.document, name)
    _lines_for_structure(tree)
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


_EXIT = object()  # in a walk's stack: the element on top of `open_` is left
_LAYOUT = frozenset(("table", "h1", "h2", "h3", "h4", "h5", "h6"))  # a table holding these lays out a page


def _lines_for_structure(tree) -> None:
    """Rewrite `tree` so that resiliparse's text says what its structure means: each data table
    and definition list replaced by a paragraph per line (table_lines, definition_line), each
    ordered list item's text prefixed by its number. A table holding a heading or a table lays
    out the page and is read as it stands; what lies inside a replaced element is read as its
    text. One walk, then one read of each replaced element: linear in the page."""
    root = tree.body
    if root is None or root.query_selector("table, dl, ol") is None:
        return
    replaced, ordered = [], []
    stack, open_ = [root], []  # open_: [element, len(replaced) when entered, whether it holds layout]
    while stack:
        node = stack.pop()
        if node is not _EXIT:
            open_.append([node, len(replaced), False])
            stack.append(_EXIT)
            stack.extend(reversed(list(_elements(node))))
            continue
        element, first, holds_layout = open_.pop()
        tag = element.tag
        if tag == "ol":
            ordered.append(element)
        if tag == "dl" or (tag == "table" and not holds_layout):
            del replaced[first:]  # read inside this one
            replaced.append(element)
        if open_:
            open_[-1][2] |= holds_layout or tag in _LAYOUT
    for ol in ordered:
        _number_items(tree, ol)
    for element in replaced:
        lines = _html_table_lines(element) if element.tag == "table" else _definition_lines(element)
        paragraphs = []
        for line in lines:
            paragraphs.append(tree.create_element("p"))
            paragraphs[-1].text = line
        if paragraphs:
            element.replace_with(*paragraphs)
        else:
            element.decompose()


def _elements(node):
    """`node`'s child elements, by sibling links (resiliparse's `children` is quadratic)."""
    child = node.first_element_child
    while child is not None:
        yield child
        child = child.next_element_sibling


def _nodes(node):
    """`node`'s child nodes, text included, by sibling links."""
    child = node.first_child
    while child is not None:
        yield child
        child = child.next


def _number_items(tree, ol, look: int = 64) -> None:
    """Put each item's number (`start`, `reversed` and `value` honoured) before its first text,
    looked for among its first `look` nodes (else before the item's children)."""
    from resiliparse.parse.html import NodeType

    items = [li for li in _elements(ol) if li.tag == "li"]
    down = ol.hasattr("reversed")
    n = _html_int(ol.getattr("start"), len(items) if down else 1)
    for li in items:
        n = _html_int(li.getattr("value"), n)
        node, steps = li.first_child, 0
        while node is not None and steps < look and not (node.type == NodeType.TEXT and (node.text or "").strip()):
            node, steps = _next_in(li, node), steps + 1
        if node is not None and node.type == NodeType.TEXT and (node.text or "").strip():
            node.text = f"{n}. {node.text.lstrip()}"
        elif (li.text or "").strip():
            li.prepend(tree.create_text_node(f"{n}. "))
        n += -1 if down else 1


def _next_in(top, node):
    """The node after `node` in a walk of `top`'s descendants in document order, or None."""
    if node.first_child is not None and node.tag not in _UNREAD:
        return node.first_child
    while node is not None and node != top:
        if node.next is not None:
            return node.next
        node = node.parent
    return None


def _html_int(value: str | None, default: int) -> int:
    try:
        return int((value or "").strip())
    except ValueError:
        return default


def _html_table_lines(table) -> list[str]:
    """A table's caption and rows (table_lines): the header is its <thead> rows (their texts
    joined per column), else a first row of <th> cells only; colspan and rowspan spread a cell
    over the columns and rows it covers (a body cell's colspan counted once)."""
    caption, head, body = "", [], []
    for part in _elements(table):
        if part.tag == "caption":
            caption = _node_text(part)
        elif part.tag == "tr":
            body.append(part)
        elif part.tag in ("thead", "tbody", "tfoot"):
            (head if part.tag == "thead" else body).extend(tr for tr in _elements(part) if tr.tag == "tr")
    grid = _table_grid(head + body)
    head_rows, body_rows = grid[:len(head)], grid[len(head):]
    if not head_rows and body_rows and body_rows[0][1]:
        head_rows, body_rows = body_rows[:1], body_rows[1:]
    header = None
    if head_rows:
        columns = itertools.zip_longest(*(cells for cells, _ in head_rows), fillvalue=("", False))
        header = [" ".join(dict.fromkeys(text for text, _ in column if text)) for column in columns]
    rows = [[text if not spread else "" for text, spread in cells] for cells, _ in body_rows]
    return table_lines(header, rows, caption=caption)


def _table_grid(trs) -> list[tuple[list[tuple[str, bool]], bool]]:
    """Each row's cells as (text, whether it is a colspan's spread copy), with row- and colspans
    laid over the columns they cover, and whether the row is all <th>. Spans spend a budget of
    a few grid cells per source cell: beyond it a span counts as 1, so the grid stays linear."""
    rows = [[c for c in _elements(tr) if c.tag in ("td", "th")] for tr in trs]
    budget = 4 * sum(map(len, rows)) + 64
    below: dict[int, tuple[str, bool, int]] = {}  # column -> (text, spread, rows still covered)
    grid = []
    for cells in rows:
        out: list[tuple[str, bool]] = []

        def carry_down(upto: int | None = None) -> None:  # the rowspans from above at the next columns
            while len(out) in below and (upto is None or len(out) < upto):
                text, spread, left = below.pop(len(out))
                out.append((text, spread))
                if left > 1:
                    below[len(out) - 1] = (text, spread, left - 1)

        for cell in cells:
            carry_down()
            text = _node_text(cell)
            across = max(1, min(_html_int(cell.getattr("colspan"), 1), budget + 1))
            down = max(1, min(_html_int(cell.getattr("rowspan"), 1), budget // across + 1))
            budget -= across * down - 1
            for k in range(across):
                below.pop(len(out), None)  # a cell spanning into a rowspan's column cuts it short
                out.append((text, k > 0))
                if down > 1:
                    below[len(out) - 1] = (text, k > 0, down - 1)
        for column in sorted(c for c in below if c >= len(out)):  # rowspans right of the row's own cells
            out.extend([("", True)] * (column - len(out)))
            carry_down(column + 1)
        grid.append((out, bool(cells) and all(c.tag == "th" for c in cells)))
    return grid


def _definition_lines(dl) -> list[str]:
    """A line per term of a <dl> (its <div> groups read through): definition_line."""
    lines, terms, definitions = [], [], []
    for child in _elements(dl):
        for item in (_elements(child) if child.tag == "div" else [child]):
            if item.tag == "dt":
                if definitions:
                    lines.append(definition_line(terms, definitions))
                    terms, definitions = [], []
                terms.append(_node_text(item))
            elif item.tag == "dd":
                definitions.append(_node_text(item))
    if terms or definitions:
        lines.append(definition_line(terms, definitions))
    return [line for line in lines if line]


_INLINE = frozenset("a abbr b bdi bdo cite code data del dfn em font i ins kbd label mark q s samp small span strong "
                    "sub sup time tt u var".split())
_UNREAD = frozenset(("script", "style", "template", "noscript"))


def _node_text(node) -> str:
    """An element's text on one line: a space between blocks (`<p>`, `<br>`, `<li>`), none
    inside a word's inline markup (`ex<b>am</b>ple`)."""
    from resiliparse.parse.html import NodeType

    out, stack = [], [node]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            out.append(item)
        elif item.type == NodeType.TEXT:
            out.append(item.text or "")
        elif item.type == NodeType.ELEMENT and item.tag not in _UNREAD:
            gap = "" if item.tag in _INLINE else " "
            out.append(gap)
            stack.append(gap)
            stack.extend(reversed(list(_nodes(item))))
    return " ".join("".join(out).split())


@parser_errors("a readable PDF")
def pdf_sections(data: bytes, name: str) -> list[DocumentSection]:
    """One section per page (empty for a page without a text layer: a scan, which the corpus
    reader counts and names): pypdf's plain text, with the tables its layout-mode text shows
    read as table_lines (pdf_page_text)."""
    from pypdf import PdfReader

    reader = PdfReader(io.BytesIO(data))
    if reader.is_encrypted and not reader.decrypt(""):
        raise RalmError(f"{name}: the PDF is encrypted; decrypt it first")
    texts = [page.extract_text() or "" for page in reader.pages]
    layouts = [_layout_text(page) for page in reader.pages]
    meta_title = (reader.metadata.title if reader.metadata else None) or ""
    first_line = next((line.strip() for text in texts for line in text.splitlines() if line.strip()), "")
    title = " ".join(meta_title.split()) or first_line[:200] or stem_title(name)
    chapters, chapter = deque(_outline(reader)), None  # in page order: the page's is the last begun by it
    sections = []
    for i, (text, layout) in enumerate(zip(texts, layouts)):
        while chapters and chapters[0][0] <= i:
            chapter = chapters.popleft()[1]
        sections.append(DocumentSection(f"#page={i + 1}", title + (PATH_SEPARATOR + chapter if chapter else ""),
                                        pdf_page_text(text, layout)))
    return sections


def _layout_text(page) -> str:
    """pypdf's layout-mode text of a page (its columns kept apart by spaces), "" where that
    mode fails: the page is then read as plain text only."""
    try:
        return page.extract_text(extraction_mode="layout") or ""
    except Exception:  # noqa: BLE001 - layout mode trips on fonts plain mode reads; the tables are what is lost
        return ""


def pdf_page_text(plain: str, layout: str) -> str:
    """A page's plain text with each table of its layout text (layout_tables) in its rows'
    place: the plain lines that hold the table's characters, found by their counts. Where a
    table's lines cannot be found so, the page is its layout text, each line's spaces closed up
    and the tables rendered."""
    lines = layout.splitlines()
    tables = layout_tables(lines)
    if not tables:
        return plain
    out, plain_lines, at = [], plain.splitlines(), 0
    for start, end, rendered in tables:
        found = _lines_holding(plain_lines, Counter("".join("".join(lines[start:end]).split())), at)
        if found is None:
            break
        out += plain_lines[at:found[0]] + rendered
        at = found[1]
    else:
        return "\n".join(out + plain_lines[at:])
    out, at = [], 0
    for start, end, rendered in tables:
        out += [" ".join(line.split()) for line in lines[at:start]] + rendered
        at = end
    out += [" ".join(line.split()) for line in lines[at:]]
    return "\n".join(line for line in out if line)


def _lines_holding(lines: list[str], chars: Counter, start: int) -> tuple[int, int] | None:
    """The first run of whole `lines` from `start` on whose non-space characters are `chars`:
    a sliding window, each line entering and leaving it once."""
    window: Counter = Counter()
    held: deque[Counter] = deque()  # the counts of the window's lines
    size, need, over, first = 0, chars.total(), 0, start  # over: characters the window has too many of
    for i in range(start, len(lines)):
        line = Counter("".join(lines[i].split()))
        if any(chars[c] < k for c, k in line.items()):  # no window holding this line fits
            window, held, size, over, first = Counter(), deque(), 0, 0, i + 1
            continue
        held.append(line)
        size += line.total()
        for c, k in line.items():
            over += window[c] <= chars[c] < window[c] + k
            window[c] += k
        while over:
            gone = held.popleft()
            size -= gone.total()
            first += 1
            for c, k in gone.items():
                over -= window[c] - k <= chars[c] < window[c]
                window[c] -= k
        if size == need:
            return first, i + 1
    return None


_CELL = re.compile(r"\S+(?: \S+)*")  # words a single space apart: a cell of a layout-mode line
_MARKER = re.compile(r"(?:\d{1,3}|[a-zA-Z])[.)]|[-–•·*]")  # a list's number or bullet, not a row label


def layout_tables(lines: Sequence[str]) -> list[tuple[int, int, list[str]]]:
    """(first line, end line, table_lines) of each table in a page's layout-mode lines. A
    candidate is a run of lines that split into >= 2 cells at gaps of >= 2 spaces, or are one
    indented cell (a wrapped cell's line), with no two blank lines in a row, cut to its first
    and last groups of adjacent lines that hold a line of >= 2 cells; it is a table where its
    cells stand in aligned columns and read as one (_region_table). One pass: each line is in at
    most one candidate."""
    cells = [[(m.start(), m.end(), m.group()) for m in _CELL.finditer(line)] for line in lines]

    def in_table(c: list) -> bool:
        return len(c) >= 2 or (len(c) == 1 and c[0][0] > 0)

    tables, i = [], 0
    while i < len(lines):
        if not in_table(cells[i]):
            i += 1
            continue
        end = i + 1
        while end < len(lines) and (in_table(cells[end]) or (not cells[end] and end + 1 < len(lines)
                                                            and in_table(cells[end + 1]))):
            end += 1
        groups = [list(g) for blank, g in itertools.groupby(range(i, end), key=lambda k: not cells[k]) if not blank]
        held = [g for g in groups if any(len(cells[k]) >= 2 for k in g)]
        if held:
            start, stop = held[0][0], held[-1][-1] + 1
            if (rendered := _region_table(cells[start:stop])) is not None:
                tables.append((start, stop, rendered))
        i = end
    return tables


def _region_table(region: list[list[tuple[int, int, str]]]) -> list[str] | None:
    """A run of layout lines as a table's lines, or None where it is not one. Its columns are
    the spans its cells cover together (cells of one column overlap); a row is a group of
    adjacent lines, split again at each further line with a first-column cell (the lines
    without one hold wrapped cells); the first row is the header. Not a table: fewer than 2
    columns or rows; prose side by side (over 6 words a cell on average); `key: value` lines or
    a list (every first cell a key or a list marker)."""
    width = max((e for line in region for _, e, _ in line), default=0)
    cover = [0] * (width + 1)
    for line in region:
        for s, e, _ in line:
            cover[s] += 1
            cover[e] -= 1
    column_at, spans, depth = [0] * (width + 1), 0, 0
    for x in range(width + 1):
        opened = depth == 0 and cover[x] > 0
        depth += cover[x]
        spans += opened
        column_at[x] = spans - 1
    if spans < 2:
        return None
    rows: list[list[list[str]]] = []
    row, labelled = None, False  # the row being read (None after a blank line); whether it has its first cell
    words = count = 0
    for line in region:
        if not line:
            row = None
            continue
        first = column_at[line[0][0]] == 0
        if row is None or (first and labelled):
            row, labelled = [[] for _ in range(spans)], False
            rows.append(row)
        labelled |= first
        for s, _, text in line:
            row[column_at[s]].append(text)
            words, count = words + len(text.split()), count + 1
    table = [[" ".join(parts) for parts in row] for row in rows]
    filled = [sum(map(bool, row)) for row in table]
    if len(table) < 2 or filled[0] < 2 or max(filled[1:]) < 2 or words > 6 * count:
        return None
    labels = [row[0] for row in table]
    if all(label.endswith(":") or _MARKER.fullmatch(label) for label in labels):
        return None
    return table_lines(table[0], table[1:])


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
