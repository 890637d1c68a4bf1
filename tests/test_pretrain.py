"""REALM pre-training runs: resume reproduces the uninterrupted run, the export contract, the
CLI (resume message, clear errors)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from ralm.cli import app
from ralm.errors import RalmError
from ralm.models.realm import KnowledgeAugmentedEncoder
from ralm.retrieval.towers.encoders import Retriever
from ralm.train.pretrain import PretrainConfig, pretrain


def _cfg(corpus, bert, **kw) -> PretrainConfig:
    base = dict(model=str(bert), dim=16, steps=4, batch_size=2, k=2, lr=1e-3, warmup=1, refresh="sync",
                refresh_every=2, save_every=2, log_every=1, max_len=96, seed=3, mlm_warmup=0,
                retriever_warmup=0, retriever_lr=None)
    return PretrainConfig(str(corpus), **{**base, **kw})


def _losses(run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_resumed_run_reproduces_the_uninterrupted_one(tiny_bert, corpus_file, tmp_path):
    cpu = torch.device("cpu")
    whole = pretrain(_cfg(corpus_file, tiny_bert), tmp_path / "whole", cpu, show_progress=False)
    assert whole.steps == 4
    # the interrupted run: 2 steps, then the same --out again with --steps 4
    pretrain(_cfg(corpus_file, tiny_bert, steps=2), tmp_path / "cut", cpu, show_progress=False)
    messages = []
    pretrain(_cfg(corpus_file, tiny_bert), tmp_path / "cut", cpu, show_progress=False, notify=messages.append)
    assert "resuming from step 2" in messages
    a, b = _losses(tmp_path / "whole"), _losses(tmp_path / "cut")
    assert sorted(b) == [1, 2, 3, 4]
    for step in (3, 4):
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6)
    # sync refresh: the index was rebuilt from the trained document tower at steps 2 (and later)
    rows = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [r["index_step"] for r in rows] == [0, 0, 2, 2]
    assert [r["staleness"] for r in rows] == [0, 1, 0, 1]
    assert all(set(r) >= {"step", "loss", "retrieval_utility", "staleness", "steps_per_s"} for r in rows)


def test_exports_follow_the_contract(tiny_bert, corpus_file, tmp_path):
    from transformers import AutoTokenizer, BertForMaskedLM

    run = tmp_path / "run"
    pretrain(_cfg(corpus_file, tiny_bert, steps=2, refresh="none"), run, torch.device("cpu"), show_progress=False)
    assert json.loads((run / "final" / "trainer.json").read_text()) == {"step": 2, "kind": "pretrain", "parts": ["retriever", "encoder"]}
    retriever = Retriever.from_pretrained(run / "final" / "retriever")
    assert retriever.dim == 16 and retriever.cfg.projection_ready
    mlm = BertForMaskedLM.from_pretrained(str(run / "final" / "encoder"))
    assert KnowledgeAugmentedEncoder.from_pretrained(str(run / "final" / "encoder")).fresh_head is False
    assert KnowledgeAugmentedEncoder.from_pretrained(str(tiny_bert)).fresh_head is True
    AutoTokenizer.from_pretrained(str(run / "final" / "encoder"))
    from safetensors.torch import load_file

    state = load_file(str(run / "checkpoints" / "step-000002" / "model.safetensors"))
    torch.testing.assert_close(mlm.bert.encoder.layer[0].output.dense.weight, state["encoder.mlm.bert.encoder.layer.0.output.dense.weight"])
    for png in ("loss", "retrieval_utility", "staleness"):
        assert (run / f"{png}.png").is_file()


def test_async_refresh_starts_and_stops_the_builder(tiny_bert, corpus_file, tmp_path):
    run = tmp_path / "run"
    pretrain(_cfg(corpus_file, tiny_bert, steps=3, refresh="async", refresh_every=1, save_every=3),
             run, torch.device("cpu"), show_progress=False)
    # snapshots were handed over at steps 1 and 2; the builder process is gone, no partial version left
    assert (run / "refresh" / "LATEST").read_text().strip() == "step-000002"
    assert not list((run / "index" / "versions").glob(".building-*"))


def test_cli_pretrain_resume_message_and_errors(tiny_bert, corpus_file, tmp_path):
    runner = CliRunner()
    args = ["pretrain", "--corpus", str(corpus_file), "--out", str(tmp_path / "run"), "--model", str(tiny_bert),
            "--dim", "16", "--batch-size", "2", "-k", "2", "--refresh", "none", "--save-every", "1", "--max-len", "96",
            "--mlm-warmup", "0", "--device", "cpu", "--json"]
    first = runner.invoke(app, [*args, "--steps", "1"])
    assert first.exit_code == 0, first.output
    assert "mlm_warmup is 0" in first.output  # tiny_bert ships no MLM head: the collapse warning
    again = runner.invoke(app, [*args, "--steps", "2"])
    assert again.exit_code == 0, again.output
    assert "resuming from step 1" in again.output
    assert json.loads(again.stdout.strip().splitlines()[-1])["steps"] == 2

    bad = runner.invoke(app, [*args[:-1], "--refresh", "sometimes"])
    assert isinstance(bad.exception, RalmError) and "refresh must be one of" in str(bad.exception)
    with pytest.raises(RalmError, match="too few for k = "):
        pretrain(_cfg(corpus_file, tiny_bert, k=6), tmp_path / "k", torch.device("cpu"), show_progress=False)
    shutil.rmtree(tmp_path / "k", ignore_errors=True)
    with pytest.raises(RalmError, match="different config"):
        pretrain(_cfg(corpus_file, tiny_bert, steps=2, refresh="none", lr=0.5), tmp_path / "run", torch.device("cpu"), show_progress=False)


def test_starting_from_an_existing_index(tiny_bert, tiny_dense_index, corpus_file, tmp_path):
    from ralm.retrieval.index.store import IndexDir

    run = tmp_path / "run"
    pretrain(_cfg(corpus_file, tiny_bert, steps=1, refresh="none", index=str(tiny_dense_index)), run, torch.device("cpu"),
             show_progress=False)
    index = IndexDir(run / "index")
    manifest = index.version_manifest(index.latest())
    src = IndexDir(tiny_dense_index)
    assert manifest["step"] == 0 and manifest["source"] == str(src.root)
    dense = manifest["sections"]["dense"]
    assert dense["doc_fingerprint"] == src.version_manifest(src.latest())["sections"]["dense"]["doc_fingerprint"]
    assert (index.root / dense["retriever"] / "config.json").is_file() and "faiss" not in dense
    with pytest.raises(RalmError, match=r"block_len is 64 but index .* holds blocks of 288 wordpieces"):
        pretrain(_cfg(corpus_file, tiny_bert, steps=1, refresh="none", index=str(tiny_dense_index), block_len=64),
                 tmp_path / "other", torch.device("cpu"), show_progress=False)


def test_retriever_warmup_trains_the_encoder_alone_first(tiny_bert, corpus_file, tmp_path):
    from ralm.retrieval.index.store import IndexDir

    def weights(path) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in Retriever.from_pretrained(path).state_dict().items()}

    run = tmp_path / "run"
    cpu = torch.device("cpu")
    pretrain(_cfg(corpus_file, tiny_bert, steps=2, refresh="none", retriever_warmup=2), run, cpu, show_progress=False)
    index = IndexDir(run / "index")
    start = weights(index.root / index.version_manifest(index.latest())["sections"]["dense"]["retriever"])  # the towers at step 0
    frozen = weights(run / "final" / "retriever")
    assert all(torch.equal(start[k], frozen[k]) for k in start)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["retriever_lr"] == 0.0 and rows[0]["lr"] > 0  # the rate for the next step: the towers start at step 3
    encoder = _first_layer_weight(run / "final" / "encoder")
    assert not torch.equal(encoder, _first_layer_weight(tiny_bert))  # the encoder did train

    pretrain(_cfg(corpus_file, tiny_bert, steps=3, refresh="none", retriever_warmup=2), run, cpu, show_progress=False)
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["retriever_lr"] == pytest.approx(1e-3)
    trained = weights(run / "final" / "retriever")
    assert any(not torch.equal(start[k], trained[k]) for k in start)  # step 3: the towers train too
    with pytest.raises(RalmError, match="retriever_warmup must be >= 0"):
        PretrainConfig(str(corpus_file), retriever_warmup=-1)
    with pytest.raises(RalmError, match="retriever_lr must be positive"):
        PretrainConfig(str(corpus_file), retriever_lr=0.0)


def test_retriever_lr_sets_the_towers_rate(tiny_bert, corpus_file, tmp_path):
    run = tmp_path / "run"
    pretrain(_cfg(corpus_file, tiny_bert, steps=2, refresh="none", retriever_lr=1e-5), run, torch.device("cpu"), show_progress=False)
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["lr"] == pytest.approx(1e-3) and last["retriever_lr"] == pytest.approx(1e-5)


def _first_layer_weight(path) -> torch.Tensor:
    from transformers import BertForMaskedLM

    return BertForMaskedLM.from_pretrained(str(path)).bert.encoder.layer[0].output.dense.weight.detach().clone()
