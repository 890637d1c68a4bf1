"""The span reader: span scores, the shared-normalisation likelihood against brute force, masking,
saving and loading (its inputs from text: test_reader_features.py)."""

from __future__ import annotations

import math

import pytest
import torch

from ralm.data.reader_features import valid_spans
from ralm.errors import RalmError
from ralm.models.reader import (
    Reader,
    ReaderConfig,
    SpanScorer,
    best_spans,
    distill_kl,
    is_reader_dir,
    marginal_nll,
    shared_nll,
)


@pytest.fixture(scope="module")
def reader(tiny_bert) -> Reader:
    torch.manual_seed(0)
    return Reader.from_encoder(tiny_bert, max_len=64, max_query_len=16).eval()


def test_span_scorer_is_an_mlp_over_concatenated_endpoints():
    torch.manual_seed(0)
    scorer = SpanScorer(hidden=6, span_hidden=5, max_width=3)
    h = torch.randn(2, 7, 6)
    got = scorer(h)  # [2, 7, 3]
    w1 = torch.cat([scorer.start.weight, scorer.end.weight], 1)  # the first layer of MLP([h_s; h_e])
    for n in range(2):
        for i in range(7):
            for w in range(3):
                if i + w >= 7:
                    continue
                x = torch.cat([h[n, i], h[n, i + w]])
                want = scorer.out(torch.relu(w1 @ x + scorer.start.bias))
                assert torch.allclose(got[n, i, w], want.squeeze(), atol=1e-5)


def _brute_force_shared_nll(scores, valid, match, log_pz, question, questions, null=None, no_answer=None):
    """-log p(y|x) with one softmax over every valid span (and null span) of every input of a
    question, spelt out span by span: p(y|x) = Σ_n Σ_{matching s} p(z_n) e^f(s) / C,
    C = Σ_n p(z_n) (e^g_n + Σ_{valid s} e^f(s)); for a no-answer question y is the null spans."""
    total, count = 0.0, 0
    N, L, W = scores.shape
    for b in range(questions):
        num = den = nul = 0.0
        for n in range(N):
            if question[n] != b:
                continue
            if null is not None:
                nul += math.exp(float(log_pz[n]) + float(null[n]))
            for i in range(L):
                for w in range(W):
                    if valid[n, i, w]:
                        mass = math.exp(float(log_pz[n]) + float(scores[n, i, w]))
                        den += mass
                        num += mass if match[n, i, w] else 0.0
        den += nul
        if num > 0:
            total += -math.log(num / den)
            count += 1
        elif null is not None and no_answer is not None and no_answer[b]:
            total += -math.log(nul / den)
            count += 1
    return total / max(count, 1), count


def _random_inputs(seed, N=7, L=6, W=3):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(N, L, W, generator=g) * 2
    valid = torch.rand(N, L, W, generator=g) > 0.2
    match = torch.rand(N, L, W, generator=g) > 0.85
    return scores, valid, match, g


def test_shared_nll_equals_a_brute_force_sum_over_blocks_and_spans():
    scores, valid, match, g = _random_inputs(0)
    question = torch.tensor([0, 0, 0, 1, 1, 2, 2])  # question 0 reads 3 inputs, 1 and 2 two each
    match[5:] = False  # question 2: no answer anywhere
    match[1] = False  # an answer-free input of an answerable question
    log_pz = torch.log_softmax(torch.randn(7, generator=g), 0)
    loss, answerable = shared_nll(scores, valid, match, log_pz=log_pz, question=question, questions=3)
    want, count = _brute_force_shared_nll(scores, valid, match, log_pz, question, 3)
    assert loss.item() == pytest.approx(want, rel=1e-5)
    assert answerable.tolist() == [True, True, False] and count == 2


