"""REALM's evidence gain: how much the retrieved blocks lower the masked-LM loss on held-out text.

The sentences of a held-out corpus are salient-span masked exactly as pre-training masks
(data.masking: the spaCy sentence pass, `masked_batch` with the seed and step 0). Each masked
sentence x is then scored by the knowledge-augmented encoder twice, per masked wordpiece y_j:

  loss_retrieved  -log Σ_z p(z|x) p(y_j|z,x), z the top k blocks of a MIPS search of the query
                  tower over the index, then the null document: the marginal pre-training
                  minimises (`Realm.forward`, the same code). Blocks of x's own document are
                  excluded when the index holds it, as REALM excludes trivial retrievals
  loss_null       -log p(y_j|null,x): the encoder reading the empty block only, no retrieval

  evidence_gain   loss_null - loss_retrieved (nats per masked wordpiece; > 0: retrieval helps)
  helped_share    share of sentences whose retrieval loss is below their null-only loss
  gain_ci95       a 95% bootstrap interval of evidence_gain, articles resampled (the documents
                  sharing a title; a document without one is its own): a sentence's evidence is
                  mostly its article's other paragraphs, so the sentences of one article are not
                  independent draws. A gain of a few hundredths of a nat is noise unless it excludes 0
  retrieval_utility, p_null  training's metrics (log p(y|z*,x) - log p(y|null,x) summed over x's
                  masked wordpieces, z* the most relevant block; p(null|x)), averaged over sentences

Shapes: B batch, K candidates (top k, then the null document), M masked positions, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import KW_ONLY, asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ralm.configs import CORPUS_HELP, SPACY_HELP, ConfigError, option
from ralm.data.blocks import BlockStore
from ralm.data.geometry import GEOMETRY, check_block_len
from ralm.data.masking import MaskedSentence, MaskingConfig, SentenceConfig, corpus_sentences, masked_batch
from ralm.defaults import EVIDENCE_BATCH, EVIDENCE_SENTENCES, REALM_K
from ralm.errors import RalmError
from ralm.models.realm import (KnowledgeAugmentedEncoder, Realm, RealmConfig, marginal_nll, masked_token_log_probs,
                               read_pairs)
from ralm.progress import progress_bar
from ralm.retrieval.index.dense_side import dense_of, section_of
from ralm.retrieval.index.store import IndexDir
from ralm.retrieval.search.searcher import LoadedVersion, Searcher
from ralm.retrieval.towers.encoders import Retriever, is_retriever_dir
from ralm.rundir import find_model, is_model_dir
from ralm.runtime import Runtime, autocast


@dataclass(frozen=True)
class EvidenceConfig:
    retriever: str = option(help="a REALM run (its final/retriever) or a retriever directory", path="location")
    encoder: str = option(help="a REALM run (its final/encoder) or a BERT masked-LM directory", path="location")
    index: str = option(help="a dense index over the pre-training corpus, built with the retriever's document tower",
                        path="location")
    corpus: str = option(help="the held-out corpus: " + CORPUS_HELP, path="content")
    _: KW_ONLY
    k: int = option(REALM_K, "retrieved blocks per sentence (the null document is added), as in pre-training")
    limit: int | None = option(EVIDENCE_SENTENCES, "masked sentences scored, spread evenly over the corpus (None: all)")
    max_len: int = option(GEOMETRY.joined_len, "encoder input length: [CLS] x [SEP] block [SEP]")
    max_query_len: int = option(GEOMETRY.query_len, "wordpieces of the masked sentence x, [CLS] and [SEP] included")
    block_len: int = option(GEOMETRY.block_len, "wordpieces per block of the held-out corpus (where its sentences come from)")
    spacy_model: str = option(SentenceConfig.spacy_model, SPACY_HELP)
    seed: int = option(0, "the masks' seed (which salient span of a sentence is masked)")
    batch_size: int = option(EVIDENCE_BATCH, "sentences per forward pass (each reads k + 2 blocks)")
    cache: str | None = option(None, "folder for the held-out corpus' blocks and spaCy pass (None: a temporary one)",
                               path="location")

    def __post_init__(self):
        for name in ("k", "limit", "batch_size", "block_len"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ConfigError(name, f"must be a positive integer, got {value!r}")
        self.realm_config()

    def realm_config(self) -> RealmConfig:
        return RealmConfig(self.k, self.max_len, self.max_query_len, null_doc=True, exclude_trivial=True)


@dataclass(frozen=True)
class EvidenceScores:
    loss_retrieved: float  # nats per masked wordpiece, the marginal over the top k and the null document
    loss_null: float  # nats per masked wordpiece, the null document alone
    evidence_gain: float  # loss_null - loss_retrieved
    helped_share: float  # sentences whose retrieval loss is below their null-only loss
    gain_ci95: tuple[float, float]  # bootstrap over articles (`gain_interval`)
    retrieval_utility: float  # mean over sentences, nats summed over a sentence's masked wordpieces
    p_null: float  # mean p(null|x)
    sentences: int
    articles: int  # the units gain_ci95 resamples
    wordpieces: int  # masked wordpieces scored
    own_document_indexed: int  # sentences whose own document's blocks were excluded from their retrieval

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SentenceLosses:
    """One batch's per-sentence results [B]."""

    retrieved: torch.Tensor  # -Σ_j log Σ_z p(z|x) p(y_j|z,x)
    null: torch.Tensor  # -Σ_j log p(y_j|null,x)
    tokens: torch.Tensor  # masked wordpieces
    utility: torch.Tensor
    p_null: torch.Tensor


