"""Open-domain QA inference and evaluation: p(answer|x) under one softmax over the spans of
all blocks read (weighted by p(z|x), summed per answer text), evidence, EM/F1."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import math

import numpy as np
import pytest
import torch

from conftest import DOCS
from ralm.data.qa import Question
from ralm.errors import RalmError
from ralm.eval.openqa import evaluate_qa
from ralm.data.qa import normalize_answer
from ralm.data.reader_features import valid_spans
from ralm.models.reader import Reader, default_reader_path, is_reader_dir, write_calibration
from ralm.pipeline import OpenQA, ReadBlock, Span, open_searcher, pick_answer, resolve_reader
from ralm.retrieval.index.build import build_index
from ralm.retrieval.towers.encoders import Retriever
from ralm.retrieval.search.searcher import Searcher
from ralm.retrieval.index.store import IndexDir
from ralm.retrieval.index.dense_side import dense_of

QUESTIONS = [
    Question("q1", "What is the capital of France?", ("Paris",)),
    Question("q2", "When did Armstrong walk on the Moon?", ("1969",)),
    Question("q3", "Which river flows into the Mediterranean?", ("the Nile",)),
]
TARGETS = {"france": "Paris", "moon": "1969", "mediterranean": "Nile"}  # question word -> the span to score high


@pytest.fixture(scope="module")
def oracle_reader(tiny_bert) -> Reader:
    """A reader whose span scores are 10 on spans equal to its question's target (the shortest
    highest: "Paris" over "Paris ."), 0 elsewhere."""
    torch.manual_seed(0)
    reader = Reader.from_encoder(tiny_bert, max_len=96, max_query_len=16)

    def forward(batch):
        questions = [reader.tokenizer.decode(ids[: int(s)]) for ids, s in zip(batch.input_ids, batch.evidence_start)]
        targets = [[t for w, t in TARGETS.items() if w in q] for q in questions]
        match = reader.featurizer.answer_match(batch, targets).float()  # [N, L, W]
        return match * (10.0 - 0.01 * torch.arange(match.shape[-1]))

    reader.forward = forward
    return reader


def test_answers_come_from_evidence_with_consistent_scores(oracle_reader, tiny_dense_index):
    qa = OpenQA(oracle_reader, Searcher.open(tiny_dense_index), k=6)
    (a,) = qa.answer(["What is the capital of France?"])
    best = a.evidence[a.best]
    assert best.title == "Paris" and a.answer == best.span_text
    start, end = best.span
    assert best.text[start:end] == a.answer == "Paris"
    # p(answer|x) by brute force: every valid span of every block read, one softmax, p(z|x) weights
    batch = oracle_reader.featurizer.featurize([a.question] * len(a.evidence), [e.text for e in a.evidence])
    scores, valid = oracle_reader(batch), valid_spans(batch, oracle_reader.cfg.max_span_width)
    num = den = 0.0
    for n, e in enumerate(a.evidence):
        for i, w in valid[n].nonzero().tolist():
            mass = e.retrieval_prob * math.exp(float(scores[n, i, w]))
            den += mass
            num += mass if normalize_answer(batch.span_text(n, i, w)[0]) == "paris" else 0.0
    assert a.score == pytest.approx(num / den, rel=1e-4)
    assert sum(e.retrieval_prob for e in a.evidence) == pytest.approx(1.0, abs=1e-5)
    assert json.loads(json.dumps(a.to_json()))["evidence"][a.best]["span"] == [start, end]


def _blocks(f, texts, log_norm=None):
    """ReadBlocks from span scores f [k, n] and texts[j][r] (None: no such span)."""
    log_norm = torch.logsumexp(torch.tensor(f), 1) if log_norm is None else log_norm
    return [ReadBlock([Span(s, t, (0, len(t))) for s, t in zip(row, names) if t is not None], float(z))
            for row, names, z in zip(f, texts, log_norm)]


def test_an_answer_found_in_several_blocks_adds_up():
    """Block 0 (p 0.6): "K" 2, "B" 1; block 1 (p 0.4): "B" 2, "C" 0. "K" is the best single span
    (0.6 e^2 > 0.4 e^2) but "B" has more mass in all (0.6 e + 0.4 e^2). ("A" would normalise to "".)"""
    log_pz = torch.log(torch.tensor([0.6, 0.4]))
    r = pick_answer(log_pz, _blocks([[2.0, 1.0], [2.0, 0.0]], [["K", "B"], ["B", "the c"]]))
    e = math.e
    partition = 0.6 * (e**2 + e) + 0.4 * (e**2 + 1)
    assert r.score == pytest.approx((0.6 * e + 0.4 * e**2) / partition, rel=1e-5)
    assert r.answer == "B" and r.best == 1 and r.shown == [0, 0]  # block 1 adds most to "B"; block 0 still shows its own best
    assert r.signals["score"] == r.score and r.signals["log_partition"] == pytest.approx(math.log(partition), rel=1e-6)
    assert r.signals["retrieval_entropy"] == pytest.approx(-(0.6 * math.log(0.6) + 0.4 * math.log(0.4)), rel=1e-6)


def test_null_spans_join_the_reading_softmax_and_give_p_null():
    """With a reader's null spans g_z the partition is Σ_z p(z) (e^g_z + Σ_s e^f(s)): p(a|x) is
    what "not in what I read" leaves, and p_null = Σ_z p(z) e^g_z / partition."""
    log_pz = torch.log(torch.tensor([0.6, 0.4]))
    blocks = _blocks([[2.0, 1.0], [2.0, 0.0]], [["K", "B"], ["B", "the c"]])
    nulls = [ReadBlock(b.spans, b.log_norm, g) for b, g in zip(blocks, (3.0, 0.0))]
    r = pick_answer(log_pz, nulls)
    e = math.e
    partition = 0.6 * (e**2 + e + e**3) + 0.4 * (e**2 + 1 + 1)
    assert r.answer == "B" and r.score == pytest.approx((0.6 * e + 0.4 * e**2) / partition, rel=1e-5)
    assert r.signals["p_null"] == pytest.approx((0.6 * e**3 + 0.4) / partition, rel=1e-5)
    assert r.signals["log_partition"] == pytest.approx(math.log(partition), rel=1e-6)
    assert "p_null" not in pick_answer(log_pz, blocks).signals  # a reader without null spans


def test_one_softmax_over_all_blocks_lets_a_confident_block_win():
    """Per-block softmaxes would pick "X" (p(X|z0) = 1 as its only span, 0.5 x 1 > 0.5 x 0.5);
    over one softmax "X" scores e^0 against e^5 for "Y"."""
    log_norm = [0.0, math.log(math.exp(5) + math.exp(4.9))]
    half = torch.log(torch.tensor([0.5, 0.5]))
    r = pick_answer(half, _blocks([[0.0], [5.0, 4.9]], [["X"], ["Y", "Z"]], log_norm))
    assert r.best == 1 and r.shown == [0, 0] and r.score == pytest.approx(math.exp(5) / (1 + math.exp(5) + math.exp(4.9)), rel=1e-5)
    shown_second = pick_answer(half, _blocks([[0.0], [5.0, 5.5]], [["X"], ["Y", "X"]], log_norm)).shown
    assert shown_second == [0, 1]  # "X" wins through block 1's second span, which that block then shows
    none = pick_answer(torch.zeros(2), _blocks([[], []], [[], []], log_norm))
    assert (none.answer, none.score, none.best, none.shown) == ("", 0.0, None, [None, None])


def test_a_span_with_empty_normalised_text_never_wins():
    """ "the" and "," normalise to "": even the best-scoring spans, pooled, are no answer."""
    f = [[9.0, 8.0, 1.0], [9.0, 0.5]]
    log_norm = [math.log(sum(map(math.exp, row))) for row in f]
    r = pick_answer(torch.log(torch.tensor([0.5, 0.5])), _blocks(f, [["the", ",", "Paris"], ["The", "Paris."]], log_norm))
    e = math.exp
    assert r.best == 0 and r.shown == [2, 1] and r.answer == "Paris"  # each block shows its best span with text
    assert r.score == pytest.approx((e(1.0) + e(0.5)) / (e(9) + e(8) + e(1) + e(9) + e(0.5)), rel=1e-5)  # "paris", in both
    r = pick_answer(torch.zeros(1), _blocks(f[:1], [["the", ","]], log_norm[:1]))
    assert (r.score, r.best, r.shown) == (0.0, None, [None])


@pytest.fixture(scope="module")
def distractor_bm25_index(tmp_path_factory) -> Path:
    """BM25 over DOCS + two distractors that share words with the questions; one also holds "1969"."""
    root = tmp_path_factory.mktemp("distractors")
    docs = [*DOCS, {"id": "apollo-12", "title": "Apollo 12", "text": "Apollo 12 landed on the Moon in November 1969."},
            {"id": "seine", "title": "Seine", "text": "The Seine flows through Paris to the English Channel."}]
    build_index(docs, root / "bm25", kind="bm25", show_progress=False)
    return root / "bm25"


def test_evaluate_qa_reads_the_right_block_among_distractors(oracle_reader, distractor_bm25_index, tmp_path):
    qa = OpenQA(oracle_reader, Searcher.open(distractor_bm25_index), k=2)  # reads 2 of 8 blocks
    unanswerable = Question("q4", "Who painted the Mona Lisa?", ("Leonardo da Vinci",))  # in no block
    second = Question("q5", "What is the capital of France?", ("Tokyo",))  # only in the block ranked 2nd
    result = evaluate_qa(qa, [*QUESTIONS, unanswerable, second], ks=(1, 2), predictions=tmp_path / "pred.jsonl",
                         show_progress=False)
    assert (result["recall@1"], result["recall@2"], result["em"]) == (60.0, 80.0, 60.0)
    rows = [json.loads(line) for line in (tmp_path / "pred.jsonl").read_text().splitlines()]
    assert [r["read"] for r in rows[:3]] == [["paris:0", "tokyo:0"], ["moon:0", "apollo-12:0"], ["nile:0", "seine:0"]]
    # both Moon blocks hold "1969" with the same span score: p(z|x) must pick Armstrong's
    assert [r["evidence_id"] for r in rows[:3]] == ["paris:0", "moon:0", "nile:0"]
    assert [r["em"] for r in rows] == [1.0, 1.0, 1.0, 0.0, 0.0] and rows[4]["prediction"] == "Paris"
    assert [r["answer_in_read"] for r in rows] == [True, True, True, False, True]


def test_a_block_is_read_whole_past_the_readers_training_window(oracle_reader, tmp_path):
    """The oracle reader was trained at 96 wordpieces; the answer sits after wordpiece 150."""
    text = "The capital of France, " + "an old city of many bridges and museums, " * 16 + "is Paris."
    build_index([{"id": "long", "title": "France", "text": text}], tmp_path / "bm25", kind="bm25", show_progress=False)
    searcher = Searcher.open(tmp_path / "bm25")
    assert len(searcher) == 1 and len(oracle_reader.featurizer._wordpieces.encode(text).ids) > 150
    (a,) = OpenQA(oracle_reader, searcher, k=1).answer(["What is the capital of France?"])
    assert a.answer == "Paris" and a.evidence[0].text[slice(*a.evidence[0].span)] == "Paris"
    assert oracle_reader.featurizer.featurize(["q"], [text]).input_ids.shape[1] == 96  # training still reads its window
    assert oracle_reader.featurizer.max_read_len == 512
    with pytest.raises(RalmError, match="exceeds the 512 wordpieces the encoder reads"):
        oracle_reader.featurizer.featurize(["q"], [text], max_len=513)


def test_below_the_threshold_the_answer_is_withheld_with_its_evidence(oracle_reader, tiny_dense_index, monkeypatch):
    searcher = Searcher.open(tiny_dense_index)
    (raw,) = OpenQA(oracle_reader, searcher, k=6).answer(["What is the capital of France?"])
    assert raw.confidence is None and raw.answer == "Paris"  # uncalibrated: always answers
    # confidence = 0.5 x the raw score, so the raw score s gets confidence s / 2
    monkeypatch.setattr(oracle_reader.cfg, "calibration", {"raw": [0.0, 1.0], "confidence": [0.0, 0.5]})
    for threshold, withheld in ((raw.score / 2 - 0.01, False), (raw.score / 2 + 0.01, True)):
        (a,) = OpenQA(oracle_reader, searcher, k=6, min_confidence=threshold).answer(["What is the capital of France?"])
        assert a.confidence == pytest.approx(raw.score / 2) and a.no_answer == withheld
        assert a.answer == ("" if withheld else "Paris") and a.evidence[a.best].span_text == "Paris"
        out = a.to_json()
        assert out["no_answer"] == withheld and out["evidence"][out["best"]]["answer"] == "Paris"
    with pytest.raises(RalmError, match=r"min_confidence must be in \[0, 1\]"):  # the field named
        OpenQA(oracle_reader, searcher, min_confidence=1.5)


def _mixed(n: int) -> list[Question]:
    """n questions, a third of them with a wrong gold answer (as if the corpus held none)."""
    wrong = Question("w", "What is the capital of France?", ("Lyon",))
    picked = [wrong if i % 3 == 0 else QUESTIONS[i % 3] for i in range(n)]
    return [Question(f"q{i}", q.question, q.answers) for i, q in enumerate(picked)]


def test_evaluate_qa_fits_the_kinds_map_on_cross_fitted_questions_and_reports_answered(oracle_reader, tiny_dense_index,
                                                                                        tmp_path, monkeypatch):
    monkeypatch.setattr(oracle_reader.cfg, "calibration", None)
    qa = OpenQA(oracle_reader, Searcher.open(tiny_dense_index), k=6, min_confidence=0.5)
    questions = _mixed(60)
    result = evaluate_qa(qa, questions, ks=(1, 6), predictions=tmp_path / "p.jsonl", show_progress=False, calibrate=True)
    assert result["em"] == pytest.approx(100 * 40 / 60, abs=0.01)  # the threshold never hides the best answer from EM
    assert qa.kind == "dense" and qa.calibrations.for_kind("dense").questions == 60
    assert qa.calibrations.for_kind("bm25") is None  # fitted for the kind searched only
    assert result["reliability"]["cross_fitted"] == "by half" and sum(b["count"] for b in result["reliability"]["bins"]) == 60
    fitted = qa.calibrations.for_kind("dense")
    assert {k: fitted.fitted_with[k] for k in ("reader", "k", "questions")} == {"reader": oracle_reader.fingerprint(), "k": 6,
                                                                                 "questions": 60}
    assert fitted.fitted_with["sets"] == ["questions"] and "threshold" in fitted.fitted_with  # kept: none marked unanswerable
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert all(0 < r["confidence"] < 1 for r in rows)  # shrunk ends: never certain
    answered = [not r["no_answer"] for r in rows]
    assert result["answered"] == pytest.approx(100 * sum(answered) / 60, abs=0.01)
    if any(answered):
        assert result["answered_em"] == pytest.approx(100 * sum(r["em"] for r, a in zip(rows, answered) if a) / sum(answered), abs=0.01)
    for few in (questions[:10], [q for q in questions if q.answers != ("Lyon",)][:55]):  # too few; all right
        with pytest.raises(RalmError, match="at least 50|both right and wrong"):
            evaluate_qa(qa, few, ks=(1,), show_progress=False, calibrate=True)


def test_evaluate_qa_on_a_set_where_every_answer_is_wrong_reports_auroc_as_null(oracle_reader, tiny_dense_index, tmp_path):
    """A set none of whose answers is right (their answers are not in the corpus) runs to the end:
    AUROC has nothing to rank, so it is null with a one-line note, not an error blaming the index."""
    from ralm.errors import RalmWarning

    from ralm.models.confidence import Calibration, Calibrations

    qa = OpenQA(oracle_reader, Searcher.open(tiny_dense_index), k=3)
    qa.calibrations = Calibrations({"*": Calibration((0.0, 1.0), (0.1, 0.9), 10)})
    wrong = [Question(f"w{i}", "What is the capital of France?", ("Lyon",)) for i in range(6)]
    with pytest.warns(RalmWarning, match="AUROC is undefined: all 6 answers were wrong"):
        result = evaluate_qa(qa, wrong, ks=(1,), show_progress=False)
    assert result["em"] == 0.0 and result["auroc"] is None and result["notes"] == ["AUROC is undefined: all 6 answers were wrong"]
    assert result["aurc"] == 1.0
    json.dumps(result, allow_nan=False)


def test_questions_without_answers_do_not_blame_the_index(oracle_reader, tiny_dense_index):
    """A set of unanswerable questions with no answers (constructed near misses) has nothing to
    retrieve: no warning that the index is of another corpus; one answerable question whose
    answer no block holds still gets it."""
    import warnings

    from ralm.errors import RalmWarning

    qa = OpenQA(oracle_reader, Searcher.open(tiny_dense_index), k=3)
    none = [Question(f"u{i}", "What is the capital of Peru?", (), {"unanswerable": True}) for i in range(3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        evaluate_qa(qa, none, ks=(1,), show_progress=False)
    assert not [w for w in caught if "no question has an answer" in str(w.message)]
    with pytest.warns(RalmWarning, match="no question has an answer in its top-"):
        evaluate_qa(qa, [*none, Question("a", "What is the capital of Peru?", ("Lima",))], ks=(1,), show_progress=False)


def test_resolve_reader_and_errors(tmp_path, tiny_bert, tiny_dense_index):
    assert resolve_reader(None) == default_reader_path() and is_reader_dir(default_reader_path())
    reader = Reader.from_encoder(tiny_bert, max_len=96)
    reader.save_pretrained(tmp_path / "run" / "final" / "reader")
    assert resolve_reader(tmp_path / "run") == tmp_path / "run" / "final" / "reader"
    with pytest.raises(RalmError, match="ralm finetune"):
        resolve_reader(tmp_path)
    with pytest.raises(RalmError, match="k must be"):
        OpenQA(reader, Searcher.open(tiny_dense_index), k=0)
    # no fine-tuned retriever in the run: the index's own retriever answers
    assert dense_of(open_searcher(tiny_dense_index, model=tmp_path / "run").current).retriever is not None
    with pytest.raises(RalmError, match="list of questions"):
        OpenQA(reader, Searcher.open(tiny_dense_index)).answer("What is the capital of France?")
    assert OpenQA(reader, Searcher.open(tiny_dense_index)).answer([]) == []


def test_open_searcher_loads_a_run_retriever_once(tmp_path, tiny_bert, other_tiny_bert, tiny_dense_index, monkeypatch):
    """A run's query tower searches when it shares the index's document tower, else the index's own."""
    index = IndexDir(tiny_dense_index)
    built_with = tiny_dense_index / index.version_manifest(index.latest())["sections"]["dense"]["retriever"]
    shutil.copytree(built_with, tmp_path / "same" / "final" / "retriever")
    Retriever.from_pretrained(other_tiny_bert, dim=16).save_pretrained(tmp_path / "other" / "final" / "retriever")
    loads = []
    real = Retriever.from_pretrained.__func__
    monkeypatch.setattr(Retriever, "from_pretrained", classmethod(lambda cls, path, **kw: loads.append(Path(path)) or real(cls, path, **kw)))
    searcher = open_searcher(tiny_dense_index, model=tmp_path / "same")
    assert loads == [tmp_path / "same" / "final" / "retriever"] and not dense_of(searcher.current).retriever.training
    loads.clear()
    open_searcher(tiny_dense_index, model=tmp_path / "other")  # another document tower: the index's own
    assert loads == [tmp_path / "other" / "final" / "retriever", built_with]


