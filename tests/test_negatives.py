"""Unanswerable questions made from answerable ones (data/negatives.py): the swapped entity is of
the same label and absent from the paragraph; the swapped relation is one the paragraph does not
state; nothing to swap gives None."""

from __future__ import annotations

import numpy as np
import pytest

from ralm.data.negatives import RELATIONS, entity_pool, entity_swap, relation_swap

PARAGRAPH = ("The Rijksmuseum in Amsterdam opened in 1885. It was designed by Pierre Cuypers and holds works by "
             "Rembrandt and Vermeer.")


@pytest.fixture(scope="module")
def nlp():
    from ralm.data.masking import load_spacy

    return load_spacy()


def test_an_entity_is_swapped_for_another_of_its_label_that_the_paragraph_does_not_name(nlp):
    others = ["Who painted the Mona Lisa in Florence?", "When did Vincent van Gogh move to Arles?",
              "Where did Claude Monet live?", "What did Pierre Cuypers design in Amsterdam?"]
    pool = entity_pool(nlp.pipe(others))
    assert "Pierre Cuypers" in pool["PERSON"] and "Florence" in pool["GPE"]
    question = nlp("Who designed the museum that Rembrandt's works hang in?")
    labels = {e.text: e.label_ for e in question.ents}
    seen = set()
    for seed in range(20):
        swapped = entity_swap(question, PARAGRAPH, pool, np.random.default_rng(seed))
        assert swapped is not None and swapped != question.text
        # exactly one entity replaced, by one of the same label, absent from the paragraph
        replaced = [e for e in labels if e not in swapped]
        assert len(replaced) == 1
        new = [t for t in pool[labels[replaced[0]]] if t in swapped]
        assert new and all(t.lower() not in PARAGRAPH.lower() for t in new)
        seen.add(swapped)
    assert "Pierre Cuypers" not in " ".join(seen)  # named in the paragraph: never the swap
    assert entity_swap(nlp("what is it made of?"), PARAGRAPH, pool, np.random.default_rng(0)) is None  # no entity


def test_a_relation_is_swapped_only_for_one_the_paragraph_does_not_state():
    rng = np.random.default_rng(0)
    swapped = relation_swap("When was the Rijksmuseum opened?", PARAGRAPH, rng)
    assert swapped == "When was the Rijksmuseum renovated?"
    stated = PARAGRAPH + " It was renovated from 2003 to 2013."
    assert relation_swap("When was the Rijksmuseum opened?", stated, rng) is None  # the renovation is stated
    assert relation_swap("Who designed the Rijksmuseum?", PARAGRAPH, rng) is None  # no relation of the list
    assert relation_swap("Where was Cuypers born?", PARAGRAPH, rng) == "Where was Cuypers buried?"
    assert relation_swap("Where was Cuypers born?", PARAGRAPH + " He was buried in Roermond.", rng) is None
    for word, swap, _ in RELATIONS:  # a paragraph that says the swap itself is never asked it
        assert relation_swap(f"What {word} here?", f"It {swap} there.", rng) is None, (word, swap)


def test_capitalisation_is_kept():
    assert relation_swap("Opened when?", "A text.", np.random.default_rng(0)) == "Renovated when?"
