"""The overlay of live documents on an index version: their blocks, what each side keeps of
each block (the dense side: its document-tower embedding), and the documents whose main-index
blocks they hide (tombstones). A Delta is immutable; an update makes a new one.

Shapes: M overlay blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from ralm.data.blocks import BlockConfig, BlockStore, iter_blocks
from ralm.data.corpus import Document, file_of
from ralm.errors import RalmError


@dataclass(frozen=True)
class LiveDoc:
    """A live document split into blocks, with what each side keeps of every block (one item
    per block), computed once when it is added and kept with the update log."""
    doc: Document
    spans: tuple[tuple[int, int], ...]  # each block's body in doc.text
    states: dict  # side -> [one state per block]

    @cached_property
    def records(self) -> tuple[dict, ...]:
        """{"id", "doc_id", "title", "text"} of each block."""
        d = self.doc
        return tuple({"id": f"{d.id}:{j}", "doc_id": d.id, "title": d.title, "text": d.text[a:b]} for j, (a, b) in enumerate(self.spans))


def split_docs(docs: Sequence[Document], *, tokenizer, block_cfg: BlockConfig, sides: dict,
               given: Mapping[str, Callable[[Sequence[dict]], list]] | None = None) -> list[LiveDoc]:
    """`docs` split into blocks as the index's are, each side's state computed for all their
    blocks at once (the dense side embeds them in batches). `given`: side -> a function of the
    blocks' records ({"id", "doc_id", "title", "text"}, in order) returning their states, used
    for that side in place of its own `live_state` (states computed elsewhere)."""
    given = given or {}
    unknown = sorted(set(given) - set(sides))
    if unknown:
        raise RalmError(f"states given for {', '.join(unknown)}, which the index does not hold (its sides: {', '.join(sides)})")
    split = list(iter_blocks(docs, tokenizer, block_cfg))
    tokens = [np.asarray(b.token_ids) for _, blocks in split for b in blocks]
    spans = [tuple(b.char_span for b in blocks) for _, blocks in split]
    records = [r for d, s in zip(docs, spans) for r in LiveDoc(d, s, {}).records]
    states = {name: list(given[name](records)) if name in given else side.live_state(tokens, records) for name, side in sides.items()}
    wrong = [name for name, st in states.items() if len(st) != len(records)]
    if wrong:
        raise RalmError(f"the states given for {wrong[0]} are {len(states[wrong[0]])}, for {len(records)} blocks")
    out, at = [], 0
    for (doc, _), s in zip(split, spans):
        out.append(LiveDoc(doc, s, {name: st[at:at + len(s)] for name, st in states.items()}))
        at += len(s)
    return out


@dataclass(frozen=True)
class Delta:
    """The overlay's documents at one moment."""
    docs: dict = field(default_factory=dict)  # doc id -> LiveDoc, in live order
    hidden_docs: frozenset[str] = frozenset()  # doc ids whose main-index blocks are hidden
    records: tuple[dict, ...] = ()  # {"id", "doc_id", "title", "text"} per overlay block
    state: dict = field(default_factory=dict)  # side -> [one state per overlay block]
    row_of: dict = field(default_factory=dict)  # block id -> its index in `records`

    @cached_property
    def files(self) -> dict[str, tuple[str, ...]]:
        """file name -> the ids of its live documents (data/corpus.py `file_of`), in live order:
        built at the first lookup of a file, once per Delta."""
        out: dict[str, list[str]] = {}
        for doc_id in self.docs:
            out.setdefault(file_of(doc_id), []).append(doc_id)
        return {name: tuple(ids) for name, ids in out.items()}


def applied(old: Delta, adds: Sequence[LiveDoc] = (), deleted: Iterable[str] = ()) -> Delta:
    """`old` with documents `deleted` gone and `adds` (unique ids) added at the end, replacing
    their earlier versions; an added or deleted document's main-index blocks are hidden."""
    gone = frozenset(deleted) | {a.doc.id for a in adds}
    if not gone:
        return old
    docs = {k: v for k, v in old.docs.items() if k not in gone}
    docs.update((a.doc.id, a) for a in adds)
    records = tuple(r for d in docs.values() for r in d.records)
    sides = next(iter(docs.values())).states if docs else {}  # every live document holds the version's sides
    state = {name: [s for d in docs.values() for s in d.states[name]] for name in sides}
    return Delta(docs, old.hidden_docs | gone, records, state, {r["id"]: i for i, r in enumerate(records)})


class OverlayBlocks:
    """BlockStore-like view: main rows first, then the overlay's blocks."""

    def __init__(self, main: BlockStore, delta: Delta):
        self.main, self.delta = main, delta

    def __len__(self) -> int:
        return len(self.main) + len(self.delta.records)

    def record(self, row: int) -> dict:
        n = len(self.main)
        return self.main.record(row) if row < n else dict(self.delta.records[row - n])
