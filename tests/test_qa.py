import json

import pytest

from ralm.data.qa import has_answer, name_coverage, normalize_answer, question_coverage, question_names, read_questions
from ralm.defaults import MAX_QUESTION_CHARS
from ralm.errors import RalmError
from ralm.eval.metrics import recall_at_k


def test_squad_normalisation():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert normalize_answer("an apple, a pear") == "apple pear"
    assert normalize_answer("Theatre") == "theatre"  # articles only as whole words


def test_has_answer_matches_normalised_words_only():
    assert has_answer("Built in 1889 by Gustave Eiffel.", ["gustave eiffel"])
    assert has_answer("It opened in (1889).", ["1889"])
    assert not has_answer("In 18890 nothing happened.", ["1889"])
    assert not has_answer("anything", ["", "the"])


def test_question_coverage_counts_content_words_only():
    assert question_coverage("How many desks does the Lisbon office have?", "The Lisbon office has 46 desks.") == 1.0
    # "desks", "lisbon", "office" ("have" is a function word): Bergen's section holds two of the three
    assert question_coverage("How many desks does the Lisbon office have?", "Bergen: the office has 120 desks.") == pytest.approx(2 / 3)
    assert question_coverage("What is it?", "anything") == 1.0  # no content word: nothing to miss


def test_a_questions_names_are_its_capitalised_words_after_the_first_and_its_codes():
    assert question_names("When did the Lisbon office open?") == {"lisbon"}
    assert question_names("When was Bruno Hollis last promoted?") == {"bruno", "hollis"}
    assert question_names("Which port did version 2.0 use for queue_max_interval?") == {"2", "0", "queue_max_interval"}
    assert question_names("Who painted The Starry Night?") == {"starry", "night"}  # "The": a function word
    assert question_names("when did the lisbon office open?") == set()  # typed in lower case: none to tell


def test_name_coverage_tells_a_siblings_record_from_the_asked_one():
    q = "When was Bruno Hollis last promoted?"
    asked, sibling = "Staff › Bruno Hollis. He was last promoted in 2019.", "Staff › Jamal Hollis. He was last promoted in 2007."
    assert name_coverage(q, asked) == 1.0 and name_coverage(q, sibling) == 0.5
    assert question_coverage(q, sibling) == 0.75  # the words' share misses less of it
    assert name_coverage("when was he promoted?", sibling) == 1.0


def test_recall_at_k_hand_computed():
    hits = [[False, True, False], [False, False, False], [True, False, False], [False, False, True]]
    assert recall_at_k(hits, [1, 2, 3]) == {"recall@1": 25.0, "recall@2": 50.0, "recall@3": 75.0}


def test_question_file_errors_name_the_line(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"question": "a?", "answers": ["x"]}\n{"question": "b?", "answers": "y"}\n{"question": "", "answers": []}\n')
    with pytest.raises(RalmError, match="q.jsonl:3: field 'question' must be a non-empty string"):
        read_questions(path)
    path.write_text('{"question": "a?", "answers": ["x"], "doc_id": "d"}\n{"question": "b?", "answers": "y"}\n')
    qs = read_questions(path)
    assert qs[1].answers == ("y",) and qs[0].extra == {"doc_id": "d"} and qs[0].id == "q-1"
    path.write_text('{"question": "a?", "answers": [1]}\n')
    with pytest.raises(RalmError, match="q.jsonl:1: field 'answers' must be a list of strings"):
        read_questions(path)
    with pytest.raises(RalmError, match="question file not found"):
        read_questions(tmp_path / "none.jsonl")


def test_a_question_is_measured_as_it_is_read_without_the_whitespace_around_it(tmp_path):
    """SQuAD v1.1's train file holds a question padded with 25,592 spaces: it is read, stripped;
    a question that is long once stripped is still refused, naming its line."""
    path = tmp_path / "q.jsonl"
    padded = " " * (MAX_QUESTION_CHARS + 1) + "What radiates two lobes?" + "\n" * 10
    path.write_text(json.dumps({"question": padded, "answers": ["x"]}) + "\n")
    assert read_questions(path)[0].question == "What radiates two lobes?"
    path.write_text(json.dumps({"question": " " + "y" * (MAX_QUESTION_CHARS + 1) + " ", "answers": ["x"]}) + "\n")
    with pytest.raises(RalmError, match=f"q.jsonl:1: field 'question' holds {MAX_QUESTION_CHARS + 1:,} characters"):
        read_questions(path)