def null_only_nll(encoder: KnowledgeAugmentedEncoder, examples: Sequence[MaskedSentence], cfg: RealmConfig) -> torch.Tensor:
    """-Σ_j log p(y_j|null,x) per example [B]: the encoder reads the empty block, nothing is retrieved."""
    logits, labels, label_mask = read_pairs(encoder, examples, [[np.zeros(0, np.int64)]] * len(examples), cfg)  # [B, 1, M, V]
    log_pz = torch.zeros(len(examples), 1, device=logits.device)  # all mass on the one (null) candidate
    return marginal_nll(log_pz, masked_token_log_probs(logits, labels), label_mask)


@torch.no_grad()
def sentence_losses(model: Realm, examples: Sequence[MaskedSentence], version: LoadedVersion, rt: Runtime) -> SentenceLosses:
    """Both losses of one batch; `examples[i].doc` is x's document ordinal in the index (-1: none)."""
    with autocast(rt.device, rt.dtype):
        out = model(examples, version.blocks, lambda q, n: dense_of(version).index.search(q, n)[1])  # retrieval as in training
        null = null_only_nll(model.encoder, examples, model.cfg)
    return SentenceLosses(out.nll.float(), null.float(), out.tokens, out.utility.float(), out.log_pz[:, -1].exp())


def index_documents(blocks: BlockStore) -> dict[str, int]:
    """{document id: document ordinal} of an index's blocks."""
    doc_index = np.asarray(blocks.doc_index)
    return {blocks.record(i)["doc_id"]: int(doc_index[i]) for i in range(len(blocks))}


@dataclass(frozen=True)
class HeldOutSentences:
    """Masked held-out sentences and where each comes from."""

    examples: list[MaskedSentence]
    doc_ids: list[str]  # each sentence's document
    articles: list[str]  # its document's title (its id where it has none): the unit gain_ci95 resamples


def heldout_examples(cfg: EvidenceConfig, hf_tokenizer, folder: Path, *, show_progress: bool) -> HeldOutSentences:
    """The held-out corpus' masked sentences (`limit` of them, evenly spread)."""
    _, blocks, table = corpus_sentences(folder / "blocks", folder / "sentences", cfg.corpus, hf_tokenizer=hf_tokenizer,
                                        block_len=cfg.block_len, show_progress=show_progress,
                                        cfg=SentenceConfig(cfg.spacy_model))
    masking = MaskingConfig("salient", max_len=cfg.max_query_len - 2)
    candidates = table.with_spans(masking.max_len)
    if len(candidates) == 0:
        raise RalmError(f"{cfg.corpus}: no sentence with a salient span (entity or date) to mask")
    if cfg.limit is not None and cfg.limit < len(candidates):
        candidates = candidates[np.unique(np.linspace(0, len(candidates) - 1, cfg.limit).round().astype(np.int64))]
    examples = masked_batch(table, blocks, candidates, cfg=masking, mask_id=hf_tokenizer.mask_token_id, seed=cfg.seed, step=0)
    records = [blocks.record(int(table.rows[s])) for s in candidates]
    return HeldOutSentences(examples, [r["doc_id"] for r in records], [r["title"] or r["doc_id"] for r in records])


