"""Documents as people keep them (data/formats.py through data/corpus.py): Markdown, HTML and PDF
files become one document per section or page, with the title and heading path a reader needs;
a folder's files are picked by patterns, and every file not read is counted and named."""

from __future__ import annotations

import json
import shutil

import pytest

from ralm.data.corpus import check_corpus, file_documents, read_corpus
from ralm.data.formats import FileFilter, html_sections, markdown_sections, pdf_sections, slug
from ralm.errors import RalmError, RalmWarning

GUIDE = """---
title: "Widget Guide"
layout: page
---
# Widgets

Widgets are small brass things made in Leeds since 1901, by [the Widget Co.](https://example.com).

## Care

### Oiling

Oil each widget monthly with **olive** oil.

- a soft cloth
- a dry shelf

| part | grease |
|------|--------|
| hinge | lithium |

```
widget --oil
```

## Care

A second section of the same name gets its own anchor.
"""

GADGETS = """<!doctype html><html><head><title>Gadget handbook</title></head><body>
<nav><a href="/">Home</a> | <a href="/shop">Shop</a></nav>
<main><h1>Gadgets</h1><p>Gadgets hum at exactly 50 Hz when they are &amp; stay switched on.</p>
<nav>Previous | Next</nav>
<h2 id="repair">Repairing a gadget</h2><p>Only Bob Marsh of Truro repairs gadgets.</p>
<ul><li>Unplug it first.</li><li>Keep the screws.</li></ul>
<aside>Related: sprockets</aside></main>
<footer>Copyright 2026 Gadget Ltd. All rights reserved.</footer><script>var tracking = 1;</script></body></html>"""


def write_pdf(path, pages: list[tuple[str, str]], title: str | None = "Sprocket Manual") -> None:
    """A PDF of `pages` (outline entry, text) written with fpdf2, the tests' PDF writer."""
    from fpdf import FPDF

    pdf = FPDF()
    if title:
        pdf.set_title(title)
    pdf.set_font("helvetica", size=12)
    for chapter, text in pages:
        pdf.add_page()
        if chapter:
            pdf.start_section(chapter)
        if text:
            pdf.multi_cell(0, 8, text)
    pdf.output(str(path))


def make_folder(root):
    """Markdown, HTML, PDF, a .txt, an unknown format and a hidden folder."""
    (root / "web").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: main\n")
    (root / "guide.md").write_text(GUIDE)
    (root / "web" / "gadgets.html").write_text(GADGETS)
    write_pdf(root / "manual.pdf", [("Introduction", "Sprockets were invented by Ada Brown in 1887. They turn chains."),
                                    ("Maintenance", "Grease every sprocket after 300 hours of turning."),
                                    ("", "")])  # a page without text: a scan, to the reader
    (root / "notes.txt").write_text("Cogs are counted in dozens at the Widget Co.")
    (root / "minutes.xyz").write_text("not a format ralm reads")
    return root


