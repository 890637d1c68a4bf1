"""Retrievers learn on the generated knowledge task (data/knowledge.py): ICT, DPR and REALM, trained
from a random BERT, must find an entity's fact document far more often than their start did.
REALM gets no retrieval label: its towers learn from the masked-LM loss alone.

Each test fails on a one-line change that breaks learning: misaligned positives in
`train.parallel.in_batch_contrastive` (ICT 0.025 -> 0.03, DPR 0.11 -> 0.05), or the gradient to
the towers cut in `Realm.forward` (`.detach()` on the query and candidate embeddings)."""

from __future__ import annotations

import json

import pytest
import torch

from ralm.data.knowledge import KnowledgeConfig, generate_task
from ralm.eval.knowledge import search_recall
from ralm.retrieval.index.build import build_index
from ralm.retrieval.towers.loading import save_random_encoder
from ralm.train.dpr import DPRConfig, train_dpr
from ralm.train.ict import IctConfig, train_ict

CPU = torch.device("cpu")
STEPS = 100


@pytest.fixture(scope="module")
def random_bert(tmp_path_factory):
    """A random 2-layer BERT whose retrievers mean-pool (a random [CLS] hardly depends on the input)."""
    return save_random_encoder(tmp_path_factory.mktemp("random-bert"), hidden_size=32, layers=2, heads=2, pooling="mean")


@pytest.fixture(scope="module")
def task():
    return generate_task(KnowledgeConfig(train_entities=40, eval_entities=20, seed=1))


def fact_recall(task, model, out, queries: list[str], sources: list[str]) -> float:
    """recall@1 of the fact document stating each query's fact, in an index of every entity's
    fact document built with `model`."""
    build_index(task.fact_docs, out, kind="dense", model=str(model), dim=16, show_progress=False)
    return search_recall(out, queries, sources)


def test_ict_learns_to_match_entities(task, random_bert, tmp_path):
    """ICT trains on the notes documents only (fact documents hold one sentence: no ICT pair);
    the masked notes sentences must then find their entity's fact document."""
    corpus = task.write_corpus(tmp_path / "train.jsonl")
    queries, sources = [s.masked_text for s in task.train_sentences], [s.source for s in task.train_sentences]
    start = fact_recall(task, random_bert, tmp_path / "start", queries, sources)
    cfg = IctConfig(str(corpus), model=str(random_bert), dim=16, steps=STEPS, batch_size=16, lr=2e-3, warmup=5,
                    keep_sentence=0.0, block_len=64, save_every=STEPS, log_every=20, dtype="fp32")
    done = train_ict(cfg, tmp_path / "ict", CPU, show_progress=False)
    end = fact_recall(task, done.retriever, tmp_path / "end", queries, sources)
    assert start < 0.2 and end >= start + 0.5, (start, end)


def test_dpr_learns_to_find_fact_documents(task, random_bert, tmp_path):
    """DPR trains on questions about the training entities (BM25 positives); the same
    questions must then find the fact documents in an index of fact documents."""
    corpus = task.write_corpus(tmp_path / "train.jsonl")
    qa = task.questions(held_out=False)
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in qa))
    queries, sources = [q["question"] for q in qa], [q["source"] for q in qa]
    start = fact_recall(task, random_bert, tmp_path / "start", queries, sources)
    cfg = DPRConfig(str(questions), str(corpus), model=str(random_bert), dim=16, steps=STEPS, batch_size=16, lr=2e-3,
                    warmup=5, save_every=STEPS, log_every=20, dtype="fp32")
    done = train_dpr(cfg, tmp_path / "dpr", CPU, show_progress=False)
    end = fact_recall(task, done.retriever, tmp_path / "end", queries, sources)
    assert start < 0.2 and end >= start + 0.5, (start, end)


# -- REALM: the retriever learns from the masked-LM loss alone --------------------------------

REALM_STEPS = 100
LENGTHS = {"max_len": 80, "max_query_len": 32, "block_len": 48}


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    """An encoder that copies a masked span from evidence, and the spaCy pipeline that masks the
    facts: the MLM warm-up on another generated task, its own sentence kept in its block (the
    plainest copying lesson: a hidden-64 BERT learns it in about 300 steps). It knows none of
    the facts REALM trains on."""
    from ralm.data.knowledge import save_spacy_pipeline
    from ralm.train.mlm import MlmConfig, warm_up_encoder

    root = tmp_path_factory.mktemp("reader")
    bert = save_random_encoder(root / "bert", hidden_size=64, layers=2, heads=2)
    corpus = generate_task(KnowledgeConfig(train_entities=800, eval_entities=1, seed=2)).write_corpus(root / "warm.jsonl")
    spacy_dir = save_spacy_pipeline(root / "spacy")
    cfg = MlmConfig(str(corpus), model=str(bert), steps=350, head_steps=0, batch_size=32, lr=1e-3, warmup=20,
                    evidence=1.0, keep_sentence=1.0, spacy_model=str(spacy_dir), save_every=350, log_every=50,
                    dtype="fp32", **LENGTHS)
    return warm_up_encoder(cfg, root / "mlm", CPU, show_progress=False).encoder, spacy_dir


@pytest.fixture(scope="module")
def small_task():
    return generate_task(KnowledgeConfig(train_entities=20, eval_entities=20, seed=1))


def realm_fact_recall(task, random_bert, reader, tmp_path, **overrides) -> tuple[float, float]:
    """recall@1 of the fact document for the training sentences (their fact masked), before and
    after REALM pre-training from random towers with `overrides`."""
    from ralm.train.pretrain import PretrainConfig, pretrain

    encoder, spacy_dir = reader
    corpus = task.write_corpus(tmp_path / "train.jsonl")
    queries, sources = [s.masked_text for s in task.train_sentences], [s.source for s in task.train_sentences]
    start = fact_recall(task, random_bert, tmp_path / "start", queries, sources)
    options = dict(model=str(random_bert), encoder=encoder, mlm_warmup=0, dim=16, steps=REALM_STEPS, batch_size=8, k=8,
                   lr=5e-5, warmup=10, retriever_warmup=0, retriever_lr=1e-3, spacy_model=str(spacy_dir), refresh="sync",
                   refresh_every=10, save_every=REALM_STEPS, log_every=20, dtype="fp32", **LENGTHS)
    cfg = PretrainConfig(str(corpus), **{**options, **overrides})
    done = pretrain(cfg, tmp_path / "realm", CPU, show_progress=False, notify=lambda m: None)
    return start, fact_recall(task, done.retriever, tmp_path / "end", queries, sources)


@pytest.mark.slow  # the shared warm-up (about 30 s) and 100 REALM steps (about 20 s) on 2 cores
def test_realm_learns_to_retrieve_from_the_mlm_loss(small_task, random_bert, reader, tmp_path):
    """No retrieval label anywhere: the marginal likelihood alone must teach the towers to find
    the fact document (cut the gradient to the towers in Realm.forward and this fails)."""
    start, end = realm_fact_recall(small_task, random_bert, reader, tmp_path)
    assert start < 0.2 and end >= start + 0.4, (start, end)


@pytest.mark.slow
def test_realm_with_frozen_towers_does_not_learn_to_retrieve(small_task, random_bert, reader, tmp_path):
    start, end = realm_fact_recall(small_task, random_bert, reader, tmp_path, retriever_warmup=REALM_STEPS)
    assert end < start + 0.1, (start, end)
