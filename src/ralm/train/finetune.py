"""Open-domain QA fine-tuning (ORQA/REALM): the reader and the query tower are trained on
log p(y|x) = log Σ_{z in top-k} Σ_{s in z matching y} p(z|x) exp f(s) / C with the document index
fixed, C = Σ_z p(z|x) Σ_{s valid in z} exp f(s): one span softmax shared by the k blocks read
(`marginal_nll`), the probability the pipeline answers with, so span scores are learnt on one
scale across blocks (a per-block softmax would leave every block's best span equally sure).

A reader with a null span (one `ralm train-reader --no-answer-share` trained) keeps it in the
softmax, C gaining p(z|x) exp g_z, and learns it on the questions none of whose k blocks holds an
answer (`shared_nll`'s no-answer label).

Each step retrieves the top-k blocks with the current query tower (a search over the fixed
index), then scores them again *with gradients*: p(z|x) = softmax_z <query(x), E[z]> where
E[z] are the rows of the index's embeddings.npy. With a BM25 index p(z|x) is the softmax of
the BM25 scores and only the reader trains.

A run: RUN/config.json, RUN/checkpoints/, RUN/metrics.jsonl (loss, answerable share, lr),
RUN/final/reader (Reader checkpoint) and, for a dense index, RUN/final/retriever (the
fine-tuned query tower with the index's unchanged document tower).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ralm.configs import LIMIT_HELP, QUESTIONS_HELP, WARMUP_HELP, option
from ralm.data.qa import Question, has_answer
from ralm.data.reader_features import valid_spans
from ralm.distributed import DistEnv
from ralm.errors import RalmError
from ralm.models.reader import Reader, is_reader_dir, marginal_nll
from ralm.retrieval.index.dense_side import dense_of
from ralm.retrieval.index.kinds import Side
from ralm.retrieval.towers.encoders import is_retriever_dir
from ralm.retrieval.search.searcher import Searcher
from ralm.rundir import final_dir, find_model, is_model_dir, is_run
from ralm.runtime import full_precision
from ralm.train.loop import LoopConfig, TrainResult, warmup_linear_decay
from ralm.train.parallel import global_mean, rank_batch, search_rank_queries
from ralm.train.trainer import QuestionTrainer


@dataclass
class FinetuneConfig(LoopConfig):
    questions: str = option(help=QUESTIONS_HELP, path="content")
    index: str = option(help="dense or BM25 index over the evidence corpus (kept fixed)", path="location")
    init: str | None = option(None, "ICT/pre-training run, retriever checkpoint, reader, or HF encoder directory",
                              shown="bundled MiniLM", path="location")
    k: int = option(5, "retrieved blocks read per question", aliases=("-k",))
    retriever_lr: float = option(1e-5, "query-tower learning rate")
    train_retriever: bool = option(True, "fine-tune the query tower through p(z|x) (dense indexes)",
                                   flag="--train-retriever/--freeze-retriever")
    max_len: int = option(384, "reader input length: [CLS] question [SEP] block [SEP] (a reader given as init is read at it too)")
    trainable_layers: int | None = option(None, "train only the reader's top N layers and span scorer (small checkpoints, "
                                                "faster on CPU)", shown="all")
    limit: int | None = option(None, LIMIT_HELP)
    _: KW_ONLY
    batch_size: int = option(8, "questions per step and rank (under torchrun)")
    lr: float = option(3e-5, "reader learning rate")
    warmup: int = option(100, WARMUP_HELP + " (then linear decay to 0)")
    positive_fields = ("k", "max_len", "retriever_lr", "limit")
    non_negative_fields = ("trainable_layers",)
    presets = {"cpu": {"steps": 200, "batch_size": 4, "k": 4, "warmup": 20, "trainable_layers": 2, "save_every": 50}}

    def step_work(self) -> float:
        return self.batch_size * self.k  # the reader reads k blocks a question


@dataclass
class FinetuneResult(TrainResult):
    questions: int
    dense: bool
    trained_query_tower: bool
    answerable_share: float  # of the questions seen, those with an answer among their top-k blocks
    reader: str  # RUN/final/reader


@dataclass
class AnswerableCount:
    """Questions seen over the run and how many of them the reader could learn from (a gold
    span in what it read); kept in the checkpoints, so a resumed run counts the whole run."""

    seen: int = 0
    answerable: int = 0

    def add(self, questions: int, answerable: int) -> None:
        self.seen += questions
        self.answerable += answerable

    @property
    def share(self) -> float:
        return round(self.answerable / max(self.seen, 1), 4)


def resolve_init(init: str | None) -> tuple[str | None, str | None]:
    """(reader source, retriever source) from `init`: a pre-training/fine-tuning RUN (uses
    RUN/final/reader or RUN/final/encoder, and RUN/final/retriever), a retriever checkpoint,
    a reader checkpoint, or an HF encoder directory. None means the defaults."""
    if init is None:
        return None, None
    if not Path(init).exists():
        raise RalmError(f"{init}: no such run or model directory")
    retriever = find_model(init, "retriever", is_retriever_dir)
    if not is_run(init):
        if retriever is not None:
            return None, str(retriever)
        if is_model_dir(Path(init)):
            return str(init), None
        raise RalmError(f"{init}: not a run, a retriever checkpoint or a Hugging Face model directory")
    reader = find_model(init, "reader", is_model_dir) or find_model(init, "encoder", is_model_dir)
    if reader is None and retriever is None:
        raise RalmError(f"{init}: RUN/final holds neither a reader/encoder nor a retriever")
    return (str(reader) if reader else None), (str(retriever) if retriever else None)


def load_reader(source: str | None, max_len: int, trainable_layers: int | None = None) -> Reader:
    """The reader to train: a reader checkpoint (its own settings, read at `max_len`), else a
    fresh span scorer on an HF encoder (None: the bundled MiniLM)."""
    if source is not None and is_reader_dir(source):
        # the calibration was fitted to the old weights, which training makes stale
        return Reader.from_pretrained(source, max_len=max_len, calibration=None)
    return Reader.from_encoder(source, max_len=max_len, trainable_layers=trainable_layers)


def retrieval_logits(searcher: Searcher, dense: Side | None, questions: list[str], k: int, *,
                     device: torch.device, env: DistEnv) -> tuple[torch.Tensor, np.ndarray]:
    """(logits [B, K] for p(z|x), block rows [B, K]). With the index's dense side (`dense_of`):
    scores recomputed with gradients from the query tower against the fixed document
    embeddings; without: the searcher's scores (BM25's)."""
    if dense is None:
        scores, rows = searcher.search_rows(questions, k)
        return torch.from_numpy(scores).to(device), rows
    retriever = dense.retriever
    tok = {key: v.to(device) for key, v in retriever.tokenize_queries(questions).items()}
    q = retriever.query(tok["input_ids"], tok["attention_mask"]).float()  # [B, D]
    _, rows = search_rank_queries(dense.index, q, k, env)  # the fixed index
    cand = torch.from_numpy(np.asarray(dense.embeddings[rows.reshape(-1)], dtype=np.float32)).to(device)
    cand = cand.view(len(questions), rows.shape[1], -1)  # [B, K, D]
    with full_precision(device):  # p(z|x) logits in fp32 even inside the step's autocast
        return torch.einsum("bd,bkd->bk", q, cand), rows


def read_candidates(reader: Reader, searcher: Searcher, questions: list[Question], rows: np.ndarray, *,
                    device: torch.device):
    """Reader inputs for every (question, retrieved block): batch, valid [N, L, W], match [N, L, W],
    and no_answer [B]: no block read holds an answer (a null span's gold)."""
    blocks = searcher.current.blocks
    k = rows.shape[1]
    records = [blocks.record(int(r)) for r in rows.reshape(-1)]
    texts = [rec["text"] for rec in records]
    batch = reader.featurizer.featurize([q.question for q in questions for _ in range(k)], texts,
                                        titles=[rec["title"] for rec in records])
    match = reader.featurizer.answer_match(batch, [q.answers for q in questions for _ in range(k)])
    no_answer = torch.tensor([not any(has_answer(t, q.answers) for t in texts[b * k : (b + 1) * k]) for b, q in enumerate(questions)])
    batch = batch.to(device)
    return batch, valid_spans(batch, reader.cfg.max_span_width), match.to(device), no_answer.to(device)


class QAModel(torch.nn.Module):
    """What a fine-tuning checkpoint holds: the reader and the (trainable) query tower. Its
    forward is a step's retrieval and reading, so DDP sees every parameter that trains."""

    def __init__(self, reader: Reader, searcher: Searcher, dense: Side | None, env: DistEnv):
        super().__init__()
        self.reader = reader
        self.query = dense.retriever.query if dense is not None else None
        self.searcher, self.dense, self.env = searcher, dense, env

    def forward(self, questions: list[Question], k: int) -> tuple[torch.Tensor, ...]:
        """-> retrieval logits [B, K]; span scores, valid spans, answer matches [B, K, L, W];
        no_answer [B]."""
        device = self.reader.device
        logits, rows = retrieval_logits(self.searcher, self.dense, [q.question for q in questions], k, device=device,
                                        env=self.env)
        batch, valid, match, no_answer = read_candidates(self.reader, self.searcher, questions, rows, device=device)
        scores = self.reader(batch)  # [B*K, L, W]
        shape = (len(questions), rows.shape[1], *scores.shape[1:])
        return logits, scores.view(shape), valid.view(shape), match.view(shape), no_answer


class FinetuneTrainer(QuestionTrainer):
    name, config = "finetune", FinetuneConfig
    plots = ("loss", "answerable")

    def build(self) -> QAModel:
        cfg, ctx = self.cfg, self.ctx
        reader_src, retriever_src = resolve_init(cfg.init)
        self.searcher = searcher = Searcher.open(cfg.index, model=retriever_src, runtime=ctx.runtime)
        dense = dense_of(searcher.current, optional=True)
        self.retriever = dense.retriever if dense is not None else None  # the query tower, with a dense side
        self.dense = dense is not None
        self.reader = load_reader(reader_src, cfg.max_len, cfg.trainable_layers).to(ctx.device)
        self.train_query = self.dense and cfg.train_retriever
        return QAModel(self.reader, searcher, dense, ctx.env).to(ctx.device)

    def optimizer(self, model: QAModel) -> torch.optim.Optimizer:
        retriever = self.retriever
        groups = [{"params": [p for p in self.reader.parameters() if p.requires_grad], "lr": self.cfg.lr}]
        if self.train_query:
            groups.append({"params": retriever.query.parameters(), "lr": self.cfg.retriever_lr})
        elif self.dense:
            retriever.requires_grad_(False)
        if self.dense:
            retriever.doc.requires_grad_(False)  # the index is fixed; the doc tower must match it
        return torch.optim.AdamW(groups, weight_decay=0.01)

    def schedule(self):
        return warmup_linear_decay(self.cfg.steps, self.cfg.warmup)

    def started(self) -> None:
        self.count = AnswerableCount(**self.loop.resumed)
        self.loop.model.train()
        if self.dense and not self.train_query:
            self.retriever.eval()

    def step(self, i: int):
        cfg, env, device = self.cfg, self.ctx.env, self.ctx.device
        qs = [self.questions[int(j)] for j in rank_batch(i, cfg.batch_size, n=len(self.questions), seed=cfg.seed, env=env)]
        logits, scores, valid, match, no_answer = self.loop.ddp(qs, cfg.k)
        with full_precision(device):  # the marginal likelihood outside autocast
            # a reader with a null span learns it where no block read holds an answer
            null = scores[:, :, 0, 0] if self.reader.cfg.null_span else None
            loss, answerable = marginal_nll(scores, valid, match, logits, null=null, no_answer=no_answer)  # mean over labelled
            mine = int(answerable.sum())
            loss, answerable_now = global_mean(loss * mine, mine, env)
        self.count.add(len(qs) * env.world, answerable_now)
        # with an answerable question anywhere, every rank backpropagates, even one without (zeros)
        return loss if answerable_now else None, {"loss": loss.item(), "answerable": answerable_now / (len(qs) * env.world)}

    def exports(self):
        return {"reader": self.reader, **({"retriever": self.retriever} if self.dense else {})}

    def log_extra(self, record: dict) -> dict:
        return {"answerable_cumulative": self.count.share}

    def checkpoint_extra(self) -> dict:
        return asdict(self.count)

    def result(self, done: TrainResult) -> FinetuneResult:
        return FinetuneResult(**asdict(done), questions=len(self.questions), dense=self.dense,
                              trained_query_tower=self.train_query, answerable_share=self.count.share,
                              reader=str(final_dir(self.ctx.path, "reader")))


finetune = FinetuneTrainer.fit