def test_a_folder_of_markdown_html_and_pdf_keeps_titles_sections_and_pages(tmp_path):
    folder = make_folder(tmp_path / "docs")
    with pytest.warns(RalmWarning) as caught:
        docs = {d.id: d for d in read_corpus(folder)}
    assert list(docs) == ["guide.md", "guide.md#oiling", "guide.md#care-1", "manual.pdf#page=1", "manual.pdf#page=2",
                          "notes.txt", "web/gadgets.html", "web/gadgets.html#repairing-a-gadget"]
    # Markdown: the front matter's title, the heading path, the text without markup or link targets
    assert docs["guide.md"].title == "Widget Guide"
    assert docs["guide.md"].text == "Widgets are small brass things made in Leeds since 1901, by the Widget Co.."
    assert docs["guide.md#oiling"].title == "Widget Guide › Care › Oiling"
    assert docs["guide.md#oiling"].text == ("Oil each widget monthly with olive oil.\na soft cloth\na dry shelf\n"
                                            "hinge: grease lithium.\nwidget --oil")
    assert docs["guide.md#care-1"].title == "Widget Guide › Care"
    # HTML: <title>, the main element's text and headings; navigation, asides, footer, scripts dropped
    assert docs["web/gadgets.html"].title == "Gadget handbook"
    assert docs["web/gadgets.html"].text == "Gadgets hum at exactly 50 Hz when they are & stay switched on."
    repair = docs["web/gadgets.html#repairing-a-gadget"]
    assert repair.title == "Gadget handbook › Repairing a gadget"
    assert repair.text == "Only Bob Marsh of Truro repairs gadgets.\nUnplug it first.\nKeep the screws."
    everything = " ".join(d.text + d.title for d in docs.values())
    for boilerplate in ("Home", "Previous", "Related", "Copyright", "tracking"):
        assert boilerplate not in everything
    # PDF: one document per page, titled by the metadata title and the outline entry
    assert docs["manual.pdf#page=2"].title == "Sprocket Manual › Maintenance"
    assert "Grease every sprocket after 300 hours" in docs["manual.pdf#page=2"].text
    assert docs["notes.txt"].title == "notes"
    messages = [str(w.message) for w in caught]
    assert f"{folder}: skipped 1 file of unknown format (minutes.xyz); 1 hidden entry (.git/)" in messages
    assert f"{folder}: skipped 1 document with empty text (the first at {folder / 'manual.pdf'}#page=3)" in messages


def test_patterns_pick_a_folders_files_and_an_empty_result_says_why(tmp_path):
    folder = make_folder(tmp_path / "docs")
    shutil.rmtree(folder / ".git")
    picked = FileFilter(include=("*.md", "web/*"), exclude=("gadgets.html",))
    assert [d.id for d in read_corpus(folder, files=picked)] == ["guide.md", "guide.md#oiling", "guide.md#care-1"]
    with pytest.raises(RalmError, match=r"the corpus is empty \(no documents; 5 files left out by the include/exclude patterns; "
                                        r"the folder holds no file to read \(\.txt, \.md"):
        check_corpus(folder, files=FileFilter(include=("*.rst",)))
    for f in folder.rglob("*.*"):
        if f.suffix != ".xyz":
            f.unlink()
    with pytest.raises(RalmError, match=r"empty \(no documents; skipped 1 file of unknown format \(minutes.xyz\)"):
        check_corpus(folder)
    with pytest.raises(RalmError, match="unknown corpus format"):
        check_corpus(folder / "minutes.xyz")


def test_markdown_sections_follow_the_headings():
    sections = markdown_sections(b"Lead text.\n\n# A\n\nunder A\n\n## B\n\n### C\n\nunder C\n\n# A\n\nagain", "notes/my_file.md")
    # two top-level headings: neither names the document, whose title is then its file name
    assert [(s.anchor, s.title, s.text) for s in sections] == [
        ("", "my file", "Lead text."), ("#a", "my file › A", "under A"), ("#c", "my file › A › B › C", "under C"),
        ("#a-1", "my file › A", "again")]
    assert [s.title for s in markdown_sections(b"# Only\n\ntext", "x.md")] == ["Only"]
    twins = markdown_sections(b"## Care\n\na\n\n## Care\n\nb\n\n## Care 1\n\nc", "x.md")
    assert [s.anchor for s in twins] == ["#care", "#care-1", "#care-1-1"]  # ids stay unique
    assert slug("What's new in 2.0?") == "whats-new-in-20" and slug("Ünïcode Title") == "ünïcode-title"


EDITIONS = """# Broker

| Edition | Client connections | Topics |
|---------|-------------------:|--------|
| Team | 20,000 | 500 |
| Free | | 10 |
| Lab | 5 | a; b |
"""


def test_a_markdown_table_row_reads_with_its_column_headers():
    [section] = markdown_sections(EDITIONS.encode(), "broker.md")
    # a cell tied to its row and column; an empty cell left out with its header; the header row is no line;
    # a "; " of the source is not a cell separator
    assert section.text.splitlines() == ["Team: Client connections 20,000; Topics 500.", "Free: Topics 10.",
                                         "Lab: Client connections 5; Topics a, b."]
    [blank_header] = markdown_sections(b"| Edition | |\n|--|--|\n| Team | 20,000! |\n", "b.md")
    assert blank_header.text == "Team: 20,000!"  # a cell under an empty header alone; its own punctuation ends it


