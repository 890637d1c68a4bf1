"""Retrievers learn on the generated knowledge task (data/knowledge.py), and what they learn
carries over: ICT, DPR and REALM train from a random BERT on the training entities, then must
find the documents of HELD-OUT entities, indexed after training beside the whole training corpus
(as a user adds documents), for sentences or questions that no training step saw. A retriever
that memorised the training names, or learned to match the wording of its own training text,
scores about 0 there. The sizes were chosen on these held-out rows: the smaller ones tried did not
carry over (slow tier).

Each test was seen failing on the towers' gradient cut and on own-document exclusion switched
off (figures: benchmarks/RESULTS.md, "REALM on a knowledge task"):
  gradient cut   REALM: `.detach()` on the query and candidate embeddings in `Realm.forward`,
                 so the towers get no gradient; ICT and DPR: `.detach()` on the pooled vectors
                 in `Tower.forward`, so only the projections train
  exclusion off  ICT: the pseudo-query kept in its block (`ict_pair`). REALM: `exclude_trivial`
                 off. REALM's task makes each notes sentence a document titled by its entity and
                 ends each with a year (`sentence_documents`, `dated`): a masked sentence's own
                 document is its verbatim copy, so the trivial retrieval pays in training, and
                 the held-out sentences' copies are indexed too. Without the exclusion the towers
                 learn to find the copy (first for 0.175 of held-out sentences; with it 0.0).
                 On the task's plain form no retriever ranks its own document first, and the
                 test could not tell. DPR's questions belong to no document: no such exclusion
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ralm.data.corpus import Document, jsonl_lines
from ralm.data.knowledge import KnowledgeConfig, KnowledgeTask, by_source, generate_task
from ralm.encoders.loading import save_random_encoder
from ralm.eval.knowledge import search_recall
from ralm.retrieval.index.build import build_index
from ralm.train.dpr import DPRConfig, train_dpr
from ralm.train.ict import IctConfig, train_ict

pytestmark = pytest.mark.slow  # each trains for 30 s to 2 min on 2 cores

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def small_bert(tmp_path_factory):
    """A random 2-layer BERT whose retrievers mean-pool (a random [CLS] hardly depends on the input)."""
    return save_random_encoder(tmp_path_factory.mktemp("small-bert"), hidden_size=32, layers=2, heads=2, pooling="mean")


def held_out_recall(corpus, model, out, queries: list[str], sources: list[str], *, dim: int) -> float:
    """recall@1 of each query's source document in an index of `corpus` built with `model`."""
    build_index(corpus, out, kind="dense", model=str(model), dim=dim, show_progress=False)
    return search_recall(out, queries, sources)


def held_out_notes(task: KnowledgeTask) -> tuple[list[Document], list[str]]:
    """ICT's task on the held-out entities: each one's first held-out sentence is a query, and a
    notes document of its other sentences (about its other fact: only the name is shared) the
    block it must find. Returns (the documents, the queries)."""
    by_entity, number = by_source(task.eval_sentences), {e.source: n for n, e in enumerate(task.entities)}
    docs = [Document(f"held-out-notes-{number[source]:04d}", f"Notes {number[source]}", " ".join(s.text for s in rest))
            for source, (_, *rest) in by_entity.items()]
    return docs, [first.text for first, *_ in by_entity.values()]


def entity_documents(task: KnowledgeTask) -> list[Document]:
    """Each training entity's fact document, then one document of all its notes sentences
    titled by it: ICT's corpus where the task makes a document of each sentence (a block of
    one sentence makes no ICT pair)."""
    notes = by_source(task.train_sentences)
    fact_docs = [d for d in task.train_docs if d.id in notes]
    return [doc for d in fact_docs for doc in (d, Document(f"entity-notes-{d.id[5:]}", d.title, " ".join(x.text for x in notes[d.id])))]


def test_ict_matches_held_out_entities(small_bert, tmp_path, record_property):
    """ICT trains on the training entities' notes documents (fact documents hold one sentence:
    no ICT pair); a held-out entity's sentence must then find the block of its other sentence."""
    task = generate_task(KnowledgeConfig(train_entities=400, eval_entities=80, seed=1))
    corpus = task.write_corpus(tmp_path / "train.jsonl")
    docs, queries = held_out_notes(task)
    indexed = tmp_path / "indexed.jsonl"
    indexed.write_text(corpus.read_text() + jsonl_lines(docs))
    sources = [d.id for d in docs]
    start = held_out_recall(indexed, small_bert, tmp_path / "start", queries, sources, dim=16)
    cfg = IctConfig(str(corpus), model=str(small_bert), dim=16, steps=500, batch_size=32, lr=2e-3, warmup=5,
                    keep_sentence=0.0, block_len=64, save_every=500, log_every=50, dtype="fp32")
    done = train_ict(cfg, tmp_path / "ict", CPU, show_progress=False)
    end = held_out_recall(indexed, done.retriever, tmp_path / "end", queries, sources, dim=16)
    record_property("held_out_recall_at_1", f"{start:.4f} -> {end:.4f}")  # in --junitxml reports
    assert start < 0.2 and end >= start + 0.5, (start, end)  # with the pseudo-query kept in its block: 0.39


