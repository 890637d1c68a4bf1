"""MLM warm-up of the knowledge-augmented encoder, before REALM pre-training.

REALM starts its encoder from BERT *with* its masked-LM head. The encoders we ship (MiniLM,
sentence-transformers models) have none, so a fresh head can neither predict a masked span
nor tell whether evidence helps: every retrieved block looks as useless as the null document,
and a retriever trained against such an encoder learns nothing (or collapses onto near-empty
blocks). This warm-up teaches the encoder, on the pre-training corpus, what REALM then needs:

  input   `[CLS] x [SEP] z_body [SEP]`, x a masked sentence (salient spans or random wordpieces,
          as REALM will mask), z_body x's own block for a share `evidence` of the examples
          and empty for the others, so the encoder learns both to read a span from evidence
          and to predict it without any. In a share `keep_sentence` of the blocks x itself
          stays (the plainest lesson in copying: find x's context, copy the span, as ICT
          keeps some pseudo-queries); in the others x is cut out, so the span must come from
          elsewhere in the block, as it will from other documents' blocks in REALM. A share
          `distractor` of the examples without their own block read a block of another
          document instead of none: most blocks REALM retrieves early are such, and an encoder
          that never met one copies from them as readily as from the right one
  phase 1 `head_steps` steps train the head only (transform, LayerNorm, bias; the decoder is
          tied to the frozen word embeddings): a random head would otherwise send large
          gradients into the pretrained body
  phase 2 the whole encoder

The run exports RUN/final/encoder (a Hugging Face BertForMaskedLM directory) that
`ralm pretrain --encoder` starts from; `ralm pretrain` runs this warm-up itself (in RUN/mlm)
when its encoder's head is fresh. Logged: the loss, the same loss with and without evidence,
and `evidence_gain` (their difference, nats per masked wordpiece: > 0 when evidence helps).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, asdict, dataclass

import numpy as np
import torch
from torch import nn

from ralm.configs import CORPUS_HELP, MASKING_HELP, SAVE_EVERY_HELP, SPACY_HELP, WARMUP_HELP, option
from ralm.data.blocks import BlockStore
from ralm.data.geometry import GEOMETRY
from ralm.data.masking import MaskedSentence, MaskingConfig, SentenceConfig, SentenceTable, corpus_sentences, masked_batch
from ralm.errors import RalmError
from ralm.models.realm import KnowledgeAugmentedEncoder, RealmConfig, masked_token_log_probs, read_pairs
from ralm.retrieval.index.dense_side import dense_index
from ralm.rundir import final_dir
from ralm.train.loop import LoopConfig, Schedule, TrainResult, delayed, warmup_constant
from ralm.train.parallel import global_mean, main_first, rank_batch
from ralm.train.trainer import Trainer


@dataclass
class MlmConfig(LoopConfig):
    corpus: str = option(help="the pre-training corpus: " + CORPUS_HELP, path="content")
    model: str = option("default", "HF BERT directory (with or without an MLM head)", shown="bundled MiniLM", path="location")
    head_steps: int = option(100, "first steps that train the MLM head alone (the body frozen)")
    masking: str = option("salient", MASKING_HELP)
    random_prob: float = option(0.15, "share of wordpieces masked by random masking")
    spacy_model: str = option(SentenceConfig.spacy_model, SPACY_HELP)
    evidence: float = option(0.5, "share of sentences read with their own block (the others with none)")
    keep_sentence: float = option(0.5, "share of those blocks that still hold the sentence")
    distractor: float = option(0.0, "share of the others read with another document's block instead of none")
    max_len: int = option(GEOMETRY.joined_len, "encoder input length: [CLS] x [SEP] block [SEP]")
    max_query_len: int = option(GEOMETRY.query_len, "wordpieces of the masked sentence x, [CLS] and [SEP] included")
    block_len: int = option(GEOMETRY.block_len, "wordpieces per block")
    _: KW_ONLY
    steps: int = option(300, "training steps, the head-only ones included")
    batch_size: int = option(16, "masked sentences per step and rank (under torchrun)")
    warmup: int = option(30, WARMUP_HELP + " (in each phase)")
    save_every: int = option(100, SAVE_EVERY_HELP)
    positive_fields = ("max_len", "max_query_len", "block_len")
    non_negative_fields = ("head_steps",)
    fraction_fields = ("random_prob", "evidence", "keep_sentence", "distractor")
    presets = {"cpu": {"steps": 100, "head_steps": 30, "batch_size": 8, "warmup": 10, "save_every": 50}}

    def __post_init__(self):
        super().__post_init__()
        MaskingConfig(self.masking, self.random_prob)
        RealmConfig(1, self.max_len, self.max_query_len)


@dataclass
class MlmResult(TrainResult):
    examples: int  # sentences to mask
    encoder: str  # RUN/final/encoder


class EvidenceMLM(nn.Module):
    """The warm-up objective: masked-wordpiece NLL of x read with one evidence body."""

    def __init__(self, encoder: KnowledgeAugmentedEncoder, cfg: RealmConfig):
        super().__init__()
        self.encoder = encoder
        self.cfg = cfg

    def forward(self, examples: list[MaskedSentence], bodies: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (NLL summed over each example's masked wordpieces [B], their count [B])."""
        logits, labels, label_mask = read_pairs(self.encoder, examples, [[z] for z in bodies], self.cfg)  # [B, 1, M, V]
        log_py = masked_token_log_probs(logits, labels)[:, 0]  # [B, M]
        return -torch.where(label_mask, log_py, torch.zeros_like(log_py)).sum(-1), label_mask.sum(-1)


