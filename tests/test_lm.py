"""The causal LM: causality, windowed scoring = brute force, training resumes exactly, and
any HF causal-LM directory loads behind the same interface."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ralm.data.chunks import TokenStream
from ralm.errors import RalmError
from ralm.models.lm import LMConfig, TransformerLM, load_lm, lm_loss
from ralm.runtime import Runtime


def tiny(**kw) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(LMConfig(vocab_size=64, dim=16, layers=2, heads=2, max_len=16, **kw)).eval()


def test_lm_is_causal():
    model = tiny()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    other = ids.clone()
    other[:, 7] = (other[:, 7] + 1) % 64
    a, b = model(ids), model(other)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=0)
    assert (a[:, 7:] - b[:, 7:]).abs().amax() > 0


def test_windowed_nll_equals_one_full_forward_when_it_fits():
    from ralm.eval.perplexity import lm_nll, perplexity_report

    model = tiny()
    tokens = (np.arange(20) * 5 % 64).astype(np.int32)
    stream = TokenStream(tokens, np.array([0, 20]), np.array([0]), words=10)
    ids = torch.from_numpy(tokens.astype(np.int64))[None]
    with torch.no_grad():
        brute = -torch.log_softmax(model(ids[:, :-1]), -1)[0].gather(-1, ids[0, 1:, None])[:, 0]
    nll = lm_nll(model, stream, seq_len=32, stride=8, runtime=Runtime(torch.device("cpu"), torch.float32), show_progress=False)
    np.testing.assert_allclose(nll, brute.numpy(), rtol=1e-5, atol=1e-5)
    # the loss function is the mean of the same numbers
    assert lm_loss(model(ids[:, :-1]), ids[:, 1:]).item() == pytest.approx(brute.mean().item(), rel=1e-5)
    report = perplexity_report(nll, stream.words)
    assert report["ppl"] == pytest.approx(float(np.exp(nll.mean())), rel=1e-4)
    assert report["word_ppl"] == pytest.approx(float(np.exp(nll.sum() / 10)), rel=1e-4)


def _text(tmp_path):
    from conftest import DOCS

    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in DOCS * 3))
    return path


def test_train_lm_learns_and_resume_reproduces(tmp_path, tiny_bert):
    from ralm.train.lm import LMTrainConfig, train_lm

    text = _text(tmp_path)
    cfg = dict(text=str(text), model=LMConfig(dim=16, layers=1, heads=2, max_len=16), batch_size=4, lr=1e-2, warmup=2,
               tokenizer=str(tiny_bert), log_every=1, save_every=3)
    straight = train_lm(LMTrainConfig(steps=12, **cfg), tmp_path / "a", show_progress=False)

    def crash(record):
        if record["step"] == 8:  # killed two steps after the step-6 checkpoint
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_lm(LMTrainConfig(steps=12, **cfg), tmp_path / "b", show_progress=False, on_metrics=crash)
    resumed = train_lm(LMTrainConfig(steps=12, **cfg), tmp_path / "b", show_progress=False)
    assert resumed.loss == pytest.approx(straight.loss, rel=1e-5)
    a, _ = load_lm(tmp_path / "a")
    b, _ = load_lm(tmp_path / "b")
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(p, q, msg=name)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 12 and losses[-1] < losses[0]
    assert (tmp_path / "a" / "loss.png").is_file()
    with pytest.raises(RalmError, match="different config"):
        train_lm(LMTrainConfig(steps=12, **{**cfg, "lr": 1e-3}), tmp_path / "a", show_progress=False)


def test_an_lm_run_exports_to_final_and_an_older_run_with_run_model_still_loads(tmp_path, tiny_bert):
    """Every trainer exports to RUN/final; a run from before kept RUN/model, which still loads,
    with the same datastore fingerprint (the same model)."""
    import shutil

    from ralm.retrieval.lm.datastore import model_fingerprint
    from ralm.rundir import RunExport
    from ralm.train.lm import LMTrainConfig, train_lm

    cfg = LMTrainConfig(text=str(_text(tmp_path)), model=LMConfig(dim=16, layers=1, heads=2, max_len=16), batch_size=4,
                        steps=2, tokenizer=str(tiny_bert), log_every=1)
    train_lm(cfg, tmp_path / "new", show_progress=False)
    assert RunExport.read(tmp_path / "new") == RunExport("lm", 2, ("model",)) and not (tmp_path / "new" / "model").exists()
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "new" / "checkpoints", old / "checkpoints")
    shutil.copytree(tmp_path / "new" / "final" / "model", old / "model")
    (a, _), (b, _) = load_lm(tmp_path / "new"), load_lm(old)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    assert model_fingerprint(old) == model_fingerprint(tmp_path / "new") == model_fingerprint(tmp_path / "new" / "final" / "model")
    shutil.rmtree(old / "model")
    with pytest.raises(RalmError, match="not a language model"):
        load_lm(old)


def test_hf_causal_lm_directory_loads_behind_the_same_interface(tmp_path, tiny_bert):
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32))
    hf.save_pretrained(tmp_path / "gpt")
    AutoTokenizer.from_pretrained(str(tiny_bert)).save_pretrained(tmp_path / "gpt")
    model, _ = load_lm(tmp_path / "gpt")
    ids = torch.randint(0, 64, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(model.head(model.features(ids)), hf.eval()(ids).logits)
    assert model.dim == 16 and model.cfg.max_len == 32
    with pytest.raises(RalmError, match="not a language model"):
        load_lm(tmp_path)

