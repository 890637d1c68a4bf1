"""The held-out evidence gain (eval/evidence.py): both losses against a brute-force sum over the
top k blocks and the null document, the null-only loss independent of retrieval, trivial
retrievals excluded, clear errors on bad input."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

from ralm.configs import ConfigError
from ralm.errors import RalmError
from ralm.eval.evidence import (EvidenceConfig, evidence_gain, gain_interval, heldout_examples, load_realm, open_index,
                                score_evidence)
from ralm.models.realm import KnowledgeAugmentedEncoder
from ralm.retrieval.index.store import IndexDir
from ralm.runtime import Runtime
from ralm.retrieval.index.dense_side import dense_of

FP32 = Runtime(torch.device("cpu"), torch.float32, show_progress=False)
HELD_OUT = [
    {"id": "held-out-apollo", "title": "Apollo 11", "text": "Neil Armstrong walked on the Moon in 1969. Apollo 11 landed in July."},
    {"id": "held-out-rome", "title": "Rome", "text": "Rome is the capital of Italy. The Colosseum was finished in the year 80."},
]


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_bert, tiny_dense_index):
    """A REALM export as `ralm pretrain` writes it: the index's towers and an encoder with its MLM head."""
    root = tmp_path_factory.mktemp("evidence")
    index = IndexDir(tiny_dense_index)
    (root / "final").mkdir()
    shutil.copytree(index.root / index.version(index.latest()).sections["dense"].retriever, root / "final" / "retriever")
    torch.manual_seed(0)
    encoder = KnowledgeAugmentedEncoder.from_pretrained(str(tiny_bert))
    with torch.no_grad():  # larger weights: a random encoder then reads its evidence, and the losses differ by block
        for name, p in encoder.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                p.normal_(0, 0.5)
    encoder.save_pretrained(root / "final" / "encoder")
    (root / "held_out.jsonl").write_text("".join(json.dumps(d) + "\n" for d in HELD_OUT))
    return root


def _config(run, index, corpus, **kw) -> EvidenceConfig:
    return EvidenceConfig(str(run), str(run), str(index), str(corpus), max_len=96, cache=str(run / f"cache-{corpus.stem}"), **kw)


def _brute_force(model, version, examples, doc_ids, k: int, exclude: bool) -> tuple[float, float, list[bool]]:
    """(retrieval loss, null-only loss) per masked wordpiece and per sentence whether retrieval
    helped: ranking over the stored embeddings, one unpadded encoder call per (x, z) pair, float64."""
    emb = np.asarray(dense_of(version).embeddings, dtype=np.float64)
    blocks = version.blocks
    own_doc = {blocks.record(i)["doc_id"]: int(blocks.doc_index[i]) for i in range(len(blocks))}
    cls_id, sep_id = model.cls_id, model.sep_id
    total_r = total_n = 0.0
    tokens, helped = 0, []
    with torch.no_grad():
        for e, doc in zip(examples, doc_ids):
            q_ids = torch.tensor([[cls_id, *e.ids, sep_id]])
            q = model.retriever.query(q_ids, torch.ones_like(q_ids))[0].double()
            ranked = np.argsort(-(emb @ q.numpy()), kind="stable")
            if exclude:
                ranked = ranked[np.asarray(blocks.doc_index)[ranked] != own_doc.get(doc, -1)]
            rows = list(ranked[:k]) + [None]
            scores, bodies = [], []
            for r in rows:
                d_ids = torch.tensor([blocks.tokens[int(r)].tolist() if r is not None else [cls_id, sep_id]])
                scores.append(float(q @ model.retriever.doc(d_ids, torch.ones_like(d_ids))[0].double()))
                bodies.append([] if r is None else blocks.body(int(r)).tolist())
            top = max(scores)
            log_pz = [s - top - math.log(sum(math.exp(t - top) for t in scores)) for s in scores]
            nll_r = nll_n = 0.0
            for pos, label in zip(e.positions, e.labels):
                log_py = []
                for body in bodies:
                    seq = [cls_id, *e.ids, sep_id, *body, sep_id][: model.cfg.max_len]
                    types = [0] * (len(e.ids) + 2) + [1] * (len(seq) - len(e.ids) - 2)
                    ids = torch.tensor([seq])
                    h = model.encoder.mlm.bert(input_ids=ids, token_type_ids=torch.tensor([types]),
                                               attention_mask=torch.ones_like(ids)).last_hidden_state
                    log_py.append(float(model.encoder.mlm.cls(h[0, pos + 1]).double().log_softmax(-1)[label]))
                nll_r -= math.log(sum(math.exp(a + b) for a, b in zip(log_pz, log_py)))
                nll_n -= log_py[-1]  # the null document is read last
            total_r, total_n, tokens = total_r + nll_r, total_n + nll_n, tokens + len(e.positions)
            helped.append(nll_r < nll_n)
    return total_r / tokens, total_n / tokens, helped


