"""MLM warm-up of the knowledge-augmented encoder, before REALM pre-training.

REALM starts its encoder from BERT *with* its masked-LM head. The encoders we ship (MiniLM,
sentence-transformers models) have none, so a fresh head can neither predict a masked span
nor tell whether evidence helps: every retrieved block looks as useless as the null document,
and a retriever trained against such an encoder learns nothing (or collapses onto near-empty
blocks). This warm-up teaches the encoder, on the pre-training corpus, what REALM then needs:

  input   `[CLS] x [SEP] z_body [SEP]`, x a masked sentence (salient spans or random wordpieces,
          as REALM will mask), z_body the rest of x's own block (x cut out) for a share
          `evidence` of the examples and empty for the others, so the encoder learns both to
          copy a span from evidence and to predict it without any
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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from ralm.atomic import write_json
from ralm.data.blocks import BlockStore
from ralm.data.masking import MaskedSentence, MaskingConfig, SentenceTable, masked_batch
from ralm.errors import RalmError
from ralm.models.realm import KnowledgeAugmentedEncoder, RealmConfig, masked_token_log_probs, read_pairs
from ralm.retrieval.encoders import default_model_path
from ralm.runtime import autocast
from ralm.train.ict import corpus_sentences
from ralm.train.loop import MetricsLog, check_options, load_checkpoint, plot_metrics, save_checkpoint
from ralm.train.parallel import all_mean, global_mean, main_first, rank_batch, start_run, wrap_ddp


@dataclass
class MlmConfig:
    corpus: str
    model: str = "default"  # HF BERT directory (with or without an MLM head)
    steps: int = 300
    head_steps: int = 100  # steps that train the head alone (the body frozen)
    batch_size: int = 16
    lr: float = 1e-4
    warmup: int = 30  # linear learning-rate warm-up steps, in each phase
    masking: str = "salient"
    random_prob: float = 0.15
    evidence: float = 0.5  # share of examples that read the rest of their own block
    max_len: int = 352
    max_query_len: int = 64
    block_len: int = 288
    save_every: int = 100
    log_every: int = 10
    seed: int = 0
    dtype: str = "auto"

    def __post_init__(self):
        check_options(self, positive=("steps", "batch_size", "lr", "max_len", "max_query_len", "block_len",
                                      "save_every", "log_every"),
                      non_negative=("head_steps", "warmup"), fractions=("random_prob", "evidence"))
        MaskingConfig(self.masking, self.random_prob)
        RealmConfig(1, self.max_len, self.max_query_len)


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


def own_block_evidence(blocks: BlockStore, table: SentenceTable, s: int) -> np.ndarray:
    """The body of sentence s's block with the sentence cut out."""
    body = blocks.body(int(table.rows[s]))
    return np.concatenate([body[: int(table.starts[s])], body[int(table.ends[s]):]])


def _mean(values: list[float]) -> float:
    """Mean over the steps that had such examples (NaN if none had)."""
    kept = [v for v in values if not np.isnan(v)]
    return float(np.mean(kept)) if kept else float("nan")


def _schedule(cfg: MlmConfig) -> list[Callable[[int], float]]:
    """Learning-rate multipliers for [head, body]: the body waits `head_steps`, then warms up."""
    def ramp(s: int) -> float:
        return min(1.0, (s + 1) / max(cfg.warmup, 1))

    return [ramp, lambda s: 0.0 if s < cfg.head_steps else ramp(s - cfg.head_steps)]


def warm_up_encoder(cfg: MlmConfig, run: str | os.PathLike, device: torch.device, show_progress: bool = True,
                    notify: Callable[[str], None] | None = None, on_metrics: Callable[[dict], None] | None = None,
                    corpus: tuple[BlockStore, SentenceTable] | None = None) -> dict:
    """Train (or resume) the warm-up run at `run`; exports RUN/final/encoder. `corpus` passes
    blocks and sentences already prepared for cfg.corpus (pre-training's own), else RUN/index
    gets them."""
    run = Path(run)
    env, device, dtype, show_progress, resume = start_run(run, cfg, device, show_progress)
    notify = notify if notify and env.is_main else (lambda _: None)
    encoder = KnowledgeAugmentedEncoder.from_pretrained(default_model_path() if cfg.model in ("", "default") else cfg.model)
    if corpus is None:
        with main_first(env):
            _, _, *corpus = corpus_sentences(run, cfg.corpus, encoder.tokenizer, cfg.block_len, show_progress)
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
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(cfg))
    step = 0
    if resume is not None:
        step = load_checkpoint(resume, model, opt, sched)["step"]
        notify(f"resuming from step {step}")
    ddp = wrap_ddp(model, env, device)
    metrics = MetricsLog(run, step) if env.is_main else None
    mask_id = encoder.tokenizer.mask_token_id
    model.train()
    window, t0 = [], time.perf_counter()
    while step < cfg.steps:
        for p in body:  # phase 1 skips the body's backward pass altogether
            p.requires_grad_(step >= cfg.head_steps)
        idx = examples[rank_batch(step, cfg.batch_size, len(examples), cfg.seed, env)]
        batch = masked_batch(table, blocks, idx, masking, mask_id, cfg.seed, step)
        # drawn per sentence and step, so a resumed run (and any number of ranks) reads the same
        with_evidence = np.array([np.random.default_rng([cfg.seed, step, int(s), 1]).random() < cfg.evidence for s in idx])
        bodies = [own_block_evidence(blocks, table, int(s)) if e else np.zeros(0, np.int64) for s, e in zip(idx, with_evidence)]
        with autocast(device, dtype):
            nll, tokens = ddp(batch, bodies)  # [B] each
        loss, _ = global_mean(nll.sum(), int(tokens.sum()), env)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        per_token = (nll / tokens).detach().cpu().numpy()
        window.append({"loss": loss.item(),
                       "loss_evidence": float(per_token[with_evidence].mean()) if with_evidence.any() else np.nan,
                       "loss_no_evidence": float(per_token[~with_evidence].mean()) if (~with_evidence).any() else np.nan})
        step += 1
        if step % cfg.log_every == 0 or step == cfg.steps:
            elapsed = time.perf_counter() - t0
            means = {k: all_mean(_mean([w[k] for w in window]), env) for k in window[0]}
            record = {"step": step, **means, "evidence_gain": means["loss_no_evidence"] - means["loss_evidence"],
                      "head_lr": sched.get_last_lr()[0], "body_lr": sched.get_last_lr()[1],
                      "steps_per_s": round(len(window) / elapsed, 4)}
            if env.is_main:
                metrics.log(record)
                if on_metrics:
                    on_metrics(record)
            window, t0 = [], time.perf_counter()
        if step % cfg.save_every == 0 or step == cfg.steps:
            if env.is_main:
                save_checkpoint(run, step, model, opt, sched)
                encoder.save_pretrained(run / "final" / "encoder")
                write_json(run / "final" / "trainer.json", {"step": step, "kind": "mlm"})
            env.barrier()
    plots = []
    if env.is_main:
        metrics.close()
        plots = plot_metrics(run, ["loss", "evidence_gain", "steps_per_s"])
    return {"run": str(run), "steps": step, "examples": int(len(examples)), "encoder": str(run / "final" / "encoder"),
            "plots": [str(p) for p in plots]}
