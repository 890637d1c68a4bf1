"""Open-domain QA fine-tuning: runs end to end, trains reader + query tower only, resumes exactly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from ralm.errors import RalmError
from ralm.models.reader import Reader
from ralm.retrieval.towers.encoders import Retriever
from ralm.retrieval.search.searcher import Searcher
from ralm.train.finetune import FinetuneConfig, finetune, resolve_init
from ralm.retrieval.index.dense_side import dense_of

from conftest import DOCS

QUESTIONS = [
    {"id": "q1", "question": "What is the capital of France?", "answers": ["Paris"]},
    {"id": "q2", "question": "Who created Python?", "answers": ["Guido van Rossum"]},
    {"id": "q3", "question": "When did Armstrong walk on the Moon?", "answers": ["1969"]},
    {"id": "q4", "question": "What colour is a zebra?", "answers": ["black and white stripes"]},  # in no block
]


@pytest.fixture
def questions_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


def _cfg(questions_file, index, tiny_bert, **kw):
    base = dict(questions=str(questions_file), index=str(index), init=str(tiny_bert), steps=4, batch_size=4, k=2,
                lr=1e-3, retriever_lr=1e-3, max_len=96, save_every=2, log_every=1, warmup=0)
    return FinetuneConfig(**{**base, **kw})


def test_finetune_trains_reader_and_query_tower_only(questions_file, tiny_dense_index, tiny_bert, tmp_path):
    before = dense_of(Searcher.open(tiny_dense_index).current).retriever
    # every block is read (k = all of them), so exactly q1-q3 are answerable at every step: q4's answer is in no block
    summary = finetune(_cfg(questions_file, tiny_dense_index, tiny_bert, k=len(DOCS)), tmp_path / "run", show_progress=False)
    assert summary.steps == 4 and summary.trained_query_tower and summary.answerable_share == 0.75
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and all(m["answerable"] == 0.75 for m in metrics)
    after = Retriever.from_pretrained(tmp_path / "run" / "final" / "retriever")
    assert after.doc_fingerprint() == before.doc_fingerprint()  # the index stays valid
    changed = any(not torch.equal(a, b) for a, b in zip(after.query.state_dict().values(), before.query.state_dict().values()))
    assert changed  # the query tower learned through p(z|x)
    Searcher.open(tiny_dense_index, model=str(tmp_path / "run" / "final" / "retriever"))  # fingerprint check passes
    Reader.from_pretrained(tmp_path / "run" / "final" / "reader")


def test_a_reader_with_a_null_span_learns_it_where_no_block_holds_the_answer(questions_file, tiny_dense_index, tiny_bert,
                                                                             tmp_path):
    """q4's answer is in no block: with a null-span reader it counts (its gold is the null), the
    other three by their spans, so every question is labelled; the null span learns upwards."""
    torch.manual_seed(0)
    start = Reader.from_encoder(tiny_bert, max_len=96, null_span=True)
    start.save_pretrained(tmp_path / "null-reader")
    summary = finetune(_cfg(questions_file, tiny_dense_index, str(tmp_path / "null-reader"), k=len(DOCS), steps=2),
                       tmp_path / "run", show_progress=False)
    assert summary.answerable_share == 1.0  # q4 learns "not in what I read"
    after = Reader.from_pretrained(tmp_path / "run" / "final" / "reader")
    assert after.cfg.null_span and not all(torch.equal(a, b) for a, b in zip(after.spans.state_dict().values(),
                                                                             start.spans.state_dict().values()))


def test_resume_reproduces_an_uninterrupted_run(questions_file, tiny_dense_index, tiny_bert, tmp_path):
    cfg = _cfg(questions_file, tiny_dense_index, tiny_bert)
    finetune(cfg, tmp_path / "straight", show_progress=False)
    # a crash right after the step-2 checkpoint: copy the run and roll it back to step 2
    shutil.copytree(tmp_path / "straight", tmp_path / "crashed")
    ck = tmp_path / "crashed" / "checkpoints"
    shutil.rmtree(ck / "step-000004")
    shutil.rmtree(tmp_path / "crashed" / "final")
    (ck / "LATEST").write_text("step-000002\n")
    finetune(cfg, tmp_path / "crashed", show_progress=False)
    a = load_file(str(tmp_path / "straight" / "final" / "reader" / "model.safetensors"))
    b = load_file(str(tmp_path / "crashed" / "final" / "reader" / "model.safetensors"))
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    steps = [json.loads(line)["step"] for line in (tmp_path / "crashed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    with pytest.raises(RalmError, match="different config"):
        finetune(_cfg(questions_file, tiny_dense_index, tiny_bert, k=3), tmp_path / "crashed", show_progress=False)


def test_bm25_index_trains_the_reader_only(questions_file, tiny_bert, corpus_file, tmp_path):
    from ralm.retrieval.index.build import build_index

    build_index(corpus_file, tmp_path / "bm25", kind="bm25", model=str(tiny_bert), show_progress=False)
    summary = finetune(_cfg(questions_file, tmp_path / "bm25", tiny_bert, steps=2), tmp_path / "run", show_progress=False)
    assert not summary.dense and (tmp_path / "run" / "final" / "reader").is_dir()
    assert not (tmp_path / "run" / "final" / "retriever").exists()


def test_resolve_init(tmp_path, tiny_bert, tiny_dense_index):
    assert resolve_init(None) == (None, None)
    assert resolve_init(str(tiny_bert)) == (str(tiny_bert), None)
    retriever_dir = next((tiny_dense_index / "retriever").iterdir())
    assert resolve_init(str(retriever_dir)) == (None, str(retriever_dir))
    run = tmp_path / "pretrain"
    (run / "final" / "encoder").mkdir(parents=True)
    (run / "final" / "encoder" / "config.json").write_text("{}")
    assert resolve_init(str(run)) == (str(run / "final" / "encoder"), None)
    with pytest.raises(RalmError, match="no such run"):
        resolve_init(str(tmp_path / "missing"))