def gain_interval(null: torch.Tensor, retrieved: torch.Tensor, tokens: torch.Tensor, units: Sequence[str], *,
                  draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95% percentile-bootstrap interval of (Σ null - Σ retrieved) / Σ tokens from per-sentence
    sums [B], resampling whole `units` [B] (each sentence's article): sentences that share their
    evidence move together, so resampling them one by one would give too narrow an interval."""
    unit = np.unique(np.asarray(units), return_inverse=True)[1]
    gain = np.bincount(unit, weights=(null - retrieved).double().numpy())  # [U]
    tok = np.bincount(unit, weights=tokens.double().numpy())  # [U]
    rows = np.random.default_rng(seed).integers(0, len(gain), size=(draws, len(gain)))  # [draws, U]
    lo, hi = np.quantile(gain[rows].sum(1) / tok[rows].sum(1), [0.025, 0.975])
    return float(lo), float(hi)


def score_evidence(model: Realm, version: LoadedVersion, held_out: HeldOutSentences, *, rt: Runtime,
                   batch_size: int = 16) -> EvidenceScores:
    """The scores of the module docstring for `model` over the index `version`."""
    model.eval()
    own = index_documents(version.blocks)
    examples = [dataclasses.replace(e, doc=own.get(d, -1)) for e, d in zip(held_out.examples, held_out.doc_ids)]
    parts = []
    with progress_bar(rt.show_progress) as bar:
        task = bar.add_task("evidence gain", total=len(examples))
        for a in range(0, len(examples), batch_size):
            parts.append(sentence_losses(model, examples[a:a + batch_size], version, rt))
            bar.advance(task, len(parts[-1].tokens))
    retrieved, null, tokens, utility, p_null = (torch.cat([getattr(p, f.name) for p in parts]).cpu()
                                                for f in dataclasses.fields(SentenceLosses))
    n = int(tokens.sum())
    loss_retrieved, loss_null = float(retrieved.sum()) / n, float(null.sum()) / n
    return EvidenceScores(loss_retrieved, loss_null, loss_null - loss_retrieved, float((retrieved < null).float().mean()),
                          gain_interval(null, retrieved, tokens, held_out.articles), float(utility.mean()),
                          float(p_null.mean()), len(examples), len(set(held_out.articles)), n,
                          sum(e.doc >= 0 for e in examples))


def load_realm(cfg: EvidenceConfig, runtime: Runtime) -> Realm:
    """The exported towers and encoder of `cfg` as one REALM model, on the runtime's device."""
    retriever = find_model(cfg.retriever, "retriever", is_retriever_dir)
    if retriever is None:
        raise RalmError(f"retriever {cfg.retriever}: neither a REALM run (no final/retriever) nor a retriever directory")
    encoder = find_model(cfg.encoder, "encoder", is_model_dir)
    if encoder is None:
        raise RalmError(f"encoder {cfg.encoder}: neither a REALM run (no final/encoder) nor a BERT masked-LM directory")
    model = Realm(Retriever.from_pretrained(str(retriever)), KnowledgeAugmentedEncoder.from_pretrained(str(encoder)),
                  cfg.realm_config())
    if model.encoder.fresh_head:
        raise RalmError(f"encoder {encoder} has no MLM head: pass a REALM run or a masked LM, not a bare BERT")
    return model.to(runtime.device)


def open_index(cfg: EvidenceConfig, retriever: Retriever, rt: Runtime) -> LoadedVersion:
    """The index's newest version; its dense side must come from `retriever`'s document tower."""
    index = IndexDir(cfg.index)
    name = index.latest()
    if section_of(index.version(name)) is None:
        raise RalmError(f"index {cfg.index} has no dense side; the evidence gain needs the REALM document tower's embeddings")
    check_block_len(cfg.block_len, index.blocks(index.version(name).blocks).config.max_len, cfg.index)
    return Searcher(index, retriever, runtime=rt).current  # `retriever` the query model its sides are offered


def evidence_gain(cfg: EvidenceConfig, rt: Runtime | None = None) -> EvidenceScores:
    """Load the REALM model, its index and the held-out corpus of `cfg` and score them."""
    rt = Runtime.of(rt)
    if not Path(cfg.corpus).exists():
        raise RalmError(f"corpus {cfg.corpus}: no such file or folder")
    model = load_realm(cfg, rt)
    version = open_index(cfg, model.retriever, rt)
    with tempfile.TemporaryDirectory(prefix="ralm-evidence-") as tmp:
        folder = Path(cfg.cache) if cfg.cache else Path(tmp)
        held_out = heldout_examples(cfg, model.retriever.tokenizer, folder, show_progress=rt.show_progress)
    return score_evidence(model, version, held_out, rt=rt, batch_size=cfg.batch_size)