def _score(run, index, corpus, k: int, limit: int | None = None):
    cfg = _config(run, index, corpus, k=k, limit=limit)
    model = load_realm(cfg, FP32)
    version = open_index(cfg, model.retriever, FP32)
    held_out = heldout_examples(cfg, model.retriever.tokenizer, run / f"cache-{corpus.stem}", show_progress=False)
    return model, version, held_out.examples, held_out.doc_ids, score_evidence(model, version, held_out, rt=FP32, batch_size=2)


def test_losses_equal_a_brute_force_marginal(run, tiny_dense_index):
    model, version, examples, doc_ids, s = _score(run, tiny_dense_index, run / "held_out.jsonl", k=3)
    assert s.sentences == len(examples) >= 3 and s.own_document_indexed == 0  # held out: no document of its own indexed
    assert s.articles == 2  # the held-out corpus' two titles: the units of gain_ci95
    assert s.wordpieces == sum(len(e.positions) for e in examples)
    loss_r, loss_n, helped = _brute_force(model, version, examples, doc_ids, k=3, exclude=True)
    assert s.loss_retrieved == pytest.approx(loss_r, rel=1e-4)
    assert s.loss_null == pytest.approx(loss_n, rel=1e-4)
    assert s.evidence_gain == pytest.approx(loss_n - loss_r, rel=1e-4)
    assert s.helped_share == pytest.approx(np.mean(helped))
    assert s.gain_ci95[0] <= s.evidence_gain <= s.gain_ci95[1]


def test_gain_interval_resamples_articles():
    """Equal per-wordpiece gains leave nothing to resample; otherwise the interval holds the
    estimate and narrows as 1/sqrt(articles): the same 200 one-sentence articles four times over
    give half the width, but four sentences in each of them (more sentences, no more articles)
    leave it as wide, where resampling sentences would halve it."""
    tokens = torch.tensor([2.0, 3.0, 5.0])
    assert gain_interval(0.1 * tokens, torch.zeros(3), tokens, ["a", "b", "b"]) == pytest.approx((0.1, 0.1))
    rng = np.random.default_rng(1)
    null, retrieved = torch.tensor(rng.normal(3, 1, 200)), torch.tensor(rng.normal(3, 1, 200))
    tokens = torch.tensor(rng.integers(1, 4, 200)).double()
    articles = [f"article-{i}" for i in range(200)]
    lo, hi = gain_interval(null, retrieved, tokens, articles)
    assert lo < float((null - retrieved).sum() / tokens.sum()) < hi
    lo4, hi4 = gain_interval(null.repeat(4), retrieved.repeat(4), tokens.repeat(4), [f"{a}/{n}" for n in range(4) for a in articles])
    assert (hi4 - lo4) / (hi - lo) == pytest.approx(0.5, abs=0.08)
    same = gain_interval(null.repeat(4), retrieved.repeat(4), tokens.repeat(4), articles * 4)
    assert (same[1] - same[0]) / (hi - lo) == pytest.approx(1.0, abs=0.1)


def test_null_only_loss_ignores_retrieval(run, tiny_dense_index):
    one = _score(run, tiny_dense_index, run / "held_out.jsonl", k=1)[-1]
    four = _score(run, tiny_dense_index, run / "held_out.jsonl", k=4)[-1]
    assert one.loss_null == pytest.approx(four.loss_null, rel=1e-6)
    assert one.loss_retrieved != pytest.approx(four.loss_retrieved, rel=1e-6)


