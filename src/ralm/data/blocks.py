"""REALM evidence blocks: `[CLS] title [SEP] body [SEP]`, at most 288 wordpieces (data/geometry.py).

A long document is split between sentences (a sentence longer than a block is cut between
wordpieces), so every body wordpiece of a document lands in exactly one block, in order.
Block ids are `<doc id>:<j>` and stable for a given document text and tokenizer.

The store is a folder, written to a temporary name and renamed into place when complete:
  manifest.json   counts, block config, tokenizer and corpus fingerprints
  tokens/         ragged int32 wordpiece ids of every block (memory-mapped)
  body_start.npy  index of the first body wordpiece in each block
  doc_index.npy   ordinal of the source document of each block (to exclude trivial retrievals)
  doc_hash.npy    a 64-bit hash of each document's id, in document order (finds a document's
                  blocks without reading blocks.jsonl: `BlockStore.document_rows`)
  file_hash.npy   the same of each document's file name (`data/corpus.py file_of`: guide.md of
                  guide.md#setup), finding a file's every section the same way
  blocks.jsonl    {"id", "doc_id", "title", "text"} per block; blocks.idx.npy holds byte offsets
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from array import array
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tokenizers import Tokenizer

from ralm.atomic import atomic_path, manifest_file, read_manifest, read_npy
from ralm.data.corpus import Document, corpus_fingerprint, file_of, read_corpus
from ralm.data.formats import EVERY_FILE, FileFilter
from ralm.data.geometry import GEOMETRY
from ralm.data.ragged import RaggedArray, RaggedWriter
from ralm.errors import RalmError
from ralm.progress import progress_bar

FORMAT = "ralm.blocks/1"
# End of a sentence: terminal punctuation, optional closing quotes/brackets, then whitespace.
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+")


@dataclass(frozen=True)
class BlockConfig:
    max_len: int = GEOMETRY.block_len
    max_title_len: int = 32

    def __post_init__(self):
        if self.max_len < self.max_title_len + 8:
            raise RalmError(f"max block length {self.max_len} leaves no room for a body after a {self.max_title_len}-wordpiece title")


@dataclass(frozen=True)
class Block:
    doc_id: str
    index: int  # j-th block of its document
    token_ids: list[int]  # [CLS] title [SEP] body [SEP]
    body_start: int
    char_span: tuple[int, int]  # the body's span in the document text

    @property
    def id(self) -> str:
        return f"{self.doc_id}:{self.index}"


def wordpiece_tokenizer(hf_tokenizer) -> Tokenizer:
    """The fast tokenizer's backend with truncation and padding off (tokenizer.json files
    often carry a 128/512 truncation that would silently drop text), and special tokens typed
    in a text read as the text they are: "[SEP]" in a document is `[ sep ]`, never the separator
    (the ids ralm places itself, [CLS] and [SEP] around a block, are added by id)."""
    tok = Tokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())
    tok.no_truncation()
    tok.no_padding()
    tok.encode_special_tokens = True
    return tok


def tokenizer_fingerprint(hf_tokenizer) -> str:
    vocab = sorted(hf_tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def sentence_ends(text: str) -> list[int]:
    """The character offset just past each sentence of `text` but the last (its terminal
    punctuation and the whitespace after it): where blocks may be cut."""
    return [m.end() for m in _SENTENCE_END.finditer(text)]


def _sentence_ids(text: str, starts: np.ndarray) -> np.ndarray:
    """Sentence number of each wordpiece, from its character start."""
    return np.searchsorted(np.array(sentence_ends(text), dtype=np.int64), starts, side="right")


def split_document(doc: Document, ids: list[int], offsets: list[tuple[int, int]], *, title_ids: list[int],
                   cls_id: int, sep_id: int, cfg: BlockConfig) -> list[Block]:
    """Pack whole sentences greedily into blocks of at most cfg.max_len wordpieces."""
    title_ids = title_ids[: cfg.max_title_len]
    budget = cfg.max_len - 3 - len(title_ids)
    n = len(ids)
    # Piece boundaries: sentence starts, plus cuts inside sentences longer than the budget.
    if n:
        sent = _sentence_ids(doc.text, np.array([o[0] for o in offsets], dtype=np.int64))
        starts = [0] + [i for i in range(1, n) if sent[i] != sent[i - 1]]
    else:
        starts = [0]
    pieces: list[tuple[int, int]] = []
    for a, b in zip(starts, starts[1:] + [n]):
        for c in range(a, max(b, a + 1), budget):
            pieces.append((c, min(c + budget, b)))
    chunks: list[tuple[int, int]] = []
    for a, b in pieces:
        if chunks and b - chunks[-1][0] <= budget:
            chunks[-1] = (chunks[-1][0], b)
        else:
            chunks.append((a, b))
    blocks = []
    for j, (a, b) in enumerate(chunks):
        span = (offsets[a][0], offsets[b - 1][1]) if b > a else (0, 0)
        blocks.append(Block(doc.id, j, [cls_id, *title_ids, sep_id, *ids[a:b], sep_id], len(title_ids) + 2, span))
    return blocks


def iter_blocks(docs: Iterable[Document], hf_tokenizer, cfg: BlockConfig = BlockConfig(),
                batch_size: int = 512) -> Iterator[tuple[Document, list[Block]]]:
    """Tokenise documents in batches (fast Rust tokenizer) and split each into blocks."""
    tok = wordpiece_tokenizer(hf_tokenizer)
    cls_id, sep_id = hf_tokenizer.cls_token_id, hf_tokenizer.sep_token_id
    if cls_id is None or sep_id is None:
        raise RalmError("the tokenizer has no [CLS]/[SEP] tokens; REALM blocks need a BERT-style tokenizer")
    batch: list[Document] = []

    def flush():
        bodies = tok.encode_batch([d.text for d in batch], add_special_tokens=False)
        titles = tok.encode_batch([d.title for d in batch], add_special_tokens=False)
        for d, body, title in zip(batch, bodies, titles):
            yield d, split_document(d, body.ids, body.offsets, title_ids=title.ids, cls_id=cls_id, sep_id=sep_id, cfg=cfg)

    for doc in docs:
        batch.append(doc)
        if len(batch) == batch_size:
            yield from flush()
            batch = []
    if batch:
        yield from flush()


def id_hash(doc_id: str) -> int:
    """The 64-bit hash of a document id that doc_hash.npy holds."""
    return int.from_bytes(hashlib.blake2b(doc_id.encode(), digest_size=8).digest(), "little", signed=True)


def _count_documents(path: Path) -> int | None:
    """The progress bar's total: a JSONL or TSV file's lines; unknown for files read by
    sections (a Markdown file, a folder of PDFs)."""
    if path.is_dir() or path.suffix not in (".jsonl", ".json", ".ndjson", ".tsv", ".tab"):
        return None
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def build_block_store(corpus: str | os.PathLike, out: str | os.PathLike, hf_tokenizer, *, cfg: BlockConfig = BlockConfig(),
                      files: FileFilter = EVERY_FILE, show_progress: bool = True) -> "BlockStore":
    """Stream `corpus` (of a folder: the files `files` picks) into a block store at `out`
    (published atomically when complete)."""
    corpus = Path(corpus)
    total = _count_documents(corpus) if corpus.exists() else None
    id_hashes, file_hashes = array("q"), array("q")
    with atomic_path(out) as tmp:
        tmp.mkdir()
        tokens = RaggedWriter(tmp / "tokens", np.int32)
        body_start, doc_index, line_offsets = array("i"), array("q"), array("q", [0])
        n_docs = 0
        with open(tmp / "blocks.jsonl", "wb") as meta, progress_bar(show_progress) as bar:
            task = bar.add_task("blocking", total=total)
            for doc, blocks in iter_blocks(read_corpus(corpus, files=files), hf_tokenizer, cfg):
                id_hashes.append(id_hash(doc.id))
                file_hashes.append(id_hash(file_of(doc.id)))
                for size in _append_blocks(doc, blocks, n_docs, tokens=tokens, body_start=body_start, doc_index=doc_index, meta=meta):
                    line_offsets.append(line_offsets[-1] + size)
                n_docs += 1
                bar.advance(task)
        tokens.close()
        _check_unique_ids(np.frombuffer(id_hashes, dtype=np.int64), corpus, files)
        np.save(tmp / "body_start.npy", np.frombuffer(body_start, dtype=np.int32))
        np.save(tmp / "doc_index.npy", np.frombuffer(doc_index, dtype=np.int64))
        np.save(tmp / "doc_hash.npy", np.frombuffer(id_hashes, dtype=np.int64))
        np.save(tmp / "file_hash.npy", np.frombuffer(file_hashes, dtype=np.int64))
        np.save(tmp / "blocks.idx.npy", np.frombuffer(line_offsets, dtype=np.int64))
        manifest = {
            "format": FORMAT,
            "count": len(tokens),
            "documents": n_docs,
            "config": asdict(cfg),
            "tokenizer": tokenizer_fingerprint(hf_tokenizer),
            "corpus": str(corpus.resolve()),
            "corpus_fingerprint": corpus_fingerprint(corpus, files=files),
        }
        manifest_file(tmp).write_text(json.dumps(manifest, indent=2) + "\n")
    return BlockStore(out)


def ensure_block_store(folder: str | os.PathLike, corpus: str | os.PathLike, hf_tokenizer, *, cfg: BlockConfig = BlockConfig(),
                       files: FileFilter = EVERY_FILE, show_progress: bool = True) -> tuple[str, "BlockStore"]:
    """(key, store): the block store of this corpus (its files `files` picks) + tokenizer +
    config, kept in `folder` under a key of all three, so it is built once and reused."""
    if not Path(corpus).exists():
        raise RalmError(f"corpus not found: {corpus}")
    raw = json.dumps([corpus_fingerprint(corpus, files=files), tokenizer_fingerprint(hf_tokenizer), asdict(cfg)], sort_keys=True)
    key = hashlib.sha256(raw.encode()).hexdigest()[:16]
    path = Path(folder) / key
    if not manifest_file(path).is_file():
        build_block_store(corpus, path, hf_tokenizer, cfg=cfg, files=files, show_progress=show_progress)
    return key, BlockStore(path)


def _append_blocks(doc: Document, blocks: list[Block], ordinal: int, *, tokens: RaggedWriter, body_start: array,
                   doc_index: array, meta) -> list[int]:
    """Write the blocks of `doc`, the `ordinal`-th document, into a store being built; returns
    the byte length of each one's blocks.jsonl line."""
    sizes = []
    for b in blocks:
        tokens.append(b.token_ids)
        body_start.append(b.body_start)
        doc_index.append(ordinal)
        row = {"id": b.id, "doc_id": doc.id, "title": doc.title, "text": doc.text[b.char_span[0]:b.char_span[1]]}
        line = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
        meta.write(line)
        sizes.append(len(line))
    return sizes


