"""Retrievers learn on the generated knowledge task (data/knowledge.py): ICT and DPR, trained
from a random BERT, must find an entity's fact document far more often than their start did.
REALM's version of this test is tests/test_realm_learns.py."""

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

pytestmark = pytest.mark.slow  # 100 training steps each
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
