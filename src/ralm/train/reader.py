"""Reader training on gold passages (SQuAD-style reading comprehension), the first stage of
the general-purpose reader; `ralm finetune --init RUN` continues it open-domain (ORQA/REALM).

Each question comes with the passage it was written on: a "context" field, or a "doc_id"
looked up in a corpus. The passage is read as `[CLS] question [SEP] window [SEP]` windows that
start `stride` wordpieces apart (BERT's doc stride). Every verbatim occurrence of an answer on
word boundaries is a gold span, labelled in exactly one window: the one where it has the most
context on its shorter side (BERT's "max context" rule), so an answer straddling a window edge
is learnt from the window that holds it whole, and one inside two windows is not counted twice.

Windows without a gold span are dropped rather than trained toward a "no answer" score: the
reader has none (ORQA/REALM score p(span|z,x) within a block and leave the choice of block to
p(z|x)), so this stage trains exactly the p(span|z,x) the open-domain stage and the pipeline use.
The loss of a window is -log Σ_{gold spans s} p(s|window, x), i.e. `marginal_nll` with one
block. Questions with no gold span (an answer longer than W wordpieces, or not in its passage)
contribute nothing; the share of questions with one is logged as `answerable`.

A run: RUN/config.json, RUN/checkpoints/ (resumable), RUN/metrics.jsonl (loss, span_accuracy,
answerable, windows, lr, steps_per_s), loss.png, span_accuracy.png, RUN/final/reader.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch

from ralm.data.corpus import Documents, read_corpus
from ralm.data.qa import Question, answer_occurrences, read_questions
from ralm.errors import RalmError
from ralm.models.reader import Reader, ReaderBatch, best_spans, marginal_nll, valid_spans
from ralm.rundir import final_dir
from ralm.runtime import full_precision
from ralm.train.finetune import AnswerableCount, load_reader
from ralm.train.loop import TrainLoop, TrainResult, check_options, warmup_linear_decay
from ralm.train.parallel import all_mean, global_mean, rank_batch, start_run


@dataclass
class ReaderTrainConfig:
    questions: str
    corpus: str | Documents | None = None  # resolves the questions' "doc_id" (else each carries a "context"); file or documents
    init: str | None = None  # a reader checkpoint or an HF encoder dir; None: the bundled MiniLM
    steps: int = 5000
    batch_size: int = 32
    lr: float = 1e-4
    warmup: int = 500  # steps of linear learning-rate warm-up (then linear decay to 0)
    max_len: int = 384
    stride: int = 128  # wordpieces between the starts of a passage's windows
    trainable_layers: int | None = None  # None: every layer trains (reads best)
    limit: int | None = None
    seed: int = 0
    save_every: int = 500
    log_every: int = 10
    dtype: str = "auto"  # compute dtype (runtime.resolve_dtype); weights stay fp32

    def __post_init__(self):
        check_options(self, positive=("max_len", "stride", "limit"), non_negative=("trainable_layers",))


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


def label_windows(batch: ReaderBatch, owner: Sequence[int], occurrences: Sequence[Sequence[tuple[int, int]]],
                  width: int) -> torch.Tensor:
    """[N, L, W] bool: each answer occurrence (character span in its pair's text) marked in the
    one window holding it whole with the most context on its shorter side (the earlier window
    on a tie); never where it is cut by a window edge or is longer than `width` wordpieces."""
    best: dict[tuple[int, int, int], tuple[int, int, int, int]] = {}  # (pair, char span) -> (context, n, i, w)
    for n, offs in enumerate(batch.offsets):
        starts = {a: i for i, (a, _) in reversed(list(enumerate(offs)))}  # character -> first wordpiece there
        ends = {b: i for i, (_, b) in enumerate(offs)}  # character -> last wordpiece ending there
        for a, b in occurrences[owner[n]]:
            i, j = starts.get(a), ends.get(b)
            if i is None or j is None or not 0 <= j - i < width:
                continue
            context = min(i, len(offs) - 1 - j)
            key = (owner[n], a, b)
            if key not in best or context > best[key][0]:
                best[key] = (context, n, i, j - i)
    match = torch.zeros(*batch.input_ids.shape, width, dtype=torch.bool)
    for _, n, i, w in best.values():
        match[n, int(batch.evidence_start[n]) + i, w] = True
    return match


def gold_windows(reader: Reader, questions: Sequence[Question], passages: Sequence[str],
                 stride: int) -> tuple[ReaderBatch, torch.Tensor, int]:
    """The windows of the passages that hold a gold span: (batch, match [N, L, W], how many
    questions have one). With none, one unlabelled window, which contributes zero loss and
    gradient but keeps every rank's forward and backward in step."""
    batch, owner = reader.featurize_windows([q.question for q in questions], list(passages), stride)
    occurrences = [answer_occurrences(p, q.answers) for q, p in zip(questions, passages)]
    match = label_windows(batch, owner, occurrences, reader.cfg.max_span_width)
    keep = match.flatten(1).any(1).nonzero().flatten().tolist()
    return batch.take(keep or [0]), match[keep or [0]], len({owner[n] for n in keep})


def train_reader(cfg: ReaderTrainConfig, out: str | os.PathLike, device: torch.device | None = None,
                 show_progress: bool = True, notify: Callable[[str], None] | None = None,
                 on_metrics: Callable[[dict], None] | None = None) -> ReaderTrainResult:
    """Train (or resume) the run at `out`. Under torchrun every rank reads its `batch_size`
    share of a `batch_size x world` global batch of questions."""
    questions = read_questions(cfg.questions)[: cfg.limit]  # bad files fail before RUN is made
    passages = gold_passages(questions, cfg.questions, cfg.corpus)
    ctx = start_run(out, cfg, device, show_progress, notify)
    env, device = ctx.env, ctx.device
    reader = load_reader(cfg.init, cfg.max_len, cfg.trainable_layers).to(device)
    optimizer = torch.optim.AdamW([p for p in reader.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_linear_decay(cfg.steps, cfg.warmup))
    loop = TrainLoop(ctx, cfg, reader, optimizer, scheduler)
    count = AnswerableCount(**loop.resumed)
    reader.train()
    width = reader.cfg.max_span_width

    def step(i: int):
        idx = rank_batch(i, cfg.batch_size, len(questions), cfg.seed, env)
        batch, match, answerable = gold_windows(reader, [questions[j] for j in idx], [passages[j] for j in idx], cfg.stride)
        batch, match = batch.to(device), match.to(device)
        scores = loop.ddp(batch)  # [N, L, W]
        with full_precision(device):
            valid = valid_spans(batch, width)
            loss, labelled = marginal_nll(scores[:, None], valid[:, None], match[:, None],
                                          torch.zeros(len(match), 1, device=device))
            mine = int(labelled.sum())
            loss, labelled_now = global_mean(loss * mine, mine, env)
            with torch.no_grad():
                s, w, _ = best_spans(scores.detach(), valid)
                hit = match[torch.arange(len(match), device=device), s, w][labelled]
        answerable_now = round(all_mean(answerable, env) * env.world)
        count.add(len(idx) * env.world, answerable_now)
        return loss if labelled_now else None, {
            "loss": loss.item(), "span_accuracy": hit.float().mean().item() if mine else 0.0,
            "answerable": answerable_now / (len(idx) * env.world), "windows": float(len(match))}

    done = loop.run(step, "reader", {"reader": reader}, plots=("loss", "span_accuracy"),
                    checkpoint_extra=lambda: asdict(count), on_metrics=on_metrics)
    return ReaderTrainResult(**asdict(done), questions=len(questions), answerable_share=count.share,
                             reader=str(final_dir(ctx.path, "reader")))
