"""The overlay of live documents on an index version: their blocks (with what each side keeps
of them, e.g. the dense side's document-tower embeddings), and the documents whose main-index
blocks they hide (tombstones). A Delta is immutable; an update makes a new one.

Shapes: M overlay blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ralm.data.blocks import BlockConfig, BlockStore, iter_blocks
from ralm.data.corpus import Document


@dataclass(frozen=True)
class Delta:
    """The overlay's documents at one moment."""
    records: tuple[dict, ...] = ()  # {"id", "doc_id", "title", "text"} per overlay block
    state: dict = field(default_factory=dict)  # side -> what it keeps of the overlay blocks (dense: [M, D] embeddings)
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


def with_adds(old: Delta, docs: Sequence[Document], *, tokenizer, block_cfg: BlockConfig, sides: dict) -> Delta:
    """`old` with `docs` (unique ids) added at the end, replacing their earlier versions; each
    of the version's `sides` (name -> loaded Side) extends its state with the new blocks."""
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
    state = {name: side.overlay_state(old.state.get(name), keep, new_tokens) for name, side in sides.items()}
    docs_by_id = {**{k: v for k, v in old.docs.items() if k not in ids}, **{d.id: d for d in docs}}
    # a replaced document's main-index blocks go
    return _delta(records, state, old.hidden_docs | ids, docs_by_id)


def without(old: Delta, doc_ids: Sequence[str], sides: dict) -> Delta:
    """`old` with documents `doc_ids` deleted: their overlay blocks go and their main-index blocks hide."""
    gone = frozenset(doc_ids)
    keep = [i for i, r in enumerate(old.records) if r["doc_id"] not in gone]
    state = {name: side.overlay_state(old.state.get(name), keep, []) for name, side in sides.items()}
    docs = {k: v for k, v in old.docs.items() if k not in gone}
    return _delta(tuple(old.records[i] for i in keep), state, old.hidden_docs | gone, docs)


def _delta(records: tuple[dict, ...], state: dict, hidden: frozenset[str], docs: dict) -> Delta:
    return Delta(records, state, frozenset(hidden), docs, {r["id"]: i for i, r in enumerate(records)})
