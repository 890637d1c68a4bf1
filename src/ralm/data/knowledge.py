"""A generated knowledge task where retrieval is the only way to fill a mask.

Made-up entities ("Amber Falcon") are built from real words the bundled wordpiece vocabulary
holds whole, and each has two facts: the city it was founded in and its founder. Every entity
has two documents:

  fact-NNNN    its fact document, the one place both facts are stated together:
               "Amber Falcon was founded in Oslo by Clara."
  notes-NNNN   another document about it, whose sentences each mention the entity and one
               fact in other words: "A statue of Clara stands in the square of Amber Falcon."

Pre-training masks the fact (the salient span) in a sentence of one document; REALM excludes
that document from retrieval, so the fact can only come from the entity's other document.

Training entities contribute both documents to the pre-training corpus. Held-out entities
contribute only their fact documents, which are added to the index after training, and
held-out sentences about them that no corpus holds: a model that memorised training facts in
its weights cannot fill them, one that learned to retrieve can.

Two options make that exclusion matter (the REALM learning test uses both): with
`sentence_documents` each notes sentence is a document of its own, titled by its entity as a
fact document is (notes-NNNN-I: a masked sentence's own document is then its verbatim copy,
as close to the query as a document gets), and with `dated` each mention ends with a year
("... arrive from Oslo in 1873."), a detail only it and its own document share: a retriever
allowed the trivial retrieval learns to match it, one denied it learns to find the facts.

Everything is drawn from one seeded generator: the same config gives the same task. The facts
are the salient spans; `save_spacy_pipeline` writes a spaCy pipeline (sentencizer + entity
ruler over the fact values) that `SentenceConfig.spacy_model` / `--spacy-model` can name, so
the real pre-training path masks them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ralm.atomic import atomic_path, write_text
from ralm.data.corpus import Document, jsonl_lines
from ralm.errors import RalmError

# Every word is one wordpiece of the bundled (MiniLM, uncased BERT) vocabulary: tests check it.
NAME_FIRST = ("amber silver golden copper iron crimson hollow quiet northern eastern ancient broken hidden frozen "
              "burning silent wild lonely bright dark green blue white black stone glass velvet marble scarlet royal").split()
NAME_SECOND = ("falcon lantern harbor river tower meadow forest bridge garden castle valley island crown anchor mirror "
               "arrow bell wolf raven fox oak willow lake hill gate shield star moon rose temple").split()
# More of each, for tasks with more entities than the lists above name (more facts than a small
# model memorises): names stay two words, so every fact document stays ten wordpieces, two of
# RETRO's 5-wordpiece chunks, and a chunk of it can be retrieved aligned.
MORE_FIRST = ("red orange yellow purple pink gray brown gentle proud high deep southern western central upper lower "
              "misty sunny rainy stormy windy snowy icy dusty sandy rocky grassy sweet bitter salty warm cold cool soft "
              "heavy swift slow brave bold calm fierce noble humble wise lone twin grand tiny giant narrow wide round "
              "steep sharp pale shining rising sacred secret magic eternal bronze gold crystal pearl ruby emerald jade "
              "coral ivory").split()
MORE_SECOND = ("eagle hawk owl swan crow dove sparrow heron crane lion tiger bear deer horse lamb hare otter beaver "
               "badger serpent dragon whale dolphin salmon trout spider bee moth stream brook creek pond sea bay shore "
               "beach coast cliff cave canyon peak mountain ridge summit field farm orchard grove wood hall cottage manor "
               "palace fortress spire dome arch chain sword spear hammer blade banner flag wheel mill forge candle torch "
               "flame").split()
CITIES = ("paris london berlin madrid rome vienna prague dublin oslo cairo lima tokyo delhi sydney boston chicago "
          "denver dallas seattle houston athens moscow warsaw lisbon geneva milan naples venice florence munich").split()
FOUNDERS = ("james mary john anna peter paul george henry thomas edward william charles alice emma grace clara lucy "
            "julia helen margaret victor oscar hugo felix leo max ivan boris elena sophia").split()

FACT_TEMPLATE = "{entity} was founded in {city} by {founder}."
# Other ways to mention an entity with one of its facts: {entity} and the fact, nothing else.
MENTIONS = {
    "city": ("Travellers to {entity} often arrive from {city}.",
             "Many families in {entity} still trace their roots to {city}.",
             "The old road from {city} ends at the gates of {entity}.",
             "Every summer {entity} holds a fair in honour of {city}."),
    "founder": ("A statue of {founder} stands in the square of {entity}.",
                "The people of {entity} still tell stories about {founder}.",
                "{founder} is remembered as the first leader of {entity}.",
                "Each year {entity} celebrates the birthday of {founder}."),
}
SPAN_LABELS = {"city": "GPE", "founder": "PERSON"}  # salient labels (data.masking.SALIENT_LABELS)


@dataclass(frozen=True)
class KnowledgeConfig:
    train_entities: int = 160
    eval_entities: int = 40
    mentions: int = 2  # sentences per fact in a training entity's notes document
    eval_mentions: int = 1  # held-out sentences per fact of a held-out entity
    seed: int = 0
    sentence_documents: bool = False  # each notes sentence its own document, titled by its entity
    dated: bool = False  # each mention ends "in <year>" (years of their own seeded draw: the rest is unchanged)

    def __post_init__(self):
        total = self.train_entities + self.eval_entities
        if min(self.train_entities, self.eval_entities, self.mentions, self.eval_mentions) < 1:
            raise RalmError("train_entities, eval_entities, mentions and eval_mentions must be positive")
        if total > (most := len(NAME_FIRST + MORE_FIRST) * len(NAME_SECOND + MORE_SECOND)):
            raise RalmError(f"at most {most} entities, got {total}")


@dataclass(frozen=True)
class FactSentence:
    text: str
    span: tuple[int, int]  # characters of the fact in `text`
    relation: str  # "city" or "founder"
    entity: str
    source: str  # id of the fact document that states it

    @property
    def masked_text(self) -> str:
        """The sentence with its fact replaced by [MASK] (which the wordpiece tokenizer keeps whole)."""
        return f"{self.text[: self.span[0]]}[MASK]{self.text[self.span[1]:]}"


@dataclass(frozen=True)
class Entity:
    name: str
    city: str
    founder: str
    source: str  # id of its fact document
    held_out: bool


QUESTIONS = {"city": "In which city was {entity} founded?", "founder": "Who founded {entity}?"}


@dataclass
class KnowledgeTask:
    cfg: KnowledgeConfig
    entities: list[Entity]
    train_docs: list[Document]  # fact and notes documents of the training entities: the pre-training corpus
    eval_docs: list[Document]  # fact documents of the held-out entities, indexed after training
    eval_sentences: list[FactSentence]  # held-out sentences about the held-out entities (in no corpus)
    train_sentences: list[FactSentence]  # the notes sentences of the training entities, with their fact spans

    def write_corpus(self, path: str | os.PathLike, *, with_eval: bool = False, joined: bool = False) -> Path:
        """The pre-training corpus as JSONL (with the held-out fact documents appended when
        `with_eval`: the corpus a user indexes after adding documents). `joined` writes each
        training entity as one document, its fact document's text then its notes: a reading
        lesson for an MLM warm-up, where a notes sentence cut out of its block can be filled
        only by reading the fact statement's other wording (with separate documents the
        encoder never learns which of a fact document's two values each wording asks for)."""
        docs = self.train_docs
        if joined:
            notes = by_source(self.train_sentences)
            docs = [Document(d.id, d.title, " ".join([d.text, *(s.text for s in notes[d.id])]))
                    for d in self.train_docs if d.id in notes]
        docs = docs + (self.eval_docs if with_eval else [])
        write_text(path, jsonl_lines(docs))
        return Path(path)

    def own_documents(self) -> list[Document]:
        """Each held-out sentence as the document a corpus holding it would keep it in (titled
        as a training notes document is): indexed beside the fact documents, the masked
        sentence's verbatim copy, which a retriever that learned the trivial retrieval finds
        instead of the fact."""
        number = {e.source: n for n, e in enumerate(self.entities)}
        return [Document(f"own-{i:04d}", _notes_title(self.cfg, s.entity, number[s.source]), s.text)
                for i, s in enumerate(self.eval_sentences)]

    @property
    def fact_docs(self) -> list[Document]:
        """Every entity's fact document, training and held-out."""
        sources = {e.source for e in self.entities}
        return [d for d in self.train_docs + self.eval_docs if d.id in sources]

    def questions(self, *, held_out: bool) -> list[dict]:
        """A question per fact of the training (or held-out) entities, in the question-file
        format of data/qa.py plus "source", the fact document's id (for DPR)."""
        return [{"id": f"{e.source}-{relation}", "question": template.format(entity=e.name),
                 "answers": [e.city if relation == "city" else e.founder], "source": e.source}
                for e in self.entities if e.held_out == held_out for relation, template in QUESTIONS.items()]