def test_cli_finetune_eval_and_ask(tiny_bert, tiny_dense_index, tmp_path, ralm, monkeypatch):
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("".join(json.dumps({"id": q.id, "question": q.question, "answers": list(q.answers)}) + "\n" for q in QUESTIONS))
    run = tmp_path / "run"
    code, out, err = ralm("finetune", "--questions", qfile, "--index", tiny_dense_index, "--out", run, "--init", tiny_bert,
                          "--steps", 2, "--batch-size", 2, "-k", 2, "--max-len", 96, "--json")
    assert code == 0, err
    assert json.loads(out)["steps"] == 2
    code, out, err = ralm("eval", "qa", "--model", run, "--index", tiny_dense_index, "--questions", qfile, "-k", 2, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert {"em", "f1", "recall@1", "recall@5", "recall@20"} <= set(result) and result["questions"] == 3
    # predictions go to the current directory by default, never into the model directory
    assert len((tmp_path / "work" / f"q-{tiny_dense_index.name}-dense.predictions.jsonl").read_text().splitlines()) == 3
    assert not list(run.rglob("*predictions*"))
    code, out, err = ralm("eval", "qa", "--model", run, "--index", tiny_dense_index, "--questions", qfile, "--calibrate")
    assert code == 2 and "--out" in err  # the reader given is never modified in place
    code, out, err = ralm("eval", "qa", "--model", run, "--index", tiny_dense_index, "--questions", qfile, "--calibrate",
                          "--out", tmp_path / "cal")
    assert code == 2 and "at least 50" in err and not (tmp_path / "cal").exists()
    # every word n-gram of the corpus is a right answer to the first 40 questions, none to the rest:
    # whatever the random reader picks, the outcomes mix
    ngrams = sorted({" ".join(w[i:i + n]) for d in DOCS for w in [d["text"].split()] for n in range(1, 11) for i in range(len(w))})
    many = tmp_path / "many.jsonl"
    many.write_text("".join(json.dumps({"id": f"m{i}", "question": QUESTIONS[i % 3].question,
                                        "answers": ngrams if i < 40 else ["Lyon"]}) + "\n" for i in range(60)))
    before = (run / "final" / "reader" / "config.json").read_bytes()
    code, out, err = ralm("eval", "qa", "--model", run, "--index", tiny_dense_index, "--questions", many, "-k", 2,
                          "--predictions", tmp_path / "mine" / "p.jsonl", "--calibrate", "--out", tmp_path / "cal", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["predictions"] == str(tmp_path / "mine" / "p.jsonl") and (tmp_path / "mine" / "p.jsonl").is_file()
    assert "reliability" in result and result["calibration"] == str(tmp_path / "cal")
    assert (run / "final" / "reader" / "config.json").read_bytes() == before
    cal = Reader.from_pretrained(tmp_path / "cal").cfg.calibration
    assert cal["by_kind"]["dense"]["questions"] == 60 and cal["by_kind"]["dense"]["method"] == "two_stage"
    write_calibration(run / "final" / "reader", {"raw": [0.0, 1.0], "confidence": [0.0, 0.9]})
    code, out, err = ralm("ask", "Who created Python?", "--model", run, "--index", tiny_dense_index, "-k", 2, "--json")
    assert code == 0, err
    answer = json.loads(out)
    assert set(answer) >= {"answer", "score", "evidence"} and len(answer["evidence"]) == 2
    for e in answer["evidence"]:
        assert {"id", "title", "text", "retrieval_score", "span"} <= set(e)
        assert e["text"][e["span"][0]:e["span"][1]] == e["answer"]
    assert 0 <= answer["confidence"] <= 1 and answer["guess"] and answer["index_version"] == "v000001"
    assert answer["retriever"] == "dense" and all(e["found_by"] == ["dense"] for e in answer["evidence"])
    write_calibration(run / "final" / "reader", {"raw": [0.0, 1.0], "confidence": [0.0, 0.5]})  # confidence <= 0.5
    ask = ("ask", "Who created Python?", "--model", run, "--index", tiny_dense_index, "-k", 2)
    code, out, err = ralm(*ask, "--min-confidence", 0, "--json")
    assert code == 0 and json.loads(out)["no_answer"] is False and json.loads(out)["answer"]
    code, out, err = ralm(*ask, "--min-confidence", 0.6, "--json")
    assert code == 0 and json.loads(out)["no_answer"] is True and json.loads(out)["answer"] == ""
    code, out, err = ralm(*ask, "--min-confidence", 0.6)
    assert code == 0 and "no answer found in the corpus" in out and "best guess" in out
    code, out, err = ralm(*ask)
    assert code == 0 and "A:" in out and "confidence" in out
    code, out, err = ralm("ask", "Who?", "--model", tmp_path, "--index", tiny_dense_index)
    assert code == 2 and "ralm finetune" in err


def test_ask_reads_questions_from_stdin_with_the_models_loaded_once(ralm, tiny_dense_index, monkeypatch):
    import io

    opened = []
    real_open = OpenQA.open.__func__
    monkeypatch.setattr(OpenQA, "open", classmethod(lambda cls, *a, **kw: opened.append(1) or real_open(cls, *a, **kw)))
    questions = ["Who created Python?", "", "What is the capital of France?"]
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(("\n".join(questions) + "\n").encode())))
    code, out, err = ralm("ask", "--index", tiny_dense_index, "-k", 2, "--min-confidence", 0, "--json")
    assert code == 0, err
    answers = [json.loads(line) for line in out.splitlines()]
    assert len(opened) == 1 and len(answers) == 2  # the blank line is skipped
    for question, answer in zip(["Who created Python?", "What is the capital of France?"], answers):
        code, one, _ = ralm("ask", question, "--index", tiny_dense_index, "-k", 2, "--min-confidence", 0, "--json")
        assert code == 0 and json.loads(one) == answer
    code, _, err = ralm("ask", "  ", "--index", tiny_dense_index)
    assert code == 2 and "the question is empty" in err
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"Who created Python?\nWho \xff\xfe?\n")))  # Latin-1 bytes
    code, out, err = ralm("ask", "--index", tiny_dense_index, "-k", 2, "--min-confidence", 0, "--json")
    assert code == 2 and len(out.splitlines()) == 1 and "stdin:2: not valid UTF-8" in err and "Traceback" not in err


