"""Language-model text: documents -> one token stream, and its RETRO chunk layout.

Text: a corpus file (JSONL/TSV/folder, read by data/corpus.py; consecutive records with the
same title form one article) or a raw .txt/.raw file (WikiText: articles start at
` = Title = ` lines). Documents become one token stream, each followed by [SEP].

Chunks (RETRO): chunk c of a stream is tokens[c*m : (c+1)*m]; its value in a chunk DB is the
chunk plus its continuation in its document, tokens[c*m : (c+2)*m] cut at the end of the
document of the chunk's last token (with its [SEP]). A chunk belongs to the documents of its
first and last token, recorded as 64-bit hashes of the document key (article title, else id),
so that training can exclude neighbours from the query's own document (`exclude_same_document`).
The database itself (keys, search) is retrieval/lm/chunkdb.py.

Dimensions: T tokens, N chunks, m chunk length, Q queries, C candidates, k neighbours.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ralm.data.blocks import wordpiece_tokenizer
from ralm.data.corpus import read_corpus
from ralm.errors import RalmError
from ralm.progress import track

_WIKITEXT_TITLE = re.compile(r"^ ?= ([^=].*[^=]) = ?$")  # " = Title = "; sections have "= =" or more


# -- text -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class LMDocument:
    key: str  # what "same document" means: the article title, else the record id
    text: str


def read_lm_documents(path: str | os.PathLike) -> list[LMDocument]:
    """Articles of a corpus file or of a raw WikiText-style .txt/.raw file."""
    path = Path(path)
    if not path.exists():
        raise RalmError(f"text not found: {path}")
    if path.is_file() and path.suffix in (".txt", ".raw", ".tokens"):
        return _read_raw(path)
    docs: list[LMDocument] = []
    for d in read_corpus(path):
        key = d.title or d.id
        if docs and docs[-1].key == key:
            docs[-1] = LMDocument(key, docs[-1].text + "\n" + d.text)
        else:
            docs.append(LMDocument(key, d.text))
    return docs


def _read_raw(path: Path) -> list[LMDocument]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise RalmError(f"{path}: not valid UTF-8 (byte {e.start})") from None
    docs, title, body = [], path.stem, []
    for line in lines:
        m = _WIKITEXT_TITLE.match(line)
        if m:
            if any(s.strip() for s in body):
                docs.append(LMDocument(title, "\n".join(s.strip() for s in body if s.strip())))
            title, body = m.group(1).strip(), []
        else:
            body.append(line)
    if any(s.strip() for s in body):
        docs.append(LMDocument(title, "\n".join(s.strip() for s in body if s.strip())))
    if not docs:
        raise RalmError(f"{path}: the text is empty")
    return docs


def doc_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little", signed=True)


@dataclass
class TokenStream:
    tokens: np.ndarray  # int32 [T]: each document's wordpieces followed by [SEP]
    doc_starts: np.ndarray  # int64 [n_docs + 1]: offset of each document in `tokens`
    doc_hashes: np.ndarray  # int64 [n_docs]: doc_hash of each document key
    words: int  # whitespace-separated words of the text, for word-level perplexity

    def fingerprint(self) -> str:
        return hashlib.sha256(np.ascontiguousarray(self.tokens).tobytes()).hexdigest()[:16]

    def chunk_docs(self, chunk_len: int, count: int | None = None) -> np.ndarray:
        """[N, 2] document hashes of the first and last token of each chunk."""
        n = count if count is not None else -(-len(self.tokens) // chunk_len)
        first = np.arange(n, dtype=np.int64) * chunk_len
        last = np.minimum(first + chunk_len, len(self.tokens)) - 1
        doc = lambda t: self.doc_hashes[np.searchsorted(self.doc_starts, t, side="right") - 1]  # noqa: E731
        return np.stack([doc(first), doc(last)], axis=1)


def tokenize_text(path: str | os.PathLike, hf_tokenizer, limit_tokens: int | None = None,
                  show_progress: bool = True) -> TokenStream:
    """The token stream of a text file or corpus; `limit_tokens` keeps a prefix (whole documents
    plus the cut one)."""
    docs = read_lm_documents(path)
    tok = wordpiece_tokenizer(hf_tokenizer)
    sep = hf_tokenizer.sep_token_id
    if sep is None:
        raise RalmError("the tokenizer has no [SEP]/end-of-text token to separate documents")
    pieces, starts, hashes, words, total = [], [0], [], 0, 0
    batch = 256
    for i in track(range(0, len(docs), batch), -(-len(docs) // batch), "tokenizing", show_progress):
        for d, enc in zip(docs[i : i + batch], tok.encode_batch([d.text for d in docs[i : i + batch]], add_special_tokens=False)):
            ids = np.asarray(enc.ids + [sep], dtype=np.int32)
            words += len(d.text.split())
            pieces.append(ids)
            hashes.append(doc_hash(d.key))
            total += len(ids)
            starts.append(total)
            if limit_tokens and total >= limit_tokens:
                break
        if limit_tokens and total >= limit_tokens:
            break
    tokens = np.concatenate(pieces)
    if limit_tokens and len(tokens) > limit_tokens:
        words = round(words * limit_tokens / len(tokens))  # the cut document counts pro rata
        tokens = tokens[:limit_tokens]
        starts[-1] = limit_tokens
    return TokenStream(tokens, np.asarray(starts, dtype=np.int64), np.asarray(hashes, dtype=np.int64), words)


def separator_doc_starts(tokens: np.ndarray, sep_id: int) -> np.ndarray:
    """[n_docs + 1] document offsets of a stream whose documents each end with [SEP] (for chunk
    DBs built before their doc_starts.npy was stored)."""
    ends = np.flatnonzero(np.asarray(tokens) == sep_id) + 1
    return np.unique(np.concatenate([[0], ends, [len(tokens)]])).astype(np.int64)


def chunk_values(tokens: np.ndarray, doc_starts: np.ndarray, ids: np.ndarray, *, chunk_len: int,
                 pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Chunk + continuation of chunk ids [...] (-1: none) -> tokens [..., 2m] int64, mask [..., 2m] bool.
    `doc_starts` [n_docs + 1] are the document offsets in `tokens`: the continuation stops where
    the document of the chunk's last token ends (the paper's F: the continuation in its source
    document, never the start of the next one)."""
    flat = ids.reshape(-1)
    out = np.full((len(flat), 2 * chunk_len), pad_id, dtype=np.int64)
    mask = np.zeros((len(flat), 2 * chunk_len), dtype=bool)
    for row, c in enumerate(flat):
        if c >= 0:
            last = min((c + 1) * chunk_len, len(tokens)) - 1
            doc_end = doc_starts[np.searchsorted(doc_starts, last, side="right")]
            value = tokens[c * chunk_len : min((c + 2) * chunk_len, doc_end)]
            out[row, : len(value)] = value
            mask[row, : len(value)] = True
    return out.reshape(*ids.shape, 2 * chunk_len), mask.reshape(*ids.shape, 2 * chunk_len)