def test_blocks_of_the_sentences_own_document_are_excluded(run, tiny_dense_index):
    """Scoring the indexed corpus itself: every sentence's own document is in the index and must
    not be among its candidates (the brute force without the exclusion scores otherwise)."""
    corpus = run / "indexed.jsonl"
    from conftest import DOCS

    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    model, version, examples, doc_ids, s = _score(run, tiny_dense_index, corpus, k=3, limit=4)
    assert s.own_document_indexed == s.sentences == 4
    excluded = _brute_force(model, version, examples, doc_ids, k=3, exclude=True)
    kept = _brute_force(model, version, examples, doc_ids, k=3, exclude=False)
    assert s.loss_retrieved == pytest.approx(excluded[0], rel=1e-4)
    assert abs(kept[0] - excluded[0]) > 1e-3


def test_bad_input_is_a_clear_error(run, tiny_dense_index, other_tiny_bert, tmp_path):
    held_out = run / "held_out.jsonl"
    with pytest.raises(ConfigError, match="k must be a positive"):
        _config(run, tiny_dense_index, held_out, k=0)
    with pytest.raises(RalmError, match="no such file"):
        evidence_gain(_config(run, tiny_dense_index, tmp_path / "missing.jsonl"), FP32)
    with pytest.raises(RalmError, match="not an index directory"):
        evidence_gain(_config(run, tmp_path, held_out), FP32)
    with pytest.raises(ConfigError, match=r"block_len is 128 but index .* holds blocks of 288 wordpieces"):
        evidence_gain(_config(run, tiny_dense_index, held_out, block_len=128), FP32)
    with pytest.raises(RalmError, match="neither a REALM run"):
        evidence_gain(EvidenceConfig(str(tmp_path), str(run), str(tiny_dense_index), str(held_out)), FP32)
    with pytest.raises(RalmError, match="no MLM head"):  # a bare BERT: its head would be random
        evidence_gain(EvidenceConfig(str(run), str(other_tiny_bert), str(tiny_dense_index), str(held_out), max_len=96), FP32)
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"id": "a", "title": "", "text": "it was good and then it was not good at all."}) + "\n")
    with pytest.raises(RalmError, match="no sentence with a salient span"):
        evidence_gain(_config(run, tiny_dense_index, plain), FP32)


def test_index_of_another_document_tower_is_refused(run, other_tiny_bert, tmp_path):
    from conftest import DOCS
    from ralm.retrieval.index.build import build_index

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    build_index(corpus, tmp_path / "other", kind="dense", model=str(other_tiny_bert), dim=16, show_progress=False)
    with pytest.raises(RalmError, match="another model"):
        evidence_gain(_config(run, tmp_path / "other", run / "held_out.jsonl"), FP32)


def test_cli_prints_the_gain_and_errors_in_one_line(ralm, run, tiny_dense_index):
    code, out, _ = ralm("eval", "evidence", "--model", run, "--index", tiny_dense_index, "--corpus", run / "held_out.jsonl",
                        "-k", 2, "--limit", 2, "--device", "cpu", "--dtype", "fp32", "--json")
    assert code == 0
    got = json.loads(out)
    assert got["sentences"] == 2
    assert got["evidence_gain"] == pytest.approx(got["loss_null"] - got["loss_retrieved"])
    code, _, err = ralm("eval", "evidence", "--model", run, "--index", tiny_dense_index, "--corpus", run / "held_out.jsonl",
                        "--limit", -1)
    assert code == 2 and err.strip() == "error: --limit must be a positive integer, got -1"


def test_the_printed_line_gives_no_interval_from_one_article():
    """Articles are the units the interval resamples: one gives a zero-width interval, not a finding."""
    from types import SimpleNamespace

    from ralm.commands.evidence import summary_line

    s = SimpleNamespace(evidence_gain=0.12, gain_ci95=(0.12, 0.12), articles=1, loss_null=3.0, loss_retrieved=2.88,
                        helped_share=0.6, sentences=40, wordpieces=90)
    assert "one article: no interval" in summary_line(s) and "95%" not in summary_line(s)
    s.articles, s.gain_ci95 = 5, (0.05, 0.2)
    assert "95% interval +0.0500 to +0.2000 over 5 articles" in summary_line(s)