def _constant_map(p: float, threshold: float | None = None, feature: str = "logit_score", weight: float = 0.0) -> dict:
    """A selective map whose confidence is sigmoid(weight x standardised feature + logit p)."""
    return {"method": "selective", "questions": 100, "features": [feature], "mean": [0.0], "scale": [1.0],
            "weights": [weight], "bias": math.log(p / (1 - p)), **({"fitted_with": {"threshold": threshold}} if threshold else {})}


def test_each_side_withholds_at_its_own_maps_threshold(oracle_reader, tiny_hybrid_index, monkeypatch):
    """Every answer here has confidence 0.5: the dense map's threshold (0.6) withholds it, the
    BM25 map's (0.4) gives it; a map that records none falls back to MIN_CONFIDENCE (0.41), and
    --min-confidence overrides them all."""
    monkeypatch.setattr(oracle_reader.cfg, "calibration", {"by_kind": {"dense": _constant_map(0.5, 0.6),
                                                                       "bm25": _constant_map(0.5, 0.4),
                                                                       "hybrid": _constant_map(0.5)}})
    searcher = open_searcher(tiny_hybrid_index)
    got = {side: OpenQA(oracle_reader, searcher, k=6, side=side) for side in ("dense", "bm25", None)}
    assert {side: qa.threshold for side, qa in got.items()} == {"dense": 0.6, "bm25": 0.4, None: 0.41}
    answers = {side: qa.answer(["What is the capital of France?"])[0] for side, qa in got.items()}
    assert answers["dense"].no_answer and answers["dense"].guess == "Paris"
    assert answers["bm25"].answer == "Paris" and answers[None].answer == "Paris"
    assert OpenQA(oracle_reader, searcher, k=6, side="bm25", min_confidence=0.55).answer(["What is the capital of France?"])[0].no_answer