def compact_block_store(source: BlockStore, keep: np.ndarray, docs: Iterable[tuple[Document, list[Block]]],
                        out: str | os.PathLike, *, origin: dict) -> BlockStore:
    """A block store (published atomically at `out`) of `source`'s rows `keep`, ascending,
    copied a run of consecutive rows at a time, then the blocks of `docs` (an index's
    compaction: its version minus hidden documents, plus its live ones). `origin` goes into its
    manifest, saying what it was made from."""
    source.check_line_offsets()  # runs of records are copied by their offsets
    runs = np.split(keep, np.flatnonzero(np.diff(keep) != 1) + 1) if len(keep) else []
    kept_docs, doc_index = np.unique(source.doc_index[keep], return_inverse=True)  # the kept documents, renumbered in order
    rows = source.document_rows()
    id_hashes = array("q", rows.hashes[kept_docs].astype(np.int64).tobytes())
    file_hashes = array("q", rows.file_hashes[kept_docs].astype(np.int64).tobytes())
    doc_index, body_start = array("q", doc_index.astype(np.int64).tobytes()), array("i", source.body_start[keep].astype(np.int32).tobytes())
    with atomic_path(out) as tmp:
        tmp.mkdir()
        tokens = RaggedWriter(tmp / "tokens", np.int32)
        offsets, line_offsets = source.tokens.offsets, source._line_offsets
        n_docs = int(doc_index[-1]) + 1 if len(doc_index) else 0
        with open(tmp / "blocks.jsonl", "wb") as meta:
            for run in runs:
                a, b = int(run[0]), int(run[-1]) + 1
                tokens.extend(source.tokens.values[offsets[a]:offsets[b]], np.diff(offsets[a:b + 1]))
                meta.write(os.pread(source._meta.fileno(), int(line_offsets[b] - line_offsets[a]), int(line_offsets[a])))
            lengths = [np.diff(line_offsets)[keep]]
            for doc, blocks in docs:
                lengths.append(np.array(_append_blocks(doc, blocks, n_docs, tokens=tokens, body_start=body_start, doc_index=doc_index,
                                                       meta=meta), dtype=np.int64))
                id_hashes.append(id_hash(doc.id))
                file_hashes.append(id_hash(file_of(doc.id)))
                n_docs += 1
        tokens.close()
        np.save(tmp / "doc_hash.npy", np.frombuffer(id_hashes, dtype=np.int64))
        np.save(tmp / "file_hash.npy", np.frombuffer(file_hashes, dtype=np.int64))
        np.save(tmp / "body_start.npy", np.frombuffer(body_start, dtype=np.int32))
        np.save(tmp / "doc_index.npy", np.frombuffer(doc_index, dtype=np.int64))
        np.save(tmp / "blocks.idx.npy", np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int64))
        manifest = {**source.manifest, "count": len(tokens), "documents": n_docs, "origin": origin}
        manifest_file(tmp).write_text(json.dumps(manifest, indent=2) + "\n")
    return BlockStore(out)


