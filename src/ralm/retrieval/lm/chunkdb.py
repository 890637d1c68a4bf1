"""The RETRO chunk database: keys of 64-token chunks from a frozen BERT, searched exactly
(ExactIndex) or with faiss (FaissIndex), values read from the memory-mapped token stream.

The key of a chunk is the mean-pooled last layer of the frozen encoder (the bundled MiniLM by
default) over `[CLS] chunk [SEP]`, L2-normalised whatever the encoder, so inner product = cosine
and the nearest keys by inner product are the nearest by L2 distance (the paper's search). The
chunk layout and document exclusion are data/chunks.py.

  DB/manifest.json    format, chunk_len, counts, encoder path and fingerprint, faiss spec
  DB/tokens.npy       int32 [T] the token stream (documents separated by [SEP])
  DB/doc_starts.npy   int64 [n_docs + 1] offset of each document in tokens.npy (where values end)
  DB/chunk_docs.npy   int64 [N, 2] document hashes of each chunk's first and last token
  DB/embeddings.npy   float32 [N, H] keys
  DB/faiss.index      optional approximate index over the keys
  DB/cache/           neighbour lists of texts, computed once (`text_neighbours`)

Dimensions: T tokens, N chunks, m chunk length, H encoder hidden size, Q queries, k neighbours.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from ralm.atomic import atomic_path, read_manifest, read_npy
from ralm.configs import ConfigError
from ralm.data.blocks import tokenizer_fingerprint
from ralm.data.chunks import TokenStream, chunk_values, exclude_same_document, separator_doc_starts, tokenize_text
from ralm.data.corpus import corpus_fingerprint
from ralm.data.resumable import PartialBuild, build_hint
from ralm.defaults import CHUNK_LEN, EMBED_BATCH
from ralm.errors import RalmError
from ralm.progress import progress_bar
from ralm.runtime import Runtime
from ralm.retrieval.towers.encoders import Retriever, Tower
from ralm.retrieval.towers.encoding import encode_rows
from ralm.retrieval.backends.exact import ExactIndex
from ralm.retrieval.backends.faiss_index import FaissIndex
from ralm.encoders.loading import load_tokenizer

FORMAT = "ralm.chunkdb/1"


def load_chunk_encoder(model: str | None) -> tuple[Tower, object, str]:
    """(frozen Tower with mean pooling and no projection, tokenizer, fingerprint)."""
    retriever = Retriever.from_pretrained(model, dim=None, pooling="mean")
    return retriever.doc.eval().requires_grad_(False), retriever.tokenizer, retriever.doc_fingerprint()


def embed_chunks(tower: Tower, tokens: np.ndarray, *, chunk_len: int, start: int, end: int, cls_id: int, sep_id: int,
                 runtime: Runtime, batch_size: int = 64) -> np.ndarray:
    """Keys of chunks start..end-1 of `tokens` -> [end - start, H] float32."""
    rows = [np.concatenate([[cls_id], tokens[c * chunk_len : (c + 1) * chunk_len], [sep_id]]) for c in range(start, end)]
    out = np.empty((end - start, tower.bert.config.hidden_size), dtype=np.float32)
    lengths = np.fromiter((len(r) for r in rows), np.int64, len(rows))
    keys = encode_rows(tower, rows, lengths, out=out, batch_size=batch_size, runtime=runtime, show_progress=False)
    # Unit keys: inner product ranks as L2 distance does (the paper's search). Raw inner products
    # of an encoder without a Normalize module let a chunk of large norm outrank the chunk itself.
    keys /= np.maximum(np.linalg.norm(keys, axis=1, keepdims=True), 1e-12)
    return keys


def build_chunk_db(corpus: str | os.PathLike, out: str | os.PathLike, *, model: str | None = None, chunk_len: int = CHUNK_LEN,
                   faiss_spec: str | None = None, batch_size: int = EMBED_BATCH, runtime: Runtime | None = None,
                   limit_tokens: int | None = None, block_rows: int = 4096, show_progress: bool = True,
                   device: torch.device | str | None = None, dtype: str | torch.dtype | None = None) -> Path:
    """Tokenize, chunk and embed `corpus` into the chunk DB `out`. Resumable: a rerun after a
    crash keeps the finished blocks of `block_rows` keys; the DB appears at `out` only when complete.
    `runtime`: where the chunks are embedded and the encoding's compute dtype (None: the CPU,
    auto dtype; the older `device`/`dtype` still work, see `Runtime.of`); keys are stored as float32."""
    if chunk_len <= 1:
        raise ConfigError("chunk_len", f"must be at least 2, got {chunk_len}")
    rt = Runtime.of(runtime, device=device, dtype=dtype)
    tower, tokenizer, fingerprint = load_chunk_encoder(model)
    tower.to(rt.device)
    signature = {"format": FORMAT, "corpus": corpus_fingerprint(corpus), "encoder": fingerprint,
                 "chunk_len": chunk_len, "limit_tokens": limit_tokens, "faiss": faiss_spec, "keys": "unit"}
    build = PartialBuild(out, signature)
    stream = tokenize_text(corpus, tokenizer, limit_tokens, show_progress)
    n = -(-len(stream.tokens) // chunk_len)
    build.stage("tokens.npy", lambda tmp: np.save(tmp, stream.tokens))
    build.stage("doc_starts.npy", lambda tmp: np.save(tmp, stream.doc_starts))
    build.stage("chunk_docs.npy", lambda tmp: np.save(tmp, stream.chunk_docs(chunk_len)))
    emb = build.fill("embeddings.npy", (n, tower.bert.config.hidden_size), np.float32,
                     lambda s, e: embed_chunks(tower, stream.tokens, chunk_len=chunk_len, start=s, end=e,
                                               cls_id=tokenizer.cls_token_id, sep_id=tokenizer.sep_token_id, runtime=rt,
                                               batch_size=batch_size),
                     block=block_rows, show_progress=show_progress, description="embedding chunks")
    if faiss_spec:
        build.stage("faiss.index", lambda tmp: FaissIndex.build(emb, faiss_spec).save(tmp))
    return build.publish({**signature, "count": n, "tokens": int(len(stream.tokens)), "dim": int(emb.shape[1]),
                          "documents": int(len(stream.doc_hashes)), "encoder_model": tower.cfg.base_model,
                          "tokenizer": tokenizer_fingerprint(tokenizer), "corpus_path": str(corpus)})


def read_chunk_db_manifest(path: str | os.PathLike) -> dict:
    return read_manifest(path, FORMAT, "chunk DB", build_hint(path, "ralm retro build-db"))


def chunk_db_summary(path: str | os.PathLike) -> dict:
    """What a build reports of the chunk DB at `path`."""
    m = read_chunk_db_manifest(path)
    return {"db": str(path), "chunks": m["count"], "tokens": m["tokens"], "dim": m["dim"], "faiss": m["faiss"]}


class ChunkDB:
    def __init__(self, path: str | os.PathLike, device: torch.device | str | None = None, nprobe: int | None = None,
                 dtype: str | torch.dtype | None = None, *, runtime: Runtime | None = None):
        """`runtime`: where chunks are embedded (`embed`) and exactly searched, and the compute
        dtype of both (None: the CPU, auto dtype; the older `device`/`dtype` still work, see
        `Runtime.of`)."""
        self.runtime = Runtime.of(runtime, device=device, dtype=dtype)
        self.path = Path(path)
        self.manifest = read_chunk_db_manifest(self.path)
        self.chunk_len = int(self.manifest["chunk_len"])
        self.tokens = read_npy(self.path / "tokens.npy")  # [T]
        self.chunk_docs = read_npy(self.path / "chunk_docs.npy", mmap_mode=None)  # [N, 2]
        starts = self.path / "doc_starts.npy"
        self.doc_starts = (read_npy(starts, mmap_mode=None) if starts.is_file()  # [n_docs + 1]
                           else separator_doc_starts(self.tokens, load_tokenizer(self.manifest["encoder_model"]).sep_token_id))
        self.embeddings = read_npy(self.path / "embeddings.npy")  # [N, H]
        if self.manifest.get("faiss"):
            self.index = FaissIndex.load(self.path / "faiss.index", self.manifest["faiss"])
            self.index.set_search_params(nprobe=nprobe)
        else:
            self.index = ExactIndex(self.embeddings, runtime=self.runtime)
        self._encoder = None

    def __len__(self) -> int:
        return int(self.manifest["count"])

    def encoder(self) -> tuple[Tower, object]:
        """The frozen key encoder the DB was built with (checked by fingerprint)."""
        if self._encoder is None:
            tower, tokenizer, fp = load_chunk_encoder(self.manifest["encoder_model"])
            if fp != self.manifest["encoder"]:
                raise RalmError(f"{self.path}: encoder {self.manifest['encoder_model']} changed since the DB was built")
            self._encoder = (tower.to(self.runtime.device), tokenizer)
        return self._encoder

    def embed(self, tokens: np.ndarray, count: int, batch_size: int = 64) -> np.ndarray:
        """Keys of the first `count` chunks of a token stream [count, H]."""
        tower, tokenizer = self.encoder()
        return embed_chunks(tower, tokens, chunk_len=self.chunk_len, start=0, end=count, cls_id=tokenizer.cls_token_id,
                            sep_id=tokenizer.sep_token_id, runtime=self.runtime, batch_size=batch_size)

    def search(self, queries: np.ndarray, k: int, query_docs: np.ndarray | None = None) -> np.ndarray:
        """queries [Q, H] -> chunk ids [Q, k] best first (-1: none). With `query_docs` [Q, 2],
        chunks sharing a document with the query are skipped (RETRO training)."""
        if query_docs is None:
            return self.index.search(queries, k)[1]
        ids = np.full((len(queries), k), -1, dtype=np.int64)
        todo, fetch = np.arange(len(queries)), 4 * k + 16
        while len(todo):
            cand = self.index.search(queries[todo], min(fetch, len(self)))[1]
            ids[todo] = exclude_same_document(cand, query_docs[todo], self.chunk_docs, k)
            if fetch >= len(self):
                break
            todo, fetch = todo[(ids[todo] < 0).any(axis=1)], fetch * 4  # too many same-document hits: look deeper
        return ids

    def values(self, ids: np.ndarray, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Chunk + continuation in its document of ids [...]: tokens [..., 2m], mask [..., 2m]."""
        return chunk_values(self.tokens, self.doc_starts, ids, chunk_len=self.chunk_len, pad_id=pad_id)


