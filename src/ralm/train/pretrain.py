"""REALM pre-training: masked salient spans, retrieval over a refreshed index, marginal MLM.

Each step: mask a batch of sentences (data.masking), let the model retrieve top-k blocks from
the index version in use, compute the marginal loss (models.realm) and update the query tower,
the document tower and the knowledge-augmented encoder together. Between steps the trainer
swaps in the newest complete index version:

  refresh="async"  every `refresh_every` steps the retriever is handed to a separate builder
                   process (retrieval.index.refresh) that re-embeds the corpus; training never waits
  refresh="sync"   the trainer itself re-embeds the corpus when its index is `refresh_every`
                   steps stale (tests, tiny corpora); deterministic, so resumes reproduce
  refresh="none"   the starting index is never refreshed (an ablation)

A run directory holds, besides the layout of ralm.rundir (checkpoints, metrics, RUN/final/retriever
and RUN/final/encoder, a Hugging Face BertForMaskedLM):
  RUN/index/            its own versioned index (blocks, spaCy sentence cache, versions)
  RUN/refresh/          retriever snapshots for the builder; RUN/refresh.log its log
  RUN/mlm/              the encoder's MLM warm-up run (train.mlm), when its head starts fresh
"""

from __future__ import annotations

import shutil
from dataclasses import KW_ONLY, asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ralm.configs import CORPUS_HELP, MASKING_HELP, SPACY_HELP, ConfigError, option
from ralm.data.blocks import BlockStore
from ralm.data.geometry import GEOMETRY, check_block_len
from ralm.data.masking import MaskingConfig, SentenceConfig, SentenceTable, corpus_sentences, masked_batch
from ralm.defaults import REALM_K
from ralm.errors import RalmError
from ralm.models.realm import KnowledgeAugmentedEncoder, Realm, RealmConfig, span_in_top_block, trivial_margin
from ralm.retrieval.towers.encoders import Retriever, is_retriever_dir
from ralm.retrieval.index.refresh import Snapshots, publish_embeddings, start_refresher
from ralm.retrieval.search.searcher import load_version
from ralm.retrieval.index.dense_side import dense_index, dense_of, dense_sections, embeddings_file, section_of
from ralm.retrieval.index.kinds import kind_of
from ralm.retrieval.index.store import IndexDir
from ralm.rundir import final_dir, find_model, is_model_dir
from ralm.runtime import Runtime
from ralm.train.loop import LoopConfig, Schedule, TrainResult, delayed, warmup_constant
from ralm.train.mlm import MlmConfig, warm_up_encoder
from ralm.train.parallel import RunContext, global_mean, main_first, rank_batch, search_rank_queries
from ralm.train.trainer import Trainer, start_projection

REFRESH_MODES = ("async", "sync", "none")


