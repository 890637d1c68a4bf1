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
answerable, windows, lr, seconds_per_step), loss.png, span_accuracy.png, RUN/final/reader.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ralm.data.corpus import read_corpus
from ralm.data.qa import Question, answer_occurrences, read_questions
from ralm.errors import RalmError
from ralm.models.reader import Reader, ReaderBatch, best_spans, marginal_nll, valid_spans
from ralm.progress import progress_bar
from ralm.runtime import autocast, full_precision
from ralm.train.finetune import load_reader
from ralm.train.loop import MetricsLog, check_options, linear_warmup_decay, load_checkpoint, plot_metrics, save_checkpoint
from ralm.train.parallel import all_mean, global_mean, rank_batch, start_run, wrap_ddp


@dataclass
class ReaderTrainConfig:
    questions: str
    corpus: str | None = None  # resolves the questions' "doc_id" (else each carries a "context")
    init: str | None = None  # a reader checkpoint or an HF encoder dir; None: the bundled MiniLM
    steps: int = 5000
    batch_size: int = 32
    lr: float = 1e-4
    warmup: float = 0.1  # share of steps with a linear learning-rate warm-up
    max_len: int = 384
    stride: int = 128  # wordpieces between the starts of a passage's windows
    trainable_layers: int | None = None  # None: every layer trains (reads best)
    limit: int | None = None
    seed: int = 0
    save_every: int = 500
    log_every: int = 10
    dtype: str = "auto"  # compute dtype (runtime.resolve_dtype); weights stay fp32

    def __post_init__(self):
        check_options(self, positive=("steps", "batch_size", "max_len", "stride", "save_every", "log_every", "lr", "limit"),
                      non_negative=("trainable_layers",), shares=("warmup",))


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
            raise RalmError(f"{source}: question {q.id} names its passage by 'doc_id'; give the corpus with --corpus")
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
                 show_progress: bool = True) -> dict:
    """Train (or resume) the run at `out`; returns a summary. Under torchrun every rank reads its
    `batch_size` share of a `batch_size x world` global batch of questions."""
    questions = read_questions(cfg.questions)[: cfg.limit]  # bad files fail before RUN is made
    passages = gold_passages(questions, cfg.questions, cfg.corpus)
    env, device, dtype, show_progress, resume = start_run(out, cfg, device, show_progress)
    reader = load_reader(cfg.init, cfg.max_len, cfg.trainable_layers).to(device)
    optimizer = torch.optim.AdamW([p for p in reader.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_warmup_decay(cfg.steps, cfg.warmup))
    step = seen = answerable_total = 0
    if resume is not None:
        meta = load_checkpoint(resume, reader, optimizer, scheduler)
        step, seen, answerable_total = meta["step"], meta["extra"]["seen"], meta["extra"]["answerable"]
    model = wrap_ddp(reader, env, device)
    log = MetricsLog(out, step) if env.is_main else None
    reader.train()
    width = reader.cfg.max_span_width
    start, first_step = time.perf_counter(), step
    with progress_bar(show_progress) as bar:
        task = bar.add_task("reader training", total=cfg.steps, completed=step)
        while step < cfg.steps:
            idx = rank_batch(step, cfg.batch_size, len(questions), cfg.seed, env)
            batch, match, answerable = gold_windows(reader, [questions[i] for i in idx], [passages[i] for i in idx], cfg.stride)
            batch, match = batch.to(device), match.to(device)
            with autocast(device, dtype):
                scores = model(batch)  # [N, L, W]
            with full_precision(device):
                valid = valid_spans(batch, width)
                loss, labelled = marginal_nll(scores[:, None], valid[:, None], match[:, None],
                                              torch.zeros(len(match), 1, device=device))
                mine = int(labelled.sum())
                loss, labelled_now = global_mean(loss * mine, mine, env)
            optimizer.zero_grad(set_to_none=True)
            if labelled_now:  # else no rank has gradients: the step leaves the weights alone
                loss.backward()
                torch.nn.utils.clip_grad_norm_(reader.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            seen += len(idx) * env.world
            answerable_now = round(all_mean(answerable, env) * env.world)
            answerable_total += answerable_now
            bar.advance(task)
            if step % cfg.log_every == 0 or step == cfg.steps:
                with torch.no_grad():
                    s, w, _ = best_spans(scores.detach(), valid)
                    hit = match[torch.arange(len(match), device=device), s, w][labelled]
                record = {"step": step, "loss": round(all_mean(loss.item(), env), 5),
                          "span_accuracy": round(all_mean(hit.float().mean().item() if mine else 0.0, env), 4),
                          "answerable": round(answerable_now / (len(idx) * env.world), 4),
                          "windows": len(match), "lr": scheduler.get_last_lr()[0],
                          "seconds_per_step": round((time.perf_counter() - start) / max(1, step - first_step), 3)}
                if env.is_main:
                    log.log(record)
            if step % cfg.save_every == 0 or step == cfg.steps:
                if env.is_main:
                    save_checkpoint(out, step, reader, optimizer, scheduler, extra={"seen": seen, "answerable": answerable_total})
                env.barrier()  # no rank runs ahead of (or resumes past) a checkpoint being written
    if env.is_main:
        log.close()
        reader.save_pretrained(Path(out) / "final" / "reader")
        plot_metrics(out, ["loss", "span_accuracy"], smooth=10)
    return {"run": str(out), "steps": step, "questions": len(questions),
            "answerable_share": round(answerable_total / max(seen, 1), 4), "seconds": round(time.perf_counter() - start, 1)}
