"""Training loops for the causal LM (`ralm lm train`) and RETRO (`ralm retro train`).

Both run train.loop's loop (checkpoints, resume, DDP under torchrun, metrics, plots) with AdamW
(no weight decay on biases and norms) and a linear warm-up then cosine decay. The data order
depends only on (seed, step), so a resumed run sees exactly the batches it would have seen.
The model is exported with every checkpoint to RUN/final/model (a directory `load_lm` /
`load_retro` read), as every trainer exports to RUN/final.

Examples are consecutive windows of the training text's token stream: seq_len + 1 tokens for
the LM; for RETRO, max_len + 1 tokens starting on a chunk boundary, with the cached neighbours
of the max_len // m chunks they contain (same-document neighbours excluded). RETRO can start
from a trained LM with only its retrieval parts training (`retrofit`, the paper's Retro-fitting).

RETRO's copy warm-up (`copy_warmup` steps first) trains on windows of the chunk DB's own text,
each chunk given itself (with its continuation) as its first neighbour. Where a small model can
memorise the text faster than it learns to read neighbours that start elsewhere, it never
learns to read them (benchmarks/RESULTS.md, "REALM on a knowledge task", its RETRO runs); leaked
neighbours make reading them the quickest way to the loss, from the first steps.
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, asdict, dataclass

import numpy as np
import torch

from ralm.configs import LIMIT_TOKENS_HELP, TEXT_HELP, ConfigError, option
from ralm.data.chunks import TokenStream, tokenize_text
from ralm.encoders.loading import default_model_path
from ralm.errors import RalmError
from ralm.models.lm import LMConfig, TransformerLM, lm_loss, load_lm
from ralm.models.retro import RetroConfig, RetroLM, neighbour_batch, retrofit
from ralm.runtime import Runtime, seed_everything
from ralm.train.loop import LoopConfig, TrainResult, warmup_cosine
from ralm.train.parallel import main_first, rank_batch
from ralm.train.trainer import Trainer


@dataclass
class OptimConfig(LoopConfig):
    """What both trainers share (flat in config.json, so steps/save_every/log_every may change on resume)."""

    _: KW_ONLY  # after the LM's and RETRO's own fields
    steps: int = option(2000, "training steps")
    batch_size: int = option(16, "sequences per step and rank (under torchrun)")
    lr: float = option(1e-3, "peak learning rate (cosine decay after the warm-up)")
    limit_tokens: int | None = option(None, LIMIT_TOKENS_HELP)
    weight_decay: float = option(0.1, "AdamW weight decay (not on biases and norms)")
    grad_clip: float = option(1.0, "gradient-norm clipping")
    positive_fields = ("grad_clip", "limit_tokens")
    non_negative_fields = ("weight_decay",)
    presets = {"cpu": {"steps": 300, "batch_size": 8, "warmup": 30, "save_every": 100}}


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
    copy_warmup: int = option(0, "first steps on the chunk DB's own text, each chunk's first neighbour itself: the "
                                 "cross-attention learns to copy from neighbours before the decoder memorises the text")
    non_negative_fields = ("copy_warmup",)

    def __post_init__(self):
        super().__post_init__()
        if self.copy_warmup > self.steps:
            raise ConfigError("copy_warmup", f"{self.copy_warmup} is more than the {self.steps} training steps")


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


def _window_batch(tokens: np.ndarray, idx: np.ndarray, seq: int, runtime: Runtime) -> torch.Tensor:
    """Windows `idx` of the token stream: [B, seq + 1] on the runtime's device."""
    return torch.from_numpy(np.stack([tokens[i * seq : i * seq + seq + 1] for i in idx]).astype(np.int64)).to(runtime.device)


@dataclass
class WithTokenizer:
    """An LM's export: its model directory holds the tokenizer too."""

    model: torch.nn.Module
    tokenizer: object

    def save_pretrained(self, out) -> None:
        self.model.save_pretrained(out, self.tokenizer)


class CausalLMTrainer(Trainer):
    """What the LM and RETRO trainers share: AdamW without weight decay on biases and norms,
    warm-up then cosine decay, RUN/final/model. A subclass reads the text (`build`, setting
    `tokens`, `seq`, `examples` and `tokenizer`) and defines `loss(example indices, model to call)`."""

    tokenizer: object
    tokens: np.ndarray  # the training text's token stream
    seq: int  # tokens per example (+1 for the targets)
    examples: int  # windows of the token stream

    def __init__(self, cfg: OptimConfig):
        super().__init__(cfg)
        self.grad_clip = cfg.grad_clip

    def new_model(self, model: torch.nn.Module) -> torch.nn.Module:
        self.model = model.to(self.ctx.device).train()
        return self.model

    def optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        decay = [p for p in self.trainable if p.ndim >= 2]
        rest = [p for p in self.trainable if p.ndim < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": self.cfg.weight_decay},
                                  {"params": rest, "weight_decay": 0.0}], lr=self.cfg.lr, betas=(0.9, 0.95))

    def schedule(self):
        return warmup_cosine(self.cfg.steps, self.cfg.warmup)

    def loss(self, idx: np.ndarray, net: torch.nn.Module) -> torch.Tensor:
        raise NotImplementedError

    def step(self, i: int):
        loss = self.loss(rank_batch(i, self.cfg.batch_size, n=self.examples, seed=self.cfg.seed, env=self.ctx.env), self.loop.ddp)
        return loss, {"loss": loss.item()}

    def log_extra(self, record: dict) -> dict:
        tokens_per_step = self.cfg.batch_size * self.ctx.env.world * self.seq
        return {"tokens_per_s": round(record["steps_per_s"] * tokens_per_step, 1)}

    def exports(self):
        return {"model": WithTokenizer(self.model, self.tokenizer)}

    def result(self, done: TrainResult) -> LMTrainResult:
        return LMTrainResult(**asdict(done), loss=round(self.loop.last.get("loss", math.nan), 4),
                             parameters=sum(p.numel() for p in self.model.parameters()),
                             trainable_parameters=sum(p.numel() for p in self.trainable), examples=self.examples,
                             tokens=len(self.tokens))


