"""The dense side of an index: document-tower embeddings of every block, searched by maximum
inner product (exact torch search, sharded under torchrun, or a faiss index).

  VERSION/embeddings.npy   float32 [N, D], memory-mapped (embedded here, or imported: --embeddings)
  VERSION/faiss.index      with `--faiss SPEC`, or `auto` (the default) on a large index
  DIR/retriever/<fp>/      the retriever that built it (its document tower's fingerprint)

Its manifest section (`DenseSection`, "sections": {"dense": {...}}) records the dimension, that
retriever and its fingerprint, the compute dtype it embedded in, and the faiss index, if any.

Code outside this module never names the side (STYLE 15): the trainers, the refresher and the
REALM evaluations reach it through `dense_of(version)` (a loaded version's embeddings, search
index and query tower), `section_of(manifest)`, `dense_sections`, `dense_index` and DENSE_KIND.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar, Sequence

import numpy as np
import torch

from ralm.atomic import read_npy
from ralm.data.blocks import BlockStore
from ralm.errors import RalmError
from ralm.retrieval.backends.exact import ExactIndex
from ralm.retrieval.backends.faiss_index import AUTO, FaissIndex, auto_spec
from ralm.retrieval.backends.sharded import ShardedExactIndex, assemble_pieces, encode_pieces
from ralm.retrieval.index.kinds import BuildContext, Section, kind_of, sides_of
from ralm.retrieval.index.store import IndexDir, VersionManifest
from ralm.retrieval.towers.encoders import Retriever
from ralm.retrieval.towers.encoding import encode_rows
from ralm.retrieval.towers.projection import init_projection
from ralm.runtime import Runtime, dtype_name


@dataclass(frozen=True)
class DenseSection(Section):
    """What a version's manifest records of its dense side."""

    dim: int  # embedding dimension
    retriever: str  # the retriever that embedded it (DIR-relative)
    doc_fingerprint: str  # its document tower
    dtype: str | None = None  # the compute dtype it embedded in
    faiss: str | None = None  # its faiss index spec; None: exact search
    faiss_params: dict = field(default_factory=dict)

    TYPES: ClassVar[dict[str, tuple[type, ...]]] = {"dim": (int,), "retriever": (str,), "doc_fingerprint": (str,),
                                                    "dtype": (str,), "faiss": (str,), "faiss_params": (dict,)}
    REQUIRED: ClassVar[tuple[str, ...]] = ("dim", "retriever", "doc_fingerprint")

    def check(self, where: str | os.PathLike, prefix: str) -> None:
        if self.dim <= 0:
            raise RalmError(f"{where}: {prefix + 'dim'!r} must be positive, got {self.dim!r}; the index is damaged: rebuild it")

    def summary(self) -> dict:
        return {"dim": self.dim, "faiss": self.faiss, "dtype": self.dtype}


def section_of(manifest: VersionManifest) -> DenseSection | None:
    """The dense side's section of a version manifest (None: the version holds no dense side)."""
    return manifest.sections.get(DenseSide.name)


def embeddings_file(version_dir: Path) -> Path:
    """Where a dense version keeps its float32 block embeddings [N, D], also while it is written."""
    return version_dir / "embeddings.npy"


def read_embeddings(index: IndexDir, name: str, manifest: VersionManifest, mmap_mode: str = "r") -> np.ndarray:
    """Version `name`'s embeddings [N, D], memory-mapped, checked against its manifest."""
    emb = read_npy(embeddings_file(index.version_path(name)), mmap_mode)
    if emb.shape != (manifest.count, section_of(manifest).dim):
        raise RalmError(f"{index.version_path(name)}: embeddings have shape {emb.shape}, "
                        f"manifest says {(manifest.count, section_of(manifest).dim)}")
    return emb


