"""ICT: pseudo-query / context pairs, the in-batch loss, training both towers, resume, export."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ralm.distributed import DistEnv
from ralm.data.masking import corpus_sentences
from ralm.errors import RalmError
from ralm.retrieval.towers.encoders import Retriever
from ralm.train.ict import IctConfig, ict_pair, train_ict
from ralm.train.parallel import in_batch_contrastive


def test_ict_pair_removes_the_sentence_unless_kept(tiny_bert, corpus_file, tmp_path):
    retriever = Retriever.from_pretrained(str(tiny_bert), dim=16)
    tok = retriever.tokenizer
    _, blocks, table = corpus_sentences(tmp_path / "blocks", tmp_path / "sentences", str(corpus_file), hf_tokenizer=tok,
                                        show_progress=False)
    s = next(s for s in range(len(table)) if tok.decode(table.tokens(blocks, s).tolist()) == "it lies on the seine river.")
    query, context = ict_pair(blocks, table, s, keep=False, cls_id=tok.cls_token_id, sep_id=tok.sep_token_id, max_query_len=64)
    assert tok.decode(query) == "[CLS] it lies on the seine river. [SEP]"
    assert tok.decode(context) == "[CLS] paris [SEP] paris is the capital of france. the eiffel tower was finished in 1889. [SEP]"
    _, kept = ict_pair(blocks, table, s, keep=True, cls_id=tok.cls_token_id, sep_id=tok.sep_token_id, max_query_len=64)
    assert kept == blocks.tokens[int(table.rows[s])].tolist()


def test_in_batch_loss_is_cross_entropy():
    g = torch.Generator().manual_seed(0)
    q, c = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    s = (q @ c.T).tolist()
    want = -sum(s[i][i] - math.log(sum(math.exp(v) for v in s[i])) for i in range(3)) / 3
    assert in_batch_contrastive(q, c, DistEnv())[0].item() == pytest.approx(want, rel=1e-5)


def test_train_ict_updates_both_towers_resumes_and_exports(tiny_bert, corpus_file, tmp_path):
    run = tmp_path / "ict"
    start = Retriever.from_pretrained(str(tiny_bert), dim=16)
    cfg = IctConfig(str(corpus_file), model=str(tiny_bert), dim=16, steps=2, batch_size=4, save_every=2, log_every=1, warmup=1)
    summary = train_ict(cfg, run, torch.device("cpu"), show_progress=False)
    assert summary.steps == 2
    trained = Retriever.from_pretrained(run / "final" / "retriever")
    for tower in ("query", "doc"):
        before = getattr(start, tower).bert.encoder.layer[0].attention.self.query.weight
        after = getattr(trained, tower).bert.encoder.layer[0].attention.self.query.weight
        assert not torch.allclose(before, after), f"the {tower} tower did not change"
    assert json.loads((run / "final" / "trainer.json").read_text()) == {"step": 2, "kind": "ict", "parts": ["retriever"]}
    assert not (run / "final" / "encoder").exists()  # ICT exports only the retriever
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    assert (run / "loss.png").is_file()

    messages = []
    train_ict(IctConfig(**{**cfg.__dict__, "steps": 3}), run, torch.device("cpu"), show_progress=False, notify=messages.append)
    assert "resuming from step 2" in messages
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_ict_config_errors():
    with pytest.raises(RalmError, match="batch_size must be at least 2"):
        IctConfig("c.jsonl", batch_size=1)
    with pytest.raises(RalmError, match="steps must be positive"):
        IctConfig("c.jsonl", steps=0)


def test_ict_trains_on_documents_given_in_memory(tiny_bert, tmp_path):
    """As build_index: the documents are saved once as RUN/corpus/<sha>.jsonl, the config names
    that file, and the same documents resume the run."""
    from conftest import DOCS

    from ralm.data.corpus import Document, read_corpus

    docs = [Document(d["id"], d["title"], d["text"]) for d in DOCS]
    run = tmp_path / "ict"
    cfg = IctConfig(docs, model=str(tiny_bert), dim=16, steps=1, batch_size=4, save_every=1, log_every=1, warmup=1)
    train_ict(cfg, run, torch.device("cpu"), show_progress=False)
    saved = list((run / "corpus").glob("*.jsonl"))
    assert len(saved) == 1 and cfg.corpus == str(saved[0]) and list(read_corpus(saved[0])) == docs
    assert json.loads((run / "config.json").read_text())["corpus"] == str(saved[0])
    messages = []
    again = IctConfig([d.__dict__ for d in docs], model=str(tiny_bert), dim=16, steps=2, batch_size=4, save_every=1, log_every=1, warmup=1)
    train_ict(again, run, torch.device("cpu"), show_progress=False, notify=messages.append)
    assert "resuming from step 1" in messages
    with pytest.raises(RalmError, match="different config"):
        train_ict(IctConfig(docs[:-1], model=str(tiny_bert), dim=16, steps=3, batch_size=4), run, torch.device("cpu"), show_progress=False)
