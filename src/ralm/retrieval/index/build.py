"""Build an index version: corpus -> block store -> embeddings (dense) or BM25 -> publish."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from ralm.atomic import read_npy
from ralm.data.blocks import BlockConfig, BlockStore, ensure_block_store
from ralm.data.corpus import Document, save_documents
from ralm.distributed import DistEnv, dist_env
from ralm.errors import RalmError
from ralm.progress import track
from ralm.retrieval.backends.bm25 import BM25Index
from ralm.retrieval.towers.encoders import Retriever
from ralm.retrieval.towers.encoding import encode_rows
from ralm.retrieval.backends.faiss_index import FaissIndex
from ralm.retrieval.towers.loading import load_tokenizer
from ralm.retrieval.towers.projection import init_projection
from ralm.retrieval.backends.sharded import assemble_pieces, encode_pieces
from ralm.retrieval.index.store import IndexDir, embeddings_file
from ralm.runtime import dtype_name, resolve_dtype


Corpus = str | os.PathLike | Iterable[Document | dict | str]  # a corpus file or folder, or the documents


def _corpus_file(corpus: Corpus, out: str | os.PathLike, kind: str, env: DistEnv) -> str | os.PathLike:
    """Documents given in memory are saved in the index directory first (by rank 0), so every
    rank and the block store read a file like any other corpus."""
    if isinstance(corpus, (str, os.PathLike)):
        return corpus
    path = str(save_documents(IndexDir.create(out, kind).root / "corpus", corpus)) if env.is_main else None
    env.barrier()
    return env.broadcast_object(path)


def block_texts(blocks: BlockStore, show_progress: bool = True) -> list[str]:
    """Title + body of every block: what BM25 indexes."""
    return [f"{r['title']} {r['text']}" for r in track((blocks.record(i) for i in range(len(blocks))), len(blocks), "reading blocks", show_progress)]


def embed_blocks(retriever: Retriever, blocks: BlockStore, out: Path, device: torch.device,
                 batch_size: int = 64, show_progress: bool = True, pooled: torch.Tensor | None = None,
                 dtype: torch.dtype | None = None) -> np.ndarray:
    """Document-tower embeddings of every block, streamed into `out` (a .npy memmap) [N, D].
    `pooled` [N, H], when given, holds every block's pooled vector: only the projection runs."""
    emb = np.lib.format.open_memmap(out, mode="w+", dtype=np.float32, shape=(len(blocks), retriever.dim))
    if pooled is not None:
        with torch.inference_mode():
            doc = retriever.doc.cpu()
            emb[:] = doc.norm(doc.proj(pooled)).numpy()
            retriever.doc.to(device)
    else:
        encode_rows(retriever.doc, blocks.tokens, blocks.tokens.lengths(), emb, batch_size, device,
                    pad_id=retriever.tokenizer.pad_token_id or 0, show_progress=show_progress, description="embedding blocks", dtype=dtype)
    emb.flush()
    return emb


def version_manifest(kind: str, key: str, blocks: BlockStore) -> dict:
    """What every version's manifest.json records (publishing adds its name and time)."""
    return {"kind": kind, "count": len(blocks), "blocks": key, "corpus": blocks.manifest["corpus"]}


def dense_manifest(index: IndexDir, key: str, blocks: BlockStore, dim: int, retriever_path: Path,
                   dtype: torch.dtype) -> dict:
    """A dense version's: also its dimension and the retriever (saved in the index) that built it."""
    return {**version_manifest("dense", key, blocks), "dim": dim, "doc_fingerprint": retriever_path.name,
            "retriever": str(retriever_path.relative_to(index.root)), "dtype": dtype_name(dtype)}