def embed_blocks(retriever: Retriever, blocks: BlockStore, out: Path, runtime: Runtime, *,
                 batch_size: int = 64, show_progress: bool = True, pooled: torch.Tensor | None = None) -> np.ndarray:
    """Document-tower embeddings of every block, encoded under `runtime` (the retriever on its
    device), streamed into `out` (a .npy memmap) [N, D]. `pooled` [N, H], when given, holds
    every block's pooled vector: only the projection runs (on the CPU, in fp32)."""
    emb = np.lib.format.open_memmap(out, mode="w+", dtype=np.float32, shape=(len(blocks), retriever.dim))
    if pooled is not None:
        with torch.inference_mode():
            doc = retriever.doc.cpu()
            emb[:] = doc.norm(doc.proj(pooled)).numpy()
            retriever.doc.to(runtime.device)
    else:
        encode_rows(retriever.doc, blocks.tokens, blocks.tokens.lengths(), out=emb, batch_size=batch_size, runtime=runtime,
                    pad_id=retriever.tokenizer.pad_token_id or 0, show_progress=show_progress, description="embedding blocks")
    emb.flush()
    return emb


def dense_manifest(index: IndexDir, retriever_path: Path, dim: int, runtime: Runtime) -> dict:
    """The dense section of a version embedded under `runtime` (its compute dtype recorded) with
    the retriever saved at `retriever_path`."""
    return {"dim": dim, "doc_fingerprint": retriever_path.name, "retriever": str(retriever_path.relative_to(index.root)),
            "dtype": dtype_name(runtime.dtype)}


def check_retriever(retriever: Retriever, section: DenseSection, where: str) -> None:
    """An index only answers queries from the model family whose document tower built it."""
    if retriever.dim != section.dim:
        raise RalmError(f"{where} was built with dimension {section.dim}, but the model produces {retriever.dim}")
    fp = retriever.doc_fingerprint()
    if fp != section.doc_fingerprint:
        raise RalmError(f"{where} was built with another model (document tower {section.doc_fingerprint}, "
                        f"this model {fp}); rebuild the index with this model or pass the model it was built with")