def test_a_verifier_that_rejects_an_answer_withholds_it(tiny_bert, tiny_dense_index, monkeypatch):
    """The reader alone gives "Paris"; its verifier's P(supported) enters the confidence map, so
    a verifier that rejects the answer's context withholds it."""
    torch.manual_seed(0)
    reader = Reader.from_encoder(tiny_bert, max_len=96, max_query_len=16).reading_titles().with_verifier()
    reader.forward = lambda batch: reader.featurizer.answer_match(batch, [["Paris"]] * len(batch.texts)).float() * 10
    monkeypatch.setattr(reader.cfg, "calibration", _constant_map(0.5, 0.5, feature="logit_verify", weight=1.0))
    qa = OpenQA(reader, Searcher.open(tiny_dense_index), k=6)
    for bias, withheld in ((-8.0, True), (8.0, False)):
        with torch.no_grad():
            reader.verify_head.weight.zero_()
            reader.verify_head.bias.fill_(bias)
        (a,) = qa.answer(["What is the capital of France?"])
        assert a.guess == "Paris" and a.no_answer == withheld
        assert a.signals["p_verify"] == pytest.approx(torch.sigmoid(torch.tensor(bias)).item(), rel=1e-4)
        assert 0 < a.signals["coverage"] <= 1


def test_an_answer_read_in_a_record_that_names_another_entity_is_withheld(tiny_bert, tiny_dense_index, monkeypatch):
    """The reader gives "Paris" for France and for Germany alike; the answer's context names
    France, so for Germany `entity_coverage` is 0 and a map that reads it withholds the answer."""
    reader = Reader.from_encoder(tiny_bert, max_len=96, max_query_len=16).reading_titles()
    reader.forward = lambda batch: reader.featurizer.answer_match(batch, [["Paris"]] * len(batch.texts)).float() * 10
    monkeypatch.setattr(reader.cfg, "calibration", _constant_map(0.3, 0.5, feature="entity_coverage", weight=2.0))
    qa = OpenQA(reader, Searcher.open(tiny_dense_index), k=6)
    france, germany = qa.answer(["What is the capital of France?", "What is the capital of Germany?"])
    assert france.guess == germany.guess == "Paris"
    assert france.signals["entity_coverage"] == 1.0 and germany.signals["entity_coverage"] == 0.0
    assert germany.signals["coverage"] == 0.5  # "capital" is there, "germany" is not
    assert france.answer == "Paris" and germany.no_answer


