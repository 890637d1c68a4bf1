"""The encoder's MLM warm-up: the head trains alone first, then the whole encoder; it learns;
`ralm pretrain` runs it for an encoder without an MLM head and starts from its export."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ralm.errors import RalmError
from ralm.models.realm import KnowledgeAugmentedEncoder
from ralm.train.mlm import MlmConfig, distractor_evidence, own_block_evidence, warm_up_encoder
from ralm.train.pretrain import PretrainConfig, pretrain

CPU = torch.device("cpu")


def _cfg(corpus, bert, **kw) -> MlmConfig:
    base = dict(model=str(bert), steps=4, head_steps=2, batch_size=2, lr=1e-3, warmup=1, masking="random",
                max_len=96, save_every=2, log_every=1, seed=3, dtype="fp32")
    return MlmConfig(str(corpus), **{**base, **kw})


def _state(path) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in KnowledgeAugmentedEncoder.from_pretrained(str(path)).mlm.state_dict().items()}


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_head_trains_alone_then_the_whole_encoder(tiny_bert, corpus_file, tmp_path):
    start = _state(tiny_bert)  # tiny_bert has no MLM head: its head is fresh
    run = tmp_path / "mlm"
    warm_up_encoder(_cfg(corpus_file, tiny_bert, steps=2), run, CPU, show_progress=False)
    after_head = _state(run / "final" / "encoder")
    body = [k for k in start if k.startswith("bert.")]
    assert body and all(torch.equal(start[k], after_head[k]) for k in body)
    assert not KnowledgeAugmentedEncoder.from_pretrained(str(run / "final" / "encoder")).fresh_head
    messages = []
    warm_up_encoder(_cfg(corpus_file, tiny_bert), run, CPU, show_progress=False, notify=messages.append)  # resumed to 4
    assert "resuming from step 2" in messages
    final = _state(run / "final" / "encoder")
    assert any(not torch.equal(after_head[k], final[k]) for k in body)
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["body_lr"] == 0.0 and rows[-1]["body_lr"] > 0


def test_warm_up_lowers_the_masked_lm_loss(tiny_bert, corpus_file, tmp_path):
    run = tmp_path / "mlm"
    warm_up_encoder(_cfg(corpus_file, tiny_bert, steps=60, head_steps=10, lr=3e-3, batch_size=4, log_every=10,
                         save_every=60, evidence=1.0), run, CPU, show_progress=False)
    rows = _rows(run)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
    assert np.isnan(rows[0]["loss_no_evidence"])  # every sentence read its block: no evidence-free loss to log


def test_evidence_is_the_block_without_the_sentence(tiny_bert, corpus_file, tmp_path):
    from transformers import AutoTokenizer

    from ralm.data.masking import corpus_sentences

    _, blocks, table = corpus_sentences(tmp_path / "blocks", tmp_path / "sentences", str(corpus_file),
                                        hf_tokenizer=AutoTokenizer.from_pretrained(str(tiny_bert)))
    s = int(np.flatnonzero(np.bincount(np.asarray(table.rows))[np.asarray(table.rows)] >= 2)[0])
    body = blocks.body(int(table.rows[s])).tolist()
    a, b = int(table.starts[s]), int(table.ends[s])
    assert own_block_evidence(blocks, table, s).tolist() == body[:a] + body[b:]
    assert own_block_evidence(blocks, table, s, keep=True).tolist() == body
    own = blocks.doc_index[int(table.rows[s])]
    for draw in np.linspace(0, 0.99, 12):  # always a block of another document, whatever the draw
        z = distractor_evidence(blocks, table, s, float(draw)).tolist()
        assert z and any(z == blocks.body(r).tolist() for r in range(len(blocks)) if blocks.doc_index[r] != own)


def test_bad_options_are_clear_errors(corpus_file):
    with pytest.raises(RalmError, match="evidence must be in"):
        MlmConfig(str(corpus_file), evidence=1.5)
    with pytest.raises(RalmError, match="head_steps must be >= 0"):
        MlmConfig(str(corpus_file), head_steps=-1)
    with pytest.raises(RalmError, match="keep_sentence must be in"):
        MlmConfig(str(corpus_file), keep_sentence=-0.1)
    with pytest.raises(RalmError, match="distractor must be in"):
        MlmConfig(str(corpus_file), distractor=2.0)
    with pytest.raises(RalmError, match="mlm_distractor must be in"):
        PretrainConfig(str(corpus_file), mlm_distractor=2.0)
    with pytest.raises(RalmError, match="masking"):
        MlmConfig(str(corpus_file), masking="words")


def test_pretrain_warms_up_a_fresh_encoder_and_starts_from_it(tiny_bert, corpus_file, tmp_path):
    run = tmp_path / "run"
    messages = []
    cfg = PretrainConfig(str(corpus_file), model=str(tiny_bert), dim=16, steps=1, batch_size=2, k=2, lr=1e-3, warmup=1,
                         refresh="none", save_every=1, log_every=1, max_len=96, seed=3, mlm_warmup=2, mlm_distractor=0.5,
                         dtype="fp32")
    pretrain(cfg, run, CPU, show_progress=False, notify=messages.append)
    assert any("MLM warm-up" in m for m in messages)
    assert (run / "mlm" / "final" / "trainer.json").is_file()
    assert json.loads((run / "mlm" / "config.json").read_text())["distractor"] == 0.5
    assert [r["step"] for r in _rows(run / "mlm")] == [1, 2]
    # --encoder takes the warm-up run: its head is trained, so no second warm-up
    again = tmp_path / "again"
    pretrain(PretrainConfig(**{**cfg.__dict__, "encoder": str(run / "mlm")}), again, CPU, show_progress=False)
    assert not (again / "mlm").exists()