def import_embeddings(source: Path, out: Path, *, count: int, dim: int, rows: int = 1 << 18) -> None:
    """Copy precomputed block embeddings (a .npy [count, dim] of floats, row i = block i) into
    `out` as float32, a slice at a time, refusing a wrong shape, NaN or infinite values and
    all-zero rows (a zero vector has no direction: it scores 0 against every query, and a
    cosine divides by its norm; it is what a failed export leaves)."""
    try:
        emb = np.load(source, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise RalmError(f"--embeddings {source}: not a readable .npy array ({e})") from None
    if emb.shape != (count, dim) or emb.dtype.kind != "f":
        raise RalmError(f"--embeddings {source}: {emb.dtype} array of shape {emb.shape}; the index needs float vectors of shape "
                        f"({count}, {dim}): one row per block, in the order of the block store's blocks.jsonl, of the "
                        "retriever's dimension")
    dst = np.lib.format.open_memmap(out, mode="w+", dtype=np.float32, shape=(count, dim))
    for start in range(0, count, rows):
        part = np.asarray(emb[start : start + rows], dtype=np.float32)
        bad = np.flatnonzero(~np.isfinite(part).all(1))
        if len(bad):
            raise RalmError(f"--embeddings {source}: row {start + int(bad[0])} holds NaN or infinite values")
        zero = np.flatnonzero(~part.any(1))
        if len(zero):
            raise RalmError(f"--embeddings {source}: row {start + int(zero[0])} is all zeros"
                            f"{f' (and {len(zero) - 1} more in rows {start}-{start + len(part) - 1})' if len(zero) > 1 else ''}; "
                            "a block needs a vector with a direction")
        dst[start : start + rows] = part
    dst.flush()


@dataclass
class _DenseBuilder:
    ctx: BuildContext
    retriever: Retriever
    rpath: Path
    pooled: torch.Tensor | None = None  # every block's pooled vector, when the PCA sample was the whole corpus
    staging: Path | None = None  # the encoded pieces, when encoded piecewise

    def write(self, tmp: Path) -> dict:
        c = self.ctx
        out = embeddings_file(tmp)
        if c.embeddings is not None:
            import_embeddings(c.embeddings, out, count=len(c.blocks), dim=self.retriever.dim)
        elif self.staging is None:
            embed_blocks(self.retriever, c.blocks, out, c.runtime, batch_size=c.batch_size, show_progress=c.show_progress,
                         pooled=self.pooled)
        else:
            assemble_pieces(self.staging, len(c.blocks), self.retriever.dim, out=out, world=c.env.world, piece_rows=c.piece_rows)
            shutil.rmtree(self.staging, ignore_errors=True)  # the version holds them now (a failed publish re-encodes)
        manifest = {**dense_manifest(c.index, self.rpath, self.retriever.dim, c.runtime), "faiss": None}
        spec = auto_spec(len(c.blocks)) if c.faiss_spec == AUTO else c.faiss_spec
        if not spec:
            return manifest
        ann = FaissIndex.build(read_npy(out), spec)
        ann.save(tmp / "faiss.index")
        return {**manifest, "faiss": ann.spec, "faiss_params": ann.default_search_params()}


class DenseSide:
    name = "dense"
    Section = DenseSection
    calibrated_scores = True  # inner products of unit or trained vectors: one scale on any corpus

    def __init__(self, retriever: Retriever, index, embeddings: np.ndarray, *, runtime: Runtime, section: DenseSection):
        self.retriever = retriever
        self.index = index  # ExactIndex | ShardedExactIndex | FaissIndex
        self.embeddings = embeddings  # [N, D] float32, memory-mapped
        self.runtime = runtime  # the searcher's: queries and live blocks are encoded in its dtype
        self.section = section
        self._state_head = section.doc_fingerprint.encode() + b"\0"  # opens each logged state: made once, not per document

    def exactly(self) -> "DenseSide":
        """This side searched by exact fp32 inner products over its own vectors: what an
        approximate (faiss) index's recall is measured against (a version holding it in place
        of this side searches the same blocks exactly)."""
        return DenseSide(self.retriever, ExactIndex(self.embeddings, dtype="fp32"), self.embeddings, runtime=self.runtime,
                         section=self.section)

    # -- building ------------------------------------------------------------------------
    @classmethod
    def tokenizer(cls, model: str | None):
        return Retriever.from_pretrained(model).tokenizer

    @classmethod
    def builder(cls, ctx: BuildContext) -> _DenseBuilder:
        """Every rank: the retriever (its projection PCA-initialised by rank 0 when fresh), then
        the blocks' embeddings in pieces written atomically per rank, so a killed build
        resumes. A small single-process build projects the PCA sample's pooled vectors instead."""
        env = ctx.env
        retriever = (ctx.retriever or Retriever.from_pretrained(ctx.model, dim=ctx.dim)).to(ctx.runtime.device).eval()
        if ctx.embeddings is not None and not retriever.cfg.projection_ready:
            raise RalmError(f"--embeddings {ctx.embeddings}: the retriever has a fresh, untrained projection (--dim); give "
                            "the retriever whose document tower made the vectors (its query tower encodes the queries)")
        pooled = None
        if env.is_main:
            if not retriever.cfg.projection_ready:
                pooled = init_projection(retriever, ctx.blocks, runtime=ctx.runtime, batch_size=ctx.batch_size,
                                         show_progress=ctx.show_progress)
            rpath = ctx.index.retriever_path(retriever.doc_fingerprint())
            if not (rpath / "config.json").is_file():
                retriever.save_pretrained(rpath)
        env.barrier()
        rpath = Path(env.broadcast_object(str(ctx.index.retriever_path(retriever.doc_fingerprint())) if env.is_main else None))
        if not env.is_main and not retriever.cfg.projection_ready:
            retriever = Retriever.from_pretrained(rpath).to(ctx.runtime.device).eval()
        if ctx.embeddings is not None or (pooled is not None and not env.active):
            return _DenseBuilder(ctx, retriever, rpath, pooled=pooled)  # rank 0 writes it
        staging = ctx.index.root / "versions" / f".pieces-{rpath.name}-{ctx.key}-w{env.world}"
        encode_pieces(retriever.doc, ctx.blocks.tokens, ctx.blocks.tokens.lengths(), dim=retriever.dim, staging=staging,
                      env=env, runtime=ctx.runtime, batch_size=ctx.batch_size, pad_id=retriever.tokenizer.pad_token_id or 0,
                      piece_rows=ctx.piece_rows, show_progress=ctx.show_progress)
        env.barrier()
        return _DenseBuilder(ctx, retriever, rpath, staging=staging)

    @classmethod
    def files(cls, version_dir: Path) -> list[Path]:
        """This side's files in a version folder."""
        return [p for p in (embeddings_file(version_dir), version_dir / "faiss.index") if p.is_file()]

    # -- loading -------------------------------------------------------------------------
    @classmethod
    def query_model(cls, index: IndexDir, manifest: VersionManifest, model: Retriever | str | os.PathLike | None,
                    runtime: Runtime, *, own_if_other: bool = False) -> Retriever:
        """The query tower: `model` (a loaded Retriever, used as it is, or a checkpoint; it must
        share the version's document tower), else the retriever the version was built with.
        `own_if_other`: a checkpoint of another document tower gives way to the version's own."""
        if isinstance(model, Retriever):
            return model
        section = section_of(manifest)
        given = Retriever.from_pretrained(model) if model is not None else None
        if given is None or (own_if_other and given.doc_fingerprint() != section.doc_fingerprint):
            given = Retriever.from_pretrained(str(index.root / section.retriever))
        return given.to(runtime.device).eval()

    @classmethod
    def load(cls, index: IndexDir, name: str, manifest: VersionManifest, *, model: Retriever, runtime: Runtime,
             check_model: bool) -> "DenseSide":
        from ralm.distributed import dist_env

        section = section_of(manifest)
        if check_model:
            check_retriever(model, section, f"index {index.root} ({name})")
        path = index.version_path(name)
        # Copy-on-write: pages load lazily as with "r", but torch can view them without a copy.
        emb = read_embeddings(index, name, manifest, mmap_mode="c")
        if section.faiss:
            ann = FaissIndex.load(path / "faiss.index", section.faiss, source=emb)
            ann.set_search_params(**section.faiss_params)
            return cls(model, ann, emb, runtime=runtime, section=section)
        env = dist_env()
        if env.active:  # under torchrun each rank holds and searches its shard of the rows
            shard = ShardedExactIndex(emb, env, runtime=replace(runtime, device=env.device(runtime.device)))
            return cls(model, shard, emb, runtime=runtime, section=section)
        return cls(model, ExactIndex(emb, runtime=runtime), emb, runtime=runtime, section=section)

    def block_tokenizer(self):
        """The wordpieces its blocks were split into (live documents are split the same way)."""
        return self.retriever.tokenizer

    # -- searching -----------------------------------------------------------------------
    def encode(self, queries: list[str]) -> torch.Tensor:
        return self.retriever.encode_queries(queries, dtype=self.runtime.dtype)  # [Q, D]

    def search(self, encoded: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.index.search(encoded, k)

    def score_rows(self, encoded: torch.Tensor, i: int, rows: np.ndarray) -> np.ndarray:
        """Exact inner products with the stored float32 embeddings (whatever the search index
        approximates or holds in bf16)."""
        return np.asarray(self.embeddings[rows], dtype=np.float32) @ encoded[i].float().numpy()

    def is_result(self, scores: np.ndarray) -> np.ndarray:
        return np.isfinite(scores)

    # -- live blocks ---------------------------------------------------------------------
    def live_state(self, tokens: Sequence[np.ndarray], records: Sequence[dict]) -> list[np.ndarray]:
        """Each new block's document-tower embedding [D], embedded in batches."""
        r = self.retriever
        fresh = np.zeros((len(tokens), r.dim), np.float32)  # [M_new, D]
        if len(tokens):
            encode_rows(r.doc, list(tokens), np.array([len(t) for t in tokens]), out=fresh,
                        runtime=replace(self.runtime, device=r.device),  # where the query model is (a loaded one: as given)
                        pad_id=r.tokenizer.pad_token_id or 0, show_progress=False)
        return list(fresh)

    def encode_state(self, states: Sequence[np.ndarray]) -> bytes:
        """The document tower's fingerprint, a NUL, then the embeddings as float32 [n, D]."""
        return self._state_head + np.asarray(states, np.float32).tobytes()

    def decode_state(self, data: bytes, n: int) -> list[np.ndarray] | None:
        head = self._state_head
        if not data.startswith(head) or len(data) - len(head) != 4 * n * self.section.dim:
            return None  # embedded by another document tower (or damaged): embedded again
        vectors = np.frombuffer(data, np.float32, offset=len(head))
        return [vectors] if n == 1 else list(vectors.reshape(n, self.section.dim))  # most documents are one block

    def overlay_scorer(self, states: Sequence[np.ndarray], records: Sequence[dict]) -> "_DenseOverlay":
        # np.array, not np.stack: one copy in C, no view per block (a restart has one per logged block)
        return _DenseOverlay(np.array(states, np.float32) if len(states) else np.zeros((0, self.section.dim), np.float32))

    def write_compacted(self, tmp: Path, ctx: BuildContext, *, keep: np.ndarray, live: Sequence[np.ndarray]) -> dict:
        """The kept rows' embeddings and the live blocks', as stored: nothing is embedded again."""
        out = embeddings_file(tmp)
        emb = np.lib.format.open_memmap(out, mode="w+", dtype=np.float32, shape=(len(keep) + len(live), self.section.dim))
        step = 1 << 16
        for i in range(0, len(keep), step):
            rows = keep[i:i + step]
            emb[i:i + len(rows)] = self.embeddings[rows]
        if len(live):
            emb[len(keep):] = np.stack(live)
        emb.flush()
        if not self.section.faiss:
            return {}
        ann = FaissIndex.build(read_npy(out), self.section.faiss)
        ann.save(tmp / "faiss.index")
        return {"faiss": ann.spec, "faiss_params": ann.default_search_params()}


class _DenseOverlay:
    def __init__(self, embeddings: np.ndarray):
        self.embeddings = embeddings  # [M, D]

    def scores(self, encoded: torch.Tensor) -> np.ndarray:
        return encoded.float().numpy() @ self.embeddings.T  # [Q, M]

    def score_rows(self, encoded: torch.Tensor, i: int, rows: np.ndarray) -> np.ndarray:
        return self.embeddings[rows] @ encoded[i].float().numpy()


DENSE_KIND = kind_of((DenseSide.name,))  # an index of the dense side alone: the trainers' and REALM evaluations'


def dense_of(version, *, optional: bool = False) -> DenseSide | None:
    """The dense side of a loaded version (a searcher's `current`, `load_version`'s, a live
    snapshot): its embeddings [N, D] (`.embeddings`), search index (`.index`) and query tower
    (`.retriever`). A version without one raises, naming the index, or with `optional` gives None."""
    side = version.sides.get(DenseSide.name)
    if side is None and not optional:
        raise RalmError(f"index {version.path.parent.parent} ({version.name}) holds {', '.join(version.sides)} and no dense "
                        "side, whose document-tower embeddings this needs; `ralm index upgrade` adds it")
    return side


def dense_sections(section: dict) -> dict:
    """The "sections" of a version manifest holding the dense side alone, with its `section`."""
    return {DenseSide.name: section}


def dense_index(root: str | os.PathLike) -> IndexDir:
    """The index directory at `root` (new, or one of the dense side alone), for a trainer's versions."""
    return IndexDir.create(root, DENSE_KIND)


def holds_dense(kind: str) -> bool:
    """Whether an index kind's versions hold the dense side (what --embeddings are imported into)."""
    return DenseSide.name in sides_of(kind)
