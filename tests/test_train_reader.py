"""Reader training on gold passages plus retrieved distractors: window labels (an answer cut by
a window edge is labelled only where whole), answer-free windows and distractors kept in the
shared softmax, passages from context or doc_id, training end to end, resume, bf16, and the
open-domain fine-tuning that continues from it."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ralm.data.qa import Question
from ralm.errors import RalmError
from ralm.eval.metrics import exact_match
from ralm.models.reader import Reader, write_calibration
from ralm.runtime import cpu_has_bf16
from ralm.train.finetune import FinetuneConfig, finetune
from ralm.retrieval.search.searcher import Searcher
from ralm.train.reader import (
    ReaderTrainConfig,
    best_is_gold,
    drop_gold,
    without_answer,
    gold_passages,
    ReadingExample,
    read_inputs,
    retrieve_distractors,
    train_reader,
)

from conftest import DOCS

QUESTIONS = [  # gold passages are DOCS entries, by doc_id or inline context
    {"id": "q1", "question": "What is the capital of France?", "answers": ["Paris"], "doc_id": "paris"},
    {"id": "q2", "question": "Who created Python?", "answers": ["Guido van Rossum"], "doc_id": "python"},
    {"id": "q3", "question": "When did Armstrong walk on the Moon?", "answers": ["1969"], "context": DOCS[5]["text"]},
    {"id": "q4", "question": "Which sea does the Nile flow into?", "answers": ["the Mediterranean Sea"], "doc_id": "nile"},
]


@pytest.fixture(scope="module")
def small_reader(tiny_bert) -> Reader:
    """Inputs of 20 wordpieces: a 2-wordpiece question leaves 15 for the evidence window."""
    torch.manual_seed(0)
    return Reader.from_encoder(tiny_bert, max_len=20, max_query_len=4).eval()


@pytest.fixture(scope="module")
def words(small_reader) -> list[str]:
    """40 distinct words that are one wordpiece each, so wordpiece i of the text is word i."""
    vocab = sorted(t for t in small_reader.tokenizer.get_vocab() if t.isalpha() and t.islower() and len(t) >= 5)
    return vocab[1000:1040]


def _labelled(reader, text, answer, stride):
    batch, owner = reader.featurizer.featurize_windows(["q ?"], [text], stride)
    return batch, reader.featurizer.answer_match(batch, [[answer]] * len(owner))


def test_an_answer_is_labelled_in_every_window_holding_it_whole(small_reader, words):
    text = " ".join(words)
    # windows of 15 words start every 5 words: 0-14, 5-19, 10-24, ...; words 13-16 cross the end of window 0
    answer = " ".join(words[13:17])
    batch, match = _labelled(small_reader, text, answer, stride=5)
    assert [int(batch.input_ids[n, int(batch.evidence_start[n])]) for n in range(2)] == \
        small_reader.tokenizer.convert_tokens_to_ids([words[0], words[5]])
    assert match.flatten(1).sum(1).tolist()[:4] == [0, 1, 1, 0]  # not in window 0 that cuts it; in 5-19 and 10-24
    for n, start, width in match.nonzero().tolist():
        assert batch.span_text(n, start, width)[0] == answer


def test_answer_free_windows_and_distractors_are_read(small_reader, words):
    text = " ".join(words)
    other = " ".join(words[:10])
    examples = [ReadingExample("q ?", (words[30],), [("", text), ("", other), ("", words[30])]),
                ReadingExample("q ?", ("absent words",), [("", text)])]
    batch, match, question, titles = read_inputs(small_reader, examples, stride=5)
    windows = len(small_reader.featurizer.featurize_windows(["q ?"], [text], stride=5)[0].texts)
    assert question.tolist() == [0] * (windows + 2) + [1] * windows  # every window, with the answer or not
    hits = match.flatten(1).any(1)
    assert hits[:windows].sum() >= 1 and not hits[windows] and hits[windows + 1]  # the distractor holding it is gold too
    assert not hits[windows + 2 :].any()


def test_best_is_gold_looks_over_all_windows_of_a_question():
    scores = torch.zeros(3, 2, 1)
    valid = torch.ones(3, 2, 1, dtype=torch.bool)
    match = torch.zeros(3, 2, 1, dtype=torch.bool)
    match[0, 1, 0] = True  # question 0: the gold span is in input 0, but input 1 has the best span
    scores[0, 1, 0], scores[1, 0, 0] = 2.0, 3.0
    match[2, 0, 0], scores[2, 0, 0] = True, 1.0  # question 1: its one input's best span is gold
    hit = best_is_gold(scores, valid, match, torch.tensor([0, 0, 1]), questions=2)
    assert hit.tolist() == [False, True]


def test_distractors_come_from_other_documents(tiny_dense_index):
    searcher = Searcher.open(tiny_dense_index)
    qs = [Question("a", "What is the capital of France?", ("Paris",), {"doc_id": "paris"}),
          Question("b", "Who created Python?", ("Guido van Rossum",), {"context": "Guido made Python."})]
    got = retrieve_distractors(searcher, qs, 3)
    paris = next(d["text"] for d in DOCS if d["id"] == "paris")
    assert [len(g) for g in got] == [3, 3] and paris not in [text for _, text in got[0]]
    titles = {d["text"]: d["title"] for d in DOCS}
    assert all(title == titles[text] for g in got for title, text in g)  # each block with its own title
    assert retrieve_distractors(searcher, qs, 0) == [[], []]


def test_gold_passages_from_context_or_doc_id(corpus_file):
    qs = [Question(q["id"], q["question"], tuple(q["answers"]), {k: v for k, v in q.items() if k in ("doc_id", "context")})
          for q in QUESTIONS]
    assert [text for _, text in gold_passages(qs, "q.jsonl", str(corpus_file))] == [DOCS[0]["text"], DOCS[4]["text"],
                                                                                    DOCS[5]["text"], DOCS[2]["text"]]
    with pytest.raises(RalmError, match="no corpus was given"):
        gold_passages(qs, "q.jsonl", None)
    with pytest.raises(RalmError, match="q.jsonl: question x: doc_id 'nowhere' is not in"):
        gold_passages([Question("x", "?", ("a",), {"doc_id": "nowhere"})], "q.jsonl", str(corpus_file))
    with pytest.raises(RalmError, match="neither a 'context' nor a 'doc_id'"):
        gold_passages([Question("y", "?", ("a",))], "q.jsonl", str(corpus_file))


@pytest.fixture
def questions_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


def _cfg(questions_file, corpus_file, tiny_bert, **kw):
    base = dict(questions=str(questions_file), corpus=str(corpus_file), init=str(tiny_bert), steps=4, batch_size=4,
                lr=1e-3, warmup=0, max_len=80, stride=16, save_every=2, log_every=1)
    return ReaderTrainConfig(**{**base, **kw})


def test_training_lowers_the_loss_and_exports_a_reader(questions_file, corpus_file, tiny_bert, tmp_path):
    summary = train_reader(_cfg(questions_file, corpus_file, tiny_bert, steps=12, lr=3e-3, log_every=2), tmp_path / "run",
                           show_progress=False)
    assert summary.steps == 12 and summary.answerable_share == 1.0
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["loss"] < 0.5 * metrics[0]["loss"] and metrics[-1]["span_accuracy"] == 1.0
    assert all(m["windows"] >= 4 for m in metrics)  # every question's passage is read
    reader = Reader.from_pretrained(tmp_path / "run" / "final" / "reader")
    assert reader.cfg.max_len == 80 and (tmp_path / "run" / "loss.png").is_file()


def test_resume_reproduces_an_uninterrupted_run(questions_file, corpus_file, tiny_bert, tmp_path):
    cfg = _cfg(questions_file, corpus_file, tiny_bert, batch_size=2)
    train_reader(cfg, tmp_path / "straight", show_progress=False)
    shutil.copytree(tmp_path / "straight", tmp_path / "crashed")  # a crash right after the step-2 checkpoint
    ck = tmp_path / "crashed" / "checkpoints"
    shutil.rmtree(ck / "step-000004")
    shutil.rmtree(tmp_path / "crashed" / "final")
    (ck / "LATEST").write_text("step-000002\n")
    train_reader(cfg, tmp_path / "crashed", show_progress=False)
    a = load_file(str(tmp_path / "straight" / "final" / "reader" / "model.safetensors"))
    b = load_file(str(tmp_path / "crashed" / "final" / "reader" / "model.safetensors"))
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    steps = [json.loads(line)["step"] for line in (tmp_path / "crashed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


@pytest.mark.skipif(not cpu_has_bf16(), reason="this CPU has no native bf16")
def test_bf16_autocast_trains(questions_file, corpus_file, tiny_bert, tmp_path):
    loss = {}
    for dtype in ("fp32", "bf16"):
        summary = train_reader(_cfg(questions_file, corpus_file, tiny_bert, steps=2, dtype=dtype), tmp_path / dtype,
                               show_progress=False)
        assert summary.steps == 2
        loss[dtype] = [json.loads(line)["loss"] for line in (tmp_path / dtype / "metrics.jsonl").read_text().splitlines()]
    # the fp32 run's losses, before and after an update, up to bf16 rounding (which must show)
    assert loss["bf16"] == pytest.approx(loss["fp32"], rel=5e-3) and loss["bf16"] != loss["fp32"]
    reader = Reader.from_pretrained(tmp_path / "bf16" / "final" / "reader")
    assert all(p.dtype == torch.float32 for p in reader.parameters())  # fp32 master weights


def test_open_domain_finetuning_continues_from_the_gold_run(questions_file, corpus_file, tiny_bert, tiny_dense_index, tmp_path):
    train_reader(_cfg(questions_file, corpus_file, tiny_bert, steps=2), tmp_path / "gold", show_progress=False)
    gold = tmp_path / "gold" / "final" / "reader"
    write_calibration(gold, {"method": "isotonic", "questions": 2, "raw": [0.1, 0.9], "confidence": [0.2, 0.8]})
    # lr 1e-12 (0 is refused): the open-domain run must start from (and here keep) the gold reader's weights
    cfg = FinetuneConfig(str(questions_file), str(tiny_dense_index), init=str(tmp_path / "gold"), steps=1, batch_size=2,
                         k=2, lr=1e-12, retriever_lr=1e-12, warmup=0, max_len=96)
    finetune(cfg, tmp_path / "open", show_progress=False)
    before, after = load_file(str(gold / "model.safetensors")), load_file(str(tmp_path / "open" / "final" / "reader" / "model.safetensors"))
    assert set(before) == set(after) and all(torch.allclose(before[k], after[k], atol=1e-8) for k in before)
    reader = Reader.from_pretrained(tmp_path / "open" / "final" / "reader")
    assert reader.cfg.max_len == 96 and reader.cfg.calibration is None  # read at the run's length; the stale calibration is dropped


def test_drop_gold_takes_a_fixed_share_of_each_batch_reproducibly():
    a, b = drop_gold(7, 10, 0.3, seed=1), drop_gold(7, 10, 0.3, seed=1)
    assert a.sum() == 3 and (a == b).all()
    assert any((drop_gold(s, 10, 0.3, seed=1) != a).any() for s in range(8, 12))  # another choice at other steps
    assert not drop_gold(0, 10, 0.0, seed=1).any()


def test_a_near_miss_is_the_passage_without_the_sentences_that_answer():
    text = "The tower opened in 1889. It was designed by Gustave Eiffel. Eiffel also built bridges! Paris loved it."
    assert without_answer(text, ["Gustave Eiffel"]) == "The tower opened in 1889. Eiffel also built bridges! Paris loved it."
    assert without_answer(text, ["eiffel"]) == "The tower opened in 1889. Paris loved it."  # every sentence holding it
    assert without_answer("Only 1889.", ["1889"]) is None  # nothing left


@pytest.mark.slow
def test_questions_read_without_their_passage_learn_the_null_span(questions_file, corpus_file, tiny_bert, tiny_dense_index,
                                                                    tmp_path):
    """Half of each batch reads only distractors (from other documents: none holds its answer),
    so its gold is the null span; trained, the reader says "not here" on those reads and answers
    from the passage; a teacher trained so distils into a student through the same softmax."""
    cfg = _cfg(questions_file, corpus_file, tiny_bert, index=str(tiny_dense_index), distractors=2, no_answer_share=0.5,
               steps=60, lr=3e-3, log_every=5)
    train_reader(cfg, tmp_path / "run", show_progress=False)
    reader = Reader.from_pretrained(tmp_path / "run" / "final" / "reader").eval()
    assert reader.cfg.null_span
    searcher = Searcher.open(tiny_dense_index)
    qs = [Question(q["id"], q["question"], tuple(q["answers"]), {"doc_id": q.get("doc_id")}) for q in QUESTIONS[:2]]
    gold = [next((d["title"], d["text"]) for d in DOCS if d["id"] == q.extra["doc_id"]) for q in qs]
    others = retrieve_distractors(searcher, qs, 2)  # (title, text) pairs
    from ralm.pipeline import pick_answer, read_blocks
    gaps = []
    for q, passage, distractors in zip(qs, gold, others):
        def read(blocks):  # as trained and as served: each block with its title
            with torch.no_grad():
                read = read_blocks(reader, [q.question] * len(blocks), [text for _, text in blocks],
                                   titles=[title for title, _ in blocks], device=torch.device("cpu"), dtype=torch.float32)
            return pick_answer(torch.log_softmax(torch.zeros(len(blocks)), 0), read)
        with_gold, without = read([passage, *distractors]), read(distractors)
        assert exact_match(with_gold.answer, q.answers) == 1.0, with_gold.answer
        gaps.append(without.signals["p_null"] - with_gold.signals["p_null"])
    assert min(gaps) > 0 and sum(gaps) / len(gaps) > 0.3, gaps
    student = train_reader(_cfg(questions_file, corpus_file, tiny_bert, index=str(tiny_dense_index), distractors=2,
                                no_answer_share=0.5, steps=2, teacher=str(tmp_path / "run" / "final" / "reader")),
                           tmp_path / "student", show_progress=False)
    metrics = [json.loads(line) for line in (Path(student.run) / "metrics.jsonl").read_text().splitlines()]
    assert all(m["distill_kl"] > 0 for m in metrics)


def test_cli_train_reader(questions_file, corpus_file, tiny_bert, tiny_dense_index, tmp_path, ralm):
    code, out, err = ralm("train-reader", "--questions", questions_file, "--corpus", corpus_file, "--out", tmp_path / "run",
                          "--init", tiny_bert, "--index", tiny_dense_index, "--distractors", 2, "--no-answer-share", 0, "--steps", 2,
                          "--batch-size", 2, "--max-len", 80, "--stride", 16, "--log-every", 1, "--dtype", "fp32", "--json")
    assert code == 0, err
    assert json.loads(out)["steps"] == 2 and (tmp_path / "run" / "final" / "reader" / "config.json").is_file()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["windows"] >= 2 * 3 for m in metrics)  # each question's passage and 2 distractors
    code, _, err = ralm("train-reader", "--questions", questions_file, "--out", tmp_path / "other", "--init", tiny_bert)
    assert code == 2 and "no corpus was given" in err
    code, _, err = ralm("train-reader", "--questions", questions_file, "--corpus", corpus_file, "--out", tmp_path / "x",
                        "--init", tiny_bert, "--max-len", 80, "--stride", 100, "--steps", 1)
    assert code == 2 and "stride 100" in err


def _recipe(path, **config):
    path.write_text(json.dumps({"format": "ralm.recipe/1", "command": "train-reader", "about": "a test", "config": config}))
    return path


def test_a_recipe_reproduces_a_tiny_reader_bit_for_bit(questions_file, corpus_file, tiny_bert, tiny_dense_index, tmp_path, ralm):
    """The recipe file is the run: two runs of it give the same weights byte for byte, and the
    reader records the command, the recipe's hash, the config and its inputs' fingerprints."""
    recipe = _recipe(tmp_path / "recipe.json", questions=str(questions_file), corpus=str(corpus_file), init=str(tiny_bert),
                     index=str(tiny_dense_index), distractors=1, no_answer_share=0.25, relation_swap_share=0.25,
                     sibling_share=0.25, verify=True, steps=3, batch_size=4, max_len=80, stride=16, dtype="fp32",
                     save_every=3, log_every=1, lr=1e-3, warmup=0)
    for name in ("a", "b"):
        code, out, err = ralm("train-reader", "--recipe", recipe, "--out", tmp_path / name, "--json")
        assert code == 0, err
    weights = [(tmp_path / name / "final" / "reader" / "model.safetensors").read_bytes() for name in ("a", "b")]
    assert weights[0] == weights[1]
    made = json.loads((tmp_path / "a" / "final" / "reader" / "made_by.json").read_text())
    import hashlib
    assert made["legs"][0]["recipe"]["sha256"] == hashlib.sha256(recipe.read_bytes()).hexdigest()
    assert made["legs"][0]["command"].startswith("ralm train-reader --recipe") and made["legs"][0]["from_step"] == 0
    assert made["trainer"] == "train-reader" and made["step"] == 3 and made["config"]["verify"] is True
    assert made["inputs"]["questions"]["fingerprint"] and made["inputs"]["corpus"]["fingerprint"]
    reader = Reader.from_pretrained(tmp_path / "a" / "final" / "reader")
    assert reader.cfg.read_title and reader.cfg.verifier and reader.cfg.null_span
    # an option given on the command line wins over the recipe
    code, out, err = ralm("train-reader", "--recipe", recipe, "--out", tmp_path / "c", "--steps", 1, "--json")
    assert code == 0 and json.loads(out)["steps"] == 1, err


def test_inputs_made_ahead_by_worker_processes_train_the_same_weights(questions_file, corpus_file, tiny_bert, tiny_dense_index,
                                                                    tmp_path):
    """`workers` only moves where a step's inputs are made: with 2 worker processes (distractors,
    swaps, generated records, windows) the run trains the weights of the one without, and a run
    resumed with another number of workers goes on as the uninterrupted one."""
    cfg = _cfg(questions_file, corpus_file, tiny_bert, index=str(tiny_dense_index), distractors=1, no_answer_share=0.25,
               relation_swap_share=0.25, sibling_share=0.25, verify=True, dtype="fp32")
    train_reader(cfg, tmp_path / "here", show_progress=False)
    train_reader(dataclasses.replace(cfg, workers=2), tmp_path / "ahead", show_progress=False)
    shutil.copytree(tmp_path / "ahead", tmp_path / "resumed")
    ck = tmp_path / "resumed" / "checkpoints"
    shutil.rmtree(ck / "step-000004")
    (ck / "LATEST").write_text("step-000002\n")
    train_reader(dataclasses.replace(cfg, workers=1), tmp_path / "resumed", show_progress=False)
    runs = [load_file(str(tmp_path / name / "final" / "reader" / "model.safetensors")) for name in ("here", "ahead", "resumed")]
    for other in runs[1:]:
        assert other.keys() == runs[0].keys() and all(torch.equal(other[k], runs[0][k]) for k in runs[0])
    losses = [[json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
              for name in ("here", "ahead", "resumed")]
    assert losses[0] == losses[1] == losses[2]


def test_input_workers_where_processes_cannot_be_forked_are_a_config_error(questions_file, monkeypatch):
    from ralm.configs import ConfigError
    from ralm.train import reader

    monkeypatch.setattr(reader, "can_fork", lambda: False)  # as on Windows
    with pytest.raises(ConfigError, match="workers must be 0 here, got 2"):
        ReaderTrainConfig(questions=str(questions_file), workers=2)
    assert ReaderTrainConfig(questions=str(questions_file)).workers == 0


def test_a_bad_recipe_is_one_line(tmp_path, ralm):
    for body, problem in (('{"format": "ralm.recipe/1", "command": "ict", "config": {}}', "not `ralm train-reader`"),
                          ('{"format": "ralm.recipe/1", "command": "train-reader", "config": {"stepz": 3}}', "unknown config field 'stepz'"),
                          ("[1, 2", "not JSON"), ('{"config": {}}', "ralm.recipe/1")):
        (tmp_path / "r.json").write_text(body)
        code, _, err = ralm("train-reader", "--recipe", tmp_path / "r.json", "--out", tmp_path / "x")
        assert code == 2 and "--recipe" in err and problem in err and len(err.strip().splitlines()) == 1, err
    code, _, err = ralm("train-reader", "--recipe", tmp_path / "none.json", "--out", tmp_path / "x")
    assert code == 2 and "cannot be read" in err


def test_a_step_reads_swapped_and_sibling_questions_with_their_null(questions_file, corpus_file, tiny_bert, tmp_path):
    """Relation-swapped questions read their passage alone with the null as gold; sibling
    questions read generated records; the verifier learns from every question's best span."""
    from ralm.train.reader import ReaderTrainer
    from ralm.train.parallel import start_run

    cfg = _cfg(questions_file, corpus_file, tiny_bert, relation_swap_share=1.0, sibling_share=0.5, verify=True, batch_size=4)
    trainer = ReaderTrainer(cfg)
    trainer.ctx = start_run(tmp_path / "run", cfg, show_progress=False)
    trainer.build()
    examples = trainer.examples(0, [0, 1, 2, 3])
    swapped = [ex for ex in examples if ex.question not in {q["question"] for q in QUESTIONS}]
    for ex in swapped:  # "When did Armstrong walk on the Moon?" has no relation of the list: asked as written
        assert ex.no_answer and ex.answers == () and len(ex.texts) == 1
    siblings = trainer.sibling_examples(0, 3)
    assert len(siblings) == 3 and all(ex.texts and all(title for title, _ in ex.texts) for ex in siblings)
    assert all(ex.no_answer == (not ex.answers) for ex in siblings)
