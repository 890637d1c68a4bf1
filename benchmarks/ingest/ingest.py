"""Ingestion throughput per format: how fast `read_corpus` turns a folder of .txt, Markdown,
HTML and PDF files into documents (files/s, documents/s, MB/s of input), parsing only (no
tokenising, no encoding).

The corpus is generated from SQuAD's Wikipedia paragraphs (../shared/data/squad_corpus.jsonl):
each file is one article's first `--sections` paragraphs, the same text in every format, with
the structure each format carries: Markdown and HTML with a title and one heading per paragraph
(the HTML in a page with navigation, a sidebar and a footer to drop), PDF (written with fpdf2,
the `test` extra) one paragraph per page with an outline entry each, .txt the paragraphs alone.
Medians over `--rounds`; the last line is JSON.

  python benchmarks/ingest/ingest.py --files 300 --rounds 3      # 300 files per format: 1,200 files
"""

from __future__ import annotations

import argparse
import html
import json
import statistics
import sys
import tempfile
import time
from itertools import groupby
from pathlib import Path

from ralm.data.corpus import read_corpus
from ralm.data.formats import FileFilter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import DATA  # noqa: E402

FORMATS = {"txt": "*.txt", "markdown": "*.md", "html": "*.html", "pdf": "*.pdf"}


def articles(n: int, sections: int) -> list[tuple[str, list[str]]]:
    """(title, paragraphs) of the first `n` articles with at least `sections` paragraphs; the
    corpus has 442 articles, so files past that reuse them under new names."""
    with open(DATA / "squad_corpus.jsonl", encoding="utf-8") as f:
        rows = (json.loads(line) for line in f)
        found = [(title, [r["text"] for r in group]) for title, group in groupby(rows, key=lambda r: r["title"])]
    found = [(t, p[:sections]) for t, p in found if len(p) >= sections]
    return [(f"{found[i % len(found)][0]} {i}", found[i % len(found)][1]) for i in range(n)]


def write_corpus(root: Path, n: int, sections: int) -> None:
    from fpdf import FPDF

    for i, (title, paragraphs) in enumerate(articles(n, sections)):
        name = f"doc{i:05d}"
        (root / f"{name}.txt").write_text("\n\n".join(paragraphs), encoding="utf-8")
        (root / f"{name}.md").write_text(f"# {title}\n\n" + "".join(f"## Part {j + 1}\n\n{p}\n\n" for j, p in enumerate(paragraphs)),
                                         encoding="utf-8")
        body = "".join(f"<h2>Part {j + 1}</h2><p>{html.escape(p)}</p>" for j, p in enumerate(paragraphs))
        (root / f"{name}.html").write_text(
            f"<!doctype html><html><head><title>{html.escape(title)}</title></head><body><nav><a href='/'>Home</a> "
            f"<a href='/a'>Articles</a></nav><div class='sidebar'><ul><li><a href='/x'>Related</a></li></ul></div>"
            f"<main><h1>{html.escape(title)}</h1>{body}</main><footer>Text under CC BY-SA.</footer></body></html>", encoding="utf-8")
        pdf = FPDF()
        pdf.set_title(title.encode("latin-1", "replace").decode("latin-1"))
        pdf.set_font("helvetica", size=11)
        for j, p in enumerate(paragraphs):
            pdf.add_page()
            pdf.start_section(f"Part {j + 1}")
            pdf.multi_cell(0, 6, p.encode("latin-1", "replace").decode("latin-1"))  # the core fonts are latin-1
        pdf.output(str(root / f"{name}.pdf"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=300, help="files per format")
    ap.add_argument("--sections", type=int, default=4, help="paragraphs per file (sections, PDF pages)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        start = time.perf_counter()
        write_corpus(root, args.files, args.sections)
        print(f"generated {args.files} files per format ({4 * args.files} files) in {time.perf_counter() - start:.0f} s")
        result = {}
        for fmt, pattern in FORMATS.items():
            files = FileFilter(include=(pattern,))
            size = sum(p.stat().st_size for p in root.glob(pattern))
            times, docs = [], 0
            for _ in range(args.rounds):
                start = time.perf_counter()
                docs = sum(1 for _ in read_corpus(root, files=files))
                times.append(time.perf_counter() - start)
            t = statistics.median(times)
            result[fmt] = {"files": args.files, "documents": docs, "MB": round(size / 1e6, 2), "seconds": round(t, 2),
                           "files_per_s": round(args.files / t, 1), "documents_per_s": round(docs / t, 1), "MB_per_s": round(size / 1e6 / t, 2)}
    print(f"{'format':<9} {'files':>6} {'docs':>6} {'MB':>7} {'files/s':>8} {'docs/s':>8} {'MB/s':>7}")
    for fmt, r in result.items():
        print(f"{fmt:<9} {r['files']:>6} {r['documents']:>6} {r['MB']:>7.2f} {r['files_per_s']:>8.1f} {r['documents_per_s']:>8.1f} "
              f"{r['MB_per_s']:>7.2f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
