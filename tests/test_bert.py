"""ralm's own BERT and tokenizer (encoders/bert.py, data/tokenizer.py) against
transformers, on the same weights and tokenizer files; copy-free safetensors loading."""

from __future__ import annotations

import pytest
import torch

from ralm.atomic import load_safetensors, read_weights
from ralm.data.tokenizer import WordpieceTokenizer
from ralm.encoders.loading import assign_weights, bert_from_config


@pytest.fixture(scope="module")
def hf_bert(tiny_bert):
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(tiny_bert)).eval()


def test_bert_matches_transformers_with_padding_and_segments(tiny_bert, hf_bert):
    ours = bert_from_config(hf_bert.config.to_dict(), device="meta")
    missing, unexpected = assign_weights(ours, read_weights(tiny_bert), tiny_bert)
    assert not [k for k in missing if not k.endswith("position_ids")] and not unexpected
    ours.eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 5000, (4, 19), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    mask[2, 2:] = 0
    segments = torch.zeros_like(ids)
    segments[:, 7:] = 1
    with torch.no_grad():
        ref = hf_bert(input_ids=ids, attention_mask=mask, token_type_ids=segments)
        got = ours(ids, mask, segments)
    real = mask.bool()
    torch.testing.assert_close(got.last_hidden_state[real], ref.last_hidden_state[real], atol=2e-5, rtol=0)
    torch.testing.assert_close(got.pooler_output, ref.pooler_output, atol=2e-5, rtol=0)
    with torch.no_grad():  # a broken mask changes the padded rows' real tokens: the test sees masking
        unmasked = ours(ids, torch.ones_like(mask), segments)
    assert (unmasked.last_hidden_state[1, :11] - ref.last_hidden_state[1, :11]).abs().max() > 1e-3


def test_bert_trains_like_transformers(tiny_bert, hf_bert):
    """Same gradients (dropout off) for the same loss: the encoder can be fine-tuned as loaded."""
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(str(tiny_bert), hidden_dropout_prob=0.0)
    ours = bert_from_config({**hf.config.to_dict(), "hidden_dropout_prob": 0.0}, device="meta")
    assign_weights(ours, read_weights(tiny_bert), tiny_bert)
    ids = torch.randint(1000, 5000, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    hf(input_ids=ids, attention_mask=mask).last_hidden_state.pow(2).mean().backward()
    ours(ids, mask).last_hidden_state.pow(2).mean().backward()
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        if "pooler" not in name:
            torch.testing.assert_close(p.grad, theirs[name].grad, atol=1e-5, rtol=1e-3)


def test_tokenizer_matches_transformers(tiny_bert):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_bert), use_fast=True)
    ours = WordpieceTokenizer.from_pretrained(tiny_bert)
    titles = ["Paris", "", "A very long title " * 5]
    texts = ["The capital of France.", "no title here", "word " * 300]
    for kwargs in ({"max_length": 16}, {"max_length": 300}, {}):
        a = hf(titles, texts, padding=True, truncation=True, return_tensors="pt", **kwargs)
        b = ours(titles, texts, padding=True, truncation=True, return_tensors="pt", **kwargs)
        assert all(torch.equal(a[k], b[k]) for k in ("input_ids", "token_type_ids", "attention_mask"))
        a = hf(texts, padding=True, truncation=True, return_tensors="pt", **kwargs)
        b = ours(texts, padding=True, truncation=True, return_tensors="pt", **kwargs)
        assert all(torch.equal(a[k], b[k]) for k in ("input_ids", "token_type_ids", "attention_mask"))
    assert (ours.cls_token_id, ours.sep_token_id, ours.pad_token_id, ours.mask_token_id) == \
        (hf.cls_token_id, hf.sep_token_id, hf.pad_token_id, hf.mask_token_id)
    assert ours.get_vocab() == hf.get_vocab() and ours.model_max_length == hf.model_max_length
    assert ours.decode(b["input_ids"][0], skip_special_tokens=True) == hf.decode(a["input_ids"][0], skip_special_tokens=True)


MIXED = ["Café Müller's naïve résumé, Ångström & Øresund.", "東京は日本の首都です。北京大学！", "e\u0301 vs é; ÉCOLE vs école",
         "U.S.A. -- it's (really) 3.14?! «quoted» \u201cthis\u201d... #tag @you", "  tabs\tand\nnew\u00a0lines, bell\x07 and\ufeffBOM  ",
         "Ünïcödé ﬁ ligature, ½, Ⅻ, 👍🏽 and ZWJ 👨\u200d👩\u200d👧", "antidisestablishmentarianism pneumonoultramicroscopic"]


