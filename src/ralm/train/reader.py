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

With a `teacher` (a reader checkpoint with the same wordpieces, e.g. a larger encoder fine-tuned
by this trainer), the loss is (1 - distill) x that loss + distill x KL(teacher || student) of the
same shared softmax (`distill_kl`), the teacher reading the same windows.

A run: RUN/config.json, RUN/checkpoints/ (resumable), RUN/metrics.jsonl (loss, span_accuracy:
the question's best span over all it read is a gold one, answerable, windows, lr, steps_per_s),
loss.png, span_accuracy.png, RUN/final/reader.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, asdict, dataclass, replace
from typing import Sequence

import numpy as np
import torch

from ralm.configs import LIMIT_HELP, SAVE_EVERY_HELP, WARMUP_HELP, option
from ralm.data.blocks import sentence_ends
from ralm.data.corpus import read_corpus
from ralm.data.qa import Question, has_answer
from ralm.data.reader_features import ReaderBatch, valid_spans, wordpiece_map
from ralm.errors import RalmError
from ralm.models.reader import NEG, Reader, distill_kl, shared_nll
from ralm.retrieval.search.searcher import Searcher
from ralm.rundir import final_dir
from ralm.runtime import full_precision
from ralm.train.finetune import AnswerableCount, load_reader
from ralm.train.loop import LoopConfig, TrainResult, warmup_linear_decay
from ralm.train.parallel import global_mean, rank_batch
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
    max_len: int = option(384, "reader input length: [CLS] question [SEP] window [SEP] (a reader given as init is read at it too)")
    stride: int = option(128, "wordpieces between the starts of a passage's windows")
    trainable_layers: int | None = option(None, "train only the top N layers", shown="all")
    limit: int | None = option(None, LIMIT_HELP)
    _: KW_ONLY
    steps: int = option(5000, "training steps")
    batch_size: int = option(32, "questions per step and rank (under torchrun)")
    warmup: int = option(500, WARMUP_HELP + " (then linear decay to 0)")
    save_every: int = option(500, SAVE_EVERY_HELP)
    positive_fields = ("max_len", "stride", "limit", "distill_temperature")
    non_negative_fields = ("trainable_layers", "distractors")
    fraction_fields = ("no_answer_share", "near_miss_share", "distill")
    presets = {"cpu": {"steps": 300, "batch_size": 8, "warmup": 30, "save_every": 100}}


@dataclass
class ReaderTrainResult(TrainResult):
    questions: int
    answerable_share: float  # of the questions seen, those with a gold span
    reader: str  # RUN/final/reader


def gold_passages(questions: Sequence[Question], source: str, corpus: str | None) -> list[str]:
    """The passage of each question: its "context" field, else its "doc_id" in `corpus`."""
    wanted = {q.extra.get("doc_id") for q in questions if "context" not in q.extra}
    texts = {d.id: d.text for d in read_corpus(corpus) if d.id in wanted} if corpus and wanted else {}
    out = []
    for q in questions:
        doc_id = q.extra.get("doc_id")
        if isinstance(q.extra.get("context"), str):
            out.append(q.extra["context"])
        elif doc_id is None:
            raise RalmError(f"{source}: question {q.id} has neither a 'context' nor a 'doc_id' field")
        elif corpus is None:
            raise RalmError(f"{source}: question {q.id} names its passage by 'doc_id', but no corpus was given")
        elif doc_id not in texts:
            raise RalmError(f"{source}: question {q.id}: doc_id {doc_id!r} is not in {corpus}")
        else:
            out.append(texts[doc_id])
    return out


def retrieve_distractors(searcher: Searcher, questions: Sequence[Question], n: int) -> list[list[str]]:
    """The texts of the top `n` blocks retrieved for each question that are not from its gold
    document ("doc_id"); a block holding the answer stays (answer matching labels it)."""
    if n == 0:
        return [[] for _ in questions]
    room = n + 4  # the gold document is usually one or two blocks of the top
    _, rows = searcher.search_rows([q.question for q in questions], room)
    blocks = searcher.current.blocks
    out = []
    for q, qrows in zip(questions, rows):
        records = (blocks.record(int(r)) for r in qrows)
        out.append([rec["text"] for rec in records if rec["doc_id"] != q.extra.get("doc_id")][:n])
    return out


def read_inputs(reader: Reader, questions: Sequence[Question], texts: Sequence[Sequence[str]],
                stride: int) -> tuple[ReaderBatch, torch.Tensor, torch.Tensor]:
    """Every window of every text read for each question (`texts[b]`: its gold passage first,
    unless dropped, then its distractors): (batch, match [N, L, W], question [N]: which question a window is for)."""
    pairs = [(b, text) for b, qtexts in enumerate(texts) for text in qtexts]
    batch, owner = reader.featurizer.featurize_windows([questions[b].question for b, _ in pairs], [t for _, t in pairs], stride)
    question = [pairs[o][0] for o in owner]
    match = reader.featurizer.answer_match(batch, [questions[b].answers for b in question])
    return batch, match, torch.tensor(question)


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
    flat = scores.float().masked_fill(~valid, NEG).flatten(1)  # [N, L*W]
    best, at = flat.max(1)  # [N]
    hit = match.flatten(1).gather(1, at[:, None]).squeeze(1)  # [N]
    owns = question.view(1, -1) == torch.arange(questions, device=question.device).view(-1, 1)  # [B, N]
    top = best.view(1, -1).masked_fill(~owns, 2 * NEG).argmax(1)  # [B]: the window holding it
    return hit[top]


class ReaderTrainer(QuestionTrainer):
    name, config = "train-reader", ReaderTrainConfig
    plots = ("loss", "span_accuracy")

    def __init__(self, cfg: ReaderTrainConfig):
        super().__init__(cfg)
        self.passages = gold_passages(self.questions, cfg.questions, cfg.corpus)  # bad files fail before RUN is made

    def build(self) -> Reader:
        cfg, ctx = self.cfg, self.ctx
        self.searcher = Searcher.open(cfg.index, runtime=ctx.runtime) if cfg.index else None
        self.reader = load_reader(cfg.init, cfg.max_len, cfg.trainable_layers).to(ctx.device)
        self.no_answer_share = cfg.no_answer_share if self.searcher else 0.0  # without an index there are no distractors
        if self.no_answer_share > 0:
            self.reader.cfg.null_span = True  # a reader trained without one gains its [CLS] null span here
        self.teacher = None
        if cfg.teacher:
            self.teacher = Reader.from_pretrained(cfg.teacher, max_len=cfg.max_len, calibration=None).to(ctx.device).eval()
            self.teacher.requires_grad_(False)
            if self.teacher.cfg.null_span != self.reader.cfg.null_span:
                raise RalmError(f"teacher {cfg.teacher} {'has' if self.teacher.cfg.null_span else 'lacks'} a null span and the "
                                "student does not: train the teacher with the same --no-answer-share")
            self.to_teacher = wordpiece_map(self.reader.tokenizer, self.teacher.tokenizer).to(ctx.device)
        return self.reader

    def schedule(self):
        return warmup_linear_decay(self.cfg.steps, self.cfg.warmup)

    def started(self) -> None:
        self.count = AnswerableCount(**self.loop.resumed)
        self.reader.train()

    def texts(self, i: int, idx: Sequence[int], qs: Sequence[Question]) -> tuple[list[list[str]], torch.Tensor]:
        """What each question of step i reads (its gold passage, unless dropped: then nothing or,
        for `near_miss_share` of them, the passage without its answer; then its distractors) and
        which questions are unanswerable from it [B] bool."""
        cfg = self.cfg
        distractors = retrieve_distractors(self.searcher, qs, cfg.distractors) if self.searcher else [[] for _ in qs]
        dropped = drop_gold(i, len(qs), self.no_answer_share, seed=cfg.seed)
        near = np.random.default_rng([cfg.seed, i, 1]).random(len(qs)) < cfg.near_miss_share
        texts = []
        for j, q, d, drop, miss in zip(idx, qs, distractors, dropped, near):
            passage = self.passages[j] if not drop else without_answer(self.passages[j], q.answers) if miss else None
            texts.append([*([] if passage is None else [passage]), *d])
        no_answer = [drop and not any(has_answer(t, q.answers) for t in qt) for q, qt, drop in zip(qs, texts, dropped)]
        return texts, torch.tensor(no_answer)

    def step(self, i: int):
        cfg, env, device, width = self.cfg, self.ctx.env, self.ctx.device, self.reader.cfg.max_span_width
        idx = rank_batch(i, cfg.batch_size, n=len(self.questions), seed=cfg.seed, env=env)
        qs = [self.questions[j] for j in idx]
        texts, no_answer = self.texts(i, idx, qs)
        batch, match, question = read_inputs(self.reader, qs, texts, cfg.stride)
        batch, match, question = batch.to(device), match.to(device), question.to(device)
        scores = self.loop.ddp(batch)  # [N, L, W]
        teacher = None
        if self.teacher is not None:
            with torch.no_grad():
                teacher = self.teacher(replace(batch, input_ids=self.to_teacher[batch.input_ids]))  # [N, L, W]
        with full_precision(device):
            valid = valid_spans(batch, width)
            log_pz = torch.zeros(len(match), device=device)
            null = self.reader.null_scores(scores)
            loss, labelled = shared_nll(scores, valid, match, log_pz=log_pz, question=question, questions=len(qs), null=null,
                                        no_answer=no_answer.to(device))
            extra = {}
            if teacher is not None:
                kl = distill_kl(scores, teacher, valid, log_pz=log_pz, question=question, questions=len(qs), null=null,
                                teacher_null=self.teacher.null_scores(teacher), temperature=cfg.distill_temperature)
                loss = (1 - cfg.distill) * loss + cfg.distill * kl
                extra["distill_kl"] = kl.item()
            mine = int(labelled.sum())
            loss, labelled_now = global_mean(loss * mine, mine, env)
            with torch.no_grad():
                spans = labelled & ~no_answer.to(device)
                hit = best_is_gold(scores.detach(), valid, match, question, questions=len(qs))[spans]
        self.count.add(len(idx) * env.world, labelled_now)
        return loss if labelled_now else None, {
            "loss": loss.item(), "span_accuracy": hit.float().mean().item() if len(hit) else 0.0,
            "answerable": labelled_now / (len(idx) * env.world), "windows": float(len(match)), **extra}

    def exports(self):
        return {"reader": self.reader}

    def checkpoint_extra(self) -> dict:
        return asdict(self.count)

    def result(self, done: TrainResult) -> ReaderTrainResult:
        return ReaderTrainResult(**asdict(done), questions=len(self.questions), answerable_share=self.count.share,
                                 reader=str(final_dir(self.ctx.path, "reader")))


train_reader = ReaderTrainer.fit