def _check_unique_ids(hashes: np.ndarray, corpus: Path, files: FileFilter) -> None:
    order = np.sort(hashes)
    dup = order[1:][order[1:] == order[:-1]]
    if len(dup):
        target = int(dup[0])
        seen = 0
        for doc in read_corpus(corpus, files=files):
            if id_hash(doc.id) == target:
                seen += 1
                if seen == 2:
                    raise RalmError(f"{corpus}: document id {doc.id!r} appears more than once; ids must be unique")


class BlockStore:
    """Read-only, memory-mapped view of a block store folder."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder, FORMAT, "block store")
        self.tokens = RaggedArray(self.folder / "tokens")
        self.body_start = read_npy(self.folder / "body_start.npy")
        self.doc_index = read_npy(self.folder / "doc_index.npy")
        self._line_offsets = read_npy(self.folder / "blocks.idx.npy")
        self._check_sizes()
        self._meta = open(self.folder / "blocks.jsonl", "rb")
        self._documents: DocumentRows | None = None

    def _check_sizes(self) -> None:
        """Every file holds one entry per block, and blocks.jsonl ends where its index says:
        a truncated or overwritten file is named here, not met as a crash in mid-search."""
        n = self.manifest.get("count")
        sizes = {"tokens/offsets.npy": len(self.tokens), "body_start.npy": len(self.body_start),
                 "doc_index.npy": len(self.doc_index), "blocks.idx.npy": len(self._line_offsets) - 1}
        for name, size in sizes.items():
            if size != n:
                raise RalmError(f"{self.folder / name} is damaged ({size} entries for {n} blocks); rebuild the index")
        meta = self.folder / "blocks.jsonl"
        size, expected = (meta.stat().st_size if meta.is_file() else 0), int(self._line_offsets[-1])
        self._meta_size = size
        if size != expected:
            raise RalmError(f"{meta} is damaged ({size} bytes, its index says {expected}); rebuild the index")

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"BlockStore({str(self.folder)!r}, blocks={len(self)}, config={self.manifest['config']})"

    @property
    def config(self) -> BlockConfig:
        return BlockConfig(**self.manifest["config"])

    def record(self, i: int) -> dict:
        """{"id", "doc_id", "title", "text"} of block i, read from disk on demand."""
        start, end = int(self._line_offsets[i]), int(self._line_offsets[i + 1])
        # offsets are bytes of blocks.idx.npy: checked against the data file (its size checked at
        # open) before any read, so a flipped one is named, never a read of petabytes
        if not 0 <= start < end <= self._meta_size:
            raise RalmError(f"{self.folder / 'blocks.idx.npy'} is damaged (block {i} at bytes {start}..{end}, outside "
                            f"blocks.jsonl's {self._meta_size}); rebuild the index")
        before = 1 if start else 0  # a record starts after a line's end: one byte more read shows it
        line = os.pread(self._meta.fileno(), end - start + before, start - before)
        if not line.endswith(b"\n") or (before and line[0] != 0x0A):  # which of the two was overwritten cannot be told
            raise RalmError(f"{self.folder / 'blocks.jsonl'} is damaged (block {i} at bytes {start}..{end} is not one of its "
                            "lines), or blocks.idx.npy is; rebuild the index")
        try:
            return json.loads(line[before:])
        except ValueError:  # JSON or UTF-8: bytes overwritten in place
            raise RalmError(f"{self.folder / 'blocks.jsonl'} is damaged (block {i} is not a JSON record); rebuild the index") from None

    def check_line_offsets(self) -> None:
        """Every offset in blocks.idx.npy rises from 0 to blocks.jsonl's end (a scan of it: a
        compaction's, which copies records by their offsets; a search checks the two it reads)."""
        offsets = np.asarray(self._line_offsets)
        if len(offsets) and (offsets[0] != 0 or not (np.diff(offsets) > 0).all()):
            raise RalmError(f"{self.folder / 'blocks.idx.npy'} is damaged (its offsets do not rise from 0 to the end of "
                            "blocks.jsonl); rebuild the index")

    def records(self, rows: Iterable[int]) -> list[dict]:
        return [self.record(int(i)) for i in rows]

    def document_rows(self) -> DocumentRows:
        """document id -> its block rows (built once, on first use)."""
        if self._documents is None:
            self._documents = DocumentRows(self)
        return self._documents

    def body(self, i: int) -> np.ndarray:
        """Body wordpieces of block i, without [CLS] title [SEP] and the final [SEP]."""
        return self.tokens[i][int(self.body_start[i]) : -1]

    def close(self) -> None:
        self._meta.close()