def exclude_same_document(ids: np.ndarray, query_docs: np.ndarray, db_docs: np.ndarray, k: int) -> np.ndarray:
    """The first k candidates of each row whose documents differ from the query's.

    ids [Q, C] candidate chunk ids, best first (-1: none); query_docs [Q, 2] and db_docs [N, 2]
    document hashes of first/last tokens. Returns [Q, k] chunk ids, -1 where too few remain.
    """
    cand_docs = db_docs[np.maximum(ids, 0)]  # [Q, C, 2]
    same = (cand_docs[:, :, :, None] == query_docs[:, None, None, :]).any(axis=(2, 3))  # [Q, C]
    keep = (ids >= 0) & ~same
    out = np.full((len(ids), k), -1, dtype=np.int64)
    for q in range(len(ids)):
        kept = ids[q][keep[q]][:k]
        out[q, : len(kept)] = kept
    return out


def context_windows(start: int, end: int, *, seq_len: int, stride: int, align: int = 1) -> list[tuple[int, int, int]]:
    """Windows (win_start, win_end, score_from) whose scored spans [score_from, win_end) tile
    [start, end) in steps of `stride`; each scored position sees at least seq_len - stride
    earlier tokens (fewer at the start of the text). `align` rounds window starts up to a
    multiple (RETRO windows start on chunk boundaries)."""
    if not 0 < stride <= seq_len:
        raise RalmError(f"stride must be in [1, seq_len={seq_len}], got {stride}")
    out = []
    for a in range(start, end, stride):
        b = min(a + stride, end)
        w = -(-max(0, b - seq_len) // align) * align
        out.append((min(w, a - a % align), b, a))
    return out


def window_batches(windows: list[tuple[int, int, int]], batch_size: int) -> list[list[tuple[int, int, int]]]:
    """Batches of windows of equal length (so they stack without padding)."""
    by_len: dict[int, list] = {}
    for w in windows:
        by_len.setdefault(w[1] - w[0], []).append(w)
    return [group[i : i + batch_size] for group in by_len.values() for i in range(0, len(group), batch_size)]
