"""Generated corpora of parallel records (data/siblings.py): a stated question's answer is in the
asked record's text, a missing one's attribute is absent for the asked record and present for a
sibling, an absent record is in no section, every style is read through the product's
ingestion, and the same seed gives the same corpus."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ralm.data.qa import has_answer
from ralm.data.siblings import DOMAINS, STYLES, ask, make_corpus, training_example, write_sibling_corpus


def _attribute(corpus, name):
    return next(a for a in corpus.domain.attributes if a.name == name)


@pytest.mark.parametrize("style", STYLES)
def test_questions_of_each_kind_mean_what_they_say(style):
    for seed in range(12):
        rng = np.random.default_rng(seed)
        corpus = make_corpus(rng, style=style)
        sections = corpus.sections()
        text = "\n".join(t for _, _, t in sections)
        for kind in ("stated", "missing", "absent"):
            q = ask(corpus, rng, kind)
            records = {r.name: r for r in corpus.records}
            if q.kind == "stated":
                assert q.answers == (records[q.record].values[q.attribute],) and has_answer(text, q.answers)
            elif q.kind == "missing":
                assert q.answers == () and q.attribute not in records[q.record].values
                assert any(q.attribute in r.values for r in corpus.records if r.name != q.record)  # a sibling states it
                # the sibling's value is in the text, and the asked record's own text lacks its label
                sibling = next(r for r in corpus.records if q.attribute in r.values)
                assert has_answer(text, [sibling.values[q.attribute]])
            else:
                assert q.answers == () and q.record not in records and q.record.lower() not in text.lower()
            assert q.record in q.question


def test_every_style_is_read_through_the_ingestion_with_the_records_names():
    for style in STYLES:
        corpus = make_corpus(np.random.default_rng(3), records=4, style=style)
        sections = corpus.sections()
        assert sections and all(title.startswith(corpus.title) for _, title, _ in sections)
        joined = " ".join(title + " " + text for _, title, text in sections)
        assert all(r.name in joined for r in corpus.records)
        assert all(has_answer(joined, [v]) for r in corpus.records for v in r.values.values())


def test_records_state_attributes_of_one_type_side_by_side():
    # the lesson "another attribute of the asked record, of the answer's type": several years, counts, people
    for domain in DOMAINS:
        types = [a.type for a in domain.attributes]
        assert max(types.count(t) for t in types) >= 2, domain.name


def test_the_same_seed_gives_the_same_example_and_another_seed_another():
    assert training_example(0, 5) == training_example(0, 5)
    assert training_example(0, 5) != training_example(1, 5)
    q, sections = training_example(0, 5)
    assert 1 <= len(sections) <= 4 and all(isinstance(t, str) and isinstance(x, str) for t, x in sections)


def test_a_corpus_folder_and_its_questions(tmp_path):
    summary = write_sibling_corpus(tmp_path / "sib", corpora=3, questions_per_corpus=4, seed=2)
    rows = [json.loads(line) for line in (tmp_path / "sib" / "questions.jsonl").read_text().splitlines()]
    assert summary["questions"] == len(rows) == 12 and len(list((tmp_path / "sib" / "docs").iterdir())) == 3
    assert {r["kind"] for r in rows} <= {"stated", "missing", "absent"}
    assert all(r["unanswerable"] == (r["kind"] != "stated") for r in rows)
    assert len({r["title"] for r in rows}) == 3  # one group per corpus, for fits that leave a corpus out
    again = write_sibling_corpus(tmp_path / "again", corpora=3, questions_per_corpus=4, seed=2)
    assert again == summary and (tmp_path / "again" / "questions.jsonl").read_text() == (tmp_path / "sib" / "questions.jsonl").read_text()
