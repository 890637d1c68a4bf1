import json
import shutil

import numpy as np
import pytest
import torch

from ralm.errors import RalmError
from ralm.retrieval.towers.encoders import SCORE_SCALE, Retriever, is_retriever_dir, pool
from ralm.retrieval.towers.encoding import encode_rows, length_sorted_batches
from ralm.retrieval.towers.projection import init_projection_pca


def test_mean_pooling_ignores_padding():
    h = torch.tensor([[[1.0, 1.0], [3.0, 3.0], [100.0, 100.0]]])
    mask = torch.tensor([[1, 1, 0]])
    assert pool(h, mask, "mean").tolist() == [[2.0, 2.0]]
    assert pool(h, mask, "cls").tolist() == [[1.0, 1.0]]


def test_pca_projection_with_full_dim_preserves_inner_products_up_to_the_score_scale(tiny_bert):
    r = Retriever.from_pretrained(tiny_bert, dim=32)
    x = torch.randn(50, 32)
    init_projection_pca(r, x)
    y = r.doc.proj(x).detach()
    scale = SCORE_SCALE / x.square().sum(-1).mean()  # one factor for every pair: rankings are unchanged
    torch.testing.assert_close(y @ y.T, scale * (x @ x.T), atol=1e-3, rtol=1e-4)
    assert y.square().sum(-1).mean().item() == pytest.approx(SCORE_SCALE, rel=1e-4)
    assert r.cfg.projection_ready
    torch.testing.assert_close(r.query.proj.weight, r.doc.proj.weight)


def test_pca_projection_keeps_the_top_directions(tiny_bert):
    r = Retriever.from_pretrained(tiny_bert, dim=2)
    x = torch.zeros(20, 32)
    x[:, 5] = torch.linspace(-3, 3, 20) * 10
    x[:, 9] = torch.linspace(1, 2, 20)
    init_projection_pca(r, x)
    kept = r.doc.proj(x).detach()
    scale = SCORE_SCALE / x.square().sum(-1).mean()
    torch.testing.assert_close((kept @ kept.T), scale * (x @ x.T), atol=1e-2, rtol=1e-3)


def test_save_and_load_round_trip_gives_identical_embeddings(tiny_bert, tmp_path):
    r = Retriever.from_pretrained(tiny_bert, dim=8).eval()
    init_projection_pca(r, torch.randn(40, 32))
    r.save_pretrained(tmp_path / "ckpt")
    assert is_retriever_dir(tmp_path / "ckpt") and not is_retriever_dir(tiny_bert)
    again = Retriever.from_pretrained(tmp_path / "ckpt").eval()
    q = ["where is paris", "capital of japan"]
    torch.testing.assert_close(r.encode_queries(q), again.encode_queries(q))
    assert r.doc_fingerprint() == again.doc_fingerprint()
    assert again.cfg.projection_ready and again.dim == 8


def test_equal_towers_are_stored_once_and_load_as_two_independent_towers(tiny_bert, tmp_path):
    from safetensors import safe_open

    r = Retriever.from_pretrained(tiny_bert, dim=None).eval()
    r.save_pretrained(tmp_path / "tied")
    with safe_open(str(tmp_path / "tied" / "model.safetensors"), "pt") as f:
        assert f.keys() and not [k for k in f.keys() if not k.startswith("query.")]
    again = Retriever.from_pretrained(tmp_path / "tied").eval()
    assert again.doc_fingerprint() == r.doc_fingerprint()
    ids = r.tokenize_queries(["where is paris"])
    torch.testing.assert_close(again.doc(ids["input_ids"], ids["attention_mask"]), r.doc(ids["input_ids"], ids["attention_mask"]))
    with torch.no_grad():  # the loaded towers do not share storage: training one leaves the other
        next(again.doc.parameters()).add_(1.0)
    assert again.doc_fingerprint() != r.doc_fingerprint()
    assert not torch.equal(next(again.doc.parameters()), next(again.query.parameters()))
    again.save_pretrained(tmp_path / "untied")  # towers now differ: both are stored
    assert Retriever.from_pretrained(tmp_path / "untied").doc_fingerprint() == again.doc_fingerprint()