class DocumentRows:
    """document id -> range of its block rows (a document's blocks are consecutive), or None:
    found by the id's hash in doc_hash.npy and confirmed by the block's record, so a lookup reads
    one record, not blocks.jsonl; file name -> its documents (`of_file`) alike, by file_hash.npy.
    A store written before doc_hash.npy (or file_hash.npy) existed hashes the ids once, reading
    one record per document."""

    def __init__(self, store: BlockStore):
        self.store = store
        starts = np.flatnonzero(np.diff(store.doc_index, prepend=-1))  # first row of each document
        self.bounds = np.append(starts, len(store))  # document d: rows bounds[d]:bounds[d + 1]
        path = store.folder / "doc_hash.npy"
        self._ids: list[str] | None = None  # every document id, read on first need
        self._file_index: tuple[np.ndarray, np.ndarray] | None = None  # built by `file_index`
        if path.is_file():
            hashes = read_npy(path, None)
        else:
            self._ids = [store.record(int(r))["doc_id"] for r in starts]
            hashes = np.array([id_hash(i) for i in self._ids], dtype=np.int64)
        if len(hashes) != len(starts):
            raise RalmError(f"{path} is damaged ({len(hashes)} entries for {len(starts)} documents); rebuild the index")
        self.hashes = hashes  # in document order
        self.order = np.argsort(hashes, kind="stable")  # documents by hash
        self.sorted = hashes[self.order]

    def get(self, doc_id: str, default=None) -> range | None:
        h = id_hash(doc_id)
        found = self._confirmed(doc_id, np.searchsorted(self.sorted, h, "left"), np.searchsorted(self.sorted, h, "right"))
        return default if found is None else found

    def _confirmed(self, doc_id: str, lo: int, hi: int) -> range | None:
        """The rows of the document among those whose hash sits at sorted[lo:hi], by its record."""
        for d in self.order[lo:hi]:
            start, end = int(self.bounds[d]), int(self.bounds[d + 1])
            if self.store.record(start)["doc_id"] == doc_id:
                return range(start, end)
        return None

    def rows_of(self, doc_ids: Iterable[str]) -> np.ndarray:
        """The rows of those of `doc_ids` the store holds, sorted: one search for every hash, a
        record read only where a hash is held (a replay hides thousands of documents at once,
        most of them new ids)."""
        ids = list(doc_ids)
        hashes = np.fromiter((id_hash(i) for i in ids), np.int64, len(ids))
        lo, hi = np.searchsorted(self.sorted, hashes, "left"), np.searchsorted(self.sorted, hashes, "right")
        rows = [r for j in np.flatnonzero(hi > lo) for r in self._confirmed(ids[j], lo[j], hi[j]) or ()]
        return np.array(sorted(rows), dtype=np.int64)

    def __contains__(self, doc_id: str) -> bool:
        return self.get(doc_id) is not None

    @cached_property
    def file_hashes(self) -> np.ndarray:
        """The hash of each document's file name (`file_of` its id), in document order, from
        file_hash.npy; a store written before it existed hashes every id once (a record read
        per document, on the first lookup of a file, not at open)."""
        path = self.store.folder / "file_hash.npy"
        hashes = read_npy(path, None) if path.is_file() else np.array([id_hash(file_of(i)) for i in self], dtype=np.int64)
        if len(hashes) != len(self.hashes):
            raise RalmError(f"{path} is damaged ({len(hashes)} entries for {len(self.hashes)} documents); rebuild the index")
        return hashes

    def file_index(self) -> tuple[np.ndarray, np.ndarray]:
        """(the documents in order of their file's hash, those hashes): what `of_file` searches,
        built once, at its first use (a writer builds it before it takes the lock)."""
        if self._file_index is None:
            order = np.argsort(self.file_hashes, kind="stable")  # a file's documents in document order
            self._file_index = order, self.file_hashes[order]
        return self._file_index

    def of_file(self, name: str) -> list[str]:
        """The ids of the documents of file `name` (those whose `file_of` is `name`: its own id's
        and its sections' and pages'), in document order: one search for the name's hash, one
        record read per document it finds (confirming it), none of the other documents'."""
        order, hashes = self.file_index()
        h = id_hash(name)
        found = order[np.searchsorted(hashes, h, "left"):np.searchsorted(hashes, h, "right")]
        ids = (self.store.record(int(self.bounds[d]))["doc_id"] for d in np.sort(found))
        return [i for i in ids if file_of(i) == name]

    def __iter__(self) -> Iterator[str]:
        """Every document id, in document order: read once (a record per document), then kept
        (what a store without file_hash.npy hashes the file names of)."""
        if self._ids is None:
            self._ids = [self.store.record(int(r))["doc_id"] for r in self.bounds[:-1]]
        return iter(self._ids)


