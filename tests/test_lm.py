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


# -- the LM stack's seam: one Runtime from the public entries down --------------------------

LM_STACK = ("ralm.models.lm", "ralm.models.retro", "ralm.models.knnlm", "ralm.eval.perplexity",
            "ralm.retrieval.lm.chunkdb", "ralm.retrieval.lm.datastore", "ralm.train.lm")
# What a user calls (benchmarks/ too): `runtime=`, and the older `device=`/`dtype=` through Runtime.of.
LM_ENTRIES = {"lm_perplexity", "knnlm_eval", "retro_perplexity", "generate", "neighbour_batch", "build_chunk_db",
              "build_datastore", "ChunkDB.__init__"}


def _lm_stack_functions():
    """(qualified name, function) of every function and method the LM-stack modules define (not
    a config dataclass's generated __init__: a run's `dtype` is a config field, recorded in it)."""
    import dataclasses
    import importlib
    import inspect

    for name in LM_STACK:
        for obj in vars(importlib.import_module(name)).values():
            members = vars(obj).values() if inspect.isclass(obj) else [obj]
            for f in (getattr(m, "__func__", m) for m in members):
                if not inspect.isfunction(f) or f.__module__ != name:
                    continue
                if not (dataclasses.is_dataclass(obj) and f.__name__ == "__init__"):
                    yield f.__qualname__, f


def test_below_its_public_entries_the_lm_stack_takes_a_runtime_never_device_or_dtype():
    import inspect

    params = {qual: set(inspect.signature(f).parameters) for qual, f in _lm_stack_functions()}
    assert LM_ENTRIES <= set(params)
    assert {q for q in LM_ENTRIES if "runtime" not in params[q]} == set()
    assert {q for q, p in params.items() if p & {"device", "dtype"} and q not in LM_ENTRIES} == set()
    assert {"lm_nll", "retro_nll", "knnlm_log_probs", "lm_states", "embed_chunks"} <= {q for q, p in params.items()
                                                                                       if "runtime" in p}


def test_lm_stack_entries_give_the_same_numbers_under_a_runtime_and_the_older_keywords(tmp_path, tiny_bert, corpus_file,
                                                                                       monkeypatch):
    """`runtime=Runtime(cpu, fp32)` and `device="cpu", dtype="fp32"` are one computation; both
    at once is refused; a Runtime given is never resolved again below the entry."""
    from transformers import AutoTokenizer

    import ralm.runtime as runtime
    from ralm.data.chunks import tokenize_text
    from ralm.eval.perplexity import knnlm_eval, lm_perplexity, retro_perplexity
    from ralm.models.knnlm import build_datastore
    from ralm.models.retro import RetroConfig, RetroLM, generate
    from ralm.retrieval.lm.chunkdb import ChunkDB, build_chunk_db
    from ralm.retrieval.lm.datastore import Datastore

    fp32 = Runtime(torch.device("cpu"), torch.float32, show_progress=False)
    tok = AutoTokenizer.from_pretrained(str(tiny_bert))
    model = tiny()
    stream = TokenStream((np.arange(60) * 7 % 64).astype(np.int32), np.array([0, 60]), np.array([1]), words=30)
    old = lm_perplexity(model, stream, device="cpu", dtype="fp32", show_progress=False)
    with pytest.raises(RalmError, match="give runtime= or device=/dtype=, not both"):
        lm_perplexity(model, stream, runtime=fp32, dtype="fp32", show_progress=False)
    db_path = build_chunk_db(corpus_file, tmp_path / "db", model=str(tiny_bert), chunk_len=8, device="cpu", dtype="fp32",
                             show_progress=False)
    torch.manual_seed(0)
    retro = RetroLM(RetroConfig(vocab_size=tok.vocab_size, dim=16, layers=2, heads=2, chunk_len=8, neighbours=2,
                                cca_start=1, encoder_layers=1, max_len=32)).eval()
    text = tokenize_text(corpus_file, tok, 200, show_progress=False)
    old_retro = retro_perplexity(retro, ChunkDB(db_path, "cpu", dtype="fp32"), text, device="cpu", dtype="fp32",
                                 show_progress=False)

    def resolved(*args, **kwargs):
        raise AssertionError("a Runtime given was resolved again below its entry")

    monkeypatch.setattr(runtime, "resolve_device", resolved)
    monkeypatch.setattr(runtime, "resolve_dtype", resolved)
    assert lm_perplexity(model, stream, runtime=fp32, show_progress=False) == old
    model.save_pretrained(tmp_path / "lm", tok)
    store = Datastore(build_datastore(model, tmp_path / "lm", stream, tmp_path / "store", runtime=fp32, show_progress=False))
    assert knnlm_eval(model, store, stream, k=4, runtime=fp32, show_progress=False)["lm"] == old
    again = build_chunk_db(corpus_file, tmp_path / "db2", model=str(tiny_bert), chunk_len=8, runtime=fp32, show_progress=False)
    db = ChunkDB(again, runtime=fp32)
    np.testing.assert_array_equal(db.embeddings, ChunkDB(db_path, runtime=fp32).embeddings)
    assert retro_perplexity(retro, db, text, runtime=fp32, show_progress=False) == old_retro
    assert generate(retro, db, tok, "the river flows north", max_new_tokens=9, runtime=fp32)[1]  # a chunk completed: retrieved
