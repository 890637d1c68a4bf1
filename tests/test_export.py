"""`ralm export`: an exported retriever gives ralm's embeddings in plain transformers (pooling and
projection reimplemented from the exported files) and, where installed, in sentence-transformers."""

from __future__ import annotations

import json

import pytest
import torch

from ralm.convert.export import export_model
from ralm.data.corpus import Document
from ralm.errors import RalmError
from ralm.retrieval.towers.encoders import Retriever

DOCS = [Document("a", "Paris", "Paris is the capital of France."), Document("b", "", "The Moon orbits the Earth.")]
QUERIES = ["capital of france", "what orbits the earth"]


@pytest.fixture(scope="module")
def trained(tiny_bert, tmp_path_factory):
    """A retriever with a projection and towers that differ, as training leaves them."""
    ret = Retriever.from_pretrained(str(tiny_bert), dim=8, pooling="mean")
    with torch.no_grad():
        for p in ret.doc.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    ret.cfg.projection_ready = True
    path = tmp_path_factory.mktemp("ret") / "retriever"
    ret.save_pretrained(path)
    return Retriever.from_pretrained(path), path


def _hf_encode(folder, texts, max_len):
    """What a user writes with transformers alone, from the files in the exported directory."""
    from safetensors.torch import load_file
    from transformers import AutoModel, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(str(folder)), AutoModel.from_pretrained(str(folder)).eval()
    batch = tok(texts, padding=True, truncation=True, max_length=max_len, return_tensors="pt")
    with torch.no_grad():
        hidden = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    head = json.loads((folder / "ralm_head.json").read_text())
    mask = batch["attention_mask"].unsqueeze(-1).float()
    v = hidden[:, 0] if head["pooling"] == "cls" else (hidden * mask).sum(1) / mask.sum(1)
    if head["normalize"]:
        v = torch.nn.functional.normalize(v, dim=-1)
    if head["projection"]:
        w = load_file(str(folder / "ralm_head.safetensors"))
        v = v @ w["weight"].T + w["bias"]
    return v * head["score_scale"]


def _as_text(doc: Document) -> str:
    return f"{doc.title} [SEP] {doc.text}"


def test_hf_export_gives_the_same_embeddings(trained, tmp_path):
    ret, path = trained
    summary = export_model(path, tmp_path / "hf", "hf")
    assert summary["kind"] == "retriever"
    docs = _hf_encode(tmp_path / "hf" / "document", [_as_text(d) for d in DOCS], ret.cfg.block_max_len)
    torch.testing.assert_close(docs, torch.from_numpy(ret.encode_documents(DOCS, dtype="fp32")), atol=1e-5, rtol=1e-4)
    queries = _hf_encode(tmp_path / "hf" / "query", QUERIES, ret.cfg.query_max_len)
    torch.testing.assert_close(queries, ret.encode_queries(QUERIES, dtype="fp32"), atol=1e-5, rtol=1e-4)
    # the towers differ: exporting the query tower twice would fail the document check
    assert (queries - _hf_encode(tmp_path / "hf" / "document", QUERIES, ret.cfg.query_max_len)).abs().max() > 1e-4


def test_sentence_transformers_layout_round_trip(trained, tmp_path):
    ret, path = trained
    export_model(path, tmp_path / "st", "sentence-transformers")
    folder = tmp_path / "st" / "document"
    modules = json.loads((folder / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[1] for m in modules] == ["Transformer", "Pooling", "Dense"]
    assert json.loads((folder / "1_Pooling" / "config.json").read_text())["pooling_mode_mean_tokens"]
    expected = torch.from_numpy(ret.encode_documents(DOCS, dtype="fp32"))
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        pytest.skip("sentence-transformers is not installed (the plain-transformers export test covers the maths)")
    model = SentenceTransformer(str(folder), device="cpu")
    got = torch.as_tensor(model.encode([_as_text(d) for d in DOCS], convert_to_numpy=True))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    query = SentenceTransformer(str(tmp_path / "st" / "query"), device="cpu")
    got = torch.as_tensor(query.encode(QUERIES, convert_to_numpy=True))
    torch.testing.assert_close(got * ret.cfg.score_scale, ret.encode_queries(QUERIES, dtype="fp32"), atol=1e-5, rtol=1e-4)


def test_reader_export_loads_in_transformers(tmp_path, tiny_bert):
    from transformers import AutoModel

    from ralm.models.reader import Reader

    reader = Reader.from_encoder(str(tiny_bert))
    reader.save_pretrained(tmp_path / "reader")
    export_model(tmp_path / "reader", tmp_path / "out", "hf")
    bert = AutoModel.from_pretrained(str(tmp_path / "out")).eval()
    batch = reader.featurizer.featurize(["where is paris"], ["Paris is in France."])
    with torch.no_grad():
        ours = reader.eval().bert(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                  token_type_ids=batch.token_type_ids).last_hidden_state
        theirs = bert(input_ids=batch.input_ids, attention_mask=batch.attention_mask, token_type_ids=batch.token_type_ids).last_hidden_state
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-4)
    assert json.loads((tmp_path / "out" / "ralm_reader.json").read_text())["max_span_width"] == reader.cfg.max_span_width
    with pytest.raises(RalmError, match="no sentence-transformers form"):
        export_model(tmp_path / "reader", tmp_path / "st", "sentence-transformers")