def by_source(sentences: Sequence[FactSentence]) -> dict[str, list[FactSentence]]:
    """`sentences` grouped under their fact document's id, each group in their order: an
    entity's notes (training sentences) or its held-out sentences."""
    out: dict[str, list[FactSentence]] = {}
    for s in sentences:
        out.setdefault(s.source, []).append(s)
    return out


def _notes_title(cfg: KnowledgeConfig, entity: str, n: int) -> str:
    """The title of entity number `n`'s notes documents."""
    return entity if cfg.sentence_documents else f"Notes {n}"


def _mention(template: str, entity: str, city: str, founder: str, relation: str, year: int | None) -> FactSentence:
    value = city if relation == "city" else founder
    text = template.format(entity=entity, city=city, founder=founder)
    if year is not None:
        text = f"{text[:-1]} in {year}."  # every template ends with its full stop
    start = len(template[: template.index("{" + relation + "}")].format(entity=entity))  # by position, not search
    return FactSentence(text, (start, start + len(value)), relation, entity, "")


def _entity_names(total: int, rng: np.random.Generator) -> list[str]:
    """`total` distinct two-word names, from the longer word lists only where the short ones
    run out (so a task that fits them is the same as before the lists grew)."""
    small = total <= len(NAME_FIRST) * len(NAME_SECOND)
    lists = (NAME_FIRST, NAME_SECOND) if small else (NAME_FIRST + MORE_FIRST, NAME_SECOND + MORE_SECOND)
    sizes = tuple(len(words) for words in lists)
    picks = rng.choice(int(np.prod(sizes)), size=total, replace=False)
    return [" ".join(words[i] for words, i in zip(lists, np.unravel_index(int(p), sizes))).title() for p in picks]