def test_null_span_joins_the_softmax_and_labels_no_answer_questions():
    """With null scores, C gains p(z_n) e^g_n for every input, answerable questions are pushed
    away from the null, and a no-answer question (nothing matches) learns its null spans; a
    no-answer flag on a question that does match is ignored (its spans are the gold)."""
    scores, valid, match, g = _random_inputs(3)
    question = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    match[3:] = False  # questions 1 and 2 match nothing
    match[0, 0, 0] = valid[0, 0, 0] = True
    log_pz = torch.log_softmax(torch.randn(7, generator=g), 0)
    null = torch.randn(7, generator=g, requires_grad=True)
    no_answer = torch.tensor([True, True, False])  # question 0 matches: its flag is ignored; 2 is unlabelled
    loss, labelled = shared_nll(scores, valid, match, log_pz=log_pz, question=question, questions=3, null=null,
                                no_answer=no_answer)
    want, count = _brute_force_shared_nll(scores, valid, match, log_pz, question, 3, null.detach(), no_answer)
    assert loss.item() == pytest.approx(want, rel=1e-5)
    assert labelled.tolist() == [True, True, False] and count == 2
    loss.backward()
    assert (null.grad[:3] > 0).all()  # an answerable question's nulls go down
    assert (null.grad[3:5] < 0).all()  # a no-answer question's nulls go up
    assert (null.grad[5:] == 0).all()  # an unlabelled question leaves them alone
    without, _ = shared_nll(scores, valid, match, log_pz=log_pz, question=question, questions=3)
    assert without.item() < shared_nll(scores, valid, match, log_pz=log_pz, question=question, questions=3,
                                       null=null.detach(), no_answer=torch.zeros(3, dtype=torch.bool))[0].item()


def test_distillation_is_the_kl_of_the_shared_softmaxes():
    scores, valid, _, g = _random_inputs(4)
    teacher = torch.randn(scores.shape, generator=g) * 2
    null, teacher_null = torch.randn(7, generator=g), torch.randn(7, generator=g)
    question = torch.tensor([0, 0, 1, 1, 1, 2, 2])
    log_pz = torch.log_softmax(torch.randn(7, generator=g), 0)
    T = 2.0

    def dist(f, n):  # brute force: per question, the softmax over (input, span) and (input, null)
        out = []
        for b in range(3):
            items = [float(log_pz[i]) + float(f[i, s, w]) / T for i in range(7) if question[i] == b
                     for s in range(f.shape[1]) for w in range(f.shape[2]) if valid[i, s, w]]
            items += [float(log_pz[i]) + float(n[i]) / T for i in range(7) if question[i] == b]
            t = torch.tensor(items, dtype=torch.float64)
            out.append(torch.softmax(t, 0))
        return out

    pt, ps = dist(teacher, teacher_null), dist(scores, null)
    want = sum(float((a * (a.log() - b.log())).sum()) for a, b in zip(pt, ps)) / 3 * T**2
    got = distill_kl(scores, teacher, valid, log_pz=log_pz, question=question, questions=3, null=null,
                     teacher_null=teacher_null, temperature=T)
    assert got.item() == pytest.approx(want, rel=1e-4)
    same = distill_kl(scores, scores, valid, log_pz=log_pz, question=question, questions=3, null=null, teacher_null=null)
    assert abs(same.item()) < 1e-5
    with pytest.raises(RalmError, match="null score from both"):
        distill_kl(scores, teacher, valid, log_pz=log_pz, question=question, questions=3, null=null)


def test_marginal_is_one_softmax_over_the_k_blocks_weighted_by_retrieval():
    g = torch.Generator().manual_seed(0)
    B, K, L, W = 3, 4, 6, 3
    scores = torch.randn(B, K, L, W, generator=g) * 2
    valid = torch.rand(B, K, L, W, generator=g) > 0.2
    match = torch.rand(B, K, L, W, generator=g) > 0.8
    match[2] = False  # question 2: no answer anywhere
    logits = torch.randn(B, K, generator=g)
    loss, answerable = marginal_nll(scores, valid, match, logits)
    want, count = _brute_force_shared_nll(scores.flatten(0, 1), valid.flatten(0, 1), match.flatten(0, 1),
                                          torch.log_softmax(logits, -1).flatten(), torch.arange(B).repeat_interleave(K), B)
    assert loss.item() == pytest.approx(want, rel=1e-5)
    assert answerable.tolist() == [True, True, False] and count == 2


