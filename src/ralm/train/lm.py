"""Training loops for the causal LM (`ralm lm train`) and RETRO (`ralm retro train`).

Both run train.loop's loop (checkpoints, resume, DDP under torchrun, metrics, plots) with AdamW
(no weight decay on biases and norms) and a linear warm-up then cosine decay. The data order
depends only on (seed, step), so a resumed run sees exactly the batches it would have seen.
At the end the model is exported to RUN/model (a directory `load_lm` / `load_retro` read).

Examples are consecutive windows of the training text's token stream: seq_len + 1 tokens for
the LM; for RETRO, max_len + 1 tokens starting on a chunk boundary, with the cached neighbours
of the max_len // m chunks they contain (same-document neighbours excluded). RETRO can start
from a trained LM with only its retrieval parts training (`retrofit`, the paper's Retro-fitting).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Callable, ClassVar

import numpy as np
import torch

from ralm.configs import LIMIT_TOKENS_HELP, SAVE_EVERY_HELP, TEXT_HELP, WARMUP_HELP, option
from ralm.data.chunks import TokenStream, tokenize_text
from ralm.errors import RalmError
from ralm.models.lm import LMConfig, TransformerLM, lm_loss, load_lm
from ralm.models.retro import RetroConfig, RetroLM, neighbour_batch, retrofit
from ralm.retrieval.towers.loading import default_model_path
from ralm.runtime import seed_everything
from ralm.train.loop import RunOptions, TrainLoop, TrainResult, check_options, warmup_cosine
from ralm.train.parallel import RunContext, main_first, rank_batch, start_run


@dataclass
class OptimConfig(RunOptions):
    """What both trainers share (flat in config.json, so steps/save_every/log_every may change on resume)."""

    steps: int = option(2000, "training steps")
    batch_size: int = option(16, "sequences per step and rank (under torchrun)")
    limit_tokens: int | None = option(None, LIMIT_TOKENS_HELP)
    lr: float = option(1e-3, "peak learning rate (cosine decay after the warm-up)")
    warmup: int = option(100, WARMUP_HELP)
    weight_decay: float = option(0.1, "AdamW weight decay (not on biases and norms)")
    grad_clip: float = option(1.0, "gradient-norm clipping")
    save_every: int = option(200, SAVE_EVERY_HELP)
    presets: ClassVar[dict[str, dict]] = {"cpu": {"steps": 300, "batch_size": 8, "warmup": 30, "save_every": 100}}

    def __post_init__(self):
        check_options(self, positive=("grad_clip", "limit_tokens"), non_negative=("weight_decay",))


@dataclass
class LMTrainConfig(OptimConfig):
    text: str = option("", TEXT_HELP, path="content", required=True)
    model: LMConfig = option(default_factory=LMConfig)
    tokenizer: str = option("", "HF tokenizer directory", shown="the bundled MiniLM wordpieces, 30522", path="location")


@dataclass
class RetroTrainConfig(OptimConfig):
    text: str = option("", TEXT_HELP, path="content", required=True)
    db: str = option("", "chunk DB from `ralm retro build-db`", path="location", required=True)
    model: RetroConfig = option(default_factory=RetroConfig)
    exclude_same_document: bool = option(True, "drop neighbours from the training chunk's own article",
                                         flag="--exclude-same-doc/--keep-same-doc")
    retrofit: str = option("", "start from a `ralm lm train` model and train only the CCA layers and neighbour encoder "
                               "(its decoder stays frozen; dim, layers, heads and mlp_ratio come from it unless given)",
                         path="location")


@dataclass
class LMTrainResult(TrainResult):
    loss: float  # the last logged training loss
    parameters: int
    trainable_parameters: int
    examples: int  # training windows
    tokens: int  # in the training text


@dataclass
class RetroTrainResult(LMTrainResult):
    db_chunks: int


def _windows(tokens: np.ndarray, seq: int, text: str) -> int:
    """How many training examples (consecutive windows of seq + 1 tokens) a token stream holds."""
    n = (len(tokens) - 1) // seq
    if n <= 0:
        raise RalmError(f"{text}: {len(tokens)} tokens is fewer than one sequence of {seq + 1}")
    return n


def _window_batch(tokens: np.ndarray, idx: np.ndarray, seq: int, device: torch.device) -> torch.Tensor:
    """Windows `idx` of the token stream: [B, seq + 1]."""
    return torch.from_numpy(np.stack([tokens[i * seq : i * seq + seq + 1] for i in idx]).astype(np.int64)).to(device)


def _fit(ctx: RunContext, config: OptimConfig, model: torch.nn.Module,
         loss_of_batch: Callable[[np.ndarray, torch.nn.Module], torch.Tensor], tokenizer, kind: str,
         on_metrics: Callable[[dict], None] | None, *, examples: int, seq: int, tokens: int) -> LMTrainResult:
    """Train `model` on `loss_of_batch(example indices, the model to call)`; exports RUN/model."""
    model.to(ctx.device).train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.ndim >= 2]
    rest = [p for p in trainable if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=config.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(config.steps, config.warmup))
    loop = TrainLoop(ctx, config, model, opt, sched, grad_clip=config.grad_clip)

    def step(i: int):
        loss = loss_of_batch(rank_batch(i, config.batch_size, examples, config.seed, ctx.env), loop.ddp)
        return loss, {"loss": loss.item()}

    tokens_per_step = config.batch_size * ctx.env.world * seq
    done = loop.run(step, kind, log_extra=lambda r: {"tokens_per_s": round(r["steps_per_s"] * tokens_per_step, 1)},
                    on_metrics=on_metrics)
    if ctx.env.is_main:
        model.eval().save_pretrained(ctx.path / "model", tokenizer)
    return LMTrainResult(**asdict(done), loss=round(loop.last.get("loss", math.nan), 4),
                         parameters=sum(p.numel() for p in model.parameters()),
                         trainable_parameters=sum(p.numel() for p in trainable), examples=examples, tokens=tokens)


def train_lm(config: LMTrainConfig, run: str | os.PathLike, device: torch.device | None = None, show_progress: bool = True,
             notify: Callable[[str], None] | None = None, on_metrics: Callable[[dict], None] | None = None) -> LMTrainResult:
    from transformers import AutoTokenizer

    ctx = start_run(run, config, device, show_progress, notify)
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or default_model_path(), use_fast=True)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise RalmError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {config.model.vocab_size}")
    tokens = tokenize_text(config.text, tokenizer, config.limit_tokens, ctx.show_progress).tokens
    seq = config.model.max_len
    n = _windows(tokens, seq, config.text)
    seed_everything(config.seed)  # the same initial weights whatever reading the data drew
    model = TransformerLM(config.model)

    def loss_of_batch(idx: np.ndarray, net: torch.nn.Module) -> torch.Tensor:
        x = _window_batch(tokens, idx, seq, ctx.device)
        return lm_loss(net(x[:, :-1]), x[:, 1:])

    return _fit(ctx, config, model, loss_of_batch, tokenizer, "lm", on_metrics, examples=n, seq=seq, tokens=len(tokens))


def train_retro(config: RetroTrainConfig, run: str | os.PathLike, device: torch.device | None = None,
                show_progress: bool = True, notify: Callable[[str], None] | None = None,
                on_metrics: Callable[[dict], None] | None = None) -> RetroTrainResult:
    from ralm.retrieval.lm.chunkdb import ChunkDB, text_neighbours

    ctx = start_run(run, config, device, show_progress, notify)
    db = ChunkDB(config.db, ctx.device)
    cfg = config.model
    if cfg.chunk_len != db.chunk_len:
        raise RalmError(f"chunk_len {cfg.chunk_len} differs from the DB's chunk length {db.chunk_len}")
    _, tokenizer = db.encoder()
    if tokenizer.vocab_size > cfg.vocab_size:
        raise RalmError(f"the DB's tokenizer has {tokenizer.vocab_size} tokens but the model only {cfg.vocab_size}")
    stream: TokenStream = tokenize_text(config.text, tokenizer, config.limit_tokens, ctx.show_progress)
    with main_first(ctx.env):  # rank 0 caches the neighbours in the DB, the others read them
        neighbours = text_neighbours(db, stream, k=cfg.neighbours, exclude_same_doc=config.exclude_same_document,
                                     show_progress=ctx.show_progress)
    seq, chunks = cfg.max_len, cfg.max_len // cfg.chunk_len
    n = _windows(stream.tokens, seq, config.text)
    seed_everything(config.seed)  # the same initial weights whatever reading the data drew
    model = RetroLM(cfg)
    if config.retrofit:
        lm, lm_tokenizer = load_lm(config.retrofit)
        if not isinstance(lm, TransformerLM):
            raise RalmError(f"{config.retrofit}: retrofit needs a model from `ralm lm train`")
        if lm_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise RalmError(f"{config.retrofit}: the LM's tokenizer differs from the chunk DB's; neighbours would be other tokens to it")
        retrofit(model, lm)
    tokens, pad = stream.tokens, tokenizer.pad_token_id or 0

    def loss_of_batch(idx: np.ndarray, net: torch.nn.Module) -> torch.Tensor:
        x = _window_batch(tokens, idx, seq, ctx.device)
        nb, mask = neighbour_batch(db, np.stack([neighbours[i * chunks : (i + 1) * chunks] for i in idx]), ctx.device, pad)
        return lm_loss(net(x[:, :-1], nb, mask), x[:, 1:])

    done = _fit(ctx, config, model, loss_of_batch, tokenizer, "retro", on_metrics, examples=n, seq=seq, tokens=len(tokens))
    return RetroTrainResult(**asdict(done), db_chunks=len(db))