def test_sentence_transformers_pooling_is_honoured(tiny_bert, tmp_path):
    st = tmp_path / "st"
    shutil.copytree(tiny_bert, st)
    (st / "1_Pooling").mkdir()
    (st / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (st / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Normalize"}]))
    r = Retriever.from_pretrained(st, dim=None)
    assert (r.cfg.pooling, r.cfg.normalize) == ("mean", True)
    assert Retriever.from_pretrained(tiny_bert, dim=None).cfg.pooling == "cls"
    from ralm.retrieval.towers.encoders import SCORE_SCALE

    v = r.encode_queries(["hello world"], dtype="fp32")
    ids = r.tokenize_queries(["hello world"])
    d = r.doc(ids["input_ids"], ids["attention_mask"]).detach()
    # normalised, no projection: documents are unit vectors, queries carry the 20 x cosine scale
    assert abs(float(d.norm()) - 1.0) < 1e-5 and abs(float(v.norm()) - SCORE_SCALE) < 1e-3
    assert r.cfg.score_scale == SCORE_SCALE
    assert Retriever.from_pretrained(st, dim=8).cfg.score_scale == 1.0  # a PCA projection carries the scale


def test_an_encoder_without_sdpa_or_segment_ids_loads_and_round_trips(tmp_path):
    """MPNet (all-mpnet-base-v2's architecture) has neither SDPA attention nor token type ids:
    it loads with eager attention, pools as its plain HF model does, and a saved retriever
    reloads to the same vectors."""
    from conftest import make_tiny_bert
    from transformers import AutoModel

    make_tiny_bert(tmp_path / "mpnet", arch="mpnet")
    r = Retriever.from_pretrained(tmp_path / "mpnet", dim=None, pooling="mean").eval()
    assert r.query.bert.config._attn_implementation == "eager"
    q = ["where is paris", "capital of japan"]
    plain = AutoModel.from_pretrained(str(tmp_path / "mpnet")).eval()
    enc = r.tokenize_queries(q)
    with torch.no_grad():
        expect = pool(plain(**enc).last_hidden_state, enc["attention_mask"], "mean")
    torch.testing.assert_close(r.encode_queries(q, dtype="fp32"), expect, atol=1e-5, rtol=1e-4)
    r.save_pretrained(tmp_path / "ckpt")
    again = Retriever.from_pretrained(tmp_path / "ckpt").eval()
    torch.testing.assert_close(again.encode_queries(q, dtype="fp32"), r.encode_queries(q, dtype="fp32"))


def test_default_model_is_the_bundled_minilm_with_mean_pooling():
    r = Retriever.from_pretrained(None, dim=None)
    assert r.cfg.pooling == "mean" and r.cfg.normalize and r.dim == 384


def test_model_loading_errors_are_clear(tmp_path):
    with pytest.raises(RalmError, match="no such directory: .*missing"):
        Retriever.from_pretrained(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RalmError, match="not a Hugging Face model directory"):
        Retriever.from_pretrained(tmp_path / "empty")


def test_a_name_that_is_no_directory_is_looked_up_on_the_hub_once_without_retries(monkeypatch, tmp_path):
    """Online, `--model nosuch` used to reach the loader, which retried an unreachable hub for
    about 50 s; the lookup is one call with a timeout, and each answer is one line."""
    from unittest import mock

    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    from ralm.encoders import locate

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # nothing cached
    calls = []

    def answer(error):
        def model_info(self, name, timeout=None):
            calls.append((name, timeout))
            if error is not None:
                raise error
        return model_info

    for error, message in [(ConnectionError("no route"), "--model nosuch: no such directory, and the Hugging Face hub"),
                           (RepositoryNotFoundError("404", response=mock.Mock()), "nor a model on the Hugging Face hub")]:
        monkeypatch.setattr(HfApi, "model_info", answer(error))
        with pytest.raises(RalmError, match=message):
            locate.check_model_location("nosuch")
    for error in (None, GatedRepoError("401", response=mock.Mock())):  # a model there: the loader takes over
        monkeypatch.setattr(HfApi, "model_info", answer(error))
        locate.check_model_location("org/model")
    assert calls == [("nosuch", locate.HUB_TIMEOUT_S)] * 2 + [("org/model", locate.HUB_TIMEOUT_S)] * 2
    (tmp_path / "models--org--cached").mkdir()
    locate.check_model_location("org/cached")  # in the cache: no lookup
    assert len(calls) == 4


def test_length_sorted_batches_cover_every_row_once():
    lengths = np.random.default_rng(0).integers(1, 300, size=1000)
    batches = length_sorted_batches(lengths, 32, window=4)
    flat = np.concatenate(batches)
    assert sorted(flat.tolist()) == list(range(1000))
    assert all(len(b) <= 32 for b in batches)
    first = batches[0]
    assert lengths[first].min() >= np.sort(lengths[:128])[::-1][31]  # longest of the window first


def test_bucketed_encoding_equals_one_by_one(tiny_bert):
    r = Retriever.from_pretrained(tiny_bert, dim=None).eval()
    rng = np.random.default_rng(0)
    rows = [np.concatenate([[101], rng.integers(1000, 2000, size=n), [102]]) for n in rng.integers(3, 40, size=23)]
    lengths = np.array([len(x) for x in rows])
    out = encode_rows(r.doc, rows, lengths, out=np.zeros((23, 32), np.float32), batch_size=5, show_progress=False, dtype="fp32")
    with torch.inference_mode():
        single = torch.cat([r.doc(torch.from_numpy(x[None]), torch.ones(1, len(x), dtype=torch.long)) for x in rows]).numpy()
    np.testing.assert_allclose(out, single, atol=1e-5)


def test_encoding_errors_surface_from_the_prefetch_thread(tiny_bert):
    r = Retriever.from_pretrained(tiny_bert, dim=None).eval()

    class Broken:
        def __getitem__(self, i):
            raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        encode_rows(r.doc, Broken(), np.array([3, 4]), out=np.zeros((2, 32), np.float32), show_progress=False)
