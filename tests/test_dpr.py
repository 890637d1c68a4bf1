"""DPR: BM25-mined positives/hard negatives, the in-batch loss, an end-to-end run that indexes."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from ralm.data.qa import has_answer, read_questions
from ralm.distributed import DistEnv
from ralm.errors import RalmError
from ralm.retrieval.index.build import build_index
from ralm.retrieval.towers.encoders import Retriever
from ralm.retrieval.search.searcher import Searcher
from ralm.train.dpr import DPRConfig, mine, train_dpr
from ralm.train.parallel import in_batch_contrastive

QUESTIONS = [
    {"id": "q1", "question": "What is the capital of France?", "answers": ["Paris"]},
    {"id": "q2", "question": "Who created the Python programming language?", "answers": ["Guido van Rossum"]},
    {"id": "q3", "question": "When did Neil Armstrong walk on the Moon?", "answers": ["1969"]},
    {"id": "q4", "question": "What is the capital of Japan?", "answers": ["Tokyo"]},
    {"id": "q5", "question": "What colour is a zebra?", "answers": ["striped"]},  # no positive anywhere
]


@pytest.fixture
def questions_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


def test_in_batch_loss_matches_a_hand_computed_softmax():
    q = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    p = torch.tensor([[1.0, 1.0], [0.0, 1.0], [3.0, 0.0]])  # 2 positives, then a hard negative
    loss, acc = in_batch_contrastive(q, p, DistEnv())
    logits = [[1.0, 0.0, 3.0], [2.0, 2.0, 0.0]]
    want = sum(-row[i] + math.log(sum(math.exp(x) for x in row)) for i, row in enumerate(logits)) / 2
    assert loss.item() == pytest.approx(want) and acc.item() == 0.0  # q1 prefers its hard negative


def test_mined_positives_hold_the_answer_and_negatives_do_not(questions_file, tiny_bert, corpus_file, tmp_path):
    build_index(corpus_file, tmp_path / "bm25", kind="bm25", model=str(tiny_bert), show_progress=False)
    searcher = Searcher.open(tmp_path / "bm25")
    qs = read_questions(questions_file)
    keep, pos, neg = mine(searcher, qs, depth=6, negatives=2, show_progress=False)
    assert keep.tolist() == [0, 1, 2, 3]  # q5 has no answer-bearing block: dropped
    blocks = searcher.current.blocks
    for i, p, ns in zip(keep, pos, neg):
        assert has_answer(blocks.record(int(p))["text"], qs[i].answers)
        assert not any(has_answer(blocks.record(int(n))["text"], qs[i].answers) for n in ns)
        assert int(p) not in ns.tolist()


def test_dpr_run_trains_both_towers_and_indexes(questions_file, tiny_bert, corpus_file, tmp_path):
    cfg = DPRConfig(questions=str(questions_file), corpus=str(corpus_file), model=str(tiny_bert), dim=16, steps=3,
                    batch_size=3, hard_negatives=1, bm25_depth=6, lr=1e-3, log_every=1, save_every=3)
    summary = train_dpr(cfg, tmp_path / "run", show_progress=False)
    assert summary.trainable_questions == 4 and summary.steps == 3
    trained = Retriever.from_pretrained(tmp_path / "run" / "final" / "retriever")
    fresh = Retriever.from_pretrained(str(tiny_bert), dim=16)
    for tower in ("query", "doc"):
        a, b = getattr(trained, tower).bert.state_dict(), getattr(fresh, tower).bert.state_dict()
        assert any(not torch.equal(a[k], b[k]) for k in a), tower
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(np.isfinite(m["loss"]) for m in metrics)
    build_index(corpus_file, tmp_path / "dpr-index", model=str(tmp_path / "run" / "final" / "retriever"), show_progress=False)
    assert len(Searcher.open(tmp_path / "dpr-index").search(["capital of France"], 2)[0]) == 2


def test_config_errors(questions_file, corpus_file):
    with pytest.raises(RalmError, match="hard_negatives must be >= 0"):
        DPRConfig(questions=str(questions_file), corpus=str(corpus_file), hard_negatives=-1)
    with pytest.raises(RalmError, match="steps must be positive"):
        DPRConfig(questions=str(questions_file), corpus=str(corpus_file), steps=0)
