"""LM text loading, chunk layout, neighbour exclusion by document, and the RETRO chunk DB
(keys = frozen mean-pooled BERT; build atomic and resumable; search = brute force)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ralm.data.chunks import (LMDocument, TokenStream, chunk_values, context_windows, doc_hash, exclude_same_document,
                              read_lm_documents, tokenize_text)
from ralm.errors import RalmError

WIKI = """ 
 = Alpha river = 
 
 The Alpha river flows north . It is long . 
 
 = = Course = = 
 
 It passes three towns . 
 
 = Beta mountain = 
 
 Beta is a tall mountain . 
"""


def test_wikitext_articles_keep_their_sections(tmp_path):
    path = tmp_path / "wiki.valid.raw"
    path.write_text(WIKI)
    docs = read_lm_documents(path)
    assert [d.key for d in docs] == ["Alpha river", "Beta mountain"]
    assert "= = Course = =" in docs[0].text and "three towns" in docs[0].text


def test_corpus_paragraphs_of_one_article_form_one_document(tmp_path):
    path = tmp_path / "c.jsonl"
    rows = [{"id": "A#0", "title": "A", "text": "one"}, {"id": "A#1", "title": "A", "text": "two"},
            {"id": "B#0", "title": "B", "text": "three"}, {"id": "x", "title": "", "text": "four"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_lm_documents(path) == [LMDocument("A", "one\ntwo"), LMDocument("B", "three"), LMDocument("x", "four")]
    with pytest.raises(RalmError, match="not found"):
        read_lm_documents(tmp_path / "missing.txt")


def test_token_stream_separates_documents_and_limits(tmp_path, tiny_bert):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_bert))
    path = tmp_path / "wiki.raw"
    path.write_text(WIKI)
    s = tokenize_text(path, tok, show_progress=False)
    sep = tok.sep_token_id
    assert s.tokens[s.doc_starts[1] - 1] == sep and s.tokens[-1] == sep
    assert list(s.doc_hashes) == [doc_hash("Alpha river"), doc_hash("Beta mountain")]
    assert s.words == sum(len(d.text.split()) for d in read_lm_documents(path))
    cut = tokenize_text(path, tok, limit_tokens=5, show_progress=False)
    np.testing.assert_array_equal(cut.tokens, s.tokens[:5])


def test_chunk_docs_and_values():
    s = TokenStream(np.arange(10, dtype=np.int32), np.array([0, 3, 10]), np.array([11, 22]), 0)
    np.testing.assert_array_equal(s.chunk_docs(4), [[11, 22], [22, 22], [22, 22]])  # chunk 0 spans both
    values, mask = chunk_values(s.tokens, s.doc_starts, np.array([[1, -1, 0]]), chunk_len=4, pad_id=-5)
    np.testing.assert_array_equal(values[0, 0], [4, 5, 6, 7, 8, 9, -5, -5])  # chunk + the continuation that exists
    assert mask[0, 0].sum() == 6 and not mask[0, 1].any()
    np.testing.assert_array_equal(values[0, 2], np.arange(8))  # continues the document of its last token


@pytest.mark.parametrize("doc_starts,value", [([0, 6, 12], [0, 1, 2, 3, 4, 5]),  # the next document starts at 6
                                              ([0, 4, 12], [0, 1, 2, 3]),  # the document ends with the chunk
                                              ([0, 2, 5, 12], [0, 1, 2, 3, 4])])  # chunk 0 spans two documents
def test_continuation_stops_at_the_document_boundary(doc_starts, value):
    values, mask = chunk_values(np.arange(12, dtype=np.int32), np.array(doc_starts), np.array([0]), chunk_len=4, pad_id=-1)
    np.testing.assert_array_equal(values[0], value + [-1] * (8 - len(value)))
    np.testing.assert_array_equal(mask[0], np.arange(8) < len(value))


def test_exclude_same_document_by_hand():
    db_docs = np.array([[1, 1], [1, 2], [3, 3], [4, 4], [2, 2]])
    cand = np.array([[0, 1, 2, 3, 4], [4, 2, 1, 0, -1]])
    query = np.array([[1, 1], [2, 3]])
    np.testing.assert_array_equal(exclude_same_document(cand, query, db_docs, 2), [[2, 3], [0, -1]])


@pytest.mark.parametrize("seq_len,stride,align", [(8, 4, 1), (8, 8, 1), (8, 4, 4), (12, 4, 4)])
def test_context_windows_score_each_position_once_with_context(seq_len, stride, align):
    n = 37
    scored = []
    for a, b, s in context_windows(0, n, seq_len=seq_len, stride=stride, align=align):
        assert b - a <= seq_len and a % align == 0 and a <= s < b
        assert s - a >= min(s, seq_len - stride - align + 1)  # context, less only at the start / by alignment
        scored.extend(range(s, b))
    assert scored == list(range(n))


# -- the chunk DB -----------------------------------------------------------------------------

def _corpus(tmp_path):
    from conftest import DOCS

    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    return path


def test_chunk_db_keys_are_frozen_mean_pooled_bert(tmp_path, tiny_bert):
    from ralm.retrieval.lm.chunkdb import ChunkDB, build_chunk_db, load_chunk_encoder

    db = ChunkDB(build_chunk_db(_corpus(tmp_path), tmp_path / "db", model=str(tiny_bert), chunk_len=8, show_progress=False,
                                dtype=torch.float32))  # the maths against an fp32 forward pass
    tower, tok, _ = load_chunk_encoder(str(tiny_bert))
    c = 3
    ids = torch.tensor([[tok.cls_token_id, *db.tokens[c * 8 : c * 8 + 8], tok.sep_token_id]])
    with torch.no_grad():
        hidden = tower.bert(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
    mean = hidden.mean(0)
    np.testing.assert_allclose(db.embeddings[c], (mean / mean.norm()).numpy(), rtol=1e-4, atol=1e-5)  # unit keys
    assert len(db) == -(-db.manifest["tokens"] // 8) and db.manifest["dim"] == 32


def test_chunk_db_search_excludes_same_document_like_brute_force(tmp_path, tiny_bert):
    from ralm.retrieval.lm.chunkdb import ChunkDB, build_chunk_db

    db = ChunkDB(build_chunk_db(_corpus(tmp_path), tmp_path / "db", model=str(tiny_bert), chunk_len=8, show_progress=False,
                                dtype=torch.float32))  # the maths against an fp32 forward pass
    q = np.array(db.embeddings[:6])
    got = db.search(q, 3, db.chunk_docs[:6])
    for i in range(6):
        order = np.argsort(-(db.embeddings @ q[i]), kind="stable")
        allowed = [j for j in order if not set(db.chunk_docs[j]) & set(db.chunk_docs[i])]
        assert list(got[i]) == allowed[:3]
        assert not any(set(db.chunk_docs[j]) & set(db.chunk_docs[i]) for j in got[i])
    np.testing.assert_array_equal(db.search(q, 1)[:, 0], np.argmax(q @ np.asarray(db.embeddings).T, axis=1))


def test_chunk_db_values_never_run_into_the_next_document(tmp_path, tiny_bert):
    """Every DB value continues the document of its chunk's last token (the continuation ends
    with that document's [SEP]); a DB built before doc_starts.npy existed finds the same
    boundaries from the [SEP]s."""
    from ralm.retrieval.lm.chunkdb import ChunkDB, build_chunk_db

    path = build_chunk_db(_corpus(tmp_path), tmp_path / "db", model=str(tiny_bert), chunk_len=8, show_progress=False)
    db = ChunkDB(path)
    _, tok = db.encoder()
    stream = tokenize_text(_corpus(tmp_path), tok, show_progress=False)
    np.testing.assert_array_equal(db.doc_starts, stream.doc_starts)
    values, mask = db.values(np.arange(len(db)))
    n_tokens, cut = len(stream.tokens), 0
    doc_of = lambda t: np.searchsorted(stream.doc_starts, t, side="right") - 1  # noqa: E731
    for c in range(len(db)):
        value = values[c][mask[c]]
        np.testing.assert_array_equal(value, stream.tokens[c * 8 : c * 8 + len(value)])  # the text from chunk c on
        last = min(c * 8 + 8, n_tokens) - 1
        assert doc_of(c * 8 + len(value) - 1) == doc_of(last)  # the continuation stays in the chunk's document ...
        if len(value) < min(16, n_tokens - c * 8):  # ... and stops short only at that document's [SEP]
            assert value[-1] == tok.sep_token_id and doc_of(c * 8 + len(value)) != doc_of(last)
            cut += 1
    assert cut > 0
    (path / "doc_starts.npy").unlink()
    np.testing.assert_array_equal(ChunkDB(path).doc_starts, stream.doc_starts)


def test_chunk_db_build_is_atomic_and_resumes(tmp_path, tiny_bert, monkeypatch):
    import ralm.retrieval.lm.chunkdb as chunkdb

    corpus = _corpus(tmp_path)
    clean = chunkdb.ChunkDB(chunkdb.build_chunk_db(corpus, tmp_path / "clean", model=str(tiny_bert), chunk_len=4,
                                                   batch_size=2, block_rows=8, show_progress=False))
    real, calls = chunkdb.embed_chunks, []

    def crashing(tower, tokens, **kw):
        calls.append((kw["start"], kw["end"]))
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed while embedding the second block
        return real(tower, tokens, **kw)

    monkeypatch.setattr(chunkdb, "embed_chunks", crashing)
    out = tmp_path / "db"
    with pytest.raises(KeyboardInterrupt):
        chunkdb.build_chunk_db(corpus, out, model=str(tiny_bert), chunk_len=4, batch_size=2, block_rows=8, show_progress=False)
    assert not out.exists() and (tmp_path / ".db.partial" / "embeddings.npy").is_file()
    with pytest.raises(RalmError, match="unfinished build"):
        chunkdb.ChunkDB(out)
    calls.clear()
    monkeypatch.setattr(chunkdb, "embed_chunks", lambda *a, **kw: (calls.append((kw["start"], kw["end"])), real(*a, **kw))[1])
    db = chunkdb.ChunkDB(chunkdb.build_chunk_db(corpus, out, model=str(tiny_bert), chunk_len=4, batch_size=2, block_rows=8, show_progress=False))
    assert calls and calls[0][0] == 8  # the first block (8 rows) was kept, not recomputed
    np.testing.assert_array_equal(db.embeddings, clean.embeddings)
    np.testing.assert_array_equal(db.tokens, clean.tokens)
    assert not (tmp_path / ".db.partial").exists()
    with pytest.raises(RalmError, match="already exists"):
        chunkdb.build_chunk_db(corpus, out, model=str(tiny_bert), chunk_len=4, show_progress=False)


def test_text_neighbours_are_computed_once(tmp_path, tiny_bert, monkeypatch):
    from ralm.retrieval.lm.chunkdb import ChunkDB, build_chunk_db, text_neighbours

    corpus = _corpus(tmp_path)
    db = ChunkDB(build_chunk_db(corpus, tmp_path / "db", model=str(tiny_bert), chunk_len=8, show_progress=False))
    _, tok = db.encoder()
    stream = tokenize_text(corpus, tok, show_progress=False)
    first = text_neighbours(db, stream, k=2, exclude_same_doc=True, show_progress=False)
    docs = stream.chunk_docs(8, len(first))
    assert not any(set(db.chunk_docs[j]) & set(docs[i]) for i in range(len(first)) for j in first[i] if j >= 0)
    monkeypatch.setattr(db, "search", lambda *a, **kw: pytest.fail("neighbours were looked up again"))
    np.testing.assert_array_equal(text_neighbours(db, stream, k=2, exclude_same_doc=True, show_progress=False), first)