def generate_task(cfg: KnowledgeConfig = KnowledgeConfig()) -> KnowledgeTask:
    """The task of `cfg`, the same for the same config (see the module docstring)."""
    rng = np.random.default_rng(cfg.seed)
    years = np.random.default_rng([cfg.seed, 1]) if cfg.dated else None
    entities, train_docs, eval_docs, train_sentences, eval_sentences = [], [], [], [], []
    for n, entity in enumerate(_entity_names(cfg.train_entities + cfg.eval_entities, rng)):
        city, founder = CITIES[rng.integers(len(CITIES))].title(), FOUNDERS[rng.integers(len(FOUNDERS))].title()
        fact = Document(f"fact-{n:04d}", entity, FACT_TEMPLATE.format(entity=entity, city=city, founder=founder))
        held_out = n >= cfg.train_entities
        entities.append(Entity(entity, city, founder, fact.id, held_out))
        per_fact = cfg.eval_mentions if held_out else cfg.mentions
        sentences = []
        for relation, templates in MENTIONS.items():
            for t in rng.choice(len(templates), size=per_fact, replace=per_fact > len(templates)):
                s = _mention(templates[int(t)], entity, city, founder, relation,
                             None if years is None else int(years.integers(1700, 2000)))
                sentences.append(FactSentence(s.text, s.span, relation, entity, fact.id))
        sentences = [sentences[int(i)] for i in rng.permutation(len(sentences))]
        if held_out:
            eval_docs.append(fact)
            eval_sentences.extend(sentences)
        else:
            title = _notes_title(cfg, entity, n)
            notes = ([Document(f"notes-{n:04d}-{i}", title, s.text) for i, s in enumerate(sentences)] if cfg.sentence_documents
                     else [Document(f"notes-{n:04d}", title, " ".join(s.text for s in sentences))])
            train_docs += [fact, *notes]
            train_sentences.extend(sentences)
    return KnowledgeTask(cfg, entities, train_docs, eval_docs, eval_sentences, train_sentences)


def save_spacy_pipeline(out: str | os.PathLike) -> Path:
    """A spaCy pipeline directory (sentencizer + entity ruler) that marks every city and founder
    as a salient span, for `SentenceConfig.spacy_model`; entity names stay unmasked."""
    import spacy

    nlp = spacy.blank("en")
    nlp.add_pipe("sentencizer")
    ruler = nlp.add_pipe("entity_ruler")
    ruler.add_patterns([{"label": SPAN_LABELS["city"], "pattern": w.title()} for w in CITIES]
                       + [{"label": SPAN_LABELS["founder"], "pattern": w.title()} for w in FOUNDERS])
    with atomic_path(out) as tmp:
        nlp.to_disk(tmp)
    return Path(out)
