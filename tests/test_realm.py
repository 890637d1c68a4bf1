"""REALM maths on a tiny model: the marginal loss against a brute-force sum, gradients in all
three networks, the null document, trivial-retrieval exclusion."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ralm.data.masking import MaskedSentence
from ralm.errors import RalmError
from ralm.models.realm import (
    KnowledgeAugmentedEncoder,
    Realm,
    RealmConfig,
    marginal_nll,
    masked_token_log_probs,
    relevance_log_probs,
    retrieval_utility,
    select_candidates,
    span_in_top_block,
)
from ralm.retrieval.towers.encoders import Retriever
from ralm.retrieval.search.searcher import load_version
from ralm.retrieval.index.store import IndexDir
from ralm.retrieval.index.dense_side import dense_of
from ralm.runtime import Runtime


@pytest.fixture
def realm(tiny_bert, tiny_dense_index):
    torch.manual_seed(0)
    index = IndexDir(tiny_dense_index)
    retriever = Retriever.from_pretrained(tiny_dense_index / index.version_manifest(index.latest())["sections"]["dense"]["retriever"])
    model = Realm(retriever, KnowledgeAugmentedEncoder.from_pretrained(str(tiny_bert)), RealmConfig(k=3, max_len=96))
    return model.eval(), load_version(index, index.latest(), runtime=Runtime.resolve("cpu"))


def _examples(model, version) -> list[MaskedSentence]:
    tok = model.retriever.tokenizer
    out = []
    for text, masked, doc in (("Paris is the capital of France", [4, 5], 0), ("Neil Armstrong walked on the Moon", [0, 1, 2], 5)):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        labels = [ids[p] for p in masked]
        x = [tok.mask_token_id if i in masked else t for i, t in enumerate(ids)]
        out.append(MaskedSentence(x, masked, labels, doc))
    return out


def _exact_search(version):
    return lambda q, n: dense_of(version).index.search(q, n)[1]


def test_marginal_nll_matches_python_sum():
    g = torch.Generator().manual_seed(0)
    log_pz = torch.randn(2, 3, generator=g).log_softmax(-1)
    log_py = torch.randn(2, 3, 4, generator=g).log_softmax(-1)
    mask = torch.tensor([[True, True, False, False], [True, True, True, True]])
    got = marginal_nll(log_pz, log_py, mask)
    for b in range(2):
        want = -sum(math.log(sum(math.exp(log_pz[b, z]) * math.exp(log_py[b, z, j]) for z in range(3)))
                    for j in range(4) if mask[b, j])
        assert got[b].item() == pytest.approx(want, rel=1e-5)


def test_model_loss_equals_brute_force_over_candidates(realm):
    """Batched, padded forward == one unpadded encoder call per (x, z) pair, summed in float64."""
    model, version = realm
    examples = _examples(model, version)
    with torch.no_grad():
        out = model(examples, version.blocks, _exact_search(version))
    rows = out.rows
    tower_doc, tower_q = model.retriever.doc, model.retriever.query
    cls_id, sep_id = model.cls_id, model.sep_id
    with torch.no_grad():
        for b, e in enumerate(examples):
            q_ids = torch.tensor([[cls_id, *e.ids, sep_id]])
            q = tower_q(q_ids, torch.ones_like(q_ids))[0].double()
            bodies, scores = [], []
            for r in list(rows[b]) + [None]:
                d_ids = torch.tensor([version.blocks.tokens[int(r)].tolist() if r is not None else [cls_id, sep_id]])
                scores.append(float(q @ tower_doc(d_ids, torch.ones_like(d_ids))[0].double()))
                bodies.append([] if r is None else version.blocks.body(int(r)).tolist())
            pz = np.exp(np.array(scores) - max(scores))
            pz /= pz.sum()
            total = 0.0
            for j, (pos, label) in enumerate(zip(e.positions, e.labels)):
                mix = 0.0
                for z, body in enumerate(bodies):
                    seq = [cls_id, *e.ids, sep_id, *body, sep_id][: model.cfg.max_len]
                    types = [0] * (len(e.ids) + 2) + [1] * (len(seq) - len(e.ids) - 2)
                    ids = torch.tensor([seq])
                    h = model.encoder.mlm.bert(input_ids=ids, token_type_ids=torch.tensor([types]),
                                               attention_mask=torch.ones_like(ids)).last_hidden_state
                    logp = model.encoder.mlm.cls(h[0, pos + 1]).double().log_softmax(-1)[label]
                    mix += pz[z] * math.exp(float(logp))
                total -= math.log(mix)
            assert out.nll[b].item() == pytest.approx(total, rel=1e-4)
            assert out.tokens[b].item() == len(e.positions)


def test_gradients_reach_query_tower_doc_tower_and_encoder(realm):
    model, version = realm
    model.train()
    out = model(_examples(model, version), version.blocks, _exact_search(version))
    (out.nll.sum() / out.tokens.sum()).backward()
    for name, module in (("query", model.retriever.query), ("doc", model.retriever.doc), ("encoder", model.encoder)):
        norm = sum(float(p.grad.norm()) for p in module.parameters() if p.grad is not None)
        assert norm > 0, f"no gradient in the {name}"


def test_null_document_is_always_the_last_candidate(realm):
    model, version = realm
    examples = _examples(model, version)
    with torch.no_grad():
        out = model(examples, version.blocks, _exact_search(version))
        cands = model.embed_candidates(version.blocks, out.rows)  # [B, K, D]
        null_ids = torch.tensor([[model.cls_id, model.sep_id]])
        null = model.retriever.doc(null_ids, torch.ones_like(null_ids))[0]
    assert out.log_pz.shape == (len(examples), model.cfg.k + 1)
    assert out.rows.shape == (len(examples), model.cfg.k)
    for b in range(len(examples)):
        torch.testing.assert_close(cands[b, -1], null)
    assert torch.allclose(out.log_pz.exp().sum(-1), torch.ones(len(examples)))


def test_trivial_retrievals_never_appear(realm):
    """Even a search that ranks the example's own document first cannot return it."""
    model, version = realm
    doc_index = np.asarray(version.blocks.doc_index)
    examples = _examples(model, version)

    def own_first(q, n):
        rows = []
        for e in examples:
            own = np.flatnonzero(doc_index == e.doc)
            rest = np.flatnonzero(doc_index != e.doc)
            rows.append(np.concatenate([own, rest])[:n])
        return np.stack(rows)

    with torch.no_grad():
        out = model(examples, version.blocks, own_first)
    for e, rows in zip(examples, out.rows):
        assert all(doc_index[r] != e.doc for r in rows)
    # the plain selection function: -1 (no result) and own-document rows are skipped
    got = select_candidates(np.array([[0, -1, 1, 2, 3]]), np.array([0, 0, 1, 2]), [0], 2)
    assert got.tolist() == [[2, 3]]
    with pytest.raises(RalmError, match="non-trivial"):
        select_candidates(np.array([[0, 1, 2]]), np.array([0, 0, 1]), [0], 2)