def test_export_refuses_what_it_cannot_write(trained, tmp_path):
    _, path = trained
    with pytest.raises(RalmError, match="format must be one of"):
        export_model(path, tmp_path / "x", "onnx")
    (tmp_path / "exists").mkdir()
    with pytest.raises(RalmError, match="exists"):
        export_model(path, tmp_path / "exists", "hf")
    with pytest.raises(RalmError, match="neither a retriever nor a reader"):
        export_model(tmp_path, tmp_path / "y", "hf")


def test_cli_export(ralm, trained, tmp_path):
    _, path = trained
    code, stdout, _ = ralm("export", str(path), "--format", "hf", "--out", str(tmp_path / "e"), "--json")
    assert code == 0 and json.loads(stdout)["parts"]["query"] == str(tmp_path / "e" / "query")
    code, _, stderr = ralm("export", str(path), "--format", "hf", "--out", str(tmp_path / "e"))
    assert code == 2 and "exists" in stderr


def test_a_reader_packed_as_the_package_ships_it_reads_the_same(tiny_bert, tmp_path):
    """`--format package`: fp16 shards (word embeddings | the rest) that load back to the reader's
    fp32 weights rounded to fp16, with its config and tokenizer."""
    import torch
    from safetensors import safe_open

    from ralm.convert.export import export_model
    from ralm.models.reader import Reader

    torch.manual_seed(0)
    reader = Reader.from_encoder(tiny_bert, max_len=96, max_query_len=16).reading_titles().with_verifier()
    reader.save_pretrained(tmp_path / "reader")
    export_model(tmp_path / "reader", tmp_path / "packed", "package")
    shards = sorted(p.name for p in (tmp_path / "packed").glob("model-*.safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    with safe_open(str(tmp_path / "packed" / shards[0]), "pt") as f:
        assert all("word_embeddings" in k for k in f.keys()) and all(f.get_tensor(k).dtype == torch.float16 for k in f.keys())
    packed = Reader.from_pretrained(tmp_path / "packed")
    assert packed.cfg.read_title and packed.cfg.verifier and packed.cfg.max_len == reader.cfg.max_len
    before, after = reader.state_dict(), packed.state_dict()
    assert all(torch.equal(before[k].half().float(), after[k]) for k in before if not k.endswith("position_ids"))


def test_packing_a_reader_calibrated_in_fp32_says_its_maps_need_the_package_calibrated(tiny_bert, tmp_path):
    """A map records the fingerprint of the weights it was fitted with, and fp16 rounding changes
    it: packing a reader calibrated in fp32 warns (and notes in the result) that the package
    must be calibrated itself; a package calibrated as packed packs again in silence."""
    import json
    import warnings

    import torch

    from ralm.convert.export import export_model
    from ralm.errors import RalmWarning
    from ralm.models.reader import Reader, save_calibrated

    def calibrated(source, out):
        fingerprint = Reader.from_pretrained(source).fingerprint()
        one = {"method": "selective", "questions": 100, "features": ["logit_score"], "mean": [0.0], "scale": [1.0],
               "weights": [1.0], "bias": 0.0, "fitted_with": {"reader": fingerprint, "k": 10, "threshold": 0.4}}
        return save_calibrated(source, out, {"by_kind": {"hybrid": one, "dense": {**one, "fitted_with": {"k": 10}}}})

    torch.manual_seed(0)
    Reader.from_encoder(tiny_bert, max_len=96, max_query_len=16).save_pretrained(tmp_path / "reader")
    with pytest.warns(RalmWarning, match=r"the hybrid confidence map\(s\) were fitted with the fp32 weights"):
        result = export_model(calibrated(tmp_path / "reader", tmp_path / "cal"), tmp_path / "packed", "package")
    assert "calibrate the package itself" in result["notes"][0]
    assert json.loads((tmp_path / "packed" / "config.json").read_text())["calibration"]["by_kind"]["hybrid"]["fitted_with"]["threshold"] == 0.4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = export_model(calibrated(tmp_path / "packed", tmp_path / "cal16"), tmp_path / "packed-again", "package")
    assert "notes" not in again
