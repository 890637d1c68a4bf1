"""REALM pre-training: masked salient spans, retrieval over a refreshed index, marginal MLM.

Each step: mask a batch of sentences (data.masking), let the model retrieve top-k blocks from
the index version in use, compute the marginal loss (models.realm) and update the query tower,
the document tower and the knowledge-augmented encoder together. Between steps the trainer
swaps in the newest complete index version:

  refresh="async"  every `refresh_every` steps the retriever is handed to a separate builder
                   process (retrieval.refresh) that re-embeds the corpus; training never waits
  refresh="sync"   the trainer itself re-embeds the corpus when its index is `refresh_every`
                   steps stale (tests, tiny corpora); deterministic, so resumes reproduce
  refresh="none"   the starting index is never refreshed (an ablation)

A run directory holds, besides train.loop's checkpoints and metrics:
  RUN/index/            its own versioned index (blocks, spaCy sentence cache, versions)
  RUN/refresh/          retriever snapshots for the builder; RUN/refresh.log its log
  RUN/final/retriever/  Retriever.save_pretrained (query + document towers)
  RUN/final/encoder/    the knowledge-augmented encoder as a Hugging Face BertForMaskedLM
  RUN/final/trainer.json  {"step", "kind"}
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ralm.atomic import write_json
from ralm.data.masking import MaskingConfig, corpus_sentences, masked_batch
from ralm.distributed import DistEnv
from ralm.errors import RalmError
from ralm.models.realm import KnowledgeAugmentedEncoder, Realm, RealmConfig, span_in_top_block, trivial_margin
from ralm.retrieval.encoders import Retriever, is_retriever_dir
from ralm.retrieval.loading import default_model_path
from ralm.retrieval.projection import init_projection
from ralm.retrieval.refresh import Snapshots, publish_embeddings, start_refresher
from ralm.retrieval.searcher import LoadedVersion, load_version
from ralm.retrieval.store import IndexDir, embeddings_file
from ralm.runtime import autocast, dtype_name
from ralm.train.loop import MetricsLog, check_options, load_checkpoint, plot_metrics, save_checkpoint
from ralm.train.parallel import all_mean, global_mean, main_first, rank_batch, search_rank_queries, start_run, wrap_ddp

REFRESH_MODES = ("async", "sync", "none")


@dataclass
class PretrainConfig:
    corpus: str
    init: str | None = None  # an ICT run (its final/retriever) or a retriever checkpoint for both towers
    model: str = "default"  # HF BERT directory for the encoder (and for the towers without --init/--index)
    index: str | None = None  # an existing dense index over the same corpus to start from
    dim: int = 128
    steps: int = 1000
    batch_size: int = 8
    k: int = 8
    lr: float = 5e-5
    warmup: int = 100
    retriever_warmup: int = 0  # steps before the towers train (see _schedules)
    retriever_lr: float | None = None  # the towers' learning rate (default: lr)
    masking: str = "salient"
    random_prob: float = 0.15
    refresh: str = "async"
    refresh_every: int = 100
    max_len: int = 352
    max_query_len: int = 64
    block_len: int = 288  # wordpieces per evidence block (a --index must have been built with the same)
    save_every: int = 200
    log_every: int = 10
    seed: int = 0
    dtype: str = "auto"  # compute dtype (runtime.resolve_dtype); weights stay fp32

    def __post_init__(self):
        check_options(self, positive=("steps", "batch_size", "k", "refresh_every", "save_every", "log_every", "lr",
                                      "retriever_lr", "dim", "max_len", "max_query_len", "block_len"),
                      non_negative=("warmup", "retriever_warmup"), fractions=("random_prob",))
        if self.refresh not in REFRESH_MODES:
            raise RalmError(f"--refresh must be one of {', '.join(REFRESH_MODES)}, got {self.refresh!r}")
        MaskingConfig(self.masking, self.random_prob)
        RealmConfig(self.k, self.max_len, self.max_query_len)


# -- set-up ---------------------------------------------------------------------------------

def _retriever_source(cfg: PretrainConfig) -> str | None:
    """Where the towers come from: --init, else the --index's retriever, else None (fresh)."""
    if cfg.init:
        init = Path(cfg.init)
        for candidate in (init / "final" / "retriever", init):
            if is_retriever_dir(candidate):
                return str(candidate)
        raise RalmError(f"--init {cfg.init}: neither an ICT run (no final/retriever) nor a retriever checkpoint")
    if cfg.index:
        src = IndexDir(cfg.index)
        return str(src.root / src.version_manifest(src.latest())["retriever"])
    return None


