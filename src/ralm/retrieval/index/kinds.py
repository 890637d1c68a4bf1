"""What an index can hold: the registry of sides and of index kinds, and the contract a side keeps.

A *side* is one retrieval method over an index version's blocks (dense MIPS over document-tower
embeddings, BM25 over the block texts). An index *kind* names the sides its versions hold; the
default, hybrid, holds both over one block store, so one version, one manifest and one update
log serve both and no crash can leave them apart. A new retrieval method (say, late
interaction) is a module with a class that keeps the `Side` contract below and an entry in
SIDES; searching, fusion, live updates and serving then use it with no other change.

What an index holds is its version manifest's "sides", always: it opens by them, whatever the
registry says today. A kind name is only a name for a side set: a registered alias (KINDS:
hybrid = dense + BM25), else the sides joined by "+" in alphabetical order ("bm25+dense+title");
`kind_of` names a set, `sides_of` reads either form back. Indexes on disk and readers'
confidence maps (models/confidence.py, keyed by kind name, "*" the fallback) carry these names,
so an alias never changes its set. A side joins the default build by naming the default kind
after a set that holds it (DEFAULT_KIND, from defaults.INDEX_KIND, e.g. "bm25+dense+title", or
a new alias): hybrid indexes already built keep their name, their map and their results.

A side owns its part of a version's manifest: a `Section` dataclass of its module, kept under
"sections" in versions/vN/manifest.json (store.py `VersionManifest`), read, validated and
written by itself, e.g. {"dense": {"dim", "retriever", "doc_fingerprint", "dtype", "faiss",
"faiss_params"}, "bm25": {}}. A side also owns its query model (`query_model`: the dense side's
query tower; None for BM25, whose index splits queries into terms itself).

Shapes: Q queries, k results, C candidate rows, M live (overlay) blocks, N version rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from importlib import import_module
from pathlib import Path
from typing import Any, ClassVar, Protocol, Sequence

import numpy as np

from ralm.defaults import INDEX_KIND
from ralm.errors import RalmError
from ralm.retrieval.index.manifest import check_fields
from ralm.runtime import Runtime


# side name -> "module:Class"; imported on first use, so naming a kind loads nothing heavy
SIDES = {"dense": "ralm.retrieval.index.dense_side:DenseSide", "bm25": "ralm.retrieval.index.bm25_side:BM25Side"}
# kind name -> its side set, in search and fusion order; an alias never changes its set (see above)
KINDS = {"hybrid": ("dense", "bm25"), "dense": ("dense",), "bm25": ("bm25",)}
DEFAULT_KIND = INDEX_KIND  # what a build holds unless told otherwise


def sides_of(kind: str) -> tuple[str, ...]:
    """The sides an index kind holds: a registered alias's, or those a joined name lists
    ("bm25+dense+title"), in the order of SIDES."""
    if kind in KINDS:
        return KINDS[kind]
    named = kind.split("+") if isinstance(kind, str) else []
    if not named or len(set(named)) < len(named) or not set(named) <= set(SIDES):
        raise RalmError(f"unknown index kind {kind!r}; choose one of {', '.join(KINDS)}, or sides joined by '+' "
                        f"(of {', '.join(SIDES)})")
    return tuple(s for s in SIDES if s in named)


def kind_of(sides: Sequence[str]) -> str:
    """The name of the kind whose versions hold exactly `sides`: the alias registered for that
    set, else the sides joined by "+" in alphabetical order."""
    for kind, held in KINDS.items():
        if set(held) == set(sides):
            return kind
    unknown = sorted(set(sides) - set(SIDES))
    if unknown or not sides:
        raise RalmError(f"no index kind holds the sides {sorted(sides)} (unknown: {', '.join(unknown) or 'none given'}; "
                        f"this ralm's sides: {', '.join(SIDES)})")
    return "+".join(sorted(set(sides)))


def side_class(name: str) -> type["Side"]:
    if name not in SIDES:
        raise RalmError(f"unknown side {name!r}; choose one of {', '.join(SIDES)}")
    module, cls = SIDES[name].split(":")
    return getattr(import_module(module), cls)


@dataclass(frozen=True)
class Section:
    """A side's typed section of a version manifest. A side's module subclasses it with its
    fields (their JSON types in TYPES, those every version of the side records in REQUIRED);
    a manifest written before sections existed kept them at its top level under the same names."""

    TYPES: ClassVar[dict[str, tuple[type, ...]]] = {}
    REQUIRED: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_json(cls, raw: dict, where: str | os.PathLike, side: str) -> "Section":
        """The section of side `side` in `raw`, validated."""
        prefix = f"sections.{side}."
        if not isinstance(raw, dict):
            raise RalmError(f"{where}: {prefix[:-1]!r} must be an object, got {raw!r}; the index is damaged: rebuild it")
        unknown = sorted(set(raw) - set(cls.names()))
        if unknown:
            raise RalmError(f"{where}: {prefix + unknown[0]!r} is no field of the {side} side (written by a newer ralm, "
                            "or damaged); rebuild the index")
        check_fields(raw, cls.TYPES, required=cls.REQUIRED, where=where, prefix=prefix)
        section = cls(**raw)
        section.check(where, prefix)
        return section

    def check(self, where: str | os.PathLike, prefix: str) -> None:
        """What the field types cannot say (a side overrides it)."""

    def to_json(self) -> dict:
        """The section's JSON object (unset fields left out)."""
        return {name: value for name in self.names() if (value := getattr(self, name)) not in (None, {})}

    def summary(self) -> dict:
        """What a build reports of this side (`IndexDir.summary`)."""
        return {}


