"""A toy side, as a new retrieval method is added: this one module and its entry in
retrieval/index/kinds.py SIDES (tests/test_hybrid.py registers it as "title"). A block scores 1
when its title appears in the query, 0 otherwise: on any corpus, so its top score is a
calibrated confidence feature (`top_title`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from ralm.retrieval.index import kinds


@dataclass(frozen=True)
class TitleSection(kinds.Section):
    """Its section of a version manifest: the file that holds every block's title."""

    file: str = "titles.json"

    TYPES: ClassVar[dict[str, tuple[type, ...]]] = {"file": (str,)}
    REQUIRED: ClassVar[tuple[str, ...]] = ("file",)


def _matches(titles, queries) -> np.ndarray:
    return np.array([[float(t.lower() in q.lower()) for t in titles] for q in queries], np.float32).reshape(len(queries), -1)


class TitleSide:
    name = "title"
    Section = TitleSection
    calibrated_scores = True  # 0 or 1 on any corpus

    def __init__(self, titles):
        self.titles = titles

    @classmethod
    def tokenizer(cls, model):
        return kinds.side_class("bm25").tokenizer(model)

    @classmethod
    def builder(cls, ctx):
        class Builder:
            def write(self, tmp: Path) -> dict:
                section = TitleSection()
                (tmp / section.file).write_text(json.dumps([ctx.blocks.record(i)["title"] for i in range(len(ctx.blocks))]))
                return section.to_json()
        return Builder()

    @classmethod
    def files(cls, version_dir):
        return [version_dir / TitleSection().file]

    @classmethod
    def query_model(cls, index, manifest, model, runtime, *, own_if_other=False):
        return None

    @classmethod
    def load(cls, index, name, manifest, *, model, runtime, check_model):
        section = manifest.sections[cls.name]
        return cls(json.loads((index.version_path(name) / section.file).read_text()))

    def block_tokenizer(self):
        return kinds.side_class("bm25").tokenizer(None)

    def encode(self, queries):
        return queries

    def search(self, encoded, k):
        scores = _matches(self.titles, encoded)
        rows = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        return np.take_along_axis(scores, rows, 1), rows

    def score_rows(self, encoded, i, rows):
        return None

    def is_result(self, scores):
        return scores > 0

    def live_state(self, tokens, records):
        return [None] * len(records)  # scored from the records' titles: nothing to keep

    def encode_state(self, states):
        return b""

    def decode_state(self, data, n):
        return [None] * n

    def write_compacted(self, tmp, ctx, *, keep, live):
        return self.builder(ctx).write(tmp)

    def overlay_scorer(self, states, records):
        titles = [r["title"] for r in records]

        class Scorer:
            def scores(self, encoded):
                return _matches(titles, encoded)

            def score_rows(self, encoded, i, rows):
                return None
        return Scorer()
