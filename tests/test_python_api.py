"""The public Python API: every export resolves, `import ralm` stays light, documents go in as
lists, and the examples in docs/python-api.md run as written."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from inspect import signature
from pathlib import Path

import numpy as np
import pytest

import ralm
from conftest import DOCS
from ralm import Document, RalmError, Retriever, Searcher, build_index
from ralm.retrieval.index.dense_side import dense_of

DOC = Path(__file__).parents[1] / "docs" / "python-api.md"


def test_every_export_resolves_and_import_ralm_loads_no_torch():
    for name in ralm.__all__:
        assert getattr(ralm, name) is not None
    code = "import sys, ralm; ralm.Document, ralm.RalmError; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_encode_documents_gives_the_vectors_the_index_stores(tiny_dense_index):
    index = ralm.IndexDir(tiny_dense_index)
    version = index.latest()
    retriever = Retriever.from_pretrained(tiny_dense_index / index.version_manifest(version)["sections"]["dense"]["retriever"])
    stored = np.load(index.version_path(version) / "embeddings.npy")  # one block per document, in order
    vectors = retriever.encode_documents([Document(**d) for d in DOCS], batch_size=4, dtype="fp32")
    assert vectors.dtype == np.float32 and vectors.shape == stored.shape
    np.testing.assert_allclose(vectors, stored, atol=1e-3)  # built in other batches, bf16 where the CPU has it
    # a string is a text without a title: `[CLS] [SEP] text [SEP]`, as a titleless block
    as_text = retriever.encode_documents([DOCS[0]["text"]], dtype="fp32")
    np.testing.assert_allclose(as_text, retriever.encode_documents([Document("x", "", DOCS[0]["text"])], dtype="fp32"))
    with pytest.raises(RalmError, match="list"):
        retriever.encode_documents(DOCS[0]["text"])


def test_build_index_from_documents_in_memory(tiny_bert, tmp_path, corpus_file):
    docs = [Document(**DOCS[0]), DOCS[1], "A text without a title."]
    index, version = build_index(docs, tmp_path / "idx", kind="bm25", model=str(tiny_bert), show_progress=False)
    saved = index.blocks(index.version_manifest(version)["blocks"]).manifest["corpus"]
    assert Path(saved).parent == tmp_path / "idx" / "corpus"  # the index holds its documents
    assert [json.loads(line)["id"] for line in Path(saved).read_text().splitlines()] == ["paris", "tokyo", "2"]
    [hits] = Searcher.open(tmp_path / "idx").search(["a text without a title"], k=1)
    assert (hits[0].id, hits[0].title) == ("2:0", "")
    # the same documents as a file give the same block store
    _, from_file = build_index(corpus_file, tmp_path / "file-idx", kind="bm25", model=str(tiny_bert), show_progress=False)
    _, from_list = build_index(DOCS, tmp_path / "list-idx", kind="bm25", model=str(tiny_bert), show_progress=False)
    assert (ralm.IndexDir(tmp_path / "file-idx").version_manifest(from_file)["blocks"]
            == ralm.IndexDir(tmp_path / "list-idx").version_manifest(from_list)["blocks"])
    for bad, message in (([], "no documents"), ([{"id": "a"}], r"documents\[0\]: missing field 'text'"),
                         (Document(**DOCS[0]), "must be a list"), ([DOCS[0], DOCS[0]], "appears more than once")):
        with pytest.raises(RalmError, match=message):
            build_index(bad, tmp_path / "bad", kind="bm25", model=str(tiny_bert), show_progress=False)


def says_it_prints(code: str) -> list[str]:
    """What the guide says each `print(...)` of a block prints: the comment after it."""
    return re.findall(r"^print\(.*\)  # (.*)$", code, flags=re.MULTILINE)


def printed_as_said(printed: str, said: str) -> bool:
    """`...` in the guide stands for what varies between machines (paths)."""
    return re.fullmatch(".*?".join(re.escape(part) for part in said.split("...")), printed) is not None


@pytest.mark.slow
def test_the_python_api_guide_runs_and_prints_as_written(tmp_path, monkeypatch):
    """The ```python blocks of docs/python-api.md, in order, in one namespace, in a fresh
    directory: each runs, and each print shows what its comment says it does."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    assert len(blocks) >= 5 and sum(len(says_it_prints(code)) for code in blocks) >= 3
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for i, code in enumerate(blocks):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            exec(compile(code, f"{DOC}:block{i + 1}", "exec"), namespace)
        printed = buffer.getvalue().splitlines()
        said = says_it_prints(code)
        assert len(printed) == len(said) and all(map(printed_as_said, printed, said)), (f"block {i + 1}", printed, said)


def test_the_guide_states_the_defaults_the_code_has():
    from ralm.models.confidence import MIN_CONFIDENCE
    from ralm.pipeline import OpenQA

    text = DOC.read_text(encoding="utf-8")
    said = re.search(r"below `min_confidence` \(default None: the\s+threshold the side's confidence map was fitted with, "
                     r"else ([0-9.]+)\)", text)
    assert float(said.group(1)) == MIN_CONFIDENCE and signature(OpenQA).parameters["min_confidence"].default is None
    from ralm.retrieval.index import kinds

    default = signature(build_index).parameters["kind"].default or kinds.DEFAULT_KIND  # None: the default kind's, read when called
    assert re.search(r'build_index\(corpus, out, kind="([a-z]+)"', text).group(1) == default
    assert printed_as_said("Retriever(dim=128, base_model='/x/y')", "Retriever(dim=..., base_model=...)")
    assert not printed_as_said("[('eiffel:0', 12.4)]", "[('eiffel:0', 17.3)]")


def test_public_objects_print_what_they_are(tiny_dense_index, tiny_bert):
    searcher = Searcher.open(tiny_dense_index)
    index = ralm.IndexDir(tiny_dense_index)
    qa = ralm.OpenQA(ralm.Reader.from_encoder(str(tiny_bert)), searcher, k=3)
    shown = {"index": repr(index), "searcher": repr(searcher), "retriever": repr(dense_of(searcher.current).retriever), "qa": repr(qa),
             "blocks": repr(searcher.current.blocks), "exact": repr(dense_of(searcher.current).index)}
    assert all("\n" not in text and len(text) < 600 for text in shown.values())
    assert str(tiny_dense_index) in shown["index"] and "kind='dense'" in shown["index"] and "latest='v000001'" in shown["index"]
    assert f"blocks={len(searcher)}" in shown["searcher"] and "v000001" in shown["searcher"]
    assert f"dim={dense_of(searcher.current).retriever.dim}" in shown["retriever"] and "2x32" in shown["retriever"]
    assert "k=3" in shown["qa"] and "Reader(" in shown["qa"] and "calibrated=False" in shown["qa"]
    assert f"rows={len(searcher)}" in shown["exact"] and f"blocks={len(searcher)}" in shown["blocks"]


def test_show_progress_false_prints_no_bar(tiny_bert, tmp_path, capfd, monkeypatch):
    """Nothing on stderr, transformers' weight-loading bar included, even where bars are on."""
    monkeypatch.delenv("RALM_NO_PROGRESS", raising=False)
    capfd.readouterr()
    build_index([d["text"] for d in DOCS], tmp_path / "idx", model=str(tiny_bert), dim=None, show_progress=False)
    assert capfd.readouterr().err == ""