def test_an_html_table_row_reads_with_its_column_headers():
    rows = "<tr><td>Team</td><td>20,000</td><td>500</td></tr><tr><td>Free</td><td></td><td>10</td></tr>"
    header = "<tr><th>Edition</th><th>Client connections</th><th>Topics</th></tr>"
    for table in (f"<table>{header}{rows}</table>",
                  f"<table><caption>Editions\n compared</caption><thead>{header}</thead><tbody>{rows}</tbody></table>"):
        page = f"<html><body><main><h1>Broker</h1><p>Limits per node.</p>{table}</main></body></html>"
        [section] = html_sections(page.encode(), "broker.html")
        lines = section.text.splitlines()
        assert lines[-2:] == ["Team: Client connections 20,000; Topics 500.", "Free: Topics 10."]
        assert lines[:-2] == ["Limits per node."] + (["Editions compared"] if "caption" in table else [])
    # spans laid over the columns and rows they cover; two header rows read together
    spans = ("<table><thead><tr><th rowspan=2>Edition</th><th colspan=2>Limits</th></tr><tr><th>Clients</th><th>Topics</th>"
             "</tr></thead><tr><td rowspan=2>Team</td><td>20,000</td><td>500</td></tr><tr><td colspan=2>none</td></tr></table>")
    [section] = html_sections(f"<html><body><main>{spans}</main></body></html>".encode(), "s.html")
    assert section.text.splitlines() == ["Team: Limits Clients 20,000; Limits Topics 500.", "Team: Limits Clients none."]


def test_an_html_table_without_headers_joins_its_cells():
    page = ("<html><body><main><p>Ports.</p><table><tr><td>broker</td><td>7431</td><td>TCP</td></tr>"
            "<tr><td>admin; web</td><td><p>8080</p><p>HTTP</p></td><td></td></tr></table>"
            "<table><tr><td>Linux</td></tr><tr><td>macOS</td></tr></table></main></body></html>")
    [section] = html_sections(page.encode(), "ports.html")
    assert section.text.splitlines() == ["Ports.", "broker; 7431; TCP.", "admin, web; 8080 HTTP.", "Linux", "macOS"]


def write_table_pdf(path, rows, *, before="Editions differ in their limits per node.", after="Ports are listed on page 2."):
    """A page of prose, a table (fpdf2's pdf.table()) and more prose."""
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("helvetica", size=12)
    pdf.add_page()
    pdf.multi_cell(0, 8, before)
    with pdf.table(col_widths=(30, 40, 60)) as table:
        for cells in rows:
            row = table.row()
            for cell in cells:
                row.cell(cell)
    pdf.multi_cell(0, 8, after)
    pdf.output(str(path))


def test_a_pdf_table_reads_as_row_lines_and_the_rest_as_plain_text(tmp_path):
    write_table_pdf(tmp_path / "t.pdf", [("Edition", "Client connections", "Topics"), ("Team", "20,000", "500"),
                                         ("Free", "", "10")])
    [page] = pdf_sections((tmp_path / "t.pdf").read_bytes(), "t.pdf")
    assert page.text.splitlines() == ["Editions differ in their limits per node.", "Team: Client connections 20,000; Topics 500.",
                                      "Free: Topics 10.", "Ports are listed on page 2."]
    assert (page.anchor, page.title) == ("#page=1", "Editions differ in their limits per node.")
    # a cell wrapped over lines is read whole, in its row
    write_table_pdf(tmp_path / "w.pdf", [("Edition", "Maximum client connections", "Notes"),
                                         ("Team", "20,000", "For small teams that share one broker among a few services"),
                                         ("Enterprise", "100,000", "Clustered")])
    [page] = pdf_sections((tmp_path / "w.pdf").read_bytes(), "w.pdf")
    assert page.text.splitlines()[1:3] == [
        "Team: Maximum client connections 20,000; Notes For small teams that share one broker among a few services.",
        "Enterprise: Maximum client connections 100,000; Notes Clustered."]


