"""Open-domain QA inference and evaluation: best span per block, p(z|x)·p(s|z,x), EM/F1."""

from __future__ import annotations

import json

import pytest
import torch

from ralm.data.qa import Question
from ralm.errors import RalmError
from ralm.eval.openqa import OpenQA, evaluate_qa, open_searcher, resolve_reader
from ralm.models.reader import Reader, default_reader_path, is_reader_dir, write_calibration
from ralm.retrieval.searcher import Searcher

QUESTIONS = [
    Question("q1", "What is the capital of France?", ("Paris",)),
    Question("q2", "When did Armstrong walk on the Moon?", ("1969",)),
    Question("q3", "Which river flows into the Mediterranean?", ("the Nile",)),
]
TARGETS = {"france": "Paris", "moon": "1969", "mediterranean": "Nile"}  # question word -> the span to score high


@pytest.fixture(scope="module")
def oracle_reader(tiny_bert) -> Reader:
    """A reader whose span scores are 10 on spans equal to its question's target, 0 elsewhere."""
    torch.manual_seed(0)
    reader = Reader.from_encoder(tiny_bert, max_len=96, max_query_len=16)

    def forward(batch):
        questions = [reader.tokenizer.decode(ids[: int(s)]) for ids, s in zip(batch.input_ids, batch.evidence_start)]
        targets = [[t for w, t in TARGETS.items() if w in q] for q in questions]
        return 10.0 * reader.answer_match(batch, targets).float()

    reader.forward = forward
    return reader


def test_answers_come_from_evidence_with_consistent_scores(oracle_reader, tiny_dense_index):
    qa = OpenQA(oracle_reader, Searcher.open(tiny_dense_index), k=6)
    (a,) = qa.answer(["What is the capital of France?"])
    best = a.evidence[a.best]
    assert best.title == "Paris" and a.answer == best.span_text
    start, end = best.span
    assert best.text[start:end] == a.answer == "Paris"
    joint = [e.retrieval_prob * e.span_prob for e in a.evidence]
    assert a.score == pytest.approx(max(joint))
    assert sum(e.retrieval_prob for e in a.evidence) == pytest.approx(1.0, abs=1e-5)
    assert json.loads(json.dumps(a.to_json()))["evidence"][a.best]["span"] == [start, end]


def test_evaluate_qa_with_an_oracle_reader(oracle_reader, tiny_dense_index, tmp_path):
    qa = OpenQA(oracle_reader, Searcher.open(tiny_dense_index), k=6)  # reads every block
    result = evaluate_qa(qa, QUESTIONS, ks=(1, 6), predictions=tmp_path / "pred.jsonl", show_progress=False)
    # q1 "Paris" and q2 "1969" are unique in the corpus; q3's gold "the Nile" normalises to "nile"
    assert result["em"] == pytest.approx(100.0) and result["f1"] == pytest.approx(100.0)
    assert result["recall@6"] == 100.0 and result["questions"] == 3
    rows = [json.loads(line) for line in (tmp_path / "pred.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["q1", "q2", "q3"] and all(r["em"] == 1.0 for r in rows)


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
    with pytest.raises(RalmError, match="min-confidence"):
        OpenQA(oracle_reader, searcher, min_confidence=1.5)


def test_evaluate_qa_fits_a_calibration_and_reports_reliability(oracle_reader, tiny_dense_index, tmp_path, monkeypatch):
    monkeypatch.setattr(oracle_reader.cfg, "calibration", None)
    qa = OpenQA(oracle_reader, Searcher.open(tiny_dense_index), k=6, min_confidence=1.0)  # would withhold everything
    wrong = Question("q4", "What is the capital of France?", ("Lyon",))
    result = evaluate_qa(qa, [*QUESTIONS, wrong], ks=(1, 6), predictions=tmp_path / "p.jsonl", show_progress=False,
                         calibrate=True)
    assert result["em"] == 75.0  # the threshold never hides the best span from EM
    assert qa.calibration is not None and qa.calibration.questions == 4
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert all(0 <= r["confidence"] <= 1 for r in rows) and rows[3]["prediction"] == "Paris"
    assert sum(b["count"] for b in result["reliability"]["bins"]) == 4


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
    assert open_searcher(tiny_dense_index, model=tmp_path / "run").retriever is not None


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
    assert len((tmp_path / "work" / f"q-{tiny_dense_index.name}.predictions.jsonl").read_text().splitlines()) == 3
    assert not list(run.rglob("*predictions*"))
    code, out, err = ralm("eval", "qa", "--model", run, "--index", tiny_dense_index, "--questions", qfile, "-k", 2,
                          "--predictions", tmp_path / "mine" / "p.jsonl", "--calibrate", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["predictions"] == str(tmp_path / "mine" / "p.jsonl") and (tmp_path / "mine" / "p.jsonl").is_file()
    assert "reliability" in result and result["calibration"] == str(run / "final" / "reader" / "config.json")
    assert Reader.from_pretrained(run / "final" / "reader").cfg.calibration["questions"] == 3
    code, out, err = ralm("ask", "Who created Python?", "--model", run, "--index", tiny_dense_index, "-k", 2, "--json")
    assert code == 0, err
    answer = json.loads(out)
    assert set(answer) >= {"answer", "score", "evidence"} and len(answer["evidence"]) == 2
    for e in answer["evidence"]:
        assert {"id", "title", "text", "retrieval_score", "span"} <= set(e)
        assert e["text"][e["span"][0]:e["span"][1]] == e["answer"]
    assert 0 <= answer["confidence"] <= 1  # calibrated above
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
