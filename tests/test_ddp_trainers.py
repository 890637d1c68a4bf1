"""The trainers under torchrun: 2 gloo ranks on CPU with per-rank batch B train exactly like one
process with batch 2B (same saved parameters, same logged global-batch loss).

The tiny BERT here has dropout 0: dropout masks depend on how a batch is split over ranks, so
only a deterministic model can be compared across layouts."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from test_distributed import run_ranks

pytestmark = pytest.mark.slow  # each trains in two processes and in one
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def still_bert(tiny_bert, tmp_path_factory):
    """The tiny random BERT without dropout, mean-pooled: a random BERT's [CLS] vector is about
    the same for every input, which leaves gradients at float-noise level for Adam to amplify."""
    path = tmp_path_factory.mktemp("still-bert")
    shutil.copytree(tiny_bert, path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (path / "config.json").write_text(json.dumps(config))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    return path


# A softmax does not change when all its scores move by the same amount. These biases move all
# scores alike (every document vector of an in-batch softmax; every span score of the reader),
# so their true gradient is zero, and Adam turns its float noise into steps of up to lr that
# differ from one layout to the other.
SHIFT_ONLY = {"doc.proj.bias", "doc.bert.encoder.layer.1.output.LayerNorm.bias", "reader.spans.out.bias"}


def _same_checkpoint(one, two, step: int, prefix: str = "", atol: float = 1e-4) -> None:
    """Same parameters up to `atol`: every run here uses lr 1e-3, so a wrong split or missing
    cross-rank negatives moves weights by ~1e-3, while float noise in near-zero gradients, which
    Adam's first steps scale up to lr, stays near 1e-5 (how near depends on the CPU's kernels)."""
    name = f"checkpoints/step-{step:06d}/model.safetensors"
    a, b = load_file(str(one / name)), load_file(str(two / name))
    assert a.keys() == b.keys()
    for key in sorted(k for k in a.keys() - SHIFT_ONLY if k.startswith(prefix)):
        torch.testing.assert_close(b[key], a[key], atol=atol, rtol=0, msg=key)


def _train(rank, trainer: str, cfg, run) -> None:
    """One rank of a run (a module-level function, so spawned ranks can import it)."""
    import importlib

    module, name = trainer.rsplit(".", 1)
    getattr(importlib.import_module(module), name)(cfg, run, CPU, show_progress=False)


def _two_ranks_and_one(trainer: str, cfg, tmp_path) -> None:
    """Train `cfg` on 2 ranks into tmp/two and with the doubled batch in one process into tmp/one.
    The configs say fp32: bf16 rounding depends on how rows are batched, which differs here."""
    run_ranks(_train, trainer, cfg, tmp_path / "two")
    _train(0, trainer, replace(cfg, batch_size=2 * cfg.batch_size), tmp_path / "one")


def _losses(run) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_ict_on_two_ranks_equals_one_process_with_the_doubled_batch(still_bert, corpus_file, tmp_path):
    from ralm.train.ict import IctConfig

    cfg = IctConfig(str(corpus_file), model=str(still_bert), dim=16, steps=2, batch_size=2, lr=1e-3, warmup=1,
                    keep_sentence=0.5, save_every=2, log_every=1, dtype="fp32")
    _two_ranks_and_one("ralm.train.ict.train_ict", cfg, tmp_path)
    _same_checkpoint(tmp_path / "one", tmp_path / "two", 2)
    # the logged loss is the softmax over all 4 contexts (rank 1's are rank 0's negatives), not over 2
    assert _losses(tmp_path / "two") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)
    assert (tmp_path / "two" / "final" / "retriever" / "model.safetensors").is_file()


def test_dpr_on_two_ranks_equals_one_process_with_the_doubled_batch(still_bert, corpus_file, tmp_path):
    from ralm.train.dpr import DPRConfig

    from test_dpr import QUESTIONS

    questions = tmp_path / "train.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))  # 4 with a BM25 positive
    cfg = DPRConfig(str(questions), str(corpus_file), model=str(still_bert), dim=16, steps=2, batch_size=2,
                    hard_negatives=1, bm25_depth=6, lr=1e-3, warmup=0, save_every=2, log_every=1, dtype="fp32")
    _two_ranks_and_one("ralm.train.dpr.train_dpr", cfg, tmp_path)
    _same_checkpoint(tmp_path / "one", tmp_path / "two", 2)
    # each question is scored against all 8 passages of the global batch, not only its rank's 4
    assert _losses(tmp_path / "two") == pytest.approx(_losses(tmp_path / "one"), rel=1e-4)
    assert (tmp_path / "two" / "final" / "retriever" / "model.safetensors").is_file()


def test_finetune_on_two_ranks_equals_one_process_with_the_doubled_batch(still_bert, corpus_file, tmp_path):
    from ralm.retrieval.index.build import build_index
    from ralm.train.finetune import FinetuneConfig

    from test_finetune import QUESTIONS

    questions = tmp_path / "train.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    build_index(corpus_file, tmp_path / "dense", model=str(still_bert), dim=16, show_progress=False)
    cfg = FinetuneConfig(str(questions), str(tmp_path / "dense"), init=str(still_bert), steps=2, batch_size=2, k=2,
                         lr=1e-3, retriever_lr=1e-3, max_len=96, warmup=0, save_every=2, log_every=1, dtype="fp32")
    _two_ranks_and_one("ralm.train.finetune.finetune", cfg, tmp_path)  # 2 ranks search the index sharded
    _same_checkpoint(tmp_path / "one", tmp_path / "two", 2)
    assert _losses(tmp_path / "two") == pytest.approx(_losses(tmp_path / "one"), rel=1e-4)


def test_train_reader_on_two_ranks_equals_one_process_with_the_doubled_batch(still_bert, corpus_file, tmp_path):
    from ralm.train.reader import ReaderTrainConfig

    from test_train_reader import QUESTIONS

    questions = tmp_path / "train.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    cfg = ReaderTrainConfig(str(questions), str(corpus_file), init=str(still_bert), steps=2, batch_size=2, lr=1e-3,
                            warmup=0, max_len=80, stride=16, save_every=2, log_every=1, dtype="fp32")
    _two_ranks_and_one("ralm.train.reader.train_reader", cfg, tmp_path)
    # Some span-scorer biases get near-zero gradients from a random encoder (units that move
    # every span score alike), which Adam's first steps turn into noise of up to lr: compare the encoder.
    _same_checkpoint(tmp_path / "one", tmp_path / "two", 2, prefix="bert.")
    # the loss is the mean over the gold windows of the whole global batch
    assert _losses(tmp_path / "two") == pytest.approx(_losses(tmp_path / "one"), rel=1e-4)


def test_pretrain_on_two_ranks_equals_one_process_with_the_doubled_batch(still_bert, corpus_file, tmp_path):
    from ralm.train.pretrain import PretrainConfig

    cfg = PretrainConfig(str(corpus_file), model=str(still_bert), dim=16, steps=2, batch_size=1, k=2, lr=1e-3, warmup=1,
                         refresh="sync", refresh_every=1, save_every=2, log_every=1, max_len=96, seed=3,
                         dtype="fp32", mlm_warmup=0)
    _two_ranks_and_one("ralm.train.pretrain.pretrain", cfg, tmp_path)  # rank 0 refreshes, both search its shards
    # With a random encoder every block helps equally little (retrieval utility ~1e-4): the
    # towers' gradients are float noise that Adam scales up to +-lr, so only the encoder compares.
    _same_checkpoint(tmp_path / "one", tmp_path / "two", 2, prefix="encoder.")
    # the loss is per masked wordpiece of the whole global batch
    assert _losses(tmp_path / "two") == pytest.approx(_losses(tmp_path / "one"), rel=1e-4)
    rows = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [r["index_step"] for r in rows] == [0, 1]


def test_lm_on_two_ranks_equals_one_process_with_the_doubled_batch(tiny_bert, corpus_file, tmp_path):
    from ralm.models.lm import LMConfig
    from ralm.train.lm import LMTrainConfig

    cfg = LMTrainConfig(text=str(corpus_file), model=LMConfig(dim=16, layers=1, heads=2, max_len=8), tokenizer=str(tiny_bert),
                        steps=2, batch_size=2, lr=1e-3, warmup=0, save_every=2, log_every=1, dtype="fp32")
    _two_ranks_and_one("ralm.train.lm.train_lm", cfg, tmp_path)
    _same_checkpoint(tmp_path / "one", tmp_path / "two", 2)
    assert _losses(tmp_path / "two") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)
    assert (tmp_path / "two" / "final" / "model" / "config.json").is_file()