def test_answer_free_blocks_raise_the_normaliser_and_the_loss():
    """The normalisation is shared, not per block: with a per-block softmax an answer-free block
    adds nothing (uniform unnormalised p(z)) and shifting its scores changes nothing."""
    scores, valid, match, _ = _random_inputs(2, N=2)
    valid[:, 0, 0] = True
    match[:] = False
    match[0, 0, 0] = True  # block 0 holds the answer, block 1 does not
    zeros = torch.zeros(2)

    def loss(s, n=2):
        return shared_nll(s[:n], valid[:n], match[:n], log_pz=zeros[:n], question=torch.zeros(n, dtype=torch.long), questions=1)[0]

    alone, both, louder = loss(scores, 1), loss(scores), loss(torch.cat([scores[:1], scores[1:] + 3.0]))
    block_mass = [torch.logsumexp(scores[n][valid[n]], 0) for n in range(2)]
    assert both.item() == pytest.approx(alone.item() + math.log1p(math.exp(block_mass[1] - block_mass[0])), rel=1e-5)
    assert louder.item() > both.item() + 1.0  # a louder answer-free block takes more of the shared mass
    per_block = -torch.log_softmax(scores[0][valid[0]], 0)[0]  # block 0's gold span under its own softmax
    assert both.item() > per_block.item() + 0.1


def test_unanswerable_question_contributes_nothing_and_is_counted():
    g = torch.Generator().manual_seed(1)
    B, K, L, W = 2, 3, 5, 2
    scores = torch.randn(B, K, L, W, generator=g, requires_grad=True)
    logits = torch.randn(B, K, generator=g, requires_grad=True)
    valid = torch.ones(B, K, L, W, dtype=torch.bool)
    match = torch.zeros(B, K, L, W, dtype=torch.bool)
    match[0, 1, 2, 0] = True  # only question 0 is answerable
    loss, answerable = marginal_nll(scores, valid, match, logits)
    alone, _ = marginal_nll(scores[:1], valid[:1], match[:1], logits[:1])
    assert loss.item() == pytest.approx(alone.item())
    assert answerable.tolist() == [True, False]
    loss.backward()
    assert torch.all(scores.grad[1] == 0) and torch.all(logits.grad[1] == 0)
    assert scores.grad[0].abs().sum() > 0 and logits.grad[0].abs().sum() > 0
    none, flags = marginal_nll(scores, valid, torch.zeros_like(match), logits)
    assert none.item() == 0.0 and not flags.any()


def test_spans_never_start_in_the_question(reader):
    # the answer word appears in the question too; only the evidence copy may match
    batch = reader.featurizer.featurize(["where is paris located ?"], ["paris is in france , not in spain ."])
    valid = valid_spans(batch, reader.cfg.max_span_width)
    ev = int(batch.evidence_start[0])
    assert not valid[0, :ev].any()  # no span starts in [CLS] question [SEP]
    assert not valid[0, int(batch.evidence_end[0]):].any()  # nor at/after the final [SEP]
    match = reader.featurizer.answer_match(batch, [["Paris"]])
    starts = match[0].nonzero()[:, 0].tolist()
    assert starts == [ev]
    # even when the question wordpieces score highest, the best span lies in the evidence
    scores = torch.zeros(1, batch.input_ids.shape[1], reader.cfg.max_span_width)
    scores[0, 1:ev] = 100.0
    start, width, _ = best_spans(scores, valid)
    assert int(start) >= ev and int(start + width) < int(batch.evidence_end[0])


