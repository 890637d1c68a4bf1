"""Shared fixtures: a tiny random BERT (2 layers, hidden 32) with the bundled MiniLM
wordpiece vocabulary, and a tiny self-made corpus. Everything runs on CPU in seconds, except
tests marked `slow` (run with RALM_SLOW=1; CI does) and `gpu` (run where CUDA is)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("RALM_NO_PROGRESS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# CPU threads for torch (default: at most 2). Results must not depend on it: float sums run in
# another order with another count, so assertions need margins, not one run's values.
torch.set_num_threads(int(os.environ.get("RALM_TEST_THREADS", min(2, torch.get_num_threads()))))

def pytest_collection_modifyitems(config, items):
    """Skip `slow` tests unless RALM_SLOW=1, and `gpu` tests without CUDA, saying why."""
    skips = {"slow": None if os.environ.get("RALM_SLOW") == "1" else "slow on 2 CPU cores: RALM_SLOW=1 runs it",
             "gpu": None if torch.cuda.is_available() else "needs CUDA"}
    for item in items:
        for name, reason in skips.items():
            if reason and name in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))


DOCS = [
    {"id": "paris", "title": "Paris", "text": "Paris is the capital of France. It lies on the Seine river. The Eiffel Tower was finished in 1889."},
    {"id": "tokyo", "title": "Tokyo", "text": "Tokyo is the capital of Japan. It is one of the largest cities in the world."},
    {"id": "nile", "title": "Nile", "text": "The Nile is a long river in Africa. It flows north into the Mediterranean Sea."},
    {"id": "everest", "title": "Mount Everest", "text": "Mount Everest is the highest mountain above sea level. It stands on the border of Nepal and China."},
    {"id": "python", "title": "Python (language)", "text": "Python is a programming language created by Guido van Rossum. Its first release came in 1991."},
    {"id": "moon", "title": "Moon", "text": "The Moon orbits the Earth. Neil Armstrong walked on the Moon in 1969 during the Apollo 11 mission."},
]


def make_tiny_bert(path: Path, seed: int = 0, arch: str = "bert") -> Path:
    """Save a random 2-layer, hidden-32 BERT (or another encoder `arch`, e.g. "mpnet") with the
    MiniLM tokenizer as an HF directory."""
    from ralm.encoders.loading import save_random_encoder

    return save_random_encoder(path, hidden_size=32, layers=2, heads=2, intermediate_size=64, seed=seed, arch=arch)


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> Path:
    return make_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def other_tiny_bert(tmp_path_factory) -> Path:
    return make_tiny_bert(tmp_path_factory.mktemp("tiny-bert-2"), seed=1)


@pytest.fixture
def corpus_file(tmp_path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    return path


@pytest.fixture(scope="session")
def tiny_dense_index(tmp_path_factory, tiny_bert) -> Path:
    """A dense index over DOCS built with the tiny BERT (dim 16, PCA-initialised projection)."""
    from ralm.retrieval.index.build import build_index

    root = tmp_path_factory.mktemp("idx")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    build_index(corpus, root / "dense", kind="dense", model=str(tiny_bert), dim=16, show_progress=False)
    return root / "dense"


@pytest.fixture(scope="session")
def tiny_hybrid_index(tmp_path_factory, tiny_bert) -> Path:
    """The default kind of index over DOCS: a dense side (tiny BERT, dim 16) and a BM25 side."""
    from ralm.retrieval.index.build import build_index

    root = tmp_path_factory.mktemp("hidx")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    build_index(corpus, root / "hybrid", model=str(tiny_bert), dim=16, show_progress=False)
    return root / "hybrid"


@pytest.fixture(scope="session")
def served(tmp_path_factory, tiny_bert) -> Path:
    """What the server tests serve: the default (hybrid) index, a dense-only and a BM25-only index
    over DOCS (same blocks), and a (random) tiny reader. Copy the indexes before serving:
    updates are logged inside them."""
    from ralm.models.reader import Reader
    from ralm.retrieval.index.build import build_index

    root = tmp_path_factory.mktemp("serve")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    build_index(corpus, root / "index", model=str(tiny_bert), dim=16, show_progress=False)
    build_index(corpus, root / "dense", kind="dense", model=str(tiny_bert), dim=16, show_progress=False)
    build_index(corpus, root / "bm25", kind="bm25", show_progress=False)
    Reader.from_encoder(tiny_bert).save_pretrained(root / "reader")
    return root


@pytest.fixture
def ralm(capsys, monkeypatch):
    """Run the CLI in-process (as `ralm ARGS...`) -> (exit code, stdout, stderr)."""
    from ralm.cli import main

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["ralm", *map(str, args)])
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code or 0
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


@pytest.fixture(scope="session")
def tiny_bm25_index(tmp_path_factory) -> Path:
    """A BM25 index of DOCS (no model: quick to build)."""
    from ralm.retrieval.index.build import build_index

    root = tmp_path_factory.mktemp("bm25")
    build_index(DOCS, root / "bm25", kind="bm25", show_progress=False)
    return root / "bm25"


@pytest.fixture
def bm25_index(tiny_bm25_index, tmp_path) -> Path:
    """A test's own copy of tiny_bm25_index, which it may write (the update log is inside)."""
    shutil.copytree(tiny_bm25_index, tmp_path / "bm25")
    return tmp_path / "bm25"


FIXTURES = Path(__file__).parent / "fixtures"


def lay_out_as_ralm_04(index: Path) -> None:
    """Rewrite a hybrid index's manifests as ralm 0.4 wrote them (tests/fixtures): DIR/manifest.json
    names its kind under "retriever" alone, and each version's manifest has the keys of a real
    0.4 build's: the sides' fields at its top level, no "sections", no checksum."""
    shutil.copyfile(FIXTURES / "index_manifest_0.4_hybrid.json", index / "manifest.json")
    keys = set(json.loads((FIXTURES / "version_manifest_0.4_hybrid.json").read_text()))
    for path in (index / "versions").glob("v*/manifest.json"):
        new = json.loads(path.read_text())
        legacy = {**{k: v for k, v in new.items() if k not in ("sections", "checksum")},
                  **{k: v for section in new["sections"].values() for k, v in section.items()}}
        assert set(legacy) == keys  # the layout of a real ralm 0.4 build
        path.write_text(json.dumps(legacy))
