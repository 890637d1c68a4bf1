"""EM and F1 as defined by the official SQuAD v1.1 evaluation script."""

from __future__ import annotations

import pytest

from ralm.eval.metrics import exact_match, f1, recall_at_k


@pytest.mark.parametrize("pred, gold, em", [
    ("the Eiffel Tower", ["Eiffel Tower"], 1.0),  # articles dropped
    ("An apple", ["apple"], 1.0),
    ("Eiffel Tower.", ["eiffel tower"], 1.0),  # punctuation and case
    ("  Eiffel\t\nTower ", ["Eiffel Tower"], 1.0),  # whitespace squashed
    ("U.S.", ["US"], 1.0),  # punctuation removed inside words
    ("theatre", ["atre"], 0.0),  # "the" is only removed as a word
    ("Eiffel", ["Eiffel Tower"], 0.0),
    ("1889", ["in 1889", "1889"], 1.0),  # max over gold answers
])
def test_exact_match(pred, gold, em):
    assert exact_match(pred, gold) == em


def test_f1_hand_computed():
    # pred tokens: eiffel tower paris; gold: eiffel tower -> P=2/3, R=1, F1=0.8
    assert f1("the Eiffel Tower, Paris", ["Eiffel Tower"]) == pytest.approx(0.8)
    # multiset overlap: pred "a a b" (articles: "a" removed) -> "b"; gold "b b" -> P=1, R=1/2
    assert f1("a a b", ["b b"]) == pytest.approx(2 / 3)
    assert f1("tower tower", ["tower"]) == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert f1("nothing shared", ["Eiffel"]) == 0.0
    assert f1("Paris", ["Lyon", "paris!"]) == 1.0  # max over gold answers
    assert f1("the", ["a"]) == 0.0  # both normalise to empty: the official script gives 0


def test_recall_at_k_still_counts_first_hits():
    assert recall_at_k([[False, True], [False, False]], [1, 2]) == {"recall@1": 0.0, "recall@2": 50.0}