def test_gradients_reach_the_encoder_and_scorer(reader):
    batch = reader.featurizer.featurize(["who built it ?", "who built it ?"], ["eiffel built the tower .", "nobody knows ."])
    reader.train()
    scores = reader(batch)
    valid = valid_spans(batch, reader.cfg.max_span_width)
    match = reader.featurizer.answer_match(batch, [["Eiffel"], ["Eiffel"]])
    L, W = scores.shape[1:]
    scores.retain_grad()
    loss, answerable = marginal_nll(scores.view(1, 2, L, W), valid.view(1, 2, L, W), match.view(1, 2, L, W), torch.zeros(1, 2))
    loss.backward()
    assert answerable.item()
    assert scores.grad[1].abs().sum() > 0  # the answer-free block is pushed down too (one shared softmax)
    assert reader.bert.embeddings.word_embeddings.weight.grad.abs().sum() > 0
    assert reader.spans.out.weight.grad.abs().sum() > 0
    reader.zero_grad()
    reader.eval()


def test_reading_in_length_groups_equals_one_padded_batch(reader):
    """Each group is cut to its own longest input: the valid span scores, the loss and every
    gradient must equal those of the whole batch read at full padding."""
    torch.manual_seed(0)
    texts = [" ".join(["word"] * n) + " eiffel built it ." for n in (3, 40, 7, 25, 1, 33) * 3]  # 18 inputs > one group
    batch = reader.featurizer.featurize(["who built it ?"] * len(texts), texts)
    valid = valid_spans(batch, reader.cfg.max_span_width)
    match = reader.featurizer.answer_match(batch, [["eiffel"]] * len(texts))

    def loss_and_grads(read):
        reader.zero_grad()
        scores = read(batch)
        L, W = scores.shape[1:]
        loss, _ = marginal_nll(scores.view(3, 6, L, W), valid.view(3, 6, L, W), match.view(3, 6, L, W), torch.zeros(3, 6))
        loss.backward()
        return scores.masked_fill(~valid, 0), loss, [p.grad.clone() for p in reader.parameters() if p.grad is not None]

    def padded(b):
        h = reader.bert(input_ids=b.input_ids, attention_mask=b.attention_mask, token_type_ids=b.token_type_ids).last_hidden_state
        return reader.spans(h)

    s1, l1, g1 = loss_and_grads(reader)
    s2, l2, g2 = loss_and_grads(padded)
    reader.zero_grad()
    assert torch.allclose(s1, s2, atol=1e-5) and torch.allclose(l1, l2, atol=1e-6)
    assert len(g1) == len(g2) > 0 and all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g1, g2))


def test_save_and_load_round_trip(reader, tmp_path):
    reader.save_pretrained(tmp_path / "r")
    assert is_reader_dir(tmp_path / "r")
    again = Reader.from_pretrained(tmp_path / "r").eval()
    batch = reader.featurizer.featurize(["q ?"], ["some evidence text ."])
    with torch.no_grad():  # same weights; one or two threads sum in another order (1e-7 apart)
        torch.testing.assert_close(reader(batch), again(batch), rtol=1e-5, atol=1e-6)
    assert (again.cfg.max_span_width, again.cfg.span_hidden, again.cfg.max_len) == (reader.cfg.max_span_width, reader.cfg.span_hidden, reader.cfg.max_len)
    with pytest.raises(RalmError, match="not a reader checkpoint"):
        Reader.from_pretrained(tmp_path)


def test_a_reader_split_into_shards_loads_the_same(reader, tmp_path):
    from safetensors.torch import load_file, save_file

    reader.save_pretrained(tmp_path / "r")
    state = load_file(str(tmp_path / "r" / "model.safetensors"))
    names = sorted(state)
    (tmp_path / "r" / "model.safetensors").unlink()
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :]), 1):
        save_file({k: state[k] for k in part}, str(tmp_path / "r" / f"model-0000{i}-of-00002.safetensors"))
    again = Reader.from_pretrained(tmp_path / "r").eval()
    assert all(torch.equal(v, state[k]) for k, v in again.state_dict().items())
    batch = reader.featurizer.featurize(["q ?"], ["some evidence text ."])
    with torch.no_grad():  # the fixture's encoder is transformers' BERT, the loaded one ralm's: same maths
        assert torch.allclose(reader.eval()(batch), again(batch), atol=1e-5)
    for f in (tmp_path / "r").glob("model-*.safetensors"):
        f.unlink()
    with pytest.raises(RalmError, match="no model.safetensors"):
        Reader.from_pretrained(tmp_path / "r")