@dataclass
class PretrainConfig(LoopConfig):
    corpus: str = option(help="the pre-training corpus (also the retrieval corpus): " + CORPUS_HELP, path="content")
    init: str | None = option(None, "an ICT run (its final/retriever) or a retriever checkpoint to start both towers from",
                              path="location")
    model: str = option("default", "HF BERT directory for the towers when neither init nor index is given, and for the encoder "
                        "when no encoder is",
                        shown="bundled MiniLM", path="location")
    encoder: str | None = option(None, "the encoder's start: an `ralm mlm` run or a BERT masked-LM directory", path="location")
    mlm_warmup: int = option(300, "MLM warm-up steps (train.mlm, in RUN/mlm) when the encoder's MLM head is fresh; 0: none")
    mlm_distractor: float = option(0.0, "the warm-up's share of blockless sentences read with another document's block "
                                   "(teaches the encoder not to trust every block: docs/pretraining.md)")
    index: str | None = option(None, "an existing dense index over the corpus to start from (else one is built in RUN/index)",
                               path="location")
    dim: int = option(GEOMETRY.dim, "retrieval dimension of a fresh projection")
    k: int = option(REALM_K, "retrieved blocks per example (the null document is added)", aliases=("-k",))
    # The towers wait and then move slowly: a retriever trained at the encoder's rate against an
    # encoder still learning to read collapses onto near-empty blocks (docs/pretraining.md).
    retriever_warmup: int = option(200, "steps that train the encoder alone before the towers (it first learns to read evidence)")
    retriever_lr: float | None = option(1e-5, "the towers' learning rate (slower than the encoder's: see docs/pretraining.md)")
    masking: str = option("salient", MASKING_HELP)
    random_prob: float = option(0.15, "share of wordpieces masked by random masking")
    spacy_model: str = option(SentenceConfig.spacy_model, SPACY_HELP)
    null_doc: bool = option(True, "the empty block among the candidates (REALM's ingredients are switchable for ablations)")
    exclude_trivial: bool = option(True, "drop retrieved blocks of the masked sentence's own document")
    refresh: str = option("async", "async (separate index-builder process), sync (in-process) or none")
    refresh_every: int = option(100, "steps between index refreshes")
    max_len: int = option(GEOMETRY.joined_len, "encoder input length: [CLS] x [SEP] block [SEP]")
    max_query_len: int = option(GEOMETRY.query_len, "wordpieces of the masked sentence x, [CLS] and [SEP] included")
    block_len: int = option(GEOMETRY.block_len, "wordpieces per evidence block (an index must have been built with the same)")
    _: KW_ONLY
    batch_size: int = option(8, "masked sentences per step and rank (under torchrun)")
    lr: float = option(5e-5, "the encoder's learning rate")
    positive_fields = ("k", "refresh_every", "retriever_lr", "dim", "max_len", "max_query_len", "block_len")
    non_negative_fields = ("retriever_warmup", "mlm_warmup")
    fraction_fields = ("random_prob", "mlm_distractor")
    presets = {"cpu": {"steps": 200, "batch_size": 4, "k": 4, "mlm_warmup": 60, "warmup": 20, "retriever_warmup": 40,
                       "refresh_every": 50, "save_every": 50}}

    def __post_init__(self):
        super().__post_init__()
        if self.refresh not in REFRESH_MODES:
            raise ConfigError("refresh", f"must be one of {', '.join(REFRESH_MODES)}, got {self.refresh!r}")
        MaskingConfig(self.masking, self.random_prob)
        self.realm_config()

    def step_work(self) -> float:
        return self.batch_size * (self.k + 1)  # the encoder reads k blocks and the null document an example

    def realm_config(self) -> RealmConfig:
        return RealmConfig(self.k, self.max_len, self.max_query_len, self.null_doc, self.exclude_trivial)


@dataclass
class PretrainResult(TrainResult):
    examples: int  # sentences to mask
    blocks: int
    index_version: str  # the version in use at the end
    refreshes_kept: list[dict]  # {"version", "step", "seconds"} of each kept index version
    retriever: str  # RUN/final/retriever
    encoder: str  # RUN/final/encoder


# -- set-up ---------------------------------------------------------------------------------

def _retriever_source(cfg: PretrainConfig) -> str | None:
    """Where the towers come from: `init`, else the `index`'s retriever, else None (fresh)."""
    if cfg.init:
        found = find_model(cfg.init, "retriever", is_retriever_dir)
        if found is None:
            raise RalmError(f"{cfg.init}: neither an ICT run (no final/retriever) nor a retriever checkpoint")
        return str(found)
    if cfg.index:
        src = IndexDir(cfg.index)
        dense = section_of(src.version(src.latest()))
        if dense is None:  # checked before any work: the run would start from its retriever
            raise RalmError(f"index {cfg.index} is a {src.kind} index with no dense embeddings; pre-training needs a dense one")
        return str(src.root / dense.retriever)
    return None


