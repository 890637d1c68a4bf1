"""Salient spans from spaCy, cached and resumable; salient and random masking."""

from __future__ import annotations

import numpy as np
import pytest

from ralm.data.blocks import BlockStore, build_block_store
from ralm.data.masking import (
    MaskingConfig,
    SentenceConfig,
    SentenceTable,
    find_sentences,
    load_spacy,
    mask_sentence,
    masked_batch,
)
from ralm.errors import RalmError


@pytest.fixture(scope="module")
def nlp():
    return load_spacy()


@pytest.fixture(scope="module")
def tokenizer(tiny_bert):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_bert))


@pytest.fixture(scope="module")
def blocks(tmp_path_factory, tokenizer) -> BlockStore:
    import json

    from conftest import DOCS

    root = tmp_path_factory.mktemp("masking")
    corpus = root / "c.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    return build_block_store(corpus, root / "blocks", tokenizer, show_progress=False)


@pytest.fixture(scope="module")
def table(blocks, tokenizer, nlp, tmp_path_factory) -> SentenceTable:
    return find_sentences(blocks, tokenizer, tmp_path_factory.mktemp("sent") / "s", show_progress=False, nlp=nlp)


def _decode(tokenizer, ids) -> str:
    return tokenizer.decode([int(i) for i in ids])


def test_sentences_and_salient_spans(table, blocks, tokenizer):
    sentences = [_decode(tokenizer, table.tokens(blocks, s)) for s in range(len(table))]
    assert "paris is the capital of france." in sentences
    assert len(table) == 13  # every sentence of DOCS (none shorter than 4 wordpieces)
    spans = {_decode(tokenizer, table.tokens(blocks, s)[a:b]) for s in range(len(table)) for a, b in table.salient_spans(s)}
    assert {"paris", "france", "1889", "tokyo", "japan", "guido van rossum", "1969"} <= spans
    # sentences know their block, and through it their source document
    s = sentences.index("tokyo is the capital of japan.")
    assert blocks.record(int(table.rows[s]))["doc_id"] == "tokyo"


def test_cache_is_reused_without_spacy(table, blocks, tokenizer):
    class NoSpacy:
        def pipe(self, *a, **k):
            raise AssertionError("spaCy ran again")

    again = find_sentences(blocks, tokenizer, table.folder, show_progress=False, nlp=NoSpacy())
    assert np.array_equal(again.rows, table.rows) and np.array_equal(again.spans, table.spans)


def test_pass_resumes_after_a_kill(blocks, tokenizer, nlp, table, tmp_path):
    """A kill after the first shard keeps it; the rerun only processes the rest and yields the
    same table as an uninterrupted pass."""
    cfg = SentenceConfig(shard_size=2)

    class DiesAfterFirstShard:
        calls = 0

        def pipe(self, texts, batch_size):
            DiesAfterFirstShard.calls += 1
            if DiesAfterFirstShard.calls > 1:
                raise KeyboardInterrupt
            return nlp.pipe(texts, batch_size=batch_size)

    out = tmp_path / "s"
    with pytest.raises(KeyboardInterrupt):
        find_sentences(blocks, tokenizer, out, cfg=cfg, show_progress=False, nlp=DiesAfterFirstShard())
    assert not out.exists() and len(list((tmp_path / ".s.shards").glob("*.npz"))) == 1

    seen = []

    class Counting:
        def pipe(self, texts, batch_size):
            seen.extend(texts)
            return nlp.pipe(texts, batch_size=batch_size)

    resumed = find_sentences(blocks, tokenizer, out, cfg=cfg, show_progress=False, nlp=Counting())
    assert len(seen) == len(blocks) - 2
    for name in ("rows", "starts", "ends", "span_offsets", "spans"):
        assert np.array_equal(getattr(resumed, name), getattr(table, name))


def test_salient_masking_masks_one_whole_span(table, blocks, tokenizer):
    cfg = MaskingConfig("salient")
    s = next(s for s in range(len(table)) if len(table.salient_spans(s)) >= 2)
    tokens = table.tokens(blocks, s)
    spans = {(int(a), int(b)) for a, b in table.salient_spans(s)}
    masked_spans = set()
    for seed in range(20):
        m = mask_sentence(tokens, table.salient_spans(s), cfg, mask_id=tokenizer.mask_token_id, rng=np.random.default_rng(seed),
                          doc=3)
        span = (m.positions[0], m.positions[-1] + 1)
        assert span in spans and m.positions == list(range(*span))
        assert m.labels == tokens[span[0]:span[1]].tolist()
        assert [t for i, t in enumerate(m.ids) if i not in m.positions] == [t for i, t in enumerate(tokens.tolist()) if i not in m.positions]
        assert all(m.ids[p] == tokenizer.mask_token_id for p in m.positions)
        masked_spans.add(span)
    assert len(masked_spans) >= 2  # the span is chosen at random


def test_random_masking_rate_and_determinism(table, blocks, tokenizer):
    cfg = MaskingConfig("random", random_prob=0.15)
    tokens = np.arange(1000, 1200)
    m = mask_sentence(tokens, np.zeros((0, 2)), MaskingConfig("random", max_len=200), mask_id=103, rng=np.random.default_rng(0),
                      doc=0)
    assert 15 <= len(m.positions) <= 45 and m.labels == [1000 + p for p in m.positions]
    one = mask_sentence(np.arange(5), np.zeros((0, 2)), MaskingConfig("random", random_prob=1e-9), mask_id=103,
                        rng=np.random.default_rng(0), doc=0)
    assert len(one.positions) == 1  # at least one wordpiece is always masked
    a = masked_batch(table, blocks, [0, 3, 5], cfg=cfg, mask_id=103, seed=1, step=7)
    b = masked_batch(table, blocks, [0, 3, 5], cfg=cfg, mask_id=103, seed=1, step=7)
    c = masked_batch(table, blocks, [0, 3, 5], cfg=cfg, mask_id=103, seed=1, step=8)
    assert a == b and a != c
    assert [e.doc for e in a] == [int(blocks.doc_index[int(table.rows[s])]) for s in (0, 3, 5)]


def test_salient_selection_and_errors(table):
    usable = table.with_spans(62)
    assert all(len(table.salient_spans(s)) for s in usable)
    assert len(table.with_spans(1)) < len(usable)
    with pytest.raises(RalmError, match="salient"):
        mask_sentence(np.arange(5), np.zeros((0, 2), dtype=np.int32), MaskingConfig(), mask_id=103,
                      rng=np.random.default_rng(0), doc=0)
    with pytest.raises(RalmError, match="masking"):
        MaskingConfig("bert")
