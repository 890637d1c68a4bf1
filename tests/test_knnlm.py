"""kNN-LM: the interpolation against a hand computation, a proper distribution, the datastore
(keys = LM hidden states, values = next tokens, build atomic and resumable) and evaluation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ralm.data.chunks import TokenStream
from ralm.errors import RalmError
from ralm.models.knnlm import build_datastore, interpolate, knn_distribution, knn_target_prob
from ralm.models.lm import LMConfig, TransformerLM
from ralm.retrieval.lm.datastore import Datastore, auto_faiss_spec
from ralm.runtime import Runtime


def test_knn_interpolation_matches_hand_computation():
    """Toy datastore: the 3 nearest keys have squared distances 1, 2, 4 and values 5, 5, 7."""
    dist = torch.tensor([[1.0, 2.0, 4.0]])
    values = torch.tensor([[5, 5, 7]])
    vocab, lmbda = 10, 0.25
    z = math.exp(-1) + math.exp(-2) + math.exp(-4)
    p5, p7 = (math.exp(-1) + math.exp(-2)) / z, math.exp(-4) / z
    p_knn = knn_distribution(dist, values, vocab)[0]
    assert p_knn[5].item() == pytest.approx(p5) and p_knn[7].item() == pytest.approx(p7)
    assert p_knn.sum().item() == pytest.approx(1.0) and p_knn[[0, 1, 2, 3, 4, 6, 8, 9]].sum() == 0

    lm_logits = torch.linspace(-1, 1, vocab)[None]
    p_lm = torch.softmax(lm_logits, -1)[0]
    mixed = interpolate(torch.log_softmax(lm_logits, -1), p_knn[None], lmbda)[0].exp()
    for w, pk in ((5, p5), (7, p7), (0, 0.0)):
        assert mixed[w].item() == pytest.approx(lmbda * pk + (1 - lmbda) * p_lm[w].item(), rel=1e-6)
    assert mixed.sum().item() == pytest.approx(1.0, abs=1e-6)
    # a temperature flattens the neighbour weights: T -> inf gives counts 2/3, 1/3
    flat = knn_distribution(dist, values, vocab, temperature=1e6)[0]
    assert flat[5].item() == pytest.approx(2 / 3, rel=1e-4)


def test_knn_target_prob_equals_distribution_and_ignores_missing():
    g = torch.Generator().manual_seed(0)
    dist, values = torch.rand(6, 8, generator=g) * 5, torch.randint(0, 4, (6, 8), generator=g)
    values[0, 3:] = -1  # fewer than k neighbours exist
    targets = torch.randint(0, 4, (6,), generator=g)
    full = knn_distribution(dist, values, 4)
    torch.testing.assert_close(knn_target_prob(dist, values, targets), full.gather(1, targets[:, None])[:, 0])
    torch.testing.assert_close(full.sum(1), torch.ones(6))
    with pytest.raises(RalmError, match="lmbda"):
        interpolate(torch.zeros(1), torch.zeros(1), 1.5)


def test_auto_index_is_flat_for_small_and_ivfpq_for_large():
    assert auto_faiss_spec(50_000, 128) == "Flat"
    assert auto_faiss_spec(5_000_000, 256).startswith("IVF") and ",PQ" in auto_faiss_spec(5_000_000, 256)


@pytest.fixture
def tiny_lm(tmp_path, tiny_bert):
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    model = TransformerLM(LMConfig(vocab_size=64, dim=16, layers=2, heads=2, max_len=16)).eval()
    path = tmp_path / "lm"
    model.save_pretrained(path, AutoTokenizer.from_pretrained(str(tiny_bert)))
    return model, path


def _stream(n: int = 90) -> TokenStream:
    tokens = (np.arange(n) * 7 % 64).astype(np.int32)
    return TokenStream(tokens, np.array([0, n]), np.array([1]), words=n // 2)


def test_datastore_keys_are_hidden_states_and_values_next_tokens(tmp_path, tiny_lm):
    model, path = tiny_lm
    stream = _stream(30)
    store = Datastore(build_datastore(model, path, stream, tmp_path / "store", seq_len=32, stride=16, show_progress=False,
                                      dtype="fp32"))  # the maths against an fp32 forward pass
    with torch.no_grad():  # the whole text fits one window: brute force is one forward pass
        hidden = model.features(torch.from_numpy(stream.tokens[None].astype(np.int64)))[0, :-1]
    np.testing.assert_allclose(np.asarray(store.keys, dtype=np.float32), hidden.numpy(), rtol=1e-2, atol=1e-3)  # fp16 keys
    np.testing.assert_array_equal(store.values, stream.tokens[1:])
    dist, vals = store.search(hidden[:4].numpy(), 3)
    brute = ((hidden[:4, None] - torch.from_numpy(np.asarray(store.keys, dtype=np.float32))[None]) ** 2).sum(-1)
    np.testing.assert_array_equal(vals[:, 0], stream.tokens[1:5])  # each key finds itself first
    np.testing.assert_allclose(dist, brute.topk(3, largest=False).values.numpy(), rtol=1e-3, atol=1e-3)
    store.check_model(path)


def test_datastore_build_is_atomic_and_resumes(tmp_path, tiny_lm, monkeypatch):
    import ralm.models.knnlm as knnlm
    import ralm.retrieval.lm.datastore as datastore

    model, path = tiny_lm
    stream = _stream(90)
    clean = Datastore(build_datastore(model, path, stream, tmp_path / "clean", seq_len=16, stride=8, show_progress=False))
    real, seen = knnlm.lm_states, []

    def crashing(m, tokens, **kw):
        seen.append(kw["start"])
        if kw["start"] > 0:
            raise KeyboardInterrupt
        yield from real(m, tokens, **kw)

    monkeypatch.setattr(knnlm, "lm_states", crashing)
    monkeypatch.setattr(datastore, "FLAT_MAX", 10**9)
    out = tmp_path / "store"
    # blocks of 65536 // stride * stride rows would be one block here; use a stride that makes several
    monkeypatch.setattr(datastore.PartialBuild, "fill", _small_blocks(datastore.PartialBuild.fill))
    with pytest.raises(KeyboardInterrupt):
        build_datastore(model, path, stream, out, seq_len=16, stride=8, show_progress=False)
    assert not out.exists() and (tmp_path / ".store.partial" / "keys.npy").is_file()
    seen.clear()
    monkeypatch.setattr(knnlm, "lm_states", lambda m, tokens, **kw: (seen.append(kw["start"]), real(m, tokens, **kw))[1])
    store = Datastore(build_datastore(model, path, stream, out, seq_len=16, stride=8, show_progress=False))
    assert seen[0] == 32  # the first block was kept
    np.testing.assert_array_equal(store.keys, clean.keys)
    with pytest.raises(RalmError, match="already exists"):
        build_datastore(model, path, stream, out, seq_len=16, stride=8, show_progress=False)


def _small_blocks(fill):
    def wrapped(self, name, shape, dtype, compute, block=4096, **kw):
        return fill(self, name, shape, dtype, compute, block=32, **kw)
    return wrapped


def test_knnlm_eval_lambda_zero_is_the_lm_and_memorised_text_gets_easier(tmp_path, tiny_lm):
    from ralm.eval.perplexity import knnlm_eval, lm_nll, perplexity_report

    model, path = tiny_lm
    stream = _stream(60)
    store = Datastore(build_datastore(model, path, stream, tmp_path / "store", seq_len=16, stride=8, show_progress=False))
    res = knnlm_eval(model, store, stream, k=4, lambdas=(0.0, 0.5), temperatures=(1.0, 10.0), seq_len=16, stride=8,
                     show_progress=False)
    lm = perplexity_report(lm_nll(model, stream, seq_len=16, stride=8, runtime=Runtime.of(), show_progress=False),
                           stream.words)
    grid = {(r["lmbda"], r["temperature"]): {k: r[k] for k in lm} for r in res["knn"]}
    assert res["lm"] == lm == grid[0.0, 1.0] == grid[0.0, 10.0]
    # evaluated on its own datastore text, every query finds its own key: kNN-LM must help,
    # most with a low temperature (weight on the exact match)
    assert grid[0.5, 1.0]["ppl"] < 0.5 * lm["ppl"] and grid[0.5, 1.0]["ppl"] <= grid[0.5, 10.0]["ppl"]
    for bad in ({"lambdas": (0.5, 1.5)}, {"lambdas": ()}, {"temperatures": (1.0, 0.0)}):
        with pytest.raises(RalmError, match="lmbda must be in|temperature must be a positive"):
            knnlm_eval(model, store, stream, k=4, show_progress=False, **bad)


def test_cli_lm_train_knnlm_build_and_eval(tmp_path, tiny_bert, corpus_file, ralm):
    import json

    lm, store = tmp_path / "lm", tmp_path / "store"
    rc, out, err = ralm("lm", "train", "--text", corpus_file, "--out", lm, "--dim", 16, "--layers", 1, "--heads", 2,
                       "--seq-len", 16, "--steps", 3, "--batch-size", 2, "--warmup", 1, "--tokenizer", tiny_bert, "--json")
    assert rc == 0, err
    rc, out, err = ralm("knnlm", "build", "--model", lm, "--text", corpus_file, "--out", store, "--json")
    assert rc == 0, err
    built = json.loads(out)
    assert built["faiss"] == "Flat" and built["entries"] > 50
    rc, out, err = ralm("knnlm", "eval", "--model", lm, "--store", store, "--text", corpus_file, "--lmbda", "0.25,0.5",
                       "--temperature", "1,5", "-k", 8, "--json")
    assert rc == 0, err
    res = json.loads(out)
    assert res["knn-lm (λ=0.5, T=1.0, k=8)"]["ppl"] < res["lm"]["ppl"]  # its own text is in the store
    assert "knn-lm (λ=0.25, T=5.0, k=8)" in res
    rc, out, err = ralm("lm", "eval", "--model", lm, "--text", corpus_file, "--json")
    assert rc == 0 and json.loads(out)["lm"] == res["lm"]
    rc, _, err = ralm("knnlm", "eval", "--model", lm, "--store", store, "--text", corpus_file, "--lmbda", "2")
    assert rc == 2 and "lmbda must be in [0, 1]" in err
