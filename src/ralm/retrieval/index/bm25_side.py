"""The BM25 side of an index: bm25s over each block's `title text`.

  VERSION/bm25/   bm25s's npy/json files, memory-mapped, + ralm.json (the average length)

Its manifest section (`BM25Section`) is empty: the index's files describe it. Queries need no
model: the index splits them into terms itself (backends/bm25.py `tokens_of`). A live
document's blocks are kept in the update log as their terms' 64-bit hashes (`term_hashes`),
which a restart reads back and searches as they are (`LiveBM25`).
"""

from __future__ import annotations

import itertools
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ralm.data.blocks import BlockStore
from ralm.progress import track
from ralm.retrieval.backends.bm25 import BM25Index, LiveBM25, term_hashes, tokens_of
from ralm.retrieval.index.kinds import BuildContext, Section
from ralm.retrieval.index.store import IndexDir, VersionManifest
from ralm.runtime import Runtime

FOLDER = "bm25"
HASHED = b"\0terms:blake2b-64\n"  # opens a live document's state in the update log (ralm <= 0.4 wrote text)
log = logging.getLogger("ralm.live")


def indexed_text(record: dict) -> str:
    """What BM25 indexes of a block record ({"title", "text"}): its title, then its body."""
    return f"{record['title']} {record['text']}"


def block_texts(blocks: BlockStore, show_progress: bool = True) -> list[str]:
    """`indexed_text` of every block."""
    return [indexed_text(r) for r in track((blocks.record(i) for i in range(len(blocks))), len(blocks), "reading blocks", show_progress)]


@dataclass(frozen=True)
class BM25Section(Section):
    """What a version's manifest records of its BM25 side: nothing yet (bm25/ describes itself)."""


@dataclass
class _BM25Builder:
    ctx: BuildContext

    def write(self, tmp: Path) -> dict:
        texts = block_texts(self.ctx.blocks, self.ctx.show_progress)
        BM25Index.build(texts, show_progress=self.ctx.show_progress).save(tmp / FOLDER)
        return {}


class BM25Side:
    name = "bm25"
    Section = BM25Section
    calibrated_scores = False  # IDFs grow with the number of documents: a score's scale is the corpus's own

    def __init__(self, index: BM25Index, blocks: BlockStore):
        self.index = index
        self.blocks = blocks
        self._tokenizer = None

    @classmethod
    def tokenizer(cls, model: str | None):
        """`model`'s wordpieces; by default the bundled MiniLM's, read from its tokenizer.json
        without importing transformers (a one-shot search splits logged documents with it)."""
        from ralm.encoders.loading import default_model_path, load_checkpoint_tokenizer, load_tokenizer

        return load_checkpoint_tokenizer(Path(default_model_path())) if model is None else load_tokenizer(model)

    @classmethod
    def builder(cls, ctx: BuildContext) -> _BM25Builder:
        return _BM25Builder(ctx)  # one process's job, even under torchrun: rank 0 writes it

    @classmethod
    def files(cls, version_dir: Path) -> list[Path]:
        """This side's files in a version folder."""
        return sorted(p for p in (version_dir / FOLDER).rglob("*") if p.is_file())

    @classmethod
    def query_model(cls, index: IndexDir, manifest: VersionManifest, model, runtime: Runtime, *,
                    own_if_other: bool = False) -> None:
        return None  # queries are split into terms by the index

    @classmethod
    def load(cls, index: IndexDir, name: str, manifest: VersionManifest, *, model: None, runtime: Runtime,
             check_model: bool) -> "BM25Side":
        return cls(BM25Index.load(index.version_path(name) / FOLDER, manifest.count), index.blocks(manifest.blocks))

    def block_tokenizer(self):
        """The wordpieces its blocks were split into (live documents are split the same way)."""
        if self._tokenizer is None:
            self._tokenizer = self.tokenizer(None)
        return self._tokenizer

    def encode(self, queries: list[str]) -> list[str]:
        return list(queries)

    def search(self, encoded: list[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.index.search(encoded, k)

    def score_rows(self, encoded: list[str], i: int, rows: np.ndarray) -> None:
        return None  # a full-corpus score vector per query would not scale; fusion floors instead

    def is_result(self, scores: np.ndarray) -> np.ndarray:
        return scores > 0  # BM25 fills a short list with blocks that share no term (score 0)

    def live_state(self, tokens: Sequence[np.ndarray], records: Sequence[dict]) -> list[np.ndarray]:
        """Each new block's terms (of `title text`, as the index tokenised its blocks) as
        `term_hashes`: what a restart reads back without splitting or hashing text."""
        return [term_hashes(terms) for terms in tokens_of([indexed_text(r) for r in records])]

    def encode_state(self, states: Sequence[np.ndarray]) -> bytes:
        """HASHED, each block's term count (uint32), then all their hashes (int64)."""
        counts = np.array([len(s) for s in states], "<u4")
        return HASHED + counts.tobytes() + np.concatenate([np.zeros(0, np.int64), *states]).astype("<i8").tobytes()

    def decode_state(self, data: bytes, n: int) -> list[np.ndarray] | None:
        data = bytes(data)
        if not data.startswith(HASHED):  # ralm <= 0.4: each block's terms joined by spaces, a line a block
            lines = data.decode(errors="replace").split("\n")
            return [term_hashes(line.split(" ") if line else []) for line in lines] if len(lines) == n else None
        at = len(HASHED) + 4 * n
        if len(data) < at:
            return None  # damaged: split again
        counts = struct.unpack_from(f"<{n}I", data, len(HASHED))  # struct, not numpy: a restart decodes every document's
        if len(data) != at + 8 * sum(counts):
            return None
        terms = np.frombuffer(data, "<i8", offset=at)
        if n == 1:  # most documents are one block
            return [terms]
        ends = list(itertools.accumulate(counts))
        return [terms[a:b] for a, b in zip([0, *ends], ends)]

    def overlay_scorer(self, states: Sequence[np.ndarray], records: Sequence[dict]) -> "_BM25Overlay":
        if self.index.avgdl is None:
            self.index.avgdl = _measured_avgdl(self.blocks)
        return _BM25Overlay(LiveBM25(self.index, states) if len(states) else None)

    def write_compacted(self, tmp: Path, ctx: BuildContext, *, keep: np.ndarray, live: Sequence[str]) -> dict:
        """BM25's statistics are the whole corpus's: the compacted blocks are indexed anew."""
        return self.builder(ctx).write(tmp)


class _BM25Overlay:
    def __init__(self, live: LiveBM25 | None):
        self.live = live

    def scores(self, encoded: list[str]) -> np.ndarray:
        return self.live.scores(encoded) if self.live else np.zeros((len(encoded), 0), np.float32)  # [Q, M]

    def score_rows(self, encoded: list[str], i: int, rows: np.ndarray) -> None:
        return None


def _measured_avgdl(blocks: BlockStore, sample: int = 10_000) -> float:
    """The average block length of a BM25 index built by ralm <= 0.2.0, which did not record
    it: measured on up to `sample` evenly spaced blocks (all of them in a smaller corpus)."""
    rows = np.unique(np.linspace(0, len(blocks) - 1, min(sample, len(blocks))).astype(np.int64))
    texts = [indexed_text(r) for r in blocks.records(rows)]
    log.warning(
        "the BM25 index does not record its average block length (built by ralm <= 0.2.0); measured it on %d blocks "
        "for scoring live documents: rebuild it for the exact figure", len(rows))
    return float(np.mean([len(t) for t in tokens_of(texts)]))
