"""Screenshots of the web page (`ralm serve`) on the demo corpus with the reader that ships in
the package, in headless Chromium: an answered question at desktop width (1280 px: docs/web-page.png)
and phone width (390 px: docs/web-page-phone.png), and a question the corpus cannot answer
(docs/web-page-withheld.png); below the answer, the document form and the index's files.

  python benchmarks/serving/screenshot.py [--out-dir docs] [--question "..."] [--unanswerable "..."]

Needs Chromium (Debian: apt-get install chromium) and playwright (the test extra). The demo
index is built once (about 30 s on a CPU) and cached (`ralm demo` uses the same one).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path


FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}


def ask(page, question: str) -> None:
    page.fill("#question", question)
    page.press("#question", "Enter")
    page.wait_for_selector("#answer:not([hidden])")
    page.wait_for_function("!document.querySelector('#ask-button').disabled")
    print(f"{question} -> {page.inner_text('#answer-text')} ({page.inner_text('#confidence')})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, default=Path("docs"))
    ap.add_argument("--question", default="Who created the Python programming language?")
    ap.add_argument("--unanswerable", default="What is the recipe for lemon cake?")
    args = ap.parse_args()

    from playwright.sync_api import sync_playwright

    from ralm.demo import demo_index
    from ralm.runtime import Runtime
    from ralm.models.reader import default_reader_path
    from ralm.serve.app import serve_in_background
    from ralm.serve.service import ServeConfig, Service

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("no Chromium found (Debian: apt-get install chromium)")
    index, _ = demo_index(Runtime.resolve("cpu"))
    svc = Service(ServeConfig(index=str(index), model=str(default_reader_path())))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    shots = [("web-page.png", DESKTOP, args.question, False), ("web-page-phone.png", PHONE, args.question, False),
             ("web-page-withheld.png", DESKTOP, args.unanswerable, True)]
    with serve_in_background(svc) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=FLAGS)
        for name, viewport, question, withheld in shots:
            page = browser.new_page(viewport=viewport)
            page.goto(url)
            page.wait_for_function("document.querySelector('#status').textContent.includes('blocks')")
            page.wait_for_function("document.querySelector('#files-range').textContent.includes('of')")  # the index's files, listed
            ask(page, question)
            if withheld != (page.inner_text("#answer-text") == "No answer found in the corpus"):
                raise SystemExit(f"{question!r} was {'answered' if withheld else 'withheld'}; pick another question")
            if viewport is DESKTOP and not withheld:
                page.click("#confidence-help summary")  # what the number means, open
            page.screenshot(path=str(args.out_dir / name), full_page=True)
            print("wrote", args.out_dir / name)
            page.close()
        browser.close()


if __name__ == "__main__":
    main()