def test_calibration_pools_sets_over_their_own_indexes_and_chooses_the_threshold_per_set(oracle_reader, tiny_dense_index,
                                                                                        tmp_path, monkeypatch):
    """Questions over two indexes fit one map; its threshold answers at most the allowed share of
    each set's unanswerable questions (cross-fitted); the map records the served k; a set read
    with another k is refused."""
    from ralm.eval.openqa import CalibrationSet

    monkeypatch.setattr(oracle_reader.cfg, "calibration", None)
    searcher = Searcher.open(tiny_dense_index)
    qa = OpenQA(oracle_reader, searcher, k=6)
    unanswerable = Question("u", "What is the capital of France?", ("unanswerable",), {"unanswerable": True})
    main = [Question(f"m{i}", q.question, q.answers, {"title": f"a{i % 5}"})
            for i, q in enumerate([QUESTIONS[i % 3] for i in range(40)])]
    other = [Question(f"o{i}", "When did Armstrong walk on the Moon?", ("1969",), {"title": f"c{i % 4}"}) if i % 2 else
             Question(f"o{i}", unanswerable.question, unanswerable.answers, {"title": f"c{i % 4}", "unanswerable": True})
             for i in range(40)]
    also = [CalibrationSet("generated", OpenQA(oracle_reader, searcher, k=6), other)]
    result = evaluate_qa(qa, main, ks=(1,), show_progress=False, calibrate=True, also=also, max_unanswerable=0.1)
    fit = result["calibration_fit"]
    assert fit["sets"] == {"questions": {"questions": 40, "unanswerable": 0}, "generated": {"questions": 40, "unanswerable": 20}}
    cal = qa.calibrations.for_kind("dense")
    assert cal.fitted_with["k"] == 6 and cal.fitted_with["questions"] == 80 and cal.fitted_with["threshold"] == result["threshold"]
    assert fit["maps"]["dense"]["by_set"]["generated"]["unanswerable_answered"] <= 0.1
    assert qa.threshold == result["threshold"]  # served as fitted
    # judged at equal coverage instead: the highest threshold answering at least that share of
    # the questions' answerable ones, on the same cross-fitted confidences
    at = evaluate_qa(OpenQA(oracle_reader, searcher, k=6), main + other, ks=(1,), show_progress=False, calibrate=True,
                     coverage=0.75, predictions=tmp_path / "cov.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "cov.jsonl").read_text().splitlines()]
    answerable = np.array([r["confidence"] for r, q in zip(rows, main + other) if not q.extra.get("unanswerable")])
    t = at["threshold"]
    assert (answerable >= t).mean() >= 0.75 and (t == 0.99 or (answerable >= round(t + 0.01, 2)).mean() < 0.75)
    assert "at least 75.00% of the questions' answerable ones" in at["calibration_fit"]["rule"]
    with pytest.raises(RalmError, match="exactly as served"):
        evaluate_qa(qa, main, ks=(1,), show_progress=False, calibrate=True,
                    also=[CalibrationSet("other k", OpenQA(oracle_reader, searcher, k=3), other)])
