"""The reader's inputs from text (data/reader_features.py): windows, spans on word boundaries,
gold spans by the answer rule, and a teacher's vocabulary map."""

from __future__ import annotations

import pytest
import torch

from ralm.data.qa import normalize_answer
from ralm.data.reader_features import ReaderFeaturizer, valid_spans, wordpiece_map
from ralm.encoders.loading import load_tokenizer
from ralm.errors import RalmError


@pytest.fixture(scope="module")
def featurizer(tiny_bert) -> ReaderFeaturizer:
    """A reader's featurisation at ReaderConfig(max_len=64, max_query_len=16)'s lengths."""
    return ReaderFeaturizer(load_tokenizer(str(tiny_bert)), max_len=64, max_query_len=16, max_span_width=10, max_positions=512)


def _tokens(featurizer, batch, n):
    return featurizer.tokenizer.convert_ids_to_tokens(batch.input_ids[n].tolist())


def test_spans_start_and_end_on_word_boundaries(featurizer):
    # "eiffel" is e ##iff ##el, "rossum" ross ##um: no span may start or end inside them
    batch = featurizer.featurize(["who ?"], ["eiffel met rossum in paris ."])
    valid = valid_spans(batch, featurizer.max_span_width)
    tokens = _tokens(featurizer, batch, 0)
    spans = valid[0].nonzero().tolist()
    assert spans and all(not tokens[i].startswith("##") and not tokens[i + w + 1].startswith("##") for i, w in spans)
    words = {batch.span_text(0, i, w)[0] for i, w in spans}
    assert {"eiffel", "rossum", "eiffel met rossum", "paris ."} <= words
    assert not {"e", "eiff", "ross", "iffel", "el met"} & words
    # without word information (HF-REALM parity inputs) every wordpiece is a boundary
    batch.word_start = None
    assert valid_spans(batch, featurizer.max_span_width).sum() > valid.sum()


def test_a_window_cut_mid_word_ends_no_span_there(featurizer):
    text = "one two three four five six seven eight nine ten eleven twelve kilimanjaro thirteen"
    batch, _ = featurizer.featurize_windows(["q ?"], [text], stride=4, max_len=18)  # 13 evidence wordpieces
    valid = valid_spans(batch, featurizer.max_span_width)
    tokens = _tokens(featurizer, batch, 0)
    last = int(batch.evidence_end[0]) - 1
    assert tokens[last] == "ki" and tokens[last + 1] == "[SEP]"  # window 0 ends inside "kilimanjaro"
    assert not any(i + w == last for i, w in valid[0].nonzero().tolist())  # "twelve ki" would cut the word
    assert any(i + w == last - 1 for i, w in valid[0].nonzero().tolist())  # "twelve" itself is fine


def test_answer_match_respects_word_boundaries_and_width(featurizer):
    batch = featurizer.featurize(["when ?"], ["built in 1889s and finished in 1889 ."])
    match = featurizer.answer_match(batch, [["1889"]])
    hits = match[0].nonzero().tolist()
    assert len(hits) == 2  # "1889" and "1889 ." (equal once normalised); "1889s" is not "1889"
    text, (a, b) = batch.span_text(0, hits[0][0], hits[0][1])
    assert text == "1889" and batch.texts[0][a:b] == "1889" and a == batch.texts[0].index("1889 ")
    long_answer = " ".join(["word"] * (featurizer.max_span_width + 1))
    assert not featurizer.answer_match(batch, [[long_answer]]).any()