def own_block_evidence(blocks: BlockStore, table: SentenceTable, s: int, keep: bool = False) -> np.ndarray:
    """The body of sentence s's block, the sentence cut out unless `keep`."""
    body = blocks.body(int(table.rows[s]))
    return body if keep else np.concatenate([body[: int(table.starts[s])], body[int(table.ends[s]):]])


def distractor_evidence(blocks: BlockStore, table: SentenceTable, s: int, draw: float) -> np.ndarray:
    """The body of a block of another document than sentence s's, chosen by `draw` in [0, 1)."""
    own = blocks.doc_index[int(table.rows[s])]
    row = int(draw * len(blocks))
    for _ in range(len(blocks)):  # the next block of another document
        if blocks.doc_index[row] != own:
            return blocks.body(row)
        row = (row + 1) % len(blocks)
    raise RalmError("distractor evidence needs a corpus of at least two documents")


class MlmTrainer(Trainer):
    """`corpus` passes blocks and sentences already prepared for cfg.corpus (pre-training's
    own), else RUN/index gets them."""

    name, config = "mlm", MlmConfig
    plots = ("loss", "evidence_gain", "steps_per_s")
    lr_names = ("head_lr", "body_lr")

    def __init__(self, cfg: MlmConfig, corpus: tuple[BlockStore, SentenceTable] | None = None):
        super().__init__(cfg)
        self.corpus = corpus

    def build(self) -> EvidenceMLM:
        cfg, ctx = self.cfg, self.ctx
        self.encoder = KnowledgeAugmentedEncoder.from_pretrained(cfg.model)
        if self.corpus is None:
            with main_first(ctx.env):
                index = dense_index(ctx.path / "index")
                _, *self.corpus = corpus_sentences(index.blocks_dir, index.sentences_dir, cfg.corpus,
                                                   hf_tokenizer=self.encoder.tokenizer, block_len=cfg.block_len,
                                                   show_progress=ctx.show_progress, cfg=SentenceConfig(cfg.spacy_model))
        self.blocks, self.table = self.corpus
        self.masking = MaskingConfig(cfg.masking, cfg.random_prob, max_len=cfg.max_query_len - 2)
        self.examples = self.table.with_spans(self.masking.max_len) if cfg.masking == "salient" else np.arange(len(self.table))
        if len(self.examples) < cfg.batch_size * ctx.env.world:
            raise RalmError(f"{cfg.corpus}: only {len(self.examples)} sentences to mask; need at least batch size x ranks "
                            f"= {cfg.batch_size * ctx.env.world}" + (" (try random masking)" if cfg.masking == "salient" else ""))
        return EvidenceMLM(self.encoder, RealmConfig(1, cfg.max_len, cfg.max_query_len)).to(ctx.device)

    def optimizer(self, model: EvidenceMLM) -> torch.optim.Optimizer:
        self.body = list(self.encoder.mlm.bert.parameters())
        body_ids = {id(p) for p in self.body}
        head = [p for p in self.encoder.parameters() if id(p) not in body_ids]
        return torch.optim.AdamW([{"params": head}, {"params": self.body}], lr=self.cfg.lr, weight_decay=0.01)

    def schedule(self) -> list[Schedule]:
        """Learning-rate multipliers for [head, body]: the body waits `head_steps`, then warms up."""
        return [warmup_constant(self.cfg.warmup), delayed(warmup_constant(self.cfg.warmup), self.cfg.head_steps)]

    def started(self) -> None:
        self.loop.model.train()

    def step(self, i: int):
        cfg, env, blocks, table = self.cfg, self.ctx.env, self.blocks, self.table
        for p in self.body:  # phase 1 skips the body's backward pass altogether
            p.requires_grad_(i >= cfg.head_steps)
        idx = self.examples[rank_batch(i, cfg.batch_size, n=len(self.examples), seed=cfg.seed, env=env)]
        batch = masked_batch(table, blocks, idx, cfg=self.masking, mask_id=self.encoder.tokenizer.mask_token_id, seed=cfg.seed,
                             step=i)
        # drawn per sentence and step, so a resumed run (and any number of ranks) reads the same
        draws = np.array([np.random.default_rng([cfg.seed, i, int(s), 1]).random(4) for s in idx])  # [B, 4]
        with_evidence, keep = draws[:, 0] < cfg.evidence, draws[:, 1] < cfg.keep_sentence
        distract = ~with_evidence & (draws[:, 2] < cfg.distractor)
        bodies = [own_block_evidence(blocks, table, int(s), bool(k)) if e
                  else distractor_evidence(blocks, table, int(s), d) if x else np.zeros(0, np.int64)
                  for s, e, k, x, d in zip(idx, with_evidence, keep, distract, draws[:, 3])]
        nll, tokens = self.loop.ddp(batch, bodies)  # [B] each
        loss, _ = global_mean(nll.sum(), int(tokens.sum()), env)
        per_token = (nll / tokens).detach().cpu().numpy()
        return loss, {"loss": loss.item(),  # NaN: no such example in this step (the window's mean skips it)
                      "loss_evidence": float(per_token[with_evidence].mean()) if with_evidence.any() else np.nan,
                      "loss_no_evidence": float(per_token[~with_evidence].mean()) if (~with_evidence).any() else np.nan}

    def exports(self):
        return {"encoder": self.encoder}

    def log_extra(self, record: dict) -> dict:
        return {"evidence_gain": record["loss_no_evidence"] - record["loss_evidence"]}

    def result(self, done: TrainResult) -> MlmResult:
        return MlmResult(**asdict(done), examples=int(len(self.examples)), encoder=str(final_dir(self.ctx.path, "encoder")))


warm_up_encoder = MlmTrainer.fit
