"""Questions that ask about another entity or another relation than their paragraph states: the
unanswerable cases a reader meets on a user's own documents, made from answerable ones (the
negative types of SQuAD 2.0, Rajpurkar et al. 2018). Read with the original paragraph, each has
no answer there: its gold is the null span (train/reader.py).

  entity swap    a named entity of the question (spaCy) replaced by another of the same label
                 that the paragraph does not contain: "When did Beyoncé leave Destiny's Child?"
                 -> "When did Rihanna leave Destiny's Child?"
  relation swap  the question's relation replaced by another of the same answer type that the
                 paragraph does not state: "When was the library opened?" -> "When was the
                 library renovated?" (`RELATIONS`, pairs both ways)

Both return None where the question has nothing to swap or every swap would be stated.
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np

# Entity labels whose swap changes what a question asks about (spaCy's English NER). Cardinals
# and ordinals are left alone: "the first" -> "the third" is often still answered by the text.
SWAP_LABELS = ("PERSON", "ORG", "GPE", "LOC", "NORP", "FAC", "EVENT", "WORK_OF_ART", "PRODUCT", "DATE", "LAW", "LANGUAGE")

# Relations of one answer type that a text states apart: (word in a question, its swap, stems
# whose presence in the paragraph means the swapped relation may be stated there).
RELATIONS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("opened", "renovated", ("renovat", "refurbish", "restor")),
    ("open", "renovate", ("renovat", "refurbish", "restor")),
    ("founded", "dissolved", ("dissolv", "disband", "defunct", "closed", "shut")),
    ("established", "abolished", ("abolish", "dissolv", "disband")),
    ("built", "demolished", ("demolish", "torn down", "razed", "destroy")),
    ("constructed", "demolished", ("demolish", "torn down", "razed", "destroy")),
    ("born", "buried", ("buried", "burial", "grave", "interred")),
    ("birth", "death", ("death", "died", "dead", "deceased")),
    ("died", "was born", ("born", "birth")),
    ("die", "marry", ("marri", "wed", "spouse", "wife", "husband")),
    ("married", "divorced", ("divorc", "separat")),
    ("began", "ended", ("ended", "end of", "until", "concluded", "finished")),
    ("begin", "end", ("ended", "end of", "until", "concluded", "finished")),
    ("start", "end", ("ended", "end of", "until", "concluded", "finished")),
    ("started", "ended", ("ended", "end of", "until", "concluded", "finished")),
    ("joined", "left", ("left", "leav", "resign", "departed")),
    ("elected", "impeached", ("impeach",)),
    ("won", "lost", ("lost", "lose", "defeat")),
    ("bought", "sold", ("sold", "sell", "sale")),
    ("acquired", "sold", ("sold", "sell", "sale", "divest")),
    ("invented", "discontinued", ("discontinu", "abandon", "obsolete")),
    ("released", "discontinued", ("discontinu", "withdrawn", "cancel")),
    ("population", "area", ("area", "square", "km2", "km²", "hectare", "acre")),
    ("area", "population", ("population", "inhabitant", "resident", "people")),
    ("height", "weight", ("weigh", "kg", "kilogram", "pound", "tonne", "tons")),
    ("tallest", "oldest", ("oldest", "earliest", "first built")),
    ("largest", "smallest", ("smallest", "least")),
    ("longest", "shortest", ("shortest",)),
    ("highest", "lowest", ("lowest", "least")),
    ("oldest", "newest", ("newest", "youngest", "latest", "most recent")),
    ("north", "south", ("south",)),
    ("south", "north", ("north",)),
    ("east", "west", ("west",)),
    ("west", "east", ("east",)),
    ("father", "grandfather", ("grandfather", "grandparent")),
    ("mother", "grandmother", ("grandmother", "grandparent")),
    ("wife", "daughter", ("daughter", "child")),
    ("husband", "son", ("son", "child")),
    ("capital", "second largest city", ("second largest", "second-largest")),
    ("maximum", "minimum", ("minimum", "least", "lowest")),
    ("minimum", "maximum", ("maximum", "most", "highest", "up to")),
    ("increase", "decrease", ("decreas", "declin", "fell", "drop", "reduc")),
    ("decrease", "increase", ("increas", "rose", "grew", "growth", "rise")),
    ("first", "last", ("last", "final")),
)
_RELATION_WORDS = {word: (swap, stems) for word, swap, stems in RELATIONS}
_WORD = re.compile(r"[A-Za-z]+")


def relation_swap(question: str, paragraph: str, rng: np.random.Generator) -> str | None:
    """The question with one of its relation words (`RELATIONS`) replaced by its swap, where
    the paragraph states nothing of the swapped relation (none of its stems occurs); None when
    no word of the question can be swapped so."""
    low = paragraph.lower()
    found = [m for m in _WORD.finditer(question) if m.group().lower() in _RELATION_WORDS]
    for m in rng.permutation(len(found)).tolist() if found else []:
        word = found[m]
        swap, stems = _RELATION_WORDS[word.group().lower()]
        if swap in low or any(stem in low for stem in stems):
            continue
        swapped = swap.capitalize() if word.group()[0].isupper() else swap
        return question[: word.start()] + swapped + question[word.end():]
    return None


def entity_pool(docs: Sequence, labels: Sequence[str] = SWAP_LABELS) -> dict[str, list[str]]:
    """{label: entity texts} from spaCy docs (e.g. of other questions), each text once, in order."""
    pool: dict[str, dict[str, None]] = {label: {} for label in labels}
    for doc in docs:
        for ent in doc.ents:
            if ent.label_ in pool and len(ent.text) > 1:
                pool[ent.label_][ent.text] = None
    return {label: list(texts) for label, texts in pool.items()}


def entity_swap(question_doc, paragraph: str, pool: dict[str, list[str]], rng: np.random.Generator,
                *, tries: int = 20) -> str | None:
    """The question (a spaCy doc) with one of its named entities replaced by another entity of
    the same label from `pool` that the paragraph does not contain (compared lower-cased) and that
    is not the entity itself; None when the question names no entity of `pool`'s labels or no
    candidate is absent from the paragraph."""
    low = paragraph.lower()
    question = question_doc.text
    ents = [e for e in question_doc.ents if pool.get(e.label_)]
    for e in (ents[i] for i in rng.permutation(len(ents)).tolist()) if ents else ():
        candidates = pool[e.label_]
        for j in rng.permutation(len(candidates))[:tries].tolist():
            other = candidates[j]
            if other.lower() != e.text.lower() and other.lower() not in low and other.lower() not in question.lower():
                return question[: e.start_char] + other + question[e.end_char:]
    return None