def _import_version(src_path: str, index: IndexDir, key: str, block_len: int) -> str:
    """Publish the latest version of another dense index over the same blocks as version 1
    of this run's index (step 0), with the retriever that built it."""
    src = IndexDir(src_path)
    manifest = src.version(src.latest())
    dense = section_of(manifest)
    if dense is None:
        raise RalmError(f"{src_path} is a {src.kind} index; pre-training needs one with a dense side")
    check_block_len(block_len, src.blocks(manifest.blocks).config.max_len, src_path)
    if manifest.blocks != key:
        raise RalmError(f"{src_path} was built over another corpus, tokenizer or block size than this run's corpus")
    rpath = index.root / dense.retriever
    if not rpath.is_dir():
        shutil.copytree(src.root / dense.retriever, rpath)

    def write(tmp: Path) -> dict:
        shutil.copyfile(embeddings_file(src.version_path(src.latest())), embeddings_file(tmp))
        # the embeddings only: pre-training searches them exactly (a faiss index of them is left behind)
        sections = dense_sections(replace(dense, faiss=None, faiss_params={}).to_json())
        return {**{k: v for k, v in manifest.to_json().items() if k not in ("version", "created", "build_seconds")},
                "kind": kind_of(sections), "sides": list(sections), "sections": sections, "step": 0, "source": str(src.root)}

    return index.publish(write)


def _warm_encoder(cfg: PretrainConfig, run: Path, runtime: Runtime, notify: Callable[[str], None], blocks: BlockStore,
                  table: SentenceTable) -> KnowledgeAugmentedEncoder:
    """The knowledge-augmented encoder to start from: `encoder` (a warm-up run or a masked LM)
    or `model`; one whose MLM head is fresh first gets `mlm_warmup` steps of train.mlm in RUN/mlm
    (resumed like the rest of the run, under the pre-training's `runtime`), or REALM would start
    with an encoder that cannot read."""
    source = cfg.encoder or cfg.model
    if cfg.encoder and (found := find_model(cfg.encoder, "encoder", is_model_dir)):
        source = str(found)
    encoder = KnowledgeAugmentedEncoder.from_pretrained(source)
    if not encoder.fresh_head:
        return encoder
    if cfg.mlm_warmup == 0:
        notify("note: the encoder's MLM head starts untrained and mlm_warmup is 0: retrieval utility stays near 0 "
               "until it learns to read, and the towers may learn to rank near-empty blocks first "
               "(see docs/pretraining.md, 'Retriever collapse')")
        return encoder
    notify(f"MLM warm-up of the encoder: {cfg.mlm_warmup} steps in {run / 'mlm'}")
    # a warm-up step reads one block per sentence where REALM reads k + 1: twice the sentences is still cheap
    warm = MlmConfig(cfg.corpus, model=source, steps=cfg.mlm_warmup, head_steps=cfg.mlm_warmup // 3,
                     batch_size=2 * cfg.batch_size, masking=cfg.masking, distractor=cfg.mlm_distractor,
                     random_prob=cfg.random_prob, spacy_model=cfg.spacy_model, max_len=cfg.max_len, max_query_len=cfg.max_query_len,
                     block_len=cfg.block_len, save_every=cfg.mlm_warmup, log_every=cfg.log_every, seed=cfg.seed, dtype=cfg.dtype)
    summary = warm_up_encoder(warm, run / "mlm", runtime=runtime, notify=notify, corpus=(blocks, table))
    return KnowledgeAugmentedEncoder.from_pretrained(summary.encoder)


