"""Scoring REALM on the generated knowledge task (data/knowledge.py).

After training, the held-out entities' fact documents join the training corpus in a new index
built with the trained document tower (the ordinary `build_index` path, as a user adds
documents). Each held-out sentence, its fact masked, is then a query:

  recall@1      the top block of the index search is the fact document that states the fact
  recall@k      it is among the top k
  mlm_accuracy  the marginal Σ_z p(z|x) p(y|z,x) over the top k and the null document puts its
                argmax on the right wordpiece (per masked wordpiece)
  p_null        the mean p(null|x)

`search_recall` scores a retriever alone (ICT, DPR) through the ordinary searcher.

Shapes: B batch, K candidates (top k, then the null document), M masked positions, V vocabulary.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ralm.data.blocks import BlockConfig, wordpiece_tokenizer
from ralm.data.geometry import GEOMETRY
from ralm.data.knowledge import FactSentence, KnowledgeTask
from ralm.data.masking import MaskedSentence, MaskingConfig, mask_sentence
from ralm.models.realm import KnowledgeAugmentedEncoder, Realm, RealmConfig
from ralm.retrieval.index.build import build_index
from ralm.retrieval.index.dense_side import DENSE_KIND, dense_of
from ralm.retrieval.search.searcher import LoadedVersion, Searcher, load_version
from ralm.retrieval.towers.encoders import Retriever
from ralm.runtime import Runtime


@dataclass(frozen=True)
class KnowledgeScores:
    recall_at_1: float
    recall_at_k: float
    mlm_accuracy: float
    p_null: float
    sentences: int


def fact_examples(sentences: Sequence[FactSentence], hf_tokenizer, max_len: int = 62) -> list[MaskedSentence]:
    """Each sentence with the wordpieces of its fact replaced by [MASK] (doc -1: the sentence
    belongs to no indexed document, so nothing is excluded from its retrieval)."""
    tok = wordpiece_tokenizer(hf_tokenizer)
    cfg = MaskingConfig("salient", max_len=max_len)
    out = []
    for s, enc in zip(sentences, tok.encode_batch([s.text for s in sentences], add_special_tokens=False)):
        covered = [i for i, (a, b) in enumerate(enc.offsets) if a < s.span[1] and b > s.span[0]]
        spans = np.array([[covered[0], covered[-1] + 1]])
        out.append(mask_sentence(np.array(enc.ids), spans, cfg, mask_id=hf_tokenizer.mask_token_id,
                                 rng=np.random.default_rng(0), doc=-1))
    return out


def index_with_held_out(task: KnowledgeTask, retriever: str | os.PathLike, out: str | os.PathLike, *, runtime: Runtime,
                        block_len: int = GEOMETRY.block_len) -> LoadedVersion:
    """The training corpus plus the held-out fact documents, indexed by `retriever`'s document tower."""
    out = Path(out)
    corpus = task.write_corpus(out / "corpus.jsonl", with_eval=True)
    index, name = build_index(corpus, out / "index", kind=DENSE_KIND, model=str(retriever), runtime=runtime,
                              block_cfg=BlockConfig(max_len=block_len), show_progress=False)
    return load_version(index, name, runtime=runtime)


def search_recall(index: str | os.PathLike, queries: Sequence[str], sources: Sequence[str], k: int = 1) -> float:
    """Share of `queries` whose top `k` blocks in the index's dense side include a block of
    their source document: a retriever's score without an encoder (ICT, DPR)."""
    searcher = Searcher.open(index)
    rows = searcher.search_rows(list(queries), k, side=DENSE_KIND)[1]  # [Q, k]
    blocks = searcher.current.blocks
    return float(np.mean([any(blocks.record(int(r))["doc_id"] == s for r in ranked if r >= 0)
                          for ranked, s in zip(rows, sources)]))


@torch.no_grad()
def score_realm(model: Realm, version: LoadedVersion, sentences: Sequence[FactSentence], *,
                batch_size: int = 64) -> KnowledgeScores:
    """The scores of the module docstring for `model` over the index `version`."""
    model.eval()
    k = model.cfg.k
    doc_ids = np.array([version.blocks.record(i)["doc_id"] for i in range(len(version.blocks))])
    examples = fact_examples(sentences, model.retriever.tokenizer, model.cfg.max_query_len - 2)
    top1, topk, correct, tokens, p_null = [], [], 0, 0, []
    for a in range(0, len(examples), batch_size):
        batch, facts = examples[a:a + batch_size], sentences[a:a + batch_size]
        q = model.embed_query(batch)  # [B, D]
        rows = dense_of(version).index.search(q, k)[1]  # [B, k]
        sources = np.array([f.source for f in facts])
        top1.append(doc_ids[rows[:, 0]] == sources)
        topk.append((doc_ids[rows] == sources[:, None]).any(1))
        log_pz = model.relevance(q, model.embed_candidates(version.blocks, rows))  # [B, K]
        logits, labels, label_mask = model.read(batch, version.blocks, rows)  # [B, K, M, V], [B, M], [B, M]
        marginal = torch.logsumexp(log_pz[:, :, None, None] + logits.float().log_softmax(-1), dim=1)  # [B, M, V]
        hit = (marginal.argmax(-1) == labels) & label_mask
        correct += int(hit.sum())
        tokens += int(label_mask.sum())
        p_null.append(log_pz[:, -1].exp().cpu().numpy())
    top1, topk = np.concatenate(top1), np.concatenate(topk)
    return KnowledgeScores(float(top1.mean()), float(topk.mean()), correct / max(tokens, 1),
                           float(np.concatenate(p_null).mean()), len(examples))


def score_checkpoint(task: KnowledgeTask, retriever: str | os.PathLike, encoder: str | os.PathLike,
                     out: str | os.PathLike, *, k: int = 8, block_len: int = GEOMETRY.block_len, max_len: int = GEOMETRY.joined_len,
                     max_query_len: int = GEOMETRY.query_len, null_doc: bool = True, runtime: Runtime | None = None,
                     device: torch.device | str | None = None) -> KnowledgeScores:
    """Index the held-out fact documents with `retriever` (in `out`) and score the held-out
    sentences with it and `encoder` (exported REALM towers and encoder). `runtime`: where (None:
    the CPU, auto dtype; the older `device` still works, see `Runtime.of`)."""
    rt = Runtime.of(runtime, device=device)
    device = rt.device
    version = index_with_held_out(task, retriever, out, runtime=rt, block_len=block_len)
    model = Realm(Retriever.from_pretrained(retriever), KnowledgeAugmentedEncoder.from_pretrained(str(encoder)),
                  RealmConfig(k, max_len, max_query_len, null_doc, exclude_trivial=False)).to(device)
    return score_realm(model, version, task.eval_sentences)
