"""Inverse Cloze Task (ICT) warm start of both retriever towers (Lee et al., 2019).

A pseudo-query is one sentence of a block; its positive is the block with that sentence
removed (kept in 10% of examples, so the towers also learn word overlap); the other blocks of
the batch are the negatives. The run exports RUN/final/retriever, which `ralm pretrain
--init RUN` starts from.

Shapes: B batch, D retrieval dim.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, asdict, dataclass

import numpy as np

from ralm.configs import CORPUS_HELP, ConfigError, option
from ralm.data.blocks import BlockStore
from ralm.data.geometry import GEOMETRY
from ralm.data.masking import SentenceTable, corpus_sentences
from ralm.data.padding import pad_rows
from ralm.errors import RalmError
from ralm.retrieval.towers.encoders import Retriever
from ralm.retrieval.index.dense_side import dense_index
from ralm.rundir import final_dir
from ralm.train.loop import LoopConfig, TrainResult
from ralm.train.parallel import in_batch_contrastive, main_first, rank_batch, rank_slice
from ralm.train.trainer import Trainer, start_projection


@dataclass
class IctConfig(LoopConfig):
    corpus: str = option(help=CORPUS_HELP, path="content")
    model: str = option("default", "retriever checkpoint or HF BERT directory both towers start from", shown="bundled MiniLM",
                        path="location")
    dim: int = option(GEOMETRY.dim, "retrieval dimension of a fresh projection")
    keep_sentence: float = option(0.1, "share of positives that keep the pseudo-query sentence (so the towers also learn word overlap)")
    max_query_len: int = option(GEOMETRY.query_len, "wordpieces per pseudo-query")
    block_len: int = option(GEOMETRY.block_len, "wordpieces per evidence block ([CLS] title [SEP] body [SEP])")
    _: KW_ONLY
    batch_size: int = option(32, "queries per step and rank; the other blocks of all ranks' batches are the negatives")
    positive_fields = ("max_query_len", "dim", "block_len")
    fraction_fields = ("keep_sentence",)
    presets = {"cpu": {"steps": 200, "batch_size": 16, "warmup": 20, "save_every": 50}}

    def __post_init__(self):
        super().__post_init__()
        if self.batch_size < 2:
            raise ConfigError("batch_size", "must be at least 2 for ICT (the other blocks of a batch are the negatives)")


@dataclass
class IctResult(TrainResult):
    examples: int  # sentences of multi-sentence blocks
    retriever: str  # RUN/final/retriever


def ict_pair(blocks: BlockStore, table: SentenceTable, s: int, *, keep: bool, cls_id: int, sep_id: int,
             max_query_len: int) -> tuple[list[int], list[int]]:
    """(query `[CLS] sentence [SEP]`, context `[CLS] title [SEP] body-without-sentence [SEP]`)."""
    row = int(table.rows[s])
    tokens = blocks.tokens[row]
    a = int(blocks.body_start[row]) + int(table.starts[s])
    b = int(blocks.body_start[row]) + int(table.ends[s])
    query = [cls_id, *tokens[a:b][: max_query_len - 2].tolist(), sep_id]
    context = tokens.tolist() if keep else [*tokens[:a].tolist(), *tokens[b:].tolist()]
    return query, context


class IctTrainer(Trainer):
    name, config = "ict", IctConfig
    plots = ("loss", "in_batch_accuracy", "steps_per_s")

    def build(self) -> Retriever:
        cfg, ctx = self.cfg, self.ctx
        with main_first(ctx.env):
            self.retriever = Retriever.from_pretrained(cfg.model, dim=cfg.dim)
            index = dense_index(ctx.path / "index")
            _, self.blocks, self.table = corpus_sentences(index.blocks_dir, index.sentences_dir, cfg.corpus,
                                                          hf_tokenizer=self.retriever.tokenizer, block_len=cfg.block_len,
                                                          show_progress=ctx.show_progress)
        # A block needs a second sentence, or its context would be empty without the query.
        per_block = np.bincount(np.asarray(self.table.rows), minlength=len(self.blocks))
        self.examples = np.flatnonzero(per_block[np.asarray(self.table.rows)] >= 2)
        if len(self.examples) < cfg.batch_size * ctx.env.world:
            raise RalmError(f"{cfg.corpus}: only {len(self.examples)} ICT examples (sentences of multi-sentence blocks); "
                            f"need at least batch_size x ranks = {cfg.batch_size * ctx.env.world}")
        self.retriever.to(ctx.device)
        start_projection(ctx, self.retriever, self.blocks, sample=1024)
        return self.retriever.train()

    def step(self, i: int):
        cfg, env, device, tok = self.cfg, self.ctx.env, self.ctx.device, self.retriever.tokenizer
        idx = self.examples[rank_batch(i, cfg.batch_size, n=len(self.examples), seed=cfg.seed, env=env)]
        # drawn for the global batch, so the positives do not depend on the number of ranks
        keep = np.random.default_rng([cfg.seed, i]).random(cfg.batch_size * env.world) < cfg.keep_sentence
        pairs = [ict_pair(self.blocks, self.table, int(s), keep=bool(k), cls_id=tok.cls_token_id, sep_id=tok.sep_token_id,
                          max_query_len=cfg.max_query_len)
                 for s, k in zip(idx, keep[rank_slice(cfg.batch_size, env)])]
        q_ids, q_mask = pad_rows([q for q, _ in pairs], tok.pad_token_id or 0)  # [B, Lq]
        c_ids, c_mask = pad_rows([c for _, c in pairs], tok.pad_token_id or 0)  # [B, Lc]
        q, c = self.loop.ddp(q_ids.to(device), q_mask.to(device), c_ids.to(device), c_mask.to(device))  # [B, D] each
        loss, acc = in_batch_contrastive(q, c, env)  # every rank's contexts are negatives
        return loss, {"loss": loss.item(), "in_batch_accuracy": acc.item()}

    def exports(self):
        return {"retriever": self.retriever}

    def checkpoint_extra(self) -> dict:
        return {"retriever": asdict(self.retriever.cfg)}

    def result(self, done: TrainResult) -> IctResult:
        return IctResult(**asdict(done), examples=int(len(self.examples)),
                         retriever=str(final_dir(self.ctx.path, "retriever")))


train_ict = IctTrainer.fit