class LMTrainer(CausalLMTrainer):
    name, config = "lm", LMTrainConfig

    def build(self) -> TransformerLM:
        from transformers import AutoTokenizer

        cfg = self.cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer or default_model_path(), use_fast=True)
        if self.tokenizer.vocab_size > cfg.model.vocab_size:
            raise RalmError(f"the tokenizer has {self.tokenizer.vocab_size} tokens but the model only {cfg.model.vocab_size}")
        self.tokens = tokenize_text(cfg.text, self.tokenizer, cfg.limit_tokens, self.ctx.show_progress).tokens
        self.seq = cfg.model.max_len
        self.examples = _windows(self.tokens, self.seq, cfg.text)
        seed_everything(cfg.seed)  # the same initial weights whatever reading the data drew
        return self.new_model(TransformerLM(cfg.model))

    def loss(self, idx: np.ndarray, net: torch.nn.Module) -> torch.Tensor:
        x = _window_batch(self.tokens, idx, self.seq, self.ctx.runtime)
        return lm_loss(net(x[:, :-1]), x[:, 1:])


class RetroTrainer(CausalLMTrainer):
    name, config = "retro", RetroTrainConfig

    def build(self) -> RetroLM:
        from ralm.retrieval.lm.chunkdb import ChunkDB, text_neighbours

        config, ctx = self.cfg, self.ctx
        self.db = db = ChunkDB(config.db, runtime=ctx.runtime)  # the run's device and dtype embed and search
        cfg = config.model
        if cfg.chunk_len != db.chunk_len:
            raise RalmError(f"chunk_len {cfg.chunk_len} differs from the DB's chunk length {db.chunk_len}")
        _, self.tokenizer = db.encoder()
        if self.tokenizer.vocab_size > cfg.vocab_size:
            raise RalmError(f"the DB's tokenizer has {self.tokenizer.vocab_size} tokens but the model only {cfg.vocab_size}")
        stream: TokenStream = tokenize_text(config.text, self.tokenizer, config.limit_tokens, ctx.show_progress)
        with main_first(ctx.env):  # rank 0 caches the neighbours in the DB, the others read them
            self.neighbours = text_neighbours(db, stream, k=cfg.neighbours, exclude_same_doc=config.exclude_same_document,
                                              show_progress=ctx.show_progress)
        self.tokens, self.seq, self.chunks = stream.tokens, cfg.max_len, cfg.max_len // cfg.chunk_len
        self.examples = _windows(self.tokens, self.seq, config.text)
        if config.copy_warmup:
            self.copy_examples = _windows(db.tokens, self.seq, f"{config.db} (the copy warm-up's text)")
        seed_everything(config.seed)  # the same initial weights whatever reading the data drew
        model = RetroLM(cfg)
        if config.retrofit:
            lm, lm_tokenizer = load_lm(config.retrofit)
            if not isinstance(lm, TransformerLM):
                raise RalmError(f"{config.retrofit}: retrofit needs a model from `ralm lm train`")
            if lm_tokenizer.get_vocab() != self.tokenizer.get_vocab():
                raise RalmError(f"{config.retrofit}: the LM's tokenizer differs from the chunk DB's; neighbours would be other "
                                "tokens to it")
            retrofit(model, lm)
        return self.new_model(model)

    def step(self, i: int):
        if i >= self.cfg.copy_warmup:
            return super().step(i)
        idx = rank_batch(i, self.cfg.batch_size, n=self.copy_examples, seed=self.cfg.seed, env=self.ctx.env)
        loss = self._loss(self.db.tokens, idx, self._copy_neighbours(idx), self.loop.ddp)
        return loss, {"loss": loss.item()}

    def _copy_neighbours(self, idx: np.ndarray) -> np.ndarray:
        """Neighbours [B, n, k] of the DB's own windows `idx`: each chunk itself, then its nearest
        other chunks (the DB's windows start on its chunk boundaries: window i holds chunks
        i*n ... i*n + n - 1)."""
        k = self.cfg.model.neighbours
        ids = (idx[:, None] * self.chunks + np.arange(self.chunks)).reshape(-1)  # [B*n]
        found = self.db.search(np.asarray(self.db.embeddings[ids]), k + 1)  # [B*n, k+1]
        rows = [[own, *[c for c in row if c not in (own, -1)]][:k] for own, row in zip(ids, found)]
        return np.array([row + [-1] * (k - len(row)) for row in rows]).reshape(len(idx), self.chunks, k)  # -1: none

    def loss(self, idx: np.ndarray, net: torch.nn.Module) -> torch.Tensor:
        return self._loss(self.tokens, idx, np.stack([self.neighbours[i * self.chunks : (i + 1) * self.chunks] for i in idx]), net)

    def _loss(self, tokens: np.ndarray, idx: np.ndarray, neighbours: np.ndarray, net: torch.nn.Module) -> torch.Tensor:
        x = _window_batch(tokens, idx, self.seq, self.ctx.runtime)
        nb, mask = neighbour_batch(self.db, neighbours, pad_id=self.tokenizer.pad_token_id or 0, runtime=self.ctx.runtime)
        return lm_loss(net(x[:, :-1], nb, mask), x[:, 1:])

    def result(self, done: TrainResult) -> RetroTrainResult:
        return RetroTrainResult(**asdict(super().result(done)), db_chunks=len(self.db))


train_lm = LMTrainer.fit
train_retro = RetroTrainer.fit