def test_ablation_switches_drop_the_null_document_and_keep_trivial_retrievals(realm):
    """--no-null-doc: p(z|x) over the retrieved blocks only, the loss their marginal;
    --no-exclude-trivial: the search's first k, own document included."""
    model, version = realm
    examples = _examples(model, version)
    doc_index = np.asarray(version.blocks.doc_index)

    def own_first(q, n):
        return np.stack([np.concatenate([np.flatnonzero(doc_index == e.doc), np.flatnonzero(doc_index != e.doc)])[:n]
                         for e in examples])

    with torch.no_grad():
        full = model(examples, version.blocks, own_first)
        model.cfg = RealmConfig(k=3, max_len=96, null_doc=False, exclude_trivial=False)
        out = model(examples, version.blocks, own_first)
        assert (out.log_pz[:, -1] == float("-inf")).all()
        torch.testing.assert_close(out.log_pz[:, :-1].exp().sum(-1), torch.ones(len(examples)))
        for e, rows in zip(examples, out.rows):
            assert doc_index[rows[0]] == e.doc  # the trivial retrieval is back
        # the loss is the marginal over the k retrieved blocks alone
        logits, labels, label_mask = model.read(examples, version.blocks, out.rows)
        log_py = masked_token_log_probs(logits, labels)[:, :-1]
        want = marginal_nll(out.log_pz[:, :-1], log_py, label_mask)
    torch.testing.assert_close(out.nll, want)
    assert out.rows.tolist() != full.rows.tolist()  # with exclusion on, the same search kept other blocks
    assert select_candidates(np.array([[0, -1, 1, 2]]), np.array([0, 0, 1]), None, 2).tolist() == [[0, 1]]


def test_retrieval_utility_compares_top_block_with_null():
    log_pz = torch.tensor([[0.1, 0.7, 0.2]]).log()  # candidate 1 is z*, 2 is null
    log_py = torch.tensor([[[-3.0, -1.0], [-0.5, -0.25], [-2.0, -2.0]]])
    mask = torch.tensor([[True, True]])
    assert retrieval_utility(log_pz, log_py, mask).item() == pytest.approx(-0.75 - (-4.0))


