"""Documents built to hurt the readers (data/formats.py, data/html_depth.py): every parser's time
grows about linearly in its input (n and 4n of deep nesting, identical headings, tables, long
lines), a tree deeper than a browser's is refused in one line, and whatever a parser library
raises on a damaged or hostile file (a deflate bomb, a stream of 99999999999 bytes, a filter
name with a flipped bit) is a RalmError naming the file: exit 2 in the CLI, 400 over HTTP."""

from __future__ import annotations

import errno
import random
import time
import zlib

import pytest
from fastapi.testclient import TestClient

from ralm.data.corpus import file_documents, read_corpus
from ralm.data.formats import html_sections, markdown_sections, pdf_sections
from ralm.data.html_depth import bounded_markup, nesting_depth
from ralm.errors import RalmError


def _seconds(read, data: bytes, name: str) -> float:
    """The best of three runs (the machine may be busy), the reader's error included."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        try:
            read(data, name)
        except RalmError:
            pass
        best = min(best, time.perf_counter() - start)
    return best


def assert_linear(read, make, n: int, name: str) -> None:
    """time(4n) < 10 time(n) + slack: a quadratic step would take 16 times as long (linear: 4;
    the margin is for a busy machine)."""
    small, large = _seconds(read, make(n), name), _seconds(read, make(4 * n), name)
    assert large < 10 * small + 0.3, f"{name}: {small:.3f}s at n={n}, {large:.3f}s at 4n"


MARKDOWN = {
    "identical headings": lambda n: "# Care\n\ntext\n\n" * n,
    "nested quotes": lambda n: "> " * n + "x\n",
    "nested lists": lambda n: "- " * n + "x\n",
    "nested images": lambda n: "![" * n + "x" + "](u)" * n,
    "table rows": lambda n: "| a | b |\n|---|---|\n" + "| 1 | 2 |\n" * n,
    "many tables": lambda n: "| a | b |\n|---|---|\n| 1 | 2 |\n\n" * (n // 4),
    "a long line": lambda n: "word " * (50 * n),
    "unclosed tags": lambda n: "<div " + "<" * (20 * n) + "\n",
    "key: value lines": lambda n: "k: v\n" * n,
}


@pytest.mark.parametrize("kind", MARKDOWN)
def test_markdown_reading_time_grows_linearly(kind):
    assert_linear(markdown_sections, lambda n: MARKDOWN[kind](n).encode(), 500, f"{kind}.md")


HTML = {
    "identical headings": lambda n: "<main>" + "<h2>Care</h2><p>t</p>" * n + "</main>",
    "identical headings, no main": lambda n: "<body>" + "<h2>Care</h2><p>text here</p>" * n,
    "nested divs": lambda n: "<div>" * (20 * n) + "x",
    "nested lists": lambda n: "<ol><li>" * n + "x",
    "nested tables": lambda n: "<table><tr><td>" * n + "x",
    "misnested spans": lambda n: "<span><div></span>" * n,
    "reopened formatting": lambda n: "".join(f"<p><b id={k}></p>" for k in range(n)),  # lexbor: as deep as long
    "misnested links": lambda n: "<a><div>x</a>" * n,
    "fostered links": lambda n: "<section><a></table><span/><table><math></math><p><li/>" * n,
    "table rows": lambda n: "<table><tr><th>a</th><th>b</th></tr>" + "<tr><td>1</td><td>2</td></tr>" * n + "</table>",
    "unclosed cells": lambda n: "<table><tr><th>a<th>b" + "<tr><td>1<td>2" * n + "</table>",
    "definition lists": lambda n: "<dl>" + "<dt>a</dt><dd>b</dd>" * n + "</dl>",
    "unclosed items and paragraphs": lambda n: "<ul>" + "<li><p>item" * n,
    "a long line": lambda n: "<p>" + "word " * (50 * n),
    "comments": lambda n: "<!--" + "<div>" * n,
}


@pytest.mark.parametrize("kind", HTML)
def test_html_reading_time_grows_linearly(kind):
    assert_linear(html_sections, lambda n: HTML[kind](n).encode(), 500, f"{kind}.html")


def test_a_text_files_reading_time_grows_linearly():
    assert_linear(file_documents, lambda n: ("word " * 20 + "\n").encode() * (40 * n), 500, "notes.txt")


def test_identical_headings_get_unique_ids_in_order():
    n = 20_000
    sections = markdown_sections(("# Care\n\ntext\n\n" * n + "# Care 1\n\nlast\n").encode(), "a.md")
    assert [s.anchor for s in sections] == ["#care"] + [f"#care-{k}" for k in range(1, n)] + ["#care-1-1"]
    html = html_sections(("<main>" + "<h2>Care</h2><p>t</p>" * 3 + "<h2>Care-1</h2><p>t</p></main>").encode(), "a.html")
    assert [s.anchor for s in html] == ["#care", "#care-1", "#care-2", "#care-1-1"]


@pytest.mark.parametrize("page", [
    "<div>" * 100_000 + "x",  # the 1.1 MB page, killed at 300 s
    "<main>" + "<div>" * 600 + "x",
    "<a><div>x</a>" * 1_000,
    "<section><a></table><span/><table><math></math><p><li/>" * 1_000,  # deep by foster parenting, not the stack
])
def test_a_tree_deeper_than_a_browsers_is_refused_in_one_line(page):
    start = time.perf_counter()
    with pytest.raises(RalmError, match=r"^deep\.html: the HTML nests elements deeper than 512 levels") as caught:
        html_sections(page.encode(), "deep.html")
    assert "\n" not in str(caught.value) and time.perf_counter() - start < 5


def test_pages_that_leave_elements_open_as_people_write_them_are_read():
    sloppy = ("<html><body><main><h1>Parts</h1>" + "<p>A paragraph <b>left bold<p>and the next" * 600
              + "<ul>" + "<li>an item<li><a href=x>a link</a>" * 600 + "</ul><dl>" + "<dt>term<dd>definition" * 600
              + "</dl><table>" + "<tr><td>cell<td>cell" * 600 + "</table>" + "<div>" * 200 + "deep" + "</div>" * 200
              + "<svg>" + "<path d='M0 0'/>" * 600 + "</svg></main>")
    assert nesting_depth(bounded_markup(sloppy, "sloppy.html")) < 210  # the 200 <div>s; nothing left open piles up
    text = html_sections(sloppy.encode(), "sloppy.html")[0].text
    assert text.count("and the next") == 600 and text.count("term: definition") == 600 and "deep" in text


def test_the_depth_found_before_parsing_is_no_less_than_the_parsers():
    """Random tag soup, each piece repeated: lexbor's tree is never much deeper than
    nesting_depth says (it cannot be fooled into a deep tree it does not see)."""
    from resiliparse.parse.html import HTMLTree

    def depth(node, level=0):
        deepest, child = level, node.first_element_child
        while child is not None:
            deepest, child = max(deepest, depth(child, level + 1)), child.next_element_sibling
        return deepest

    tags = "div p span a li ul ol dl dt dd tr td th tbody caption form select option svg math path foreignObject " \
           "title script style h1 h2 br img pre section button object template".split()
    rng = random.Random(69)
    for _ in range(150):
        piece = "".join(rng.choice([f"<{rng.choice(tags)}{rng.choice(['', ' id=1', ' id=2/'])}{rng.choice(['', '/'])}>",
                                    f"</{rng.choice(tags)}>", "x", "<!-->"]) for _ in range(rng.randint(1, 10)))
        page = piece * 20
        parsed = HTMLTree.parse(page)
        assert depth(parsed.body) <= 2 * nesting_depth(page) + 10, piece


# -- hostile PDFs: bytes written here -------------------------------------------------------

def pdf_bytes(content: bytes, stream: bytes = b"") -> bytes:
    """A one-page PDF whose page's content stream is `content`, its dictionary `stream` (its
    length by default), with a correct cross-reference table."""
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 5 0 R >> >> /Contents 4 0 R >>",
               b"<< " + (stream or b"/Length %d" % len(content)) + b" >>\nstream\n" + content + b"\nendstream",
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1) + b"".join(b"%010d 00000 n \n" % o for o in offsets)
    return bytes(out + b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref))


TEXT = b"BT /F1 12 Tf 72 720 Td (Sprockets are blue) Tj ET"
BOMB = zlib.compress(b"0" * 100_000_000, 9)  # 100 MB of zeros in 97 kB
HOSTILE_PDFS = {
    "bomb": (pdf_bytes(BOMB, b"/Length %d /Filter /FlateDecode" % len(BOMB)), "LimitReachedError"),
    "length": (pdf_bytes(TEXT, b"/Length 99999999999"), "LimitReachedError"),
    "filter": (pdf_bytes(zlib.compress(TEXT), b"/Length %d /Filter /FlateDecodf" % len(zlib.compress(TEXT))), "NotImplementedError"),
    "nested": (pdf_bytes(TEXT).replace(b"/MediaBox [0 0 612 792]", b"/MediaBox " + b"[" * 5000 + b"]" * 5000), ""),
    "cut": (pdf_bytes(TEXT)[:300], ""),
}


def test_the_pdf_writer_here_makes_a_readable_pdf():
    assert [s.text for s in pdf_sections(pdf_bytes(TEXT), "ok.pdf")] == ["Sprockets are blue"]


@pytest.mark.parametrize("kind", HOSTILE_PDFS)
def test_a_hostile_pdf_is_one_error_naming_the_file(kind, tmp_path):
    data, raised = HOSTILE_PDFS[kind]
    with pytest.raises(RalmError, match=rf"^{kind}\.pdf: not a readable PDF \({raised}") as caught:
        pdf_sections(data, f"{kind}.pdf")
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 320
    (tmp_path / f"{kind}.pdf").write_bytes(data)  # in a corpus too, named by its path
    with pytest.raises(RalmError, match=rf"{kind}\.pdf: not a readable PDF"):
        list(read_corpus(tmp_path))


def test_a_pdf_reading_time_grows_linearly():
    def lines(n: int) -> bytes:
        return b"BT /F1 10 Tf 72 760 Td 12 TL " + b"(cell one    cell two    cell three) ' " * n + b"ET"
    assert_linear(pdf_sections, lambda n: pdf_bytes(lines(n)), 150, "long.pdf")


def test_a_parsers_unexpected_exception_is_the_files_error(monkeypatch):
    import markdown_it

    def broken(self, src, env=None):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(markdown_it.MarkdownIt, "parse", broken)
    with pytest.raises(RalmError, match=r"^a\.md: not readable Markdown \(RecursionError: maximum recursion depth"):
        markdown_sections(b"# A\n", "a.md")


def test_a_file_that_cannot_be_read_is_named(tmp_path):
    (tmp_path / "locked.md").mkdir()  # a folder by a file's name: read_bytes raises IsADirectoryError
    (tmp_path / "corpus.jsonl").mkdir()
    from ralm.data.corpus import _read_file, iter_jsonl

    with pytest.raises(RalmError, match=r"locked\.md: cannot read it \(Is a directory\)"):
        list(_read_file(tmp_path / "locked.md", "locked.md"))
    with pytest.raises(RalmError, match=r"corpus\.jsonl: cannot read it \(Is a directory\)"):
        list(iter_jsonl(tmp_path / "corpus.jsonl"))


# -- over HTTP ---------------------------------------------------------------------------

@pytest.fixture
def client(bm25_index):
    from ralm.serve.app import create_app
    from ralm.serve.service import ServeConfig, Service

    service = Service(ServeConfig(index=str(bm25_index), max_body_bytes=4 << 20))
    with TestClient(create_app(service, start_watcher=False), base_url="http://127.0.0.1") as c:
        yield c, service


@pytest.mark.parametrize("name, body, message", [
    *((f"{kind}.pdf", data, f"{kind}.pdf: not a readable PDF") for kind, (data, _) in HOSTILE_PDFS.items()),
    ("deep.html", b"<div>" * 100_000 + b"x", "deep.html: the HTML nests elements deeper than 512 levels"),
    ("bad.md", b"\xff\xfe# A", "bad.md: not valid UTF-8"),
])
def test_a_hostile_upload_is_a_400_naming_the_file(client, name, body, message):
    c, _ = client
    answer = c.post("/documents/file", params={"name": name}, content=body)
    assert answer.status_code == 400 and answer.json()["error"].startswith(message), answer.json()


def test_a_full_disk_on_upload_is_a_507(client, monkeypatch):
    c, service = client

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(service, "add_file", full)
    answer = c.post("/documents/file", params={"name": "a.md"}, content=b"# A\n\nSome text.\n")
    assert answer.status_code == 507 and "disk is full (No space left on device)" in answer.json()["error"]
    monkeypatch.setattr(service, "add_file", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    assert c.post("/documents/file", params={"name": "a.md"}, content=b"# A\n\ntext\n").status_code == 500