def test_config_rejects_bad_values():
    with pytest.raises(RalmError, match="max_span_width"):
        ReaderConfig(max_span_width=0)
    with pytest.raises(RalmError, match="no room"):
        ReaderConfig(max_len=20, max_query_len=64)


def test_a_reader_longer_than_its_encoders_positions_is_a_clear_error(tiny_bert):
    with pytest.raises(RalmError, match="exceeds the encoder's 512 positions"):
        Reader.from_encoder(tiny_bert, max_len=600)


def test_a_reader_checkpoint_is_trained_at_the_length_asked_for(reader, tmp_path):
    from ralm.train.finetune import load_reader

    reader.cfg.calibration = {"stale": True}
    reader.save_pretrained(tmp_path / "r")
    reader.cfg.calibration = None
    again = load_reader(str(tmp_path / "r"), 96)
    assert (again.cfg.max_len, again.cfg.calibration) == (96, None)
    long_text = " ".join(["word"] * 200)
    assert again.featurizer.featurize(["q ?"], [long_text]).input_ids.shape[1] == 96  # reads 96, not the saved 64
    with pytest.raises(RalmError, match="positions"):
        load_reader(str(tmp_path / "r"), 600)


def test_partial_reader_trains_and_saves_only_its_top_layers(tiny_bert, tmp_path):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    reader = Reader.from_encoder(tiny_bert, max_len=64, max_query_len=16, trainable_layers=1)
    trained = {n for n, p in reader.named_parameters() if p.requires_grad}
    assert trained and all(n.startswith(("spans.", "bert.encoder.layer.1.")) for n in trained)
    with torch.no_grad():
        reader.bert.encoder.layer[1].output.dense.weight.add_(0.5)  # as if fine-tuned
    reader.save_pretrained(tmp_path / "r")
    saved = load_file(str(tmp_path / "r" / "model.safetensors"))
    assert set(saved) == {n for n in reader.state_dict() if n.startswith(("spans.", "bert.encoder.layer.1."))}
    again = Reader.from_pretrained(tmp_path / "r").eval()
    batch = reader.eval().featurizer.featurize(["q ?"], ["some evidence text ."])
    with torch.no_grad():
        assert torch.allclose(reader(batch), again(batch), atol=1e-6)
    with pytest.raises(RalmError, match="exceeds"):
        Reader.from_encoder(tiny_bert, trainable_layers=3)


def test_a_reader_saved_without_titles_keeps_its_input_and_a_new_one_reads_them(reader, tmp_path):
    """A checkpoint whose config predates `read_title` (ralm <= 0.4) reads `[CLS] q [SEP] body
    [SEP]`; `reading_titles()` and `with_verifier()` turn a reader into the new form, which its
    saved config then records (the verifier's head saved and loaded with it)."""
    import json

    reader.save_pretrained(tmp_path / "old")
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    for key in ("read_title", "verifier"):
        config.pop(key)
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    old = Reader.from_pretrained(tmp_path / "old")
    assert not old.cfg.read_title and not old.featurizer.read_title and old.verify_head is None
    batch = old.featurizer.featurize(["who ?"], ["bob ."], titles=["a title"])
    assert int(batch.evidence_start[0]) == 4  # [CLS] who ? [SEP] | bob . [SEP]
    new = Reader.from_pretrained(tmp_path / "old").reading_titles().with_verifier()
    with torch.no_grad():
        new.verify_head.bias.fill_(0.25)
    new.save_pretrained(tmp_path / "new")
    again = Reader.from_pretrained(tmp_path / "new")
    assert again.cfg.read_title and again.featurizer.read_title and again.verify_head.bias.item() == 0.25
    assert int(again.featurizer.featurize(["who ?"], ["bob ."], titles=["a title"]).evidence_start[0]) > 4