def _import_version(src_path: str, index: IndexDir, key: str) -> str:
    """Publish the latest version of another dense index over the same blocks as version 1
    of this run's index (step 0), with the retriever that built it."""
    src = IndexDir(src_path)
    if src.kind != "dense":
        raise RalmError(f"--index {src_path} is a {src.kind} index; pre-training needs a dense one")
    manifest = src.version_manifest(src.latest())
    if manifest["blocks"] != key:
        raise RalmError(f"--index {src_path} was built over another corpus, tokenizer or block size than --corpus")
    if manifest.get("faiss"):
        raise RalmError(f"--index {src_path} is a faiss index; pre-training searches exact embeddings")
    rpath = index.root / manifest["retriever"]
    if not rpath.is_dir():
        shutil.copytree(src.root / manifest["retriever"], rpath)

    def write(tmp: Path) -> dict:
        shutil.copyfile(embeddings_file(src.version_path(src.latest())), embeddings_file(tmp))
        return {**{k: v for k, v in manifest.items() if k not in ("version", "created")}, "step": 0, "source": str(src.root)}

    return index.publish(write)


def _export(run: Path, model: Realm, step: int) -> None:
    model.retriever.save_pretrained(run / "final" / "retriever")
    model.encoder.save_pretrained(run / "final" / "encoder")
    write_json(run / "final" / "trainer.json", {"step": step, "kind": "realm"})


def _clean_partial_versions(index: IndexDir) -> None:
    """Remove the temporary folder of a version the (now stopped) builder was writing."""
    for tmp in (index.root / "versions").glob(".building-*"):
        shutil.rmtree(tmp, ignore_errors=True)


def _newest_version(index: IndexDir, version: LoadedVersion, device: torch.device, env: DistEnv,
                    dtype: torch.dtype) -> LoadedVersion:
    """The newest complete index version, the same on every rank (rank 0 reads LATEST: a
    sharded index must not mix the shards of two versions)."""
    name = env.broadcast_object(index.latest())
    return version if name == version.name else load_version(index, name, device, dtype)


def _schedules(cfg: PretrainConfig) -> list[Callable[[int], float]]:
    """Learning-rate multipliers for [encoder, towers]. The towers may wait `retriever_warmup`
    steps: an encoder whose MLM head starts fresh (MiniLM ships none) cannot yet use evidence,
    so every retrieved block looks worse than the null document and, left to train from step 0,
    the towers learn to rank near-empty blocks first, after which no evidence is ever read."""
    def ramp(s: int) -> float:
        return min(1.0, (s + 1) / max(cfg.warmup, 1))

    return [ramp, lambda s: 0.0 if s < cfg.retriever_warmup else ramp(s - cfg.retriever_warmup)]


# -- training -------------------------------------------------------------------------------