def test_pdf_columns_that_are_not_a_table_stay_plain_text(tmp_path):
    from fpdf import FPDF
    from pypdf import PdfReader

    pdf = FPDF()
    pdf.set_font("helvetica", size=10)
    for block in ((("Port:", "7431"), ("Host:", "broker.local")), (("1.", "Unplug it"), ("2.", "Open the lid"))):
        pdf.add_page()  # key: value lines, then a numbered list, with their second cells at one x
        for left, right in block:
            pdf.set_x(10)
            pdf.cell(40, 6, left)
            pdf.set_x(60)
            pdf.cell(40, 6, right)
            pdf.ln(6)
    pdf.add_page()  # prose in two columns
    prose = "Retrieval augmented models read a corpus and answer questions with spans of the evidence they find. " * 4
    for x in (10, 110):
        pdf.set_xy(x, 20)
        pdf.multi_cell(90, 5, prose)
    pdf.output(str(tmp_path / "c.pdf"))

    plain = [p.extract_text() for p in PdfReader(tmp_path / "c.pdf").pages]
    assert [p.text for p in pdf_sections((tmp_path / "c.pdf").read_bytes(), "c.pdf")] == plain


def test_list_items_are_lines_and_ordered_ones_keep_their_numbers():
    markdown = b"Steps:\n\n4. Unplug it.\n5. Open the lid\n   - with a coin\n   - gently\n\n- a cloth\n* oil\n"
    [section] = markdown_sections(markdown, "steps.md")
    assert section.text.splitlines() == ["Steps:", "4. Unplug it.", "5. Open the lid", "with a coin", "gently", "a cloth", "oil"]
    page = ("<html><body><main><p>Steps:</p><ol start='4'><li><p>Unplug <b>it</b>.</p></li><li>Open the lid"
            "<ul><li>with a coin</li></ul></li><li value='9'>Close it</li></ol><ul><li>a cloth</li></ul></main></body></html>")
    [section] = html_sections(page.encode(), "steps.html")
    assert section.text.splitlines() == ["Steps:", "4. Unplug it.", "5. Open the lid", "with a coin", "9. Close it", "a cloth"]


def test_a_definition_list_is_a_line_per_term():
    page = ("<html><body><main><p>Settings.</p><dl><dt>Port</dt><dd>7431</dd><dd>TCP; or TLS</dd>"
            "<div><dt>Host</dt><dd>broker.local</dd></div><dt>Timeout</dt></dl></main></body></html>")
    [section] = html_sections(page.encode(), "settings.html")
    assert section.text.splitlines() == ["Settings.", "Port: 7431; TCP, or TLS", "Host: broker.local", "Timeout"]


def test_a_paragraph_stays_one_line_and_key_value_lines_stay_lines():
    prose = "Widgets are brass; they hum at 50 Hz: quietly, in Leeds."
    [section] = markdown_sections(f"{prose}\n\nPort: 7431\nHost: broker.local\n".encode(), "w.md")
    assert section.text.splitlines() == [prose, "Port: 7431", "Host: broker.local"]
    page = f"<html><body><main><p>{prose}</p><p>Port: 7431<br>Host: broker.local</p></main></body></html>"
    [section] = html_sections(page.encode(), "w.html")
    assert section.text.splitlines() == [prose, "Port: 7431", "Host: broker.local"]


def test_prose_wrapped_in_its_source_is_one_line_and_key_value_lines_are_not():
    """A Markdown paragraph wrapped at 80 columns is one line (an answer may run across the wrap:
    "Vincent van / Gogh"); one whose every line is `key: value` keeps its lines."""
    [section] = markdown_sections(b"The office was opened by Vincent van\nGogh in 1998 and has 46\ndesks.\n\n"
                                  b"Lead: Maria Santos\nDesks: 46\n", "w.md")
    assert section.text.splitlines() == ["The office was opened by Vincent van Gogh in 1998 and has 46 desks.",
                                         "Lead: Maria Santos", "Desks: 46"]