def join_query_evidence(query_ids: list[int], body_ids, *, cls_id: int, sep_id: int,
                        max_len: int = GEOMETRY.block_len, max_query_len: int = GEOMETRY.query_len,
                        title_ids: list[int] | None = None) -> tuple[list[int], list[int], int]:
    """`[CLS] x [SEP] z_body [SEP]`, the knowledge-augmented encoder's and reader's input, or with
    `title_ids` `[CLS] x [SEP] z_title [SEP] z_body [SEP]` (REALM's join(x, z) with z = title +
    body, as a retrieval block is): the title says what the body is about ("he", "the office").

    Returns (input_ids, token_type_ids, evidence_start): evidence_start is the body's first
    wordpiece. The query is cut to `max_query_len` wordpieces and the evidence to what is left of
    `max_len`; the title counts as evidence (token type 1).
    """
    q = list(query_ids)[:max_query_len]
    title = [] if title_ids is None else [*title_ids, sep_id]
    room = max(max_len - len(q) - 3 - len(title), 0)
    z = [int(t) for t in body_ids[:room]]
    ids = [cls_id, *q, sep_id, *title, *z, sep_id]
    types = [0] * (len(q) + 2) + [1] * (len(title) + len(z) + 1)
    return ids, types, len(q) + 2 + len(title)