class IndexInUse:
    """The index version pre-training searches, refreshed between steps as `refresh` says (see
    the module doc). Rank 0 builds the starting version and runs the async builder."""

    def __init__(self, cfg: PretrainConfig, ctx: RunContext, index: IndexDir, key: str, *, blocks: BlockStore,
                 retriever: Retriever, start: int):
        self.cfg, self.ctx, self.index, self.key, self.blocks, self.retriever = cfg, ctx, index, key, blocks, retriever
        self.start = start  # the step this process starts (or resumes) at
        if ctx.env.is_main and not (index.root / "LATEST").is_file():
            ctx.notify("building the starting index")
            if cfg.index:
                _import_version(cfg.index, index, key, cfg.block_len)
            else:
                publish_embeddings(index, retriever, blocks_key=key, blocks=blocks, step=0, runtime=ctx.runtime,
                                   show_progress=ctx.show_progress)
        ctx.env.barrier()
        self.version = load_version(index, ctx.env.broadcast_object(index.latest()), runtime=ctx.runtime)
        self.snapshots = Snapshots(ctx.path / "refresh")
        self.builder = None
        if cfg.refresh == "async" and ctx.env.is_main:
            log = ctx.path / "refresh.log"
            self.builder = start_refresher(index.root, self.snapshots.root, log, runtime=ctx.runtime)
            ctx.notify(f"index builder started (pid {self.builder.pid}, log {log})")

    @property
    def built_at(self) -> int:
        """The step of the towers that embedded the version in use."""
        return self.version.manifest.step or 0

    def before_step(self, step: int) -> None:
        """Hand the builder the towers after `step` updates, or refresh in this process; then
        swap in the newest complete version."""
        cfg, env = self.cfg, self.ctx.env
        if self.builder is not None and step % cfg.refresh_every == 0 and step > self.start:
            self.snapshots.write(self.retriever, step)
        if cfg.refresh == "sync" and step - self.built_at >= cfg.refresh_every:
            if env.is_main:
                publish_embeddings(self.index, self.retriever, blocks_key=self.key, blocks=self.blocks, step=step,
                                   runtime=self.ctx.runtime)
            env.barrier()
        if cfg.refresh == "none":
            return
        # rank 0 reads LATEST for every rank: a sharded index must not mix the shards of two versions
        name = env.broadcast_object(self.index.latest())
        if name != self.version.name:
            self.version = load_version(self.index, name, runtime=self.ctx.runtime)
            m = self.version.manifest
            self.ctx.notify(f"step {step}: index {name} (built at step {m.step}, {m.seconds} s)")

    def search(self, queries: torch.Tensor, k: int) -> np.ndarray:
        """Block rows [B, k] of this rank's queries [B, D]."""
        return search_rank_queries(dense_of(self.version).index, queries, k, self.ctx.env)[1]

    def fields(self, _record: dict) -> dict:
        """What a metrics record says of the index."""
        return {"index_version": self.version.name, "index_step": self.built_at, "refresh_s": self.version.manifest.seconds}

    def close(self) -> None:
        """Stop the builder and remove the version it was writing."""
        if self.builder is None:
            return
        self.builder.terminate()
        self.builder.wait()
        for tmp in (self.index.root / "versions").glob(".building-*"):
            shutil.rmtree(tmp, ignore_errors=True)


