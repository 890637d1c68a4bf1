"""The web page in a real headless Chromium: ask a question, see the answer and the
highlighted evidence, add a document and find it. Skips (with the reason) when Chromium
or Playwright is not installed; `.ci/run` installs both."""

import json
import shutil

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium found (Debian: apt-get install chromium)")

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture
def server(tmp_path, tiny_bert):
    from ralm.models.reader import Reader
    from ralm.retrieval.index.build import build_index
    from ralm.serve.app import serve_in_background
    from ralm.serve.service import ServeConfig, Service

    from conftest import DOCS

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    build_index(corpus, tmp_path / "dense", model=str(tiny_bert), dim=16, show_progress=False)
    build_index(corpus, tmp_path / "bm25", kind="bm25", show_progress=False)
    Reader.from_encoder(tiny_bert).save_pretrained(tmp_path / "reader")
    svc = Service(ServeConfig(index=str(tmp_path / "dense"), model=str(tmp_path / "reader"), bm25=str(tmp_path / "bm25")))
    with serve_in_background(svc) as url:
        yield url


def test_page_asks_and_shows_highlighted_evidence_then_adds_a_document(server, tmp_path):
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page()
        page.goto(server)
        page.wait_for_function("document.querySelector('#status').textContent.includes('blocks')")
        page.select_option("#retriever", "bm25")
        page.fill("#question", "Who created the Python programming language?")
        page.click("#ask-button")
        page.wait_for_selector("#answer:not([hidden])")
        answer = page.inner_text("#answer-text")
        assert answer and answer != "(no answer)"
        assert page.inner_text("#evidence mark") == answer  # the span is highlighted in its passage
        assert "Python (language)" in page.inner_text("#evidence li.best .title")

        page.fill("#doc-id", "zanzibar")
        page.fill("#doc-title", "Zanzibar")
        page.fill("#doc-text", "Zanzibar is an archipelago famous for cloves.")
        page.click("#doc-button")
        page.wait_for_function("document.querySelector('#doc-status').textContent.includes('added zanzibar')")
        page.fill("#question", "Which archipelago is famous for cloves?")
        page.click("#ask-button")
        page.wait_for_function("document.querySelector('#evidence li.best .title')?.textContent === 'Zanzibar'")
        page.screenshot(path=str(tmp_path / "page.png"), full_page=True)
        browser.close()
    assert (tmp_path / "page.png").stat().st_size > 10_000