def build_index(corpus: Corpus, out: str | os.PathLike, kind: str = "dense", model: str | None = None,
                dim: int | None = None, faiss_spec: str | None = None, batch_size: int = 64,
                device: torch.device | None = None, block_cfg: BlockConfig = BlockConfig(),
                show_progress: bool = True, piece_rows: int = 1 << 20,
                dtype: str | torch.dtype | None = None) -> tuple[IndexDir, str]:
    """Build (or add a new version to) the index at `out`; returns (index, version name).
    `corpus`: a corpus file or folder, or the documents themselves (Documents, {"id", "title",
    "text"} dicts or strings), which are saved in the index directory.
    `dtype` is the encoding's compute dtype (None: auto); embeddings are stored as float32.

    Under torchrun every rank embeds its share of the blocks (see retrieval/backends/sharded.py). One
    function on purpose: rank 0 creates, every rank embeds, rank 0 publishes, and the barriers
    between those steps read in order only when the steps sit side by side."""
    if kind not in ("dense", "bm25"):
        raise RalmError(f"the retriever must be 'dense' or 'bm25', got {kind!r}")
    if batch_size <= 0:
        raise RalmError(f"batch size must be positive, got {batch_size}")
    env = dist_env()
    device = env.device(device or torch.device("cpu"))
    dtype = resolve_dtype(dtype, device)
    corpus = _corpus_file(corpus, out, kind, env)
    if kind == "bm25":
        return _build_bm25(corpus, out, model, block_cfg, show_progress, env)
    index, key, blocks, retriever, rpath, pooled = _prepare_dense(corpus, out, model, dim, block_cfg, batch_size, device,
                                                                  show_progress, dtype, env)

    def finish(tmp: Path) -> dict:
        manifest = {**dense_manifest(index, key, blocks, retriever.dim, rpath, dtype), "faiss": faiss_spec}
        if not faiss_spec:
            return manifest
        ann = FaissIndex.build(read_npy(embeddings_file(tmp)), faiss_spec)
        ann.save(tmp / "faiss.index")
        return {**manifest, "faiss_params": ann.default_search_params()}

    if pooled is not None and not env.active:  # small corpus: every block was pooled for the PCA
        def write_projected(tmp: Path) -> dict:
            embed_blocks(retriever, blocks, embeddings_file(tmp), device, batch_size, show_progress, pooled, dtype)
            return finish(tmp)

        return index, index.publish(write_projected)

    # Pieces written atomically per rank, so a killed (multi-process) build resumes.
    staging = index.root / "versions" / f".pieces-{rpath.name}-{key}-w{env.world}"
    encode_pieces(retriever.doc, blocks.tokens, blocks.tokens.lengths(), retriever.dim, staging, env, device,
                  batch_size, retriever.tokenizer.pad_token_id or 0, piece_rows, show_progress, dtype)
    env.barrier()
    name = None
    if env.is_main:
        def write_assembled(tmp: Path) -> dict:
            assemble_pieces(staging, len(blocks), retriever.dim, embeddings_file(tmp), env.world, piece_rows)
            return finish(tmp)

        name = index.publish(write_assembled)
        shutil.rmtree(staging, ignore_errors=True)
    return index, env.broadcast_object(name)


def _build_bm25(corpus: str | os.PathLike, out: str | os.PathLike, model: str | None, block_cfg: BlockConfig,
                show_progress: bool, env: DistEnv) -> tuple[IndexDir, str]:
    """BM25 is one process's job, even under torchrun: rank 0 builds, the others wait."""
    name = None
    if env.is_main:
        index = IndexDir.create(out, "bm25")
        key, blocks = ensure_block_store(index.blocks_dir, corpus, load_tokenizer(model), block_cfg, show_progress)

        def write_bm25(tmp: Path) -> dict:
            BM25Index.build(block_texts(blocks, show_progress), show_progress=show_progress).save(tmp / "bm25")
            return version_manifest("bm25", key, blocks)

        name = index.publish(write_bm25)
    env.barrier()
    return IndexDir(out), env.broadcast_object(name)


def _prepare_dense(corpus: str | os.PathLike, out: str | os.PathLike, model: str | None, dim: int | None,
                   block_cfg: BlockConfig, batch_size: int, device: torch.device, show_progress: bool, dtype: torch.dtype,
                   env: DistEnv) -> tuple[IndexDir, str, BlockStore, Retriever, Path, torch.Tensor | None]:
    """(index, blocks key, blocks, retriever, its path in the index, pooled vectors or None) on
    every rank: rank 0 creates the directory, the block store and the projection (returning the
    pooled vectors when its PCA sample was the whole corpus); the others follow."""
    retriever = Retriever.from_pretrained(model, dim=dim)
    if env.is_main:
        index = IndexDir.create(out, "dense")
        key, blocks = ensure_block_store(index.blocks_dir, corpus, retriever.tokenizer, block_cfg, show_progress)
    env.barrier()
    if not env.is_main:
        index = IndexDir(out)
        key, blocks = ensure_block_store(index.blocks_dir, corpus, retriever.tokenizer, block_cfg, show_progress=False)
    retriever.to(device).eval()
    pooled = None
    if env.is_main:
        if not retriever.cfg.projection_ready:
            pooled = init_projection(retriever, blocks, device, batch_size=batch_size, show_progress=show_progress, dtype=dtype)
        rpath = index.retriever_path(retriever.doc_fingerprint())
        if not (rpath / "config.json").is_file():
            retriever.save_pretrained(rpath)
    env.barrier()
    rpath = Path(env.broadcast_object(str(index.retriever_path(retriever.doc_fingerprint())) if env.is_main else None))
    if not env.is_main and not retriever.cfg.projection_ready:
        retriever = Retriever.from_pretrained(rpath).to(device).eval()
    return index, key, blocks, retriever, rpath, pooled