def test_bm25_side_splits_blocks_into_transformers_wordpieces():
    """The BM25 side reads the bundled MiniLM's tokenizer.json itself (no transformers import on
    a one-shot search): blocks, block-store key and queries come out as transformers' would."""
    from ralm.data.blocks import BlockConfig, Document, iter_blocks, tokenizer_fingerprint
    from ralm.encoders.loading import load_tokenizer
    from ralm.retrieval.index.bm25_side import BM25Side

    hf, ours = load_tokenizer(), BM25Side.tokenizer(None)
    assert isinstance(ours, WordpieceTokenizer)
    docs = [Document(str(i), title, text) for i, (title, text) in enumerate(zip(MIXED[::-1], MIXED))]
    docs.append(Document("long", "Long", " ".join(MIXED) * 12))  # several blocks, cut at sentence ends
    cfg = BlockConfig(max_len=40, max_title_len=8)
    assert list(iter_blocks(docs, ours, cfg)) == list(iter_blocks(docs, hf, cfg))
    assert tokenizer_fingerprint(ours) == tokenizer_fingerprint(hf)
    assert (ours.cls_token_id, ours.sep_token_id, ours.pad_token_id) == (hf.cls_token_id, hf.sep_token_id, hf.pad_token_id)
    assert ours(MIXED, padding=True)["input_ids"] == hf(MIXED, padding=True)["input_ids"]


def test_saved_tokenizer_loads_in_transformers(tiny_bert, tmp_path):
    from transformers import AutoTokenizer

    WordpieceTokenizer.from_pretrained(tiny_bert).save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(str(tmp_path), use_fast=True)
    original = AutoTokenizer.from_pretrained(str(tiny_bert), use_fast=True)
    assert again("hello world, again")["input_ids"] == original("hello world, again")["input_ids"]


def test_safetensors_views_are_private_and_copy_free(tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(4, dtype=torch.float16)}, str(path))
    first, second = load_safetensors(path), load_safetensors(path)
    assert torch.equal(first["a"], load_file(str(path))["a"]) and first["b"].dtype == torch.float16
    first["a"] += 100  # training writes into its copy-on-write pages ...
    assert torch.equal(second["a"], load_file(str(path))["a"])  # ... not into another load, nor the file
    assert torch.equal(load_safetensors(path)["a"], torch.arange(6, dtype=torch.float32).view(2, 3))
    (tmp_path / "bad.safetensors").write_bytes(b"\x05")
    from ralm.errors import RalmError

    with pytest.raises(RalmError, match="not a safetensors file"):
        load_safetensors(tmp_path / "bad.safetensors")


def test_doc_fingerprint_is_kept_until_a_weight_changes(tiny_bert, tmp_path):
    from ralm.retrieval.towers.encoders import Retriever, _fingerprint

    Retriever.from_pretrained(str(tiny_bert), dim=None).save_pretrained(tmp_path / "r")
    ret = Retriever.from_pretrained(tmp_path / "r")
    saved = ret.doc_fingerprint()
    assert saved == _fingerprint(ret.doc, ret.cfg)  # the saved value is the hash of the loaded weights
    with torch.no_grad():
        next(ret.doc.parameters()).add_(1.0)  # what an optimiser step does
    assert ret.doc_fingerprint() == _fingerprint(ret.doc, ret.cfg) != saved
    changed = ret.doc_fingerprint()
    ret.cfg.normalize = not ret.cfg.normalize
    assert ret.doc_fingerprint() != changed
    fused = torch.optim.AdamW(ret.doc.parameters(), lr=0.1, fused=True)  # writes without bumping tensor versions
    for p in ret.doc.parameters():
        p.grad = torch.ones_like(p)
    fused.step()
    ret.save_pretrained(tmp_path / "again")  # a checkpoint still records the hash of what it holds
    assert Retriever.from_pretrained(tmp_path / "again").doc_fingerprint() == _fingerprint(ret.doc, ret.cfg)
    with torch.inference_mode():  # loaded as inference tensors, which keep no version counter
        assert Retriever.from_pretrained(tmp_path / "again").doc_fingerprint() == _fingerprint(ret.doc, ret.cfg)