def test_dpr_finds_held_out_fact_documents(small_bert, tmp_path, record_property):
    """DPR trains on questions about the training entities (BM25 positives); questions about the
    held-out entities must then find their fact documents."""
    task = generate_task(KnowledgeConfig(train_entities=400, eval_entities=40, seed=1))
    corpus = task.write_corpus(tmp_path / "train.jsonl")
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in task.questions(held_out=False)))
    held_out = task.questions(held_out=True)
    queries, sources = [q["question"] for q in held_out], [q["source"] for q in held_out]
    indexed = task.write_corpus(tmp_path / "indexed.jsonl", with_eval=True)
    start = held_out_recall(indexed, small_bert, tmp_path / "start", queries, sources, dim=16)
    cfg = DPRConfig(str(questions), str(corpus), model=str(small_bert), dim=16, steps=200, batch_size=16, lr=2e-3,
                    warmup=5, save_every=200, log_every=20, dtype="fp32")
    done = train_dpr(cfg, tmp_path / "dpr", CPU, show_progress=False)
    end = held_out_recall(indexed, done.retriever, tmp_path / "end", queries, sources, dim=16)
    record_property("held_out_recall_at_1", f"{start:.4f} -> {end:.4f}")  # in --junitxml reports
    assert start < 0.2 and end >= start + 0.4, (start, end)


# -- REALM: the retriever learns from the masked-LM loss alone --------------------------------

LENGTHS = {"max_len": 80, "max_query_len": 32, "block_len": 48}


@pytest.fixture(scope="module")
def realm_start(tmp_path_factory):
    """How benchmarks/realm/realm_knowledge.py starts every arm, here on 160 training entities (each
    notes sentence a dated document: see above): a random hidden-64 BERT for the towers (mean
    pooling) and the encoder; the encoder's MLM warm-up on another, 800-entity task (too many
    facts to memorise), each entity one document read with its own block, the masked sentence
    kept in it half the time (it learns to copy, and to read a fact from another wording); 20
    ICT steps for the towers on each entity's documents (the weak start).
    Returns (task, random BERT, ICT run, warm encoder, spaCy pipeline)."""
    from ralm.data.knowledge import save_spacy_pipeline
    from ralm.train.mlm import MlmConfig, warm_up_encoder

    root = tmp_path_factory.mktemp("realm-start")
    task = generate_task(KnowledgeConfig(train_entities=160, eval_entities=40, seed=0, sentence_documents=True, dated=True))
    bert = save_random_encoder(root / "bert", hidden_size=64, layers=2, heads=2, pooling="mean")
    warm = generate_task(KnowledgeConfig(train_entities=800, eval_entities=1, seed=1)).write_corpus(root / "warm.jsonl",
                                                                                                   joined=True)
    spacy_dir = save_spacy_pipeline(root / "spacy")
    mlm = MlmConfig(str(warm), model=str(bert), steps=500, head_steps=0, batch_size=32, lr=1e-3, warmup=20,
                    evidence=1.0, keep_sentence=0.5, spacy_model=str(spacy_dir), save_every=500, log_every=50,
                    dtype="fp32", **LENGTHS)
    encoder = warm_up_encoder(mlm, root / "mlm", CPU, show_progress=False).encoder
    ict_corpus = root / "ict.jsonl"
    ict_corpus.write_text(jsonl_lines(entity_documents(task)))
    ict = IctConfig(str(ict_corpus), model=str(bert), dim=32, steps=20, batch_size=16,
                    lr=1e-3, warmup=5, keep_sentence=0.0, block_len=LENGTHS["block_len"],
                    max_query_len=LENGTHS["max_query_len"], save_every=20, log_every=10, dtype="fp32")
    return task, bert, Path(train_ict(ict, root / "ict", CPU, show_progress=False).run), encoder, spacy_dir


def test_realm_learns_to_retrieve_held_out_facts_from_the_mlm_loss(realm_start, tmp_path, record_property):
    """No retrieval label anywhere: the marginal likelihood alone must teach the towers to find
    the fact document of entities they never trained on, for sentences no training corpus
    holds, in an index that also holds each such sentence's own document (its verbatim copy,
    as a corpus holding it would): a retriever that learned the trivial retrieval, which REALM
    excludes in training, finds the copy instead of the fact."""
    from ralm.train.pretrain import PretrainConfig, pretrain

    task, bert, ict, encoder, spacy_dir = realm_start
    corpus = task.write_corpus(tmp_path / "train.jsonl")
    indexed = tmp_path / "indexed.jsonl"
    own = task.own_documents()
    indexed.write_text(task.write_corpus(tmp_path / "with-eval.jsonl", with_eval=True).read_text() + jsonl_lines(own))
    queries, sources = [s.masked_text for s in task.eval_sentences], [s.source for s in task.eval_sentences]
    start = held_out_recall(indexed, ict / "final" / "retriever", tmp_path / "start", queries, sources, dim=32)
    cfg = PretrainConfig(str(corpus), model=str(bert), init=str(ict), encoder=encoder, mlm_warmup=0, dim=32, steps=400,
                         batch_size=8, k=8, lr=5e-5, warmup=20, retriever_warmup=0, retriever_lr=3e-4,
                         spacy_model=str(spacy_dir), refresh="sync", refresh_every=20, save_every=400, log_every=20,
                         dtype="fp32", **LENGTHS)
    done = pretrain(cfg, tmp_path / "realm", CPU, show_progress=False, notify=lambda m: None)
    end = held_out_recall(indexed, done.retriever, tmp_path / "end", queries, sources, dim=32)
    copies = search_recall(tmp_path / "end", queries, [d.id for d in own])  # the own document ranked first
    record_property("held_out_recall_at_1", f"{start:.4f} -> {end:.4f}, own copy first {copies:.4f}")  # in --junitxml
    assert start < 0.2 and end >= start + 0.4 and copies <= 0.1, (start, end, copies)
