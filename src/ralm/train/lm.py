"""Training loops for the causal LM (`ralm lm train`) and RETRO (`ralm retro train`).

Both share one loop: AdamW, linear warm-up then cosine decay, gradient clipping, bf16
autocast on CUDA, checkpoints / resume / metrics / plots through train/loop.py. The data order
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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ralm.data.chunks import TokenStream, tokenize_text
from ralm.errors import RalmError
from ralm.models.lm import LMConfig, TransformerLM, lm_loss, load_lm
from ralm.models.retro import RetroConfig, RetroLM, neighbour_batch, retrofit
from ralm.progress import progress_bar
from ralm.retrieval.loading import default_model_path
from ralm.runtime import autocast, resolve_dtype, seed_everything
from ralm.train.loop import MetricsLog, batch_indices, check_options, load_checkpoint, plot_metrics, prepare_run, save_checkpoint


@dataclass
class OptimConfig:
    """What both trainers share; flat in config.json, so steps/save_every/log_every may change on resume."""

    steps: int = 2000
    batch_size: int = 16
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    save_every: int = 200
    dtype: str = "auto"  # compute dtype (runtime.resolve_dtype); weights stay fp32

    def __post_init__(self):
        check_options(self, positive=("steps", "batch_size", "log_every", "save_every", "lr", "grad_clip"),
                      non_negative=("warmup", "weight_decay"))


@dataclass
class LMTrainConfig(OptimConfig):
    text: str = ""
    model: LMConfig = field(default_factory=LMConfig)
    tokenizer: str = ""  # HF tokenizer directory; "" = the bundled MiniLM wordpiece vocabulary
    limit_tokens: int | None = None  # train on a prefix of the text


@dataclass
class RetroTrainConfig(OptimConfig):
    text: str = ""
    db: str = ""
    model: RetroConfig = field(default_factory=RetroConfig)
    exclude_same_document: bool = True
    limit_tokens: int | None = None
    retrofit: str = ""  # a `ralm lm train` model: frozen decoder, only CCA + neighbour encoder train


def _schedule(optim: OptimConfig) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < optim.warmup:
            return (step + 1) / optim.warmup
        progress = min(1.0, (step - optim.warmup) / max(1, optim.steps - optim.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def fit(run: str | os.PathLike, config, model: torch.nn.Module, loss_of_batch: Callable[[np.ndarray], torch.Tensor],
        n_examples: int, tokens_per_example: int, device: torch.device, tokenizer, show_progress: bool = True,
        on_metrics: Callable[[dict], None] | None = None) -> dict:
    """The shared loop: returns {"steps", "loss", "seconds", "parameters"} and exports RUN/model."""
    run, optim = Path(run), config  # the OptimConfig fields of either trainer config
    resume = prepare_run(run, config)
    dtype = resolve_dtype(config.dtype, device)
    model.to(device).train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.ndim >= 2]
    rest = [p for p in trainable if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": optim.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=optim.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(optim))
    step = load_checkpoint(resume, model, opt, sched)["step"] if resume else 0
    log = MetricsLog(run, step)
    start, last = time.perf_counter(), float("nan")
    try:
        with progress_bar(show_progress) as bar:
            task = bar.add_task("training", total=optim.steps, completed=step)
            while step < optim.steps:
                t0 = time.perf_counter()
                idx = batch_indices(step, optim.batch_size, n_examples, optim.seed)
                with autocast(device, dtype):
                    loss = loss_of_batch(idx)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(trainable, optim.grad_clip)
                opt.step()
                sched.step()
                step += 1
                last = loss.item()
                if step % optim.log_every == 0 or step == optim.steps:
                    dt = time.perf_counter() - t0
                    record = {"step": step, "loss": round(last, 5), "lr": sched.get_last_lr()[0], "grad_norm": round(float(grad_norm), 4),
                              "tokens_per_s": round(optim.batch_size * tokens_per_example / dt, 1)}
                    log.log(record)
                    if on_metrics:
                        on_metrics(record)
                if step % optim.save_every == 0 or step == optim.steps:
                    save_checkpoint(run, step, model, opt, sched)
                bar.advance(task)
    finally:
        log.close()
    plot_metrics(run, ["loss"], smooth=min(10, max(1, optim.steps // optim.log_every // 10)))  # ~10 points per mean
    model.eval().save_pretrained(run / "model", tokenizer)
    return {"run": str(run), "steps": step, "loss": round(last, 4), "seconds": round(time.perf_counter() - start, 1),
            "parameters": sum(p.numel() for p in model.parameters()), "trainable_parameters": sum(p.numel() for p in trainable)}


def train_lm(config: LMTrainConfig, run: str | os.PathLike, device: torch.device | None = None,
             show_progress: bool = True, on_metrics: Callable[[dict], None] | None = None) -> dict:
    from transformers import AutoTokenizer

    device = device or torch.device("cpu")
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or default_model_path(), use_fast=True)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise RalmError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {config.model.vocab_size}")
    stream = tokenize_text(config.text, tokenizer, config.limit_tokens, show_progress)
    seq = config.model.max_len
    n = (len(stream.tokens) - 1) // seq
    if n <= 0:
        raise RalmError(f"{config.text}: {len(stream.tokens)} tokens is fewer than one sequence of {seq + 1}")
    seed_everything(config.seed)
    model = TransformerLM(config.model)
    tokens = stream.tokens

    def loss_of_batch(idx: np.ndarray) -> torch.Tensor:
        x = torch.from_numpy(np.stack([tokens[i * seq : i * seq + seq + 1] for i in idx]).astype(np.int64)).to(device)
        return lm_loss(model(x[:, :-1]), x[:, 1:])

    return {**fit(run, config, model, loss_of_batch, n, seq, device, tokenizer, show_progress, on_metrics), "examples": n,
            "tokens": int(len(tokens))}


def train_retro(config: RetroTrainConfig, run: str | os.PathLike, device: torch.device | None = None,
                show_progress: bool = True, on_metrics: Callable[[dict], None] | None = None) -> dict:
    from ralm.retrieval.chunkdb import ChunkDB, text_neighbours

    device = device or torch.device("cpu")
    db = ChunkDB(config.db, device)
    cfg = config.model
    if cfg.chunk_len != db.chunk_len:
        raise RalmError(f"--chunk-len {cfg.chunk_len} differs from the DB's chunk length {db.chunk_len}")
    _, tokenizer = db.encoder()
    if tokenizer.vocab_size > cfg.vocab_size:
        raise RalmError(f"the DB's tokenizer has {tokenizer.vocab_size} tokens but the model only {cfg.vocab_size}")
    stream: TokenStream = tokenize_text(config.text, tokenizer, config.limit_tokens, show_progress)
    neighbours = text_neighbours(db, stream, cfg.neighbours, config.exclude_same_document, show_progress=show_progress)
    seq, chunks = cfg.max_len, cfg.max_len // cfg.chunk_len
    n = (len(stream.tokens) - 1) // seq
    if n <= 0:
        raise RalmError(f"{config.text}: {len(stream.tokens)} tokens is fewer than one sequence of {seq + 1}")
    seed_everything(config.seed)
    model = RetroLM(cfg)
    if config.retrofit:
        lm, lm_tokenizer = load_lm(config.retrofit)
        if not isinstance(lm, TransformerLM):
            raise RalmError(f"{config.retrofit}: --retrofit needs a model from `ralm lm train`")
        if lm_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise RalmError(f"{config.retrofit}: the LM's tokenizer differs from the chunk DB's; neighbours would be other tokens to it")
        retrofit(model, lm)
    tokens, pad = stream.tokens, tokenizer.pad_token_id or 0

    def loss_of_batch(idx: np.ndarray) -> torch.Tensor:
        x = torch.from_numpy(np.stack([tokens[i * seq : i * seq + seq + 1] for i in idx]).astype(np.int64)).to(device)
        nb, mask = neighbour_batch(db, np.stack([neighbours[i * chunks : (i + 1) * chunks] for i in idx]), device, pad)
        return lm_loss(model(x[:, :-1], nb, mask), x[:, 1:])

    return {**fit(run, config, model, loss_of_batch, n, seq, device, tokenizer, show_progress, on_metrics), "examples": n,
            "tokens": int(len(tokens)), "db_chunks": len(db)}