def text_neighbours(db: ChunkDB, stream: TokenStream, *, k: int, exclude_same_doc: bool, batch_size: int = 64,
                    block: int = 2048, show_progress: bool = True) -> np.ndarray:
    """Neighbours [n, k] of the n = T // m complete chunks of a text, computed once and cached
    in DB/cache/ (keyed by the text's tokens, k and the exclusion rule)."""
    m = db.chunk_len
    n = len(stream.tokens) // m
    key = hashlib.sha256(json.dumps([stream.fingerprint(), k, exclude_same_doc, db.manifest["encoder"],
                                     db.manifest["corpus"], db.manifest.get("faiss")]).encode()).hexdigest()[:16]
    cache = db.path / "cache" / f"neighbours-{key}.npy"
    if cache.is_file():
        return np.load(cache, allow_pickle=False)
    docs = stream.chunk_docs(m, n) if exclude_same_doc else None
    same_text = n <= len(db) and np.array_equal(np.asarray(db.tokens[: n * m]), stream.tokens[: n * m])
    out = np.empty((n, k), dtype=np.int64)
    with progress_bar(show_progress) as bar:
        task = bar.add_task("retrieving neighbours", total=n)
        for s in range(0, n, block):
            e = min(s + block, n)
            # Training on the DB's own text: its keys are already computed.
            queries = np.array(db.embeddings[s:e]) if same_text else db.embed(stream.tokens[s * m :], e - s, batch_size)
            out[s:e] = db.search(queries, k, None if docs is None else docs[s:e])
            bar.advance(task, e - s)
    with atomic_path(cache) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, out)
    return out