@dataclass(frozen=True)
class BuildContext:
    """What every side's builder may use to write its part of a new version."""
    index: Any  # IndexDir
    key: str  # the block store's key
    blocks: Any  # BlockStore
    model: str | None  # the encoder or retriever to build with (None: the bundled default)
    dim: int | None
    faiss_spec: str | None
    batch_size: int
    runtime: Runtime  # where and in which dtype blocks are encoded (this rank's device under torchrun)
    env: Any  # DistEnv
    show_progress: bool
    piece_rows: int
    retriever: Any = None  # a loaded Retriever, when the caller has one
    embeddings: Path | None = None  # precomputed block embeddings [N, D] (.npy) the dense side imports


class SideBuilder(Protocol):
    def write(self, tmp: Path) -> dict:
        """Write this side's files into the version folder `tmp` (rank 0 only, inside
        IndexDir.publish); returns its manifest section (`Side.Section`'s JSON object)."""


class Side(Protocol):
    """One retrieval method of a loaded index version. Rows are the version's block rows."""

    name: str
    Section: type[Section]  # its part of a version manifest, under "sections": {name: ...}
    # whether a score means the same on any corpus (a confidence map may then read this side's
    # best score, `top_<name>`, as a feature; models/confidence.py)
    calibrated_scores: bool

    @classmethod
    def tokenizer(cls, model: str | None):
        """The wordpiece tokenizer that splits the corpus into blocks for this side."""

    @classmethod
    def builder(cls, ctx: BuildContext) -> SideBuilder:
        """Prepare this side's part of a version (every rank: the slow, resumable work)."""

    @classmethod
    def files(cls, version_dir: Path) -> list[Path]:
        """This side's files in a version folder (an upgrade links them into the next one)."""

    @classmethod
    def query_model(cls, index, manifest: Any, model: Any, runtime: Runtime, *, own_if_other: bool):  # store.VersionManifest
        """What encodes queries for this side (on the runtime's device), loaded once per searcher, from `model` (a
        checkpoint path or a loaded model the caller offers every side; a side with no use for
        it ignores it) or else the version's own (the dense side: the query tower it was built
        with); None for a side that needs none. A `model` that does not fit the version raises
        when it is loaded (`check_model`), or, with `own_if_other`, gives way to the version's own."""

    @classmethod
    def load(cls, index, name: str, manifest: Any, *, model, runtime: Runtime, check_model: bool) -> "Side":
        """Version `name` of this side, memory-mapped and checked against its manifest, searched
        under `runtime` (the searcher's: its device and compute dtype)."""

    def block_tokenizer(self):
        """The wordpiece tokenizer its blocks were split with (live documents are split alike)."""

    def encode(self, queries: list[str]) -> Any:
        """Queries in the form this side searches with."""

    def search(self, encoded: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        """`encode`'s output -> (scores [Q, k], rows [Q, k]), best first. A row that is no
        result (BM25: shares no term with the query) scores <= `floor_score`."""

    def score_rows(self, encoded: Any, i: int, rows: np.ndarray) -> np.ndarray | None:
        """Query i's exact scores of main-index rows [C], or None where the side cannot score
        arbitrary rows cheaply (fusion then uses the lowest score of the side's list)."""

    def is_result(self, scores: np.ndarray) -> np.ndarray:
        """Which scores are real results, not fillers of a short list."""

    def live_state(self, tokens: Sequence[np.ndarray], records: Sequence[dict]) -> list:
        """What this side keeps of each new live block (its wordpieces `tokens`, its record
        {"id", "doc_id", "title", "text"}), one item per block: computed once, when the block
        is added (dense: its document-tower embedding), and stored with the update log."""

    def encode_state(self, states: Sequence) -> bytes:
        """`live_state` items of one document's blocks as the bytes the update log keeps."""

    def decode_state(self, data: bytes, n: int) -> list | None:
        """The `n` items `encode_state` wrote, or None where they no longer hold for this
        version (dense: embedded by another document tower); the blocks are then recomputed."""

    def overlay_scorer(self, states: Sequence, records: Sequence[dict]) -> "OverlayScorer":
        """Scores of the live blocks (`records`, with their `states`) on this version's scale."""

    def write_compacted(self, tmp: Path, ctx: BuildContext, *, keep: np.ndarray, live: Sequence) -> dict:
        """Write this side's files for a compacted version (search/compaction.py) into `tmp`:
        its blocks (ctx.blocks) are this version's rows `keep`, in order, then live blocks with
        states `live`. Returns the section fields it changes; a side can always rebuild
        (`builder(ctx).write(tmp)`), one that keeps rows may carry them over."""


class OverlayScorer(Protocol):
    def scores(self, encoded: Any) -> np.ndarray:
        """[Q, M] scores of every live block."""

    def score_rows(self, encoded: Any, i: int, rows: np.ndarray) -> np.ndarray | None:
        """Query i's scores of live rows [C] (0-based within the overlay), or None."""