def test_span_in_top_block_looks_only_at_the_most_relevant_block():
    class Bodies:
        def body(self, i: int) -> np.ndarray:
            return np.array({0: [5, 6, 7], 1: [6, 9], 2: [8]}[i])

    examples = [MaskedSentence([1, 103, 103], [1, 2], labels, 0) for labels in ([5, 6], [6, 9], [8, 8])]
    rows = np.array([[1, 0], [1, 0], [0, 1]])
    log_pz = torch.tensor([[0.2, 0.7, 0.1], [0.6, 0.3, 0.1], [0.1, 0.1, 0.8]]).log()  # null last, never z*
    # z* = block 0 (holds 5 and 6), block 1 (holds 6 and 9), block 0 (no 8, although block 2 has it)
    assert span_in_top_block(examples, Bodies(), rows, log_pz).tolist() == [True, True, False]


def test_relevance_and_token_log_probs_are_normalised():
    g = torch.Generator().manual_seed(1)
    log_pz = relevance_log_probs(torch.randn(2, 4, generator=g), torch.randn(2, 3, 4, generator=g))
    torch.testing.assert_close(log_pz.exp().sum(-1), torch.ones(2))
    logits = torch.randn(2, 3, 5, 7, generator=g)
    labels = torch.randint(0, 7, (2, 5), generator=g)
    got = masked_token_log_probs(logits, labels)
    assert got[1, 2, 3].item() == pytest.approx(logits[1, 2, 3].log_softmax(-1)[labels[1, 3]].item(), rel=1e-6)


def test_encoder_checkpoint_state_is_saveable(realm, tmp_path):
    """The tied MLM decoder must not break safetensors checkpoints, and reloads exactly."""
    from safetensors.torch import load_file, save_file

    model, _ = realm
    save_file(model.state_dict(), str(tmp_path / "m.safetensors"))
    model.load_state_dict(load_file(str(tmp_path / "m.safetensors")), strict=True)
    model.encoder.save_pretrained(tmp_path / "enc")
    from transformers import BertForMaskedLM

    reloaded = BertForMaskedLM.from_pretrained(str(tmp_path / "enc"))
    torch.testing.assert_close(reloaded.cls.predictions.decoder.weight, model.encoder.mlm.cls.predictions.decoder.weight)


def test_mismatched_vocabularies_are_refused(tiny_bert, tiny_dense_index, tmp_path):
    from transformers import AutoTokenizer, BertConfig, BertModel

    index = IndexDir(tiny_dense_index)
    retriever = Retriever.from_pretrained(tiny_dense_index / index.version_manifest(index.latest())["sections"]["dense"]["retriever"])
    other = tmp_path / "other"
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"]) + "\n")
    tok = AutoTokenizer.from_pretrained(str(tiny_bert)).__class__(vocab_file=str(tmp_path / "vocab.txt"))
    BertModel(BertConfig(vocab_size=7, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)).save_pretrained(str(other))
    tok.save_pretrained(str(other))
    with pytest.raises(RalmError, match="vocabulary"):
        Realm(retriever, KnowledgeAugmentedEncoder.from_pretrained(str(other)), RealmConfig(k=2))


def test_length_buckets_change_no_number(realm, monkeypatch):
    """Reading pairs and embedding blocks in groups of similar length (each padded to its own
    longest row) gives the loss and gradients of one padded batch."""
    import ralm.models.realm as realm_module

    model, version = realm
    examples = _examples(model, version)

    def loss_and_grads(group):
        monkeypatch.setattr(realm_module, "length_group", lambda device: group)
        model.zero_grad()
        out = model(examples, version.blocks, _exact_search(version))
        out.nll.sum().backward()
        return out.nll.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    nll_one, grads_one = loss_and_grads(10_000)  # a single group: the unbucketed batch
    nll_two, grads_two = loss_and_grads(2)
    torch.testing.assert_close(nll_two, nll_one, rtol=1e-5, atol=1e-5)
    assert len(grads_two) == len(grads_one) > 0
    for a, b in zip(grads_two, grads_one):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_by_length_returns_results_in_input_order():
    from ralm.encoders.length_groups import by_length

    lengths = [5, 1, 4, 1, 3]
    calls = []
    out = by_length(lengths, lambda rows: calls.append(rows) or torch.tensor([[float(lengths[r]), r] for r in rows]), group=2)
    assert calls == [[1, 3], [4, 2], [0]]  # shortest first, stable on ties
    assert out[:, 1].tolist() == [0, 1, 2, 3, 4]
