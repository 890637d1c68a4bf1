"""`ralm convert hf-realm`: name mapping on synthetic HF-REALM directories, the released
architecture's maths (pooler + Linear + LayerNorm projection, LayerNorm span scorer), and clear
errors. Parity with transformers 4.x itself is benchmarks/interop/hf_realm_compat.py (needs that venv)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from conftest import DOCS
from ralm.convert.hf_realm import convert_hf_realm
from ralm.data.reader_features import valid_spans
from ralm.errors import RalmError
from ralm.models.reader import Reader, ReaderConfig
from ralm.models.realm import KnowledgeAugmentedEncoder
from ralm.retrieval.towers.encoders import Retriever

H, D, S, W, V = 16, 8, 6, 3, 30522  # hidden, projection, span hidden, span width, vocabulary
CONFIG = dict(model_type="realm", vocab_size=V, hidden_size=H, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
              hidden_act="gelu_new", max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12, pad_token_id=1,
              retriever_proj_size=D, span_hidden_size=S, max_span_width=W, reader_layer_norm_eps=1e-3, reader_seq_len=320)


def bert_tensors(prefix: str, gen: torch.Generator, pooler: bool = True) -> dict[str, torch.Tensor]:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(**{k: v for k, v in CONFIG.items() if k != "model_type"})
    shapes = {k: v.shape for k, v in BertModel(cfg).state_dict().items() if pooler or "pooler" not in k}
    return {prefix + k: 0.1 * torch.randn(s, generator=gen) for k, s in shapes.items()}


def embedder(prefix: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    t = bert_tensors(prefix + "realm.", gen)
    t |= {prefix + "cls.dense.weight": torch.randn(D, H, generator=gen), prefix + "cls.dense.bias": torch.randn(D, generator=gen),
          prefix + "cls.LayerNorm.weight": torch.randn(D, generator=gen), prefix + "cls.LayerNorm.bias": torch.randn(D, generator=gen),
          # the unused LM head inside HF's RealmScorerProjection
          prefix + "cls.predictions.bias": torch.zeros(V), prefix + "cls.predictions.transform.dense.weight": torch.zeros(H, H)}
    return t


def reader(prefix: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    t = bert_tensors(prefix + "realm.", gen)
    q = prefix + "qa_outputs."
    t |= {q + "dense_intermediate.weight": torch.randn(2 * S, H, generator=gen), q + "dense_intermediate.bias": torch.randn(2 * S, generator=gen),
          q + "layer_normalization.weight": torch.randn(S, generator=gen), q + "layer_normalization.bias": torch.randn(S, generator=gen),
          q + "dense_output.weight": torch.randn(1, S, generator=gen), q + "dense_output.bias": torch.randn(1, generator=gen),
          prefix + "cls.predictions.bias": torch.zeros(V)}
    return t


def encoder(gen: torch.Generator) -> dict[str, torch.Tensor]:
    t = bert_tensors("realm.", gen)  # its pooler is unused by the MLM
    p = "cls.predictions."
    return t | {p + "transform.dense.weight": 0.1 * torch.randn(H, H, generator=gen), p + "transform.dense.bias": torch.randn(H, generator=gen),
                p + "transform.LayerNorm.weight": torch.randn(H, generator=gen), p + "transform.LayerNorm.bias": torch.randn(H, generator=gen),
                p + "bias": torch.randn(V, generator=gen)}  # decoder.* absent: tied, as HF saves it


def write_dir(path, arch: str, state: dict, tokenizer_dir, fmt: str = "safetensors", **config):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**CONFIG, "architectures": [arch], **config}))
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    else:
        torch.save(state, path / "pytorch_model.bin")
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, path / name)
    return path


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def inputs():
    ids = torch.tensor([[101, 2054, 2003, 1996, 3007, 102, 0], [101, 7592, 2088, 102, 0, 0, 0]])
    return ids, (ids != 0).long()


def hf_embedder_forward(state: dict, prefix: str, ids, mask, token_types=None) -> torch.Tensor:
    """HF RealmEmbedder: LayerNorm(Linear(BERT pooler_output)), written out independently."""
    from transformers import BertConfig, BertModel

    bert = BertModel(BertConfig(**{k: v for k, v in CONFIG.items() if k != "model_type"})).eval()
    bert.load_state_dict({k[len(prefix + "realm."):]: v for k, v in state.items() if k.startswith(prefix + "realm.")})
    pooled = bert(input_ids=ids, attention_mask=mask, token_type_ids=token_types).pooler_output  # [B, H]
    p = prefix + "cls."
    return F.layer_norm(F.linear(pooled, state[p + "dense.weight"], state[p + "dense.bias"]), (D,),
                        state[p + "LayerNorm.weight"], state[p + "LayerNorm.bias"], eps=1e-12)


@torch.no_grad()
def test_scorer_maps_separate_towers_and_matches_hf_projection(tiny_bert, tmp_path, gen):
    state = embedder("embedder.", gen) | embedder("query_embedder.", gen)
    src = write_dir(tmp_path / "scorer", "RealmScorer", state, tiny_bert)
    summary = convert_hf_realm(src, tmp_path / "run")
    assert summary["doc_tower"] == "separate embedder" and set(summary["components"]) == {"retriever"}
    assert "query_embedder.cls.predictions.bias" in summary["ignored_tensors"]
    ret = Retriever.from_pretrained(tmp_path / "run" / "final" / "retriever").eval()
    assert ret.cfg.pooling == "pooler" and ret.cfg.proj_layernorm and ret.dim == D
    ids, mask = inputs()
    q, d = ret.query(ids, mask), ret.doc(ids, mask)
    torch.testing.assert_close(q, hf_embedder_forward(state, "query_embedder.", ids, mask), atol=1e-5, rtol=0)
    torch.testing.assert_close(d, hf_embedder_forward(state, "embedder.", ids, mask), atol=1e-5, rtol=0)
    assert (q - d).abs().max() > 1e-2  # the towers really are different weights


@torch.no_grad()
def test_blocks_are_encoded_as_realm_tokenizer_pairs(tiny_bert, tmp_path, gen):
    """HF-REALM encodes a block as the BERT pair (title, body), segment id 1 on the body, as
    RealmTokenizer does. Our blocks `[CLS] title [SEP] body [SEP]` (ids only, as the index
    builder feeds them) through the converted towers give the relevance scores of that pair
    encoding; with segment id 0 throughout they would not."""
    from ralm.data.blocks import iter_blocks
    from ralm.data.corpus import Document
    from ralm.data.padding import pad_rows

    state = embedder("embedder.", gen) | embedder("query_embedder.", gen)
    convert_hf_realm(write_dir(tmp_path / "scorer", "RealmScorer", state, tiny_bert), tmp_path / "run")
    ret = Retriever.from_pretrained(tmp_path / "run" / "final" / "retriever").eval()
    assert ret.cfg.pair_sep_id == ret.tokenizer.sep_token_id
    docs = [Document(d["id"], d["title"], d["text"]) for d in DOCS]
    blocks = [b for _, per_doc in iter_blocks(docs, ret.tokenizer) for b in per_doc]
    ids, mask = pad_rows([b.token_ids for b in blocks])
    pairs = ret.tokenizer([d.title for d in docs], [d.text for d in docs], padding=True, return_tensors="pt")
    assert torch.equal(ids, pairs["input_ids"]) and pairs["token_type_ids"].any()  # one block per document here
    q = ret.tokenize_queries(["capital of france", "who walked on the moon"])
    scores = ret.query(q["input_ids"], q["attention_mask"]) @ ret.doc(ids, mask).T  # [2, 6]
    query = hf_embedder_forward(state, "query_embedder.", q["input_ids"], q["attention_mask"])
    reference = query @ hf_embedder_forward(state, "embedder.", pairs["input_ids"], pairs["attention_mask"], pairs["token_type_ids"]).T
    torch.testing.assert_close(scores, reference, atol=1e-4, rtol=0)
    one_segment = query @ hf_embedder_forward(state, "embedder.", pairs["input_ids"], pairs["attention_mask"]).T
    assert (one_segment - reference).abs().max() > 1e-3  # ten times the tolerance: segment ids matter here
    fingerprint = ret.doc_fingerprint()
    ret.cfg.pair_sep_id = None  # a retriever converted before the flag existed: segment 0 throughout ...
    torch.testing.assert_close(ret.query(q["input_ids"], q["attention_mask"]) @ ret.doc(ids, mask).T, one_segment, atol=1e-4, rtol=0)
    assert ret.doc_fingerprint() != fingerprint  # ... and an index built with it is refused by the new one


def test_embedder_and_shared_scorer_give_both_towers_one_weight(tiny_bert, tmp_path, gen):
    state = embedder("", gen)
    convert_hf_realm(write_dir(tmp_path / "emb", "RealmEmbedder", state, tiny_bert), tmp_path / "a")
    # A RealmScorer saved without a separate query embedder: both towers are its `embedder`.
    scorer = {f"embedder.{k}": v for k, v in state.items()}
    summary = convert_hf_realm(write_dir(tmp_path / "sc", "RealmScorer", scorer, tiny_bert), tmp_path / "b")
    assert summary["doc_tower"] == "shared with the query tower"
    for run in ("a", "b"):
        ret = Retriever.from_pretrained(tmp_path / run / "final" / "retriever")
        for name, t in ret.query.state_dict().items():
            assert torch.equal(t, ret.doc.state_dict()[name]), name
        assert torch.equal(ret.query.norm.weight, state["cls.LayerNorm.weight"])
        assert torch.equal(ret.query.bert.pooler.dense.weight, state["realm.pooler.dense.weight"])


@torch.no_grad()
def test_reader_span_scores_match_hf_reader_projection(tiny_bert, tmp_path, gen):
    state = reader("", gen)
    src = write_dir(tmp_path / "reader", "RealmReader", state, tiny_bert, fmt="bin")  # HF writes readers as .bin
    convert_hf_realm(src, tmp_path / "run")
    model = Reader.from_pretrained(tmp_path / "run" / "final" / "reader").eval()
    assert model.cfg.span_layernorm_eps == 1e-3 and model.cfg.max_span_width == W and model.cfg.span_hidden == S
    batch = model.featurizer.featurize(["where is paris"], ["paris lies on the seine river in france"])
    scores = model(batch)  # [1, L, W]
    # HF RealmReaderProjection, step by step: split dense_intermediate into start/end halves,
    # relu(start_i + end_j) -> LayerNorm(eps 1e-3) -> dense_output.
    h = model.bert(input_ids=batch.input_ids, attention_mask=batch.attention_mask, token_type_ids=batch.token_type_ids).last_hidden_state[0]
    start, end = F.linear(h, state["qa_outputs.dense_intermediate.weight"], state["qa_outputs.dense_intermediate.bias"]).chunk(2, -1)
    valid = valid_spans(batch, W)[0]
    assert valid.sum() > 0
    for i, w in valid.nonzero().tolist():
        x = F.layer_norm(torch.relu(start[i] + end[i + w]), (S,), state["qa_outputs.layer_normalization.weight"],
                         state["qa_outputs.layer_normalization.bias"], eps=1e-3)
        expected = F.linear(x, state["qa_outputs.dense_output.weight"], state["qa_outputs.dense_output.bias"])[0]
        assert abs(float(scores[0, i, w]) - float(expected)) < 1e-5


def test_encoder_restores_tied_decoder_and_drops_pooler(tiny_bert, tmp_path, gen):
    state = encoder(gen)
    summary = convert_hf_realm(write_dir(tmp_path / "enc", "RealmKnowledgeAugEncoder", state, tiny_bert), tmp_path / "run")
    assert summary["ignored_tensors"] == ["realm.pooler.dense.bias", "realm.pooler.dense.weight"]
    enc = KnowledgeAugmentedEncoder.from_pretrained(str(tmp_path / "run" / "final" / "encoder"))
    head = enc.mlm.cls.predictions
    assert torch.equal(head.decoder.weight, state["realm.embeddings.word_embeddings.weight"])
    assert torch.equal(head.decoder.bias, state["cls.predictions.bias"])
    assert enc.mlm.config.hidden_act == "gelu_new"


def test_openqa_drops_block_emb_and_takes_doc_tower_from_doc_embedder(tiny_bert, tmp_path, gen):
    state = embedder("embedder.", gen) | reader("reader.", gen) | {"block_emb": torch.randn(5, D, generator=gen)}
    src = write_dir(tmp_path / "oqa", "RealmForOpenQA", state, tiny_bert, fmt="bin")
    summary = convert_hf_realm(src, tmp_path / "run")
    assert set(summary["components"]) == {"retriever", "reader"} and "block_emb" in summary["ignored_tensors"]
    assert summary["doc_tower"] == "copied from the query embedder"
    doc_state = embedder("", gen)
    doc_src = write_dir(tmp_path / "doc", "RealmEmbedder", doc_state, tiny_bert)
    summary = convert_hf_realm(src, tmp_path / "run2", doc_embedder=doc_src)
    ret = Retriever.from_pretrained(tmp_path / "run2" / "final" / "retriever")
    assert torch.equal(ret.doc.proj.weight, doc_state["cls.dense.weight"])
    assert torch.equal(ret.query.proj.weight, state["embedder.cls.dense.weight"])
    record = json.loads((tmp_path / "run2" / "final" / "conversion.json").read_text())
    assert set(record) == {"retriever", "reader"} and record["retriever"]["doc_tower"] == f"from {doc_src}"
    with pytest.raises(RalmError, match="RealmForOpenQA checkpoints only"):
        convert_hf_realm(doc_src, tmp_path / "run3", doc_embedder=doc_src)


def test_wrong_directory_is_a_clear_error(tiny_bert, tmp_path, gen):
    with pytest.raises(RalmError, match="not a directory"):
        convert_hf_realm(tmp_path / "missing", tmp_path / "run")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RalmError, match="no config.json"):
        convert_hf_realm(tmp_path / "empty", tmp_path / "run")
    with pytest.raises(RalmError, match="model_type is 'bert'"):
        convert_hf_realm(tiny_bert, tmp_path / "run")
    src = write_dir(tmp_path / "noweights", "RealmEmbedder", embedder("", gen), tiny_bert)
    (src / "model.safetensors").unlink()
    with pytest.raises(RalmError, match="no weights"):
        convert_hf_realm(src, tmp_path / "run")
    src = write_dir(tmp_path / "notok", "RealmEmbedder", embedder("", gen), tiny_bert)
    for f in src.glob("*"):
        if f.name not in ("config.json", "model.safetensors"):
            f.unlink()
    with pytest.raises(RalmError, match="no tokenizer"):
        convert_hf_realm(src, tmp_path / "run")
    assert not (tmp_path / "run").exists()  # nothing half-written


def test_unknown_missing_and_misshapen_tensors_are_listed(tiny_bert, tmp_path, gen):
    state = embedder("", gen)
    extra = state | {"cls.extra.weight": torch.zeros(2), "mystery": torch.zeros(1)}
    with pytest.raises(RalmError, match=r"2 unknown tensor name\(s\) for RealmEmbedder: cls.extra.weight, mystery"):
        convert_hf_realm(write_dir(tmp_path / "a", "RealmEmbedder", extra, tiny_bert), tmp_path / "run")
    missing = {k: v for k, v in state.items() if k not in ("cls.LayerNorm.bias", "realm.encoder.layer.0.output.dense.weight")}
    with pytest.raises(RalmError, match=r"missing: cls.LayerNorm.bias, realm.encoder.layer.0.output.dense.weight"):
        convert_hf_realm(write_dir(tmp_path / "b", "RealmEmbedder", missing, tiny_bert), tmp_path / "run")
    r = {k: v for k, v in reader("", gen).items() if k != "qa_outputs.dense_intermediate.bias"}
    with pytest.raises(RalmError, match=r"missing: qa_outputs.dense_intermediate.bias"):
        convert_hf_realm(write_dir(tmp_path / "c", "RealmReader", r, tiny_bert), tmp_path / "run")
    with pytest.raises(RalmError, match=r"wrong shape: .*cls.dense.weight is \(8, 16\), the config implies \(4, 16\)"):
        convert_hf_realm(write_dir(tmp_path / "d", "RealmEmbedder", state, tiny_bert, retriever_proj_size=4), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_pickled_objects_in_a_bin_are_refused(tiny_bert, tmp_path, gen):
    src = write_dir(tmp_path / "evil", "RealmEmbedder", embedder("", gen) | {"note": torch.zeros(1)}, tiny_bert, fmt="bin")
    torch.save({"weights": embedder("", gen), "payload": ReaderConfig()}, src / "pytorch_model.bin")  # an arbitrary object
    with pytest.raises(RalmError, match="not a plain tensor checkpoint"):
        convert_hf_realm(src, tmp_path / "run")


def test_sharded_weights_are_read_through_their_index(tiny_bert, tmp_path, gen):
    from safetensors.torch import save_file

    state = embedder("", gen)
    src = write_dir(tmp_path / "sharded", "RealmEmbedder", state, tiny_bert)
    (src / "model.safetensors").unlink()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: state[k].contiguous() for k in keys}, str(src / file))
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    convert_hf_realm(src, tmp_path / "run")
    ret = Retriever.from_pretrained(tmp_path / "run" / "final" / "retriever")
    assert torch.equal(ret.doc.proj.bias, state["cls.dense.bias"])


def test_architecture_is_detected_from_names_without_config_hint(tiny_bert, tmp_path, gen):
    src = write_dir(tmp_path / "r", "RealmReader", reader("", gen), tiny_bert, architectures=None)
    assert convert_hf_realm(src, tmp_path / "run")["architecture"] == "RealmReader"


def _drop_config_keys(model_dir, *keys) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k not in keys}))


def test_checkpoints_from_before_the_hf_realm_options_load_and_score_unchanged(tiny_bert, tmp_path):
    """A reader and a retriever saved before the HF-REALM options existed (no span LayerNorm, [CLS]
    pooling, a bare Linear projection, one segment; none of the options in config.json) load
    strictly and give the scores they were saved with: the options stay off by default."""
    reader = Reader.from_encoder(tiny_bert, max_len=64, max_query_len=16, span_hidden=S, max_span_width=W,
                                 span_layernorm_eps=None).eval()
    reader.save_pretrained(tmp_path / "reader")
    _drop_config_keys(tmp_path / "reader", "span_layernorm_eps")
    batch = reader.featurizer.featurize(["capital of france?"], [DOCS[0]["text"]])
    torch.testing.assert_close(Reader.from_pretrained(tmp_path / "reader").eval()(batch), reader(batch))

    retriever = Retriever.from_pretrained(tiny_bert, dim=D, pooling="cls", proj_layernorm=False, pair_sep_id=None).eval()
    retriever.save_pretrained(tmp_path / "retriever")
    _drop_config_keys(tmp_path / "retriever", "pooling", "proj_layernorm", "pair_sep_id")
    again = Retriever.from_pretrained(tmp_path / "retriever").eval()
    texts = ["capital of france?", "[CLS] paris [SEP] paris is the capital of france. [SEP]"]
    torch.testing.assert_close(again.encode_queries(texts, dtype=torch.float32), retriever.encode_queries(texts, dtype=torch.float32))


def test_cli_convert_then_index_and_search(tiny_bert, tmp_path, gen, ralm, corpus_file):
    src = write_dir(tmp_path / "scorer", "RealmScorer", embedder("embedder.", gen) | embedder("query_embedder.", gen), tiny_bert)
    rc, out, err = ralm("convert", "hf-realm", src, "--out", tmp_path / "run", "--json")
    assert rc == 0, err
    assert json.loads(out)["components"] == {"retriever": str(tmp_path / "run" / "final" / "retriever")}
    rc, out, err = ralm("index", "build", corpus_file, "--out", tmp_path / "idx", "--model", tmp_path / "run" / "final" / "retriever", "--json")
    assert rc == 0, err
    assert json.loads(out)["dim"] == D
    rc, out, err = ralm("search", tmp_path / "idx", "capital of Japan", "-k", 3, "--json")
    assert rc == 0, err
    hits = json.loads(out)
    assert len(hits) == 3 and {h["id"].split(":")[0] for h in hits} <= {d["id"] for d in DOCS}
    rc, out, err = ralm("convert", "hf-realm", tmp_path / "nowhere", "--out", tmp_path / "run")
    assert rc == 2 and "not a directory" in err
