"""The generated knowledge task: deterministic, made of whole wordpieces, facts only where the
task says, and its spaCy pipeline marks exactly the facts as salient spans."""

from __future__ import annotations

import pytest

from ralm.data.blocks import BlockStore, build_block_store
from ralm.data.knowledge import (CITIES, FOUNDERS, MORE_FIRST, MORE_SECOND, NAME_FIRST, NAME_SECOND, KnowledgeConfig, generate_task,
                                 save_spacy_pipeline)
from ralm.data.masking import SentenceConfig, find_sentences, load_spacy
from ralm.encoders.loading import load_tokenizer
from ralm.errors import RalmError
from ralm.eval.knowledge import fact_examples


def test_the_task_is_seeded_and_states_each_fact_in_one_place():
    cfg = KnowledgeConfig(train_entities=12, eval_entities=4, seed=3)
    task = generate_task(cfg)
    assert task == generate_task(cfg) and task != generate_task(KnowledgeConfig(12, 4, seed=4))
    assert len(task.train_docs) == 24 and len(task.eval_docs) == 4 and len(task.eval_sentences) == 8
    held_out = [e for e in task.entities if e.held_out]
    corpus_text = " ".join(d.text for d in task.train_docs)
    for e in held_out:  # a held-out entity is in no training document
        assert e.name not in corpus_text
    for s in task.eval_sentences + task.train_sentences:
        e = next(e for e in task.entities if e.name == s.entity)
        assert s.text[s.span[0]:s.span[1]] == (e.city if s.relation == "city" else e.founder)
        assert s.source == e.source and "[MASK]" in s.masked_text and s.entity in s.masked_text
    with pytest.raises(RalmError, match="at most"):
        KnowledgeConfig(train_entities=len(NAME_FIRST + MORE_FIRST) * len(NAME_SECOND + MORE_SECOND), eval_entities=1)


def test_names_draw_on_the_longer_lists_only_beyond_the_short_ones():
    two = len(NAME_FIRST) * len(NAME_SECOND)
    small = generate_task(KnowledgeConfig(two - 1, 1))
    assert {w for e in small.entities for w in e.name.lower().split()} <= set(NAME_FIRST + NAME_SECOND)
    large = generate_task(KnowledgeConfig(two, 1))
    names = [e.name for e in large.entities]
    assert len(set(names)) == len(names) and {len(n.split()) for n in names} == {2}
    assert {w for n in names for w in n.lower().split()} & set(MORE_FIRST + MORE_SECOND)


def test_every_word_is_one_wordpiece_and_facts_mask_whole():
    tok = load_tokenizer()
    for word in NAME_FIRST + NAME_SECOND + MORE_FIRST + MORE_SECOND + CITIES + FOUNDERS:
        assert len(tok.tokenize(word)) == 1, word
    task = generate_task(KnowledgeConfig(4, 2))
    examples = fact_examples(task.eval_sentences, tok)
    for s, e in zip(task.eval_sentences, examples):
        assert len(e.positions) == 1 and tok.decode(e.labels) == s.text[s.span[0]:s.span[1]].lower()


def test_the_spacy_pipeline_marks_the_facts_as_salient(tmp_path):
    task = generate_task(KnowledgeConfig(3, 1))
    corpus = task.write_corpus(tmp_path / "corpus.jsonl")
    tok = load_tokenizer()
    blocks: BlockStore = build_block_store(corpus, tmp_path / "blocks", tok, show_progress=False)
    pipeline = save_spacy_pipeline(tmp_path / "spacy")
    table = find_sentences(blocks, tok, tmp_path / "sentences", cfg=SentenceConfig(str(pipeline)), show_progress=False)
    values = {w for e in task.entities for w in (e.city.lower(), e.founder.lower())}
    masked = [tok.decode(table.tokens(blocks, s)[a:b].tolist()) for s in range(len(table)) for a, b in table.salient_spans(s)]
    assert masked and set(masked) <= values  # the facts, never the entity names
    assert len(table) == 3 * (1 + 4)  # one fact sentence and four notes sentences per training entity
    with pytest.raises(RalmError, match="could not load the spaCy pipeline"):
        load_spacy(str(tmp_path))


def test_the_joined_corpus_holds_each_training_entity_in_one_document(tmp_path):
    import json

    task = generate_task(KnowledgeConfig(5, 2, seed=1))
    rows = [json.loads(line) for line in task.write_corpus(tmp_path / "joined.jsonl", joined=True).read_text().splitlines()]
    training = [e for e in task.entities if not e.held_out]
    assert [r["id"] for r in rows] == [e.source for e in training]
    for r, e in zip(rows, training):  # the fact statement first, then every notes sentence of the entity
        notes = [s.text for s in task.train_sentences if s.entity == e.name]
        assert r["text"].startswith(f"{e.name} was founded in {e.city} by {e.founder}.") and all(n in r["text"] for n in notes)
    assert len(task.write_corpus(tmp_path / "all.jsonl", joined=True, with_eval=True).read_text().splitlines()) == 7


def test_sentence_documents_and_dates_change_only_the_notes_and_own_the_same_facts():
    """The options REALM's learning test uses: each notes sentence its own document titled by
    its entity, each mention ending in a year; entities, facts and sentence order unchanged."""
    base = generate_task(KnowledgeConfig(6, 2, seed=2))
    task = generate_task(KnowledgeConfig(6, 2, seed=2, sentence_documents=True, dated=True))
    assert task.entities == base.entities
    for a, b in zip(task.train_sentences + task.eval_sentences, base.train_sentences + base.eval_sentences):
        assert a.text.startswith(b.text[:-1] + " in ") and a.text[-6:-1].strip().isdigit() and a.span == b.span
    notes = [d for d in task.train_docs if d.id.startswith("notes-")]
    assert [(d.title, d.text) for d in notes] == [(s.entity, s.text) for s in task.train_sentences]
    own = task.own_documents()  # a held-out sentence's verbatim copy, titled as a notes document
    assert [(d.title, d.text) for d in own] == [(s.entity, s.text) for s in task.eval_sentences]
    assert len({d.id for d in task.train_docs + own}) == len(task.train_docs + own)


def test_the_joined_corpus_is_the_same_whichever_way_the_notes_are_split(tmp_path):
    split = generate_task(KnowledgeConfig(5, 2, seed=1, sentence_documents=True))
    joined = generate_task(KnowledgeConfig(5, 2, seed=1))
    a = split.write_corpus(tmp_path / "a.jsonl", joined=True).read_text()
    assert a == joined.write_corpus(tmp_path / "b.jsonl", joined=True).read_text()