def test_answer_match_is_the_answer_rule_every_normalised_equal_span(featurizer):
    """Gold spans are exactly the valid spans whose SQuAD-normalised text equals a normalised
    answer (what EM and pick_answer count right), not only verbatim copies: "photons." and
    "The Photons" are gold for "photons"; "photon" and "photonsx" are not."""
    texts = ["light is made of photons . the photons move ; photons , they say , photon photonsx labs .",
             "a standard measurement scale was used : the standard measurement scale ( scale )"]
    answers = [["Photons"], ["a standard measurement scale", "scale"]]
    batch = featurizer.featurize(["what ?", "which ?"], texts)
    match = featurizer.answer_match(batch, answers)
    valid = valid_spans(batch, featurizer.max_span_width)
    for n in range(2):
        gold = {normalize_answer(a) for a in answers[n]}
        brute = {(i, w) for i, w in valid[n].nonzero().tolist() if normalize_answer(batch.span_text(n, i, w)[0]) in gold}
        assert {tuple(x) for x in match[n].nonzero().tolist()} == brute
    got = {batch.span_text(0, i, w)[0] for i, w in match[0].nonzero().tolist()}
    assert {"photons", "photons .", "the photons", "photons ,"} <= got and not {"photon", "photonsx"} & got
    assert "; photons ," not in got  # a span does not run across "; " (a table cell's end)


