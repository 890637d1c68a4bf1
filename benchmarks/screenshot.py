"""Screenshot of the web page (`ralm serve`) answering a question on the demo corpus, with the
demo reader that ships in the package: docs/web-page.png.

  python benchmarks/screenshot.py [--out docs/web-page.png] [--question "..."]

Needs Chromium (Debian: apt-get install chromium) and playwright (the test extra).
"""

from __future__ import annotations

import argparse
import shutil

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/web-page.png")
    ap.add_argument("--question", default="Who created the Python programming language?")
    args = ap.parse_args()

    from playwright.sync_api import sync_playwright

    from ralm.demo import demo_file, demo_index
    from ralm.serve.app import serve_in_background
    from ralm.serve.service import ServeConfig, Service

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("no Chromium found (Debian: apt-get install chromium)")
    index, _ = demo_index(torch.device("cpu"))
    svc = Service(ServeConfig(index=str(index), model=str(demo_file("reader"))))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync"]
    with serve_in_background(svc) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=flags)
        page = browser.new_page(viewport={"width": 1100, "height": 900})
        page.goto(url)
        page.wait_for_function("document.querySelector('#status').textContent.includes('blocks')")
        page.fill("#question", args.question)
        page.click("#ask-button")
        page.wait_for_selector("#answer:not([hidden])")
        print("answer:", page.inner_text("#answer-text"))
        page.screenshot(path=args.out, full_page=True)
        browser.close()
    print("wrote", args.out)


if __name__ == "__main__":
    main()
