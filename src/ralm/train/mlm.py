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

import os
from dataclasses import asdict, dataclass
from typing import Callable, ClassVar

import numpy as np
import torch
from torch import nn

from ralm.configs import CORPUS_HELP, MASKING_HELP, SAVE_EVERY_HELP, SPACY_HELP, WARMUP_HELP, option
from ralm.data.blocks import BlockStore
from ralm.data.masking import MaskedSentence, MaskingConfig, SentenceConfig, SentenceTable, corpus_sentences, masked_batch
from ralm.errors import RalmError
from ralm.models.realm import KnowledgeAugmentedEncoder, RealmConfig, masked_token_log_probs, read_pairs
from ralm.retrieval.index.store import IndexDir
from ralm.rundir import final_dir
from ralm.train.loop import RunOptions, Schedule, TrainLoop, TrainResult, check_options, delayed, warmup_constant
from ralm.train.parallel import global_mean, main_first, rank_batch, start_run


@dataclass
class MlmConfig(RunOptions):
    corpus: str = option(help="the pre-training corpus: " + CORPUS_HELP, path="content")
    model: str = option("default", "HF BERT directory (with or without an MLM head)", shown="bundled MiniLM", path="location")
    steps: int = option(300, "training steps, the head-only ones included")
    head_steps: int = option(100, "first steps that train the MLM head alone (the body frozen)")
    batch_size: int = option(16, "masked sentences per step and rank (under torchrun)")
    lr: float = option(1e-4, "learning rate")
    warmup: int = option(30, WARMUP_HELP + " (in each phase)")
    masking: str = option("salient", MASKING_HELP)
    random_prob: float = option(0.15, "share of wordpieces masked by random masking")
    spacy_model: str = option(SentenceConfig.spacy_model, SPACY_HELP)
    evidence: float = option(0.5, "share of sentences read with their own block (the others with none)")
    keep_sentence: float = option(0.5, "share of those blocks that still hold the sentence")
    distractor: float = option(0.0, "share of the others read with another document's block instead of none")
    max_len: int = option(352, "encoder input length: [CLS] x [SEP] block [SEP]")
    max_query_len: int = option(64, "wordpieces of the masked sentence x, [CLS] and [SEP] included")
    block_len: int = option(288, "wordpieces per block")
    save_every: int = option(100, SAVE_EVERY_HELP)
    presets: ClassVar[dict[str, dict]] = {"cpu": {"steps": 100, "head_steps": 30, "batch_size": 8, "warmup": 10,
                                                  "save_every": 50}}

    def __post_init__(self):
        check_options(self, positive=("max_len", "max_query_len", "block_len"), non_negative=("head_steps",),
                      fractions=("random_prob", "evidence", "keep_sentence", "distractor"))
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


def _schedule(cfg: MlmConfig) -> list[Schedule]:
    """Learning-rate multipliers for [head, body]: the body waits `head_steps`, then warms up."""
    return [warmup_constant(cfg.warmup), delayed(warmup_constant(cfg.warmup), cfg.head_steps)]


def warm_up_encoder(cfg: MlmConfig, run: str | os.PathLike, device: torch.device | None = None, show_progress: bool = True,
                    notify: Callable[[str], None] | None = None, on_metrics: Callable[[dict], None] | None = None,
                    corpus: tuple[BlockStore, SentenceTable] | None = None) -> MlmResult:
    """Train (or resume) the warm-up run at `run`; exports RUN/final/encoder. `corpus` passes
    blocks and sentences already prepared for cfg.corpus (pre-training's own), else RUN/index
    gets them."""
    ctx = start_run(run, cfg, device, show_progress, notify)
    run, env, device, show_progress = ctx.path, ctx.env, ctx.device, ctx.show_progress
    encoder = KnowledgeAugmentedEncoder.from_pretrained(cfg.model)
    if corpus is None:
        with main_first(env):
            index = IndexDir.create(run / "index", "dense")
            _, *corpus = corpus_sentences(index.blocks_dir, index.sentences_dir, cfg.corpus,
                                          hf_tokenizer=encoder.tokenizer, block_len=cfg.block_len, show_progress=show_progress,
                                          cfg=SentenceConfig(cfg.spacy_model))
    blocks, table = corpus
    masking = MaskingConfig(cfg.masking, cfg.random_prob, max_len=cfg.max_query_len - 2)
    examples = table.with_spans(masking.max_len) if cfg.masking == "salient" else np.arange(len(table))
    if len(examples) < cfg.batch_size * env.world:
        raise RalmError(f"{cfg.corpus}: only {len(examples)} sentences to mask; need at least batch size x ranks "
                        f"= {cfg.batch_size * env.world}" + (" (try random masking)" if cfg.masking == "salient" else ""))
    model = EvidenceMLM(encoder, RealmConfig(1, cfg.max_len, cfg.max_query_len)).to(device)
    body = list(encoder.mlm.bert.parameters())
    body_ids = {id(p) for p in body}
    head = [p for p in encoder.parameters() if id(p) not in body_ids]
    opt = torch.optim.AdamW([{"params": head}, {"params": body}], lr=cfg.lr, weight_decay=0.01)
    loop = TrainLoop(ctx, cfg, model, opt, torch.optim.lr_scheduler.LambdaLR(opt, _schedule(cfg)),
                     lr_names=("head_lr", "body_lr"))
    mask_id = encoder.tokenizer.mask_token_id
    model.train()

    def step(i: int):
        for p in body:  # phase 1 skips the body's backward pass altogether
            p.requires_grad_(i >= cfg.head_steps)
        idx = examples[rank_batch(i, cfg.batch_size, len(examples), cfg.seed, env)]
        batch = masked_batch(table, blocks, idx, cfg=masking, mask_id=mask_id, seed=cfg.seed, step=i)
        # drawn per sentence and step, so a resumed run (and any number of ranks) reads the same
        draws = np.array([np.random.default_rng([cfg.seed, i, int(s), 1]).random(4) for s in idx])  # [B, 4]
        with_evidence, keep = draws[:, 0] < cfg.evidence, draws[:, 1] < cfg.keep_sentence
        distract = ~with_evidence & (draws[:, 2] < cfg.distractor)
        bodies = [own_block_evidence(blocks, table, int(s), bool(k)) if e
                  else distractor_evidence(blocks, table, int(s), d) if x else np.zeros(0, np.int64)
                  for s, e, k, x, d in zip(idx, with_evidence, keep, distract, draws[:, 3])]
        nll, tokens = loop.ddp(batch, bodies)  # [B] each
        loss, _ = global_mean(nll.sum(), int(tokens.sum()), env)
        per_token = (nll / tokens).detach().cpu().numpy()
        return loss, {"loss": loss.item(),  # NaN: no such example in this step (the window's mean skips it)
                      "loss_evidence": float(per_token[with_evidence].mean()) if with_evidence.any() else np.nan,
                      "loss_no_evidence": float(per_token[~with_evidence].mean()) if (~with_evidence).any() else np.nan}

    done = loop.run(step, "mlm", {"encoder": encoder}, plots=("loss", "evidence_gain", "steps_per_s"),
                    log_extra=lambda r: {"evidence_gain": r["loss_no_evidence"] - r["loss_evidence"]},
                    on_metrics=on_metrics)
    return MlmResult(**asdict(done), examples=int(len(examples)), encoder=str(final_dir(run, "encoder")))
