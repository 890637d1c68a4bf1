"""DPR (Karpukhin et al. 2020): both towers trained contrastively from question/answer pairs.

Supervision is distant, as DPR does for datasets without gold passages: a question's
positive is the highest-ranked BM25 block that contains an answer string, its hard negatives
the highest-ranked BM25 blocks that do not. Each question is scored against every positive
and hard negative of the batch (in-batch negatives):
    loss = CE(q · [p_1..p_B, n_1..n_{B*h}]ᵀ, target = own positive).

A run: RUN/bm25/ (the BM25 index mined from; its block store is reused), RUN/mined.npz
(question ordinals, positive rows, negative rows), RUN/checkpoints/, RUN/metrics.jsonl and
RUN/final/retriever, ready for `ralm index build --model RUN/final/retriever`.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ralm.atomic import atomic_path
from ralm.configs import CORPUS_HELP, LIMIT_HELP, QUESTIONS_HELP, WARMUP_HELP, option
from ralm.data.blocks import BlockStore
from ralm.data.geometry import GEOMETRY
from ralm.data.padding import pad_rows
from ralm.data.qa import Question, has_answer
from ralm.errors import RalmError
from ralm.progress import progress_bar
from ralm.retrieval.index.build import build_index
from ralm.retrieval.towers.encoders import Retriever
from ralm.retrieval.search.searcher import Searcher
from ralm.rundir import final_dir
from ralm.train.loop import LoopConfig, TrainResult, warmup_linear_decay
from ralm.train.parallel import in_batch_contrastive, main_first, rank_batch
from ralm.train.trainer import QuestionTrainer, start_projection


@dataclass
class DPRConfig(LoopConfig):
    questions: str = option(help=QUESTIONS_HELP, path="content")
    corpus: str = option(help="the evidence corpus (positives and negatives are mined from it with BM25): " + CORPUS_HELP,
                         path="content")
    model: str | None = option(None, "initial encoder: HF directory or retriever checkpoint", shown="bundled MiniLM", path="location")
    dim: int | None = option(GEOMETRY.dim, "retrieval dimension of a fresh projection (0 or None: the encoder's own vectors)")
    hard_negatives: int = option(1, "BM25 hard negatives per question")
    bm25_depth: int = option(50, "BM25 depth searched for positives and negatives")
    limit: int | None = option(None, LIMIT_HELP)
    _: KW_ONLY
    batch_size: int = option(16, "questions per step and rank (in-batch negatives from all ranks)")
    lr: float = option(2e-5, "learning rate")
    warmup: int = option(100, WARMUP_HELP + " (then linear decay to 0)")
    positive_fields = ("bm25_depth", "limit", "dim")
    non_negative_fields = ("hard_negatives",)
    presets = {"cpu": {"steps": 200, "batch_size": 8, "warmup": 20, "save_every": 50}}

    def __post_init__(self):
        self.dim = self.dim or None  # 0 asks for no projection, as an index build does
        super().__post_init__()


@dataclass
class DPRResult(TrainResult):
    questions: int
    trainable_questions: int  # with a BM25 positive and enough negatives
    retriever: str  # RUN/final/retriever


def mine(searcher: Searcher, questions: list[Question], *, depth: int, negatives: int,
         show_progress: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(question ordinals [M], positive rows [M], hard-negative rows [M, h]) for the M questions
    with an answer-bearing block in BM25's top `depth` (and `h` negatives there)."""
    blocks = searcher.current.blocks
    keep, pos, neg = [], [], []
    with progress_bar(show_progress) as bar:
        task = bar.add_task("mining BM25 positives/negatives", total=len(questions))
        for i in range(0, len(questions), 256):
            chunk = questions[i : i + 256]
            _, rows = searcher.search_rows([q.question for q in chunk], depth)
            for j, (q, ranked) in enumerate(zip(chunk, rows)):
                p, n = None, []
                for r in ranked:
                    if p is not None and len(n) == negatives:
                        break
                    if has_answer(blocks.record(int(r))["text"], q.answers):
                        p = int(r) if p is None else p
                    elif len(n) < negatives:
                        n.append(int(r))
                if p is not None and len(n) == negatives:
                    keep.append(i + j)
                    pos.append(p)
                    neg.append(n)
            bar.advance(task, len(chunk))
    return np.array(keep, np.int64), np.array(pos, np.int64), np.array(neg, np.int64).reshape(len(keep), negatives)