def pretrain(cfg: PretrainConfig, run: str | os.PathLike, device: torch.device, show_progress: bool = True,
             notify: Callable[[str], None] | None = None, on_metrics: Callable[[dict], None] | None = None) -> dict:
    """Train (or resume) the run at `run`. Under torchrun every rank trains on its
    `batch_size` share of a `batch_size x world` global batch and searches its shard of the
    index; rank 0 writes the run, refreshes the index and runs the async builder."""
    run = Path(run)
    env, device, dtype, show_progress, resume = start_run(run, cfg, device, show_progress)
    notify = notify if notify and env.is_main else (lambda _: None)
    with main_first(env):
        source = _retriever_source(cfg)
        retriever = Retriever.from_pretrained(source or cfg.model, dim=cfg.dim)
        index = IndexDir.create(run / "index", "dense")
        key, blocks, table = corpus_sentences(index.blocks_dir, index.sentences_dir, cfg.corpus, retriever.tokenizer,
                                              cfg.block_len, show_progress)
    encoder = KnowledgeAugmentedEncoder.from_pretrained(default_model_path() if cfg.model in ("", "default") else cfg.model)
    if encoder.fresh_head and cfg.retriever_warmup == 0:
        notify("note: the encoder's MLM head starts untrained; without --retriever-warmup the towers may learn to "
               "rank near-empty blocks first (watch span_in_top; see docs/pretraining.md, 'Retriever collapse')")
    margin = trivial_margin(blocks.doc_index)
    if len(blocks) < cfg.k + margin:
        raise RalmError(f"{cfg.corpus}: {len(blocks)} blocks are too few for -k {cfg.k} (need at least {cfg.k + margin})")
    masking = MaskingConfig(cfg.masking, cfg.random_prob, max_len=cfg.max_query_len - 2)
    examples = table.with_spans(masking.max_len) if cfg.masking == "salient" else np.arange(len(table))
    if len(examples) == 0:
        raise RalmError(f"{cfg.corpus}: no sentence with a salient span (entity or date) to mask; try --masking random")

    model = Realm(retriever, encoder, RealmConfig(cfg.k, cfg.max_len, cfg.max_query_len)).to(device)
    if env.is_main and not retriever.cfg.projection_ready and resume is None:
        init_projection(retriever, blocks, device, sample=1024, show_progress=show_progress, dtype=dtype)
    retriever.cfg.projection_ready = True
    opt = torch.optim.AdamW([{"params": model.encoder.parameters()},
                             {"params": model.retriever.parameters(), "lr": cfg.retriever_lr or cfg.lr}],
                            lr=cfg.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedules(cfg))
    step = 0
    if resume is not None:
        step = load_checkpoint(resume, model, opt, sched)["step"]
        notify(f"resuming from step {step}")
    if env.is_main and not (index.root / "LATEST").is_file():
        notify("building the starting index")
        if cfg.index:
            _import_version(cfg.index, index, key)
        else:
            publish_embeddings(index, retriever, key, blocks, 0, device, show_progress=show_progress, dtype=dtype)
    env.barrier()
    version = load_version(index, env.broadcast_object(index.latest()), device, dtype)
    ddp = wrap_ddp(model, env, device)  # broadcasts rank 0's weights (its PCA projection, fresh MLM head)
    snapshots = Snapshots(run / "refresh")
    refresher = None
    if cfg.refresh == "async" and env.is_main:
        refresher = start_refresher(index.root, snapshots.root, run / "refresh.log",
                                    device="cpu" if device.type == "cpu" else str(device), dtype=dtype_name(dtype))
        notify(f"index builder started (pid {refresher.pid}, log {run / 'refresh.log'})")

    metrics = MetricsLog(run, step) if env.is_main else None
    mask_id = retriever.tokenizer.mask_token_id
    model.train()
    window, t0 = [], time.perf_counter()
    try:
        while step < cfg.steps:
            if cfg.refresh == "sync" and step - version.manifest.get("step", 0) >= cfg.refresh_every:
                if env.is_main:
                    publish_embeddings(index, retriever, key, blocks, step, device, dtype=dtype)
                env.barrier()
            if cfg.refresh != "none" and (newest := _newest_version(index, version, device, env, dtype)) is not version:
                version = newest
                m = version.manifest
                notify(f"step {step}: index {version.name} (built at step {m.get('step')}, {m.get('seconds')} s)")

            def search(q: torch.Tensor, n: int) -> np.ndarray:
                return search_rank_queries(version.index, q, n, env)[1]

            idx = examples[rank_batch(step, cfg.batch_size, len(examples), cfg.seed, env)]
            batch = masked_batch(table, blocks, idx, masking, mask_id, cfg.seed, step)
            with autocast(device, dtype):
                out = ddp(batch, blocks, search)
            loss, _ = global_mean(out.nll.sum(), int(out.tokens.sum()), env)  # per masked wordpiece, all ranks
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            window.append({"loss": loss.item(), "retrieval_utility": out.utility.mean().item(),
                           "p_null": out.log_pz[:, -1].exp().mean().item(),
                           "span_in_top": float(span_in_top_block(batch, blocks, out.rows, out.log_pz).mean()),
                           "staleness": step - version.manifest.get("step", 0)})
            step += 1
            if refresher is not None and step % cfg.refresh_every == 0 and step < cfg.steps:
                snapshots.write(retriever, step)
            if step % cfg.log_every == 0 or step == cfg.steps:
                elapsed = time.perf_counter() - t0
                record = {"step": step, **{k: all_mean(float(np.mean([w[k] for w in window])), env) for k in window[0]},
                          "steps_per_s": round(len(window) / elapsed, 4), "lr": sched.get_last_lr()[0], "retriever_lr": sched.get_last_lr()[1],
                          "index_version": version.name, "index_step": version.manifest.get("step", 0),
                          "refresh_s": version.manifest.get("seconds")}
                if env.is_main:
                    metrics.log(record)
                    if on_metrics:
                        on_metrics(record)
                window, t0 = [], time.perf_counter()
            if step % cfg.save_every == 0 or step == cfg.steps:
                if env.is_main:
                    save_checkpoint(run, step, model, opt, sched,
                                    extra={"realm": asdict(model.cfg), "retriever": asdict(retriever.cfg), "index_version": version.name})
                    _export(run, model, step)
                env.barrier()  # no rank runs ahead of (or resumes past) a checkpoint being written
    finally:
        if refresher is not None:
            refresher.terminate()
            refresher.wait()
            _clean_partial_versions(index)
        if metrics is not None:
            metrics.close()
    plots = plot_metrics(run, ["loss", "retrieval_utility", "staleness", "steps_per_s", "p_null", "span_in_top"]) if env.is_main else []
    versions = [index.version_manifest(v) for v in index.versions()]
    return {"run": str(run), "steps": step, "examples": int(len(examples)), "blocks": len(blocks),
            "index_version": version.name, "refreshes_kept": [{"version": v["version"], "step": v.get("step"), "seconds": v.get("seconds")} for v in versions],
            "retriever": str(run / "final" / "retriever"), "encoder": str(run / "final" / "encoder"),
            "plots": [str(p) for p in plots]}