class PretrainTrainer(Trainer):
    """Under torchrun every rank also searches its shard of the index; rank 0 refreshes the
    index and runs the async builder."""

    name, config = "pretrain", PretrainConfig
    plots = ("loss", "retrieval_utility", "staleness", "steps_per_s", "p_null", "span_in_top")
    lr_names = ("lr", "retriever_lr")
    in_use: IndexInUse | None = None

    def build(self) -> Realm:
        cfg, ctx = self.cfg, self.ctx
        with main_first(ctx.env):
            source = _retriever_source(cfg)
            self.retriever = Retriever.from_pretrained(source or cfg.model, dim=cfg.dim)
            self.index = dense_index(ctx.path / "index")
            self.key, self.blocks, self.table = corpus_sentences(self.index.blocks_dir, self.index.sentences_dir, cfg.corpus,
                                                                 hf_tokenizer=self.retriever.tokenizer, block_len=cfg.block_len,
                                                                 show_progress=ctx.show_progress, cfg=SentenceConfig(cfg.spacy_model))
        margin = trivial_margin(self.blocks.doc_index)
        if len(self.blocks) < cfg.k + margin:
            raise RalmError(f"{cfg.corpus}: {len(self.blocks)} blocks are too few for k = {cfg.k} (need at least {cfg.k + margin})")
        self.masking = MaskingConfig(cfg.masking, cfg.random_prob, max_len=cfg.max_query_len - 2)
        self.examples = self.table.with_spans(self.masking.max_len) if cfg.masking == "salient" else np.arange(len(self.table))
        if len(self.examples) == 0:
            raise RalmError(f"{cfg.corpus}: no sentence with a salient span (entity or date) to mask; try random masking")
        encoder = _warm_encoder(cfg, ctx.path, ctx.runtime, ctx.notify, self.blocks, self.table)
        self.model = Realm(self.retriever, encoder, cfg.realm_config()).to(ctx.device)
        start_projection(ctx, self.retriever, self.blocks, sample=1024)
        return self.model

    def optimizer(self, model: Realm) -> torch.optim.Optimizer:
        return torch.optim.AdamW([{"params": model.encoder.parameters()},
                                  {"params": model.retriever.parameters(), "lr": self.cfg.retriever_lr or self.cfg.lr}],
                                 lr=self.cfg.lr, weight_decay=0.01)

    def schedule(self) -> list[Schedule]:
        """Learning-rate multipliers for [encoder, towers]. The towers may wait `retriever_warmup`
        steps: an encoder whose MLM head starts fresh (MiniLM ships none) cannot yet use evidence,
        so every retrieved block looks worse than the null document and, left to train from step 0,
        the towers learn to rank near-empty blocks first, after which no evidence is ever read."""
        return [warmup_constant(self.cfg.warmup), delayed(warmup_constant(self.cfg.warmup), self.cfg.retriever_warmup)]

    def started(self) -> None:
        self.in_use = IndexInUse(self.cfg, self.ctx, self.index, self.key, blocks=self.blocks, retriever=self.retriever,
                                 start=self.loop.step)
        self.model.train()

    def step(self, i: int):
        cfg, in_use, blocks = self.cfg, self.in_use, self.blocks
        in_use.before_step(i)
        idx = self.examples[rank_batch(i, cfg.batch_size, n=len(self.examples), seed=cfg.seed, env=self.ctx.env)]
        batch = masked_batch(self.table, blocks, idx, cfg=self.masking, mask_id=self.retriever.tokenizer.mask_token_id,
                             seed=cfg.seed, step=i)
        out = self.loop.ddp(batch, blocks, in_use.search)
        loss, _ = global_mean(out.nll.sum(), int(out.tokens.sum()), self.ctx.env)  # per masked wordpiece, all ranks
        return loss, {"loss": loss.item(), "retrieval_utility": out.utility.mean().item(),
                      "p_null": out.log_pz[:, -1].exp().mean().item(),
                      "span_in_top": float(span_in_top_block(batch, blocks, out.rows, out.log_pz).mean()),
                      "staleness": i - in_use.built_at}

    def exports(self):
        return {"retriever": self.model.retriever, "encoder": self.model.encoder}

    def log_extra(self, record: dict) -> dict:
        return self.in_use.fields(record)

    def checkpoint_extra(self) -> dict:
        return {"realm": asdict(self.model.cfg), "retriever": asdict(self.retriever.cfg),
                "index_version": self.in_use.version.name}

    def close(self) -> None:
        if self.in_use is not None:
            self.in_use.close()

    def result(self, done: TrainResult) -> PretrainResult:
        versions = [self.index.version(v) for v in self.index.versions()]
        return PretrainResult(**asdict(done), examples=int(len(self.examples)), blocks=len(self.blocks),
                              index_version=self.in_use.version.name,
                              refreshes_kept=[{"version": v.version, "step": v.step, "seconds": v.seconds}
                                              for v in versions],
                              retriever=str(final_dir(self.ctx.path, "retriever")),
                              encoder=str(final_dir(self.ctx.path, "encoder")))


pretrain = PretrainTrainer.fit
