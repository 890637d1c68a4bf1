"""Inverse Cloze Task (ICT) warm start of both retriever towers (Lee et al., 2019).

A pseudo-query is one sentence of a block; its positive is the block with that sentence
removed (kept in 10% of examples, so the towers also learn word overlap); the other blocks of
the batch are the negatives. The run exports RUN/final/retriever, which `ralm pretrain
--init RUN` starts from.

Shapes: B batch, D retrieval dim.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Callable, ClassVar

import numpy as np
import torch

from ralm.configs import CORPUS_HELP, SAVE_EVERY_HELP, WARMUP_HELP, ConfigError, option
from ralm.data.blocks import BlockStore
from ralm.data.masking import SentenceTable, corpus_sentences
from ralm.errors import RalmError
from ralm.retrieval.towers.encoders import Retriever
from ralm.retrieval.towers.encoding import pad_rows
from ralm.retrieval.towers.projection import init_projection
from ralm.retrieval.index.store import IndexDir
from ralm.rundir import final_dir
from ralm.train.loop import RunOptions, TrainLoop, TrainResult, check_options, warmup_constant
from ralm.train.parallel import in_batch_contrastive, main_first, rank_batch, rank_slice, start_run


@dataclass
class IctConfig(RunOptions):
    corpus: str = option(help=CORPUS_HELP, path="content")
    model: str = option("default", "retriever checkpoint or HF BERT directory both towers start from", shown="bundled MiniLM",
                        path="location")
    dim: int = option(128, "retrieval dimension of a fresh projection")
    steps: int = option(1000, "training steps")
    batch_size: int = option(32, "queries per step and rank; the other blocks of all ranks' batches are the negatives")
    lr: float = option(1e-4, "learning rate")
    warmup: int = option(100, WARMUP_HELP)
    keep_sentence: float = option(0.1, "share of positives that keep the pseudo-query sentence (so the towers also learn word overlap)")
    max_query_len: int = option(64, "wordpieces per pseudo-query")
    block_len: int = option(288, "wordpieces per evidence block ([CLS] title [SEP] body [SEP])")
    save_every: int = option(200, SAVE_EVERY_HELP)
    presets: ClassVar[dict[str, dict]] = {"cpu": {"steps": 200, "batch_size": 16, "warmup": 20, "save_every": 50}}

    def __post_init__(self):
        check_options(self, positive=("max_query_len", "dim", "block_len"), fractions=("keep_sentence",))
        if self.batch_size < 2:
            raise ConfigError("batch_size", "must be at least 2 for ICT (the other blocks of a batch are the negatives)")


@dataclass
class IctResult(TrainResult):
    examples: int  # sentences of multi-sentence blocks
    retriever: str  # RUN/final/retriever


def ict_pair(blocks: BlockStore, table: SentenceTable, s: int, keep: bool, cls_id: int, sep_id: int,
             max_query_len: int) -> tuple[list[int], list[int]]:
    """(query `[CLS] sentence [SEP]`, context `[CLS] title [SEP] body-without-sentence [SEP]`)."""
    row = int(table.rows[s])
    tokens = blocks.tokens[row]
    a = int(blocks.body_start[row]) + int(table.starts[s])
    b = int(blocks.body_start[row]) + int(table.ends[s])
    query = [cls_id, *tokens[a:b][: max_query_len - 2].tolist(), sep_id]
    context = tokens.tolist() if keep else [*tokens[:a].tolist(), *tokens[b:].tolist()]
    return query, context


def train_ict(cfg: IctConfig, run: str | os.PathLike, device: torch.device | None = None, show_progress: bool = True,
              notify: Callable[[str], None] | None = None, on_metrics: Callable[[dict], None] | None = None) -> IctResult:
    """Train (or resume) the run at `run`. Under torchrun every rank trains on its
    `batch_size` share of a `batch_size x world` global batch; rank 0 writes the run."""
    ctx = start_run(run, cfg, device, show_progress, notify)
    run, env, device, show_progress = ctx.path, ctx.env, ctx.device, ctx.show_progress
    with main_first(env):
        retriever = Retriever.from_pretrained(cfg.model, dim=cfg.dim)
        index = IndexDir.create(run / "index", "dense")
        _, blocks, table = corpus_sentences(index.blocks_dir, index.sentences_dir, cfg.corpus, hf_tokenizer=retriever.tokenizer,
                                            block_len=cfg.block_len, show_progress=show_progress)
    # A block needs a second sentence, or its context would be empty without the query.
    per_block = np.bincount(np.asarray(table.rows), minlength=len(blocks))
    examples = np.flatnonzero(per_block[np.asarray(table.rows)] >= 2)
    if len(examples) < cfg.batch_size * env.world:
        raise RalmError(f"{cfg.corpus}: only {len(examples)} ICT examples (sentences of multi-sentence blocks); "
                        f"need at least batch_size x ranks = {cfg.batch_size * env.world}")
    retriever.to(device)
    if env.is_main and not retriever.cfg.projection_ready and ctx.resume is None:
        init_projection(retriever, blocks, device=device, sample=1024, show_progress=show_progress, dtype=ctx.dtype)
    retriever.cfg.projection_ready = True
    retriever.train()
    opt = torch.optim.AdamW(retriever.parameters(), lr=cfg.lr, weight_decay=0.01)
    loop = TrainLoop(ctx, cfg, retriever, opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup_constant(cfg.warmup)))
    tok = retriever.tokenizer
    pad = tok.pad_token_id or 0

    def step(i: int):
        idx = examples[rank_batch(i, cfg.batch_size, len(examples), cfg.seed, env)]
        # drawn for the global batch, so the positives do not depend on the number of ranks
        keep = np.random.default_rng([cfg.seed, i]).random(cfg.batch_size * env.world) < cfg.keep_sentence
        pairs = [ict_pair(blocks, table, int(s), bool(k), tok.cls_token_id, tok.sep_token_id, cfg.max_query_len)
                 for s, k in zip(idx, keep[rank_slice(cfg.batch_size, env)])]
        q_ids, q_mask = pad_rows([q for q, _ in pairs], pad)  # [B, Lq]
        c_ids, c_mask = pad_rows([c for _, c in pairs], pad)  # [B, Lc]
        q, c = loop.ddp(q_ids.to(device), q_mask.to(device), c_ids.to(device), c_mask.to(device))  # [B, D] each
        loss, acc = in_batch_contrastive(q, c, env)  # every rank's contexts are negatives
        return loss, {"loss": loss.item(), "in_batch_accuracy": acc.item()}

    done = loop.run(step, "ict", {"retriever": retriever}, plots=("loss", "in_batch_accuracy", "steps_per_s"),
                    checkpoint_extra=lambda: {"retriever": asdict(retriever.cfg)}, on_metrics=on_metrics)
    return IctResult(**asdict(done), examples=int(len(examples)), retriever=str(final_dir(run, "retriever")))
