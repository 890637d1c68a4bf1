"""The overlay of live documents on an index version: their blocks (with their document-tower
embeddings, dense), and the documents whose main-index blocks they hide (tombstones). A Delta
is immutable; an update makes a new one.

Shapes: M overlay blocks, D retrieval dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ralm.data.blocks import BlockConfig, BlockStore, iter_blocks
from ralm.data.corpus import Document
from ralm.retrieval.towers.encoders import Retriever
from ralm.retrieval.towers.encoding import encode_rows


@dataclass(frozen=True)
class Delta:
    """The overlay's documents at one moment."""
    records: tuple[dict, ...] = ()  # {"id", "doc_id", "title", "text"} per overlay block
    embeddings: np.ndarray | None = None  # [M, D] (dense)
    hidden_docs: frozenset[str] = frozenset()  # doc ids whose main-index blocks are hidden
    docs: dict = field(default_factory=dict)  # doc id -> Document, the overlay's documents
    row_of: dict = field(default_factory=dict)  # block id -> its index in `records`


class OverlayBlocks:
    """BlockStore-like view: main rows first, then the overlay's blocks."""

    def __init__(self, main: BlockStore, delta: Delta):
        self.main, self.delta = main, delta

    def __len__(self) -> int:
        return len(self.main) + len(self.delta.records)

    def record(self, row: int) -> dict:
        n = len(self.main)
        return self.main.record(row) if row < n else dict(self.delta.records[row - n])


def with_adds(old: Delta, docs: Sequence[Document], tokenizer, block_cfg: BlockConfig, retriever: Retriever | None,
              dtype: torch.dtype | None = None) -> Delta:
    """`old` with `docs` (unique ids) added at the end, replacing their earlier versions; dense
    overlays embed the new blocks with `retriever`'s document tower."""
    if not docs:
        return old
    ids = {d.id for d in docs}
    keep = [i for i, r in enumerate(old.records) if r["doc_id"] not in ids]
    new_records, new_tokens = [], []
    for doc, blocks in iter_blocks(docs, tokenizer, block_cfg):
        for b in blocks:
            new_records.append({"id": b.id, "doc_id": doc.id, "title": doc.title, "text": doc.text[b.char_span[0]:b.char_span[1]]})
            new_tokens.append(np.asarray(b.token_ids))
    records = tuple([old.records[i] for i in keep] + new_records)
    embeddings = None
    if retriever is not None:
        fresh = np.zeros((len(new_tokens), retriever.dim), np.float32)  # [M_new, D]
        encode_rows(retriever.doc, new_tokens, np.array([len(t) for t in new_tokens]), fresh, device=retriever.device,
                    pad_id=retriever.tokenizer.pad_token_id or 0, show_progress=False, dtype=dtype)
        base = old.embeddings[keep] if old.embeddings is not None else np.zeros((0, retriever.dim), np.float32)
        embeddings = np.concatenate([base, fresh])
    docs_by_id = {**{k: v for k, v in old.docs.items() if k not in ids}, **{d.id: d for d in docs}}
    # a replaced document's main-index blocks go
    return _delta(records, embeddings, old.hidden_docs | ids, docs_by_id)


def without(old: Delta, doc_id: str) -> Delta:
    """`old` with document `doc_id` deleted: its overlay blocks go and its main-index blocks hide."""
    keep = [i for i, r in enumerate(old.records) if r["doc_id"] != doc_id]
    embeddings = old.embeddings[keep] if old.embeddings is not None else None
    docs = {k: v for k, v in old.docs.items() if k != doc_id}
    return _delta(tuple(old.records[i] for i in keep), embeddings, old.hidden_docs | {doc_id}, docs)


def _delta(records: tuple[dict, ...], embeddings: np.ndarray | None, hidden: frozenset[str], docs: dict) -> Delta:
    return Delta(records, embeddings, frozenset(hidden), docs, {r["id"]: i for i, r in enumerate(records)})