def _load_mined(run: Path, searcher: Searcher, questions: list[Question], cfg: DPRConfig, show_progress: bool):
    path = run / "mined.npz"
    if path.is_file():
        with np.load(path, allow_pickle=False) as f:
            return f["questions"], f["positives"], f["negatives"]
    keep, pos, neg = mine(searcher, questions, depth=cfg.bm25_depth, negatives=cfg.hard_negatives, show_progress=show_progress)
    if len(keep) == 0:
        raise RalmError(f"{cfg.questions}: no question has an answer-bearing block in BM25's top {cfg.bm25_depth}")
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, questions=keep, positives=pos, negatives=neg)
    return keep, pos, neg


def _block_inputs(retriever: Retriever, blocks: BlockStore, rows: np.ndarray, device: torch.device):
    ids, mask = pad_rows([blocks.tokens[int(r)] for r in rows], retriever.tokenizer.pad_token_id or 0)
    return ids.to(device), mask.to(device)  # [P, L] each


def _per_rank_batch(cfg: DPRConfig, trainable: int, world: int) -> int:
    """--batch-size, or fewer when there are not enough questions: a question twice in one
    global batch would have its own positive as a negative."""
    if trainable < world:
        raise RalmError(f"{cfg.questions}: {trainable} trainable questions are too few for {world} ranks")
    return min(cfg.batch_size, trainable // world)


class DPRTrainer(QuestionTrainer):
    name, config = "dpr", DPRConfig
    plots = ("loss", "accuracy")

    def build(self) -> Retriever:
        cfg, ctx = self.cfg, self.ctx
        self.retriever = Retriever.from_pretrained(cfg.model, dim=cfg.dim).to(ctx.device)
        if ctx.env.broadcast_object(not (ctx.path / "bm25" / "LATEST").is_file()):  # rank 0 builds
            build_index(cfg.corpus, ctx.path / "bm25", kind="bm25", model=cfg.model, show_progress=ctx.show_progress)
        searcher = Searcher.open(ctx.path / "bm25")
        self.blocks = searcher.current.blocks
        start_projection(ctx, self.retriever, self.blocks)  # PCA, as in `ralm index build`
        with main_first(ctx.env):
            self.keep, self.pos, self.neg = _load_mined(ctx.path, searcher, self.questions, cfg, ctx.show_progress)
        self.batch_size = _per_rank_batch(cfg, len(self.keep), ctx.env.world)
        return self.retriever

    def schedule(self):
        return warmup_linear_decay(self.cfg.steps, self.cfg.warmup)

    def started(self) -> None:
        self.retriever.train()

    def step(self, i: int):
        env, device = self.ctx.env, self.ctx.device
        idx = rank_batch(i, self.batch_size, n=len(self.keep), seed=self.cfg.seed, env=env)
        texts = [self.questions[int(self.keep[j])].question for j in idx]
        rows = np.concatenate([self.pos[idx], self.neg[idx].reshape(-1)])  # [B + B*h]: positives first
        tok = self.retriever.tokenize_queries(texts)
        q, p = self.loop.ddp(tok["input_ids"].to(device), tok["attention_mask"].to(device),
                             *_block_inputs(self.retriever, self.blocks, rows, device))  # [B, D], [B(1+h), D]
        loss, acc = in_batch_contrastive(q, p, env)  # every rank's passages are negatives
        return loss, {"loss": loss.item(), "accuracy": acc.item()}

    def exports(self):
        return {"retriever": self.retriever}

    def result(self, done: TrainResult) -> DPRResult:
        return DPRResult(**asdict(done), questions=len(self.questions), trainable_questions=int(len(self.keep)),
                         retriever=str(final_dir(self.ctx.path, "retriever")))


train_dpr = DPRTrainer.fit