def test_wordpiece_map_reads_a_student_batch_in_a_shifted_vocabulary(featurizer):
    """A teacher whose vocabulary holds the same wordpieces at other ids (MPNet's: BERT's, after
    <s> <pad> </s> <unk>) reads the student's inputs token for token, specials by role."""
    class Shifted:
        def __init__(self, base):
            self.vocab = {t: i + 4 for t, i in base.get_vocab().items()}
            self.vocab.update({"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3})
            self.cls_token_id, self.pad_token_id, self.sep_token_id, self.unk_token_id = 0, 1, 2, 3
            self.mask_token_id = None

        def get_vocab(self):
            return self.vocab

    student = featurizer.tokenizer
    mapped = wordpiece_map(student, Shifted(student))
    batch = featurizer.featurize(["who built it ?"], ["eiffel built the tower ."])
    ids = batch.input_ids[0].tolist()
    got = mapped[batch.input_ids][0].tolist()
    assert got[0] == 0 and got[ids.index(student.sep_token_id)] == 2
    inner = [i for i in ids if i not in (student.cls_token_id, student.sep_token_id, student.pad_token_id)]
    assert [mapped[i].item() for i in inner] == [i + 4 for i in inner]

    class Other(Shifted):
        def __init__(self, base):
            super().__init__(base)
            self.vocab = {f"x{t}": i for t, i in self.vocab.items()}

    with pytest.raises(RalmError, match="not the student's"):
        wordpiece_map(student, Other(student))


def test_windows_cover_the_text_stride_apart(featurizer):
    text = " ".join(f"word{i}" for i in range(60))  # about 120 wordpieces: several 64-wordpiece inputs
    batch, owner = featurizer.featurize_windows(["which word ?", "short ?"], [text, "one two ."], stride=20)
    pieces = featurizer._wordpieces.encode(text, add_special_tokens=False).offsets
    windows = [n for n in range(len(owner)) if owner[n] == 0]
    assert owner[-1] == 1 and owner.count(1) == 1 and len(windows) > 2
    firsts = [pieces.index(batch.offsets[n][0]) for n in windows]
    assert firsts == [20 * j for j in range(len(windows))]
    assert batch.offsets[windows[-1]][-1] == pieces[-1]  # the last window reaches the end
    assert all(batch.offsets[n][-1] != pieces[-1] for n in windows[:-1])  # and no earlier one does
    for n in windows:
        ev, end = int(batch.evidence_start[n]), int(batch.evidence_end[n])
        assert batch.input_ids[n, ev - 1] == featurizer.tokenizer.sep_token_id and end - ev == len(batch.offsets[n])
        assert batch.texts[n] == text
    first = featurizer.featurize(["which word ?"], [text])
    assert torch.equal(first.input_ids[0], batch.input_ids[0, : first.input_ids.shape[1]])
    assert batch.span_text(windows[1], int(batch.evidence_start[windows[1]]), 0)[0] == text[slice(*pieces[20])]
    with pytest.raises(RalmError, match="stride 100"):
        featurizer.featurize_windows(["q ?"], [text], stride=100)


def test_a_title_reader_reads_the_title_between_the_question_and_the_body(tiny_bert):
    """`[CLS] question [SEP] title [SEP] body [SEP]`: the title is evidence (segment B) but never
    an answer span, and span offsets still index the body."""
    tok = load_tokenizer(str(tiny_bert))
    titled = ReaderFeaturizer(tok, max_len=64, max_query_len=16, max_span_width=10, max_positions=512, read_title=True)
    batch = titled.featurize(["who painted it ?"], ["he painted the starry night ."], titles=["vincent van gogh"])
    tokens = tok.convert_ids_to_tokens(batch.input_ids[0].tolist())
    assert tokens[:12] == ["[CLS]", "who", "painted", "it", "?", "[SEP]", "vincent", "van", "gogh", "[SEP]", "he", "painted"]
    assert int(batch.evidence_start[0]) == 10 and batch.token_type_ids[0, :6].sum() == 0 and batch.token_type_ids[0, 6:].all()
    valid = valid_spans(batch, titled.max_span_width)
    assert not valid[0, :10].any()  # no span starts in the question or the title
    spans = {batch.span_text(0, i, w)[0] for i, w in valid[0].nonzero().tolist()}
    assert "the starry night" in spans and not any("gogh" in s for s in spans)
    # an old reader (read_title False) reads `[CLS] question [SEP] body [SEP]`, titles or not
    old = ReaderFeaturizer(tok, max_len=64, max_query_len=16, max_span_width=10, max_positions=512)
    plain = old.featurize(["who painted it ?"], ["he painted the starry night ."], titles=["vincent van gogh"])
    assert tok.convert_ids_to_tokens(plain.input_ids[0].tolist())[5:8] == ["[SEP]", "he", "painted"]
    assert int(plain.evidence_start[0]) == 6


def test_no_span_crosses_a_line_or_a_table_cell(featurizer):
    text = "Team: Client connections 20,000; Topics 500.\nPro: Client connections 5,000; Topics 50."
    batch = featurizer.featurize(["how many ?"], [text])
    valid = valid_spans(batch, featurizer.max_span_width)
    spans = [batch.span_text(0, i, w) for i, w in valid[0].nonzero().tolist()]
    assert {"20,000", "Client connections 20,000", "5,000", "Topics 500."} <= {s for s, _ in spans}
    for s, (a, b) in spans:
        assert "\n" not in text[a:b] and "; " not in text[a:b], s  # never "20,000; Topics" or "500.\nPro"
    match = featurizer.answer_match(batch, [["20,000; Topics"]])
    assert not match.any()  # a gold answer across a cell is no span either


def test_the_verifier_reads_question_and_answer_then_title_and_context(tiny_bert):
    from ralm.data.reader_features import answer_context

    tok = load_tokenizer(str(tiny_bert))
    f = ReaderFeaturizer(tok, max_len=64, max_query_len=16, max_span_width=10, max_positions=512, read_title=True)
    text = "Vincent van Gogh moved to Arles. He painted the starry night in 1889. He died in 1890."
    start = text.index("1889")
    context = answer_context(text, (start, start + 4))
    assert context == "Vincent van Gogh moved to Arles. He painted the starry night in 1889."  # its sentence and the one before
    batch = f.featurize_verify(["when was it painted ?"], ["1889"], [context], titles=["the starry night"])
    tokens = tok.convert_ids_to_tokens(batch.input_ids[0].tolist())
    assert tokens[:11] == ["[CLS]", "when", "was", "it", "painted", "?", "[SEP]", "1889", "[SEP]", "the", "starr"]
    assert batch.token_type_ids[0, :9].sum() == 0 and batch.token_type_ids[0, 9 : int(batch.attention_mask[0].sum())].all()