def test_damaged_and_foreign_files_are_named(tmp_path):
    (tmp_path / "bad.pdf").write_bytes(b"%PDF-1.4 this is not a PDF")
    with pytest.raises(RalmError, match=r"bad.pdf: not a readable PDF"):
        list(read_corpus(tmp_path / "bad.pdf"))
    (tmp_path / "latin1.md").write_bytes("# Caf\xe9\n".encode("latin-1"))
    with pytest.raises(RalmError, match=r"latin1.md: not valid UTF-8"):
        list(read_corpus(tmp_path / "latin1.md"))


def test_file_documents_reads_an_uploaded_file_as_a_folder_would(tmp_path):
    write_pdf(tmp_path / "m.pdf", [("Intro", "Sprockets turn chains."), ("", "")], title=None)
    docs = file_documents((tmp_path / "m.pdf").read_bytes(), "manuals/m.pdf")
    # no metadata title: the first line names it; the empty page is left out
    assert [(d.id, d.title) for d in docs] == [("manuals/m.pdf#page=1", "Sprockets turn chains. › Intro")]
    assert [d.id for d in file_documents(GUIDE.encode(), "guide.md")][:2] == ["guide.md", "guide.md#oiling"]
    for data, name, message in ((b"x", "a.docx", "unknown format"), (b"x", "a\nb.md", "control character"),
                                (b"   ", "blank.txt", "no text to index")):
        with pytest.raises(RalmError, match=message):
            file_documents(data, name)


def test_index_and_ask_a_folder_of_each_format_citing_the_pdf_page(ralm, tiny_bert, tmp_path):
    folder = make_folder(tmp_path / "docs")
    index = tmp_path / "idx"
    code, out, err = ralm("index", "build", folder, "--out", index, "--model", tiny_bert, "--dim", "16", "--exclude", "notes.txt")
    assert code == 0, err
    assert f"warning: {folder}: skipped 1 file of unknown format (minutes.xyz); 1 hidden entry (.git/)" in err
    assert "built" in out and "7 blocks" in out
    reader = tmp_path / "reader"
    from ralm.models.reader import Reader

    Reader.from_encoder(tiny_bert).save_pretrained(reader)  # random weights: the evidence is what is checked
    for question, block, title in (
            ("When should a sprocket be greased after hours of turning?", "manual.pdf#page=2:0", "Sprocket Manual › Maintenance"),
            ("Where are brass widgets made since 1901?", "guide.md:0", "Widget Guide"),
            ("Who repairs gadgets in Truro?", "web/gadgets.html#repairing-a-gadget:0", "Gadget handbook › Repairing a gadget")):
        code, out, err = ralm("ask", question, "--index", index, "--model", reader, "--retriever", "bm25", "-k", "1", "--json")
        assert code == 0, err
        answer = json.loads(out)
        assert answer["question"] == question and answer["answer"]
        assert (answer["evidence"][0]["id"], answer["evidence"][0]["title"]) == (block, title)
    # index add reads the same formats; a folder of only unknown files is an error naming them
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "cogs.md").write_text("# Cogs\n\nCogs have teeth.\n\n## Sizes\n\nSmall and large.\n")
    code, out, err = ralm("index", "add", index, extra)
    assert code == 0 and "added 2 documents" in out and "9 blocks" in out, err
    # the file edited: a section it no longer has goes with the new version
    (extra / "cogs.md").write_text("# Cogs\n\nCogs have teeth and come in one size.\n")
    code, out, err = ralm("index", "add", index, extra, "--json")
    assert code == 0 and (json.loads(out)["added"], json.loads(out)["deleted"], json.loads(out)["blocks"]) == (1, 1, 8), err
    code, out, _ = ralm("search", index, "Small and large sizes", "--retriever", "bm25", "--json")
    assert "cogs.md#sizes:0" not in {h["id"] for h in json.loads(out)}
    (extra / "cogs.md").unlink()
    (extra / "a.docx").write_text("x")
    code, _, err = ralm("index", "add", index, extra)
    assert code == 2 and "skipped 1 file of unknown format (a.docx)" in err
