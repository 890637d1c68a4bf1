"""REALM pre-training model: retrieve blocks z for a masked sentence x, read
`[CLS] x [SEP] z_body [SEP]` with a knowledge-augmented encoder (BERT + MLM head), and
marginalise over z per masked wordpiece:

    loss = -Σ_j log Σ_z p(z|x) p(y_j|z,x),   p(z|x) = softmax_z <query(x), doc(z)>

The index only *selects* the candidates; their embeddings are recomputed with the current
document tower, so the gradient reaches both towers and the encoder.

Shapes: B batch, K candidates (the top-k retrieved, then the null document last), R rows
returned by the index search, L input length, M masked positions per example (padded),
D retrieval dim, H hidden size, V vocabulary.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from einops import rearrange
from torch import nn
from torch.nn import functional as F

from ralm.atomic import atomic_path
from ralm.data.blocks import BlockStore, join_query_evidence, tokenizer_fingerprint
from ralm.data.geometry import GEOMETRY
from ralm.data.masking import MaskedSentence
from ralm.data.padding import pad_rows
from ralm.configs import ConfigError
from ralm.encoders.length_groups import by_length, length_group
from ralm.encoders.loading import ENCODER_OVERRIDES, default_model_path
from ralm.errors import RalmError, first_line
from ralm.retrieval.towers.encoders import Retriever
from ralm.runtime import full_precision


@dataclass
class RealmConfig:
    k: int = 8  # retrieved candidates per example (the null document comes on top)
    max_len: int = GEOMETRY.joined_len  # encoder input [CLS] x [SEP] z_body [SEP]: a full query and a full block
    max_query_len: int = GEOMETRY.query_len  # [CLS] x [SEP]
    null_doc: bool = True  # the empty block among the candidates (p(z|x) may choose "no evidence")
    exclude_trivial: bool = True  # drop retrieved blocks of x's own document (the ablation copies from them)

    def __post_init__(self):
        if self.k <= 0:
            raise ConfigError("k", f"must be a positive integer, got {self.k}")
        if self.max_len <= self.max_query_len + 1:
            raise ConfigError("max_len", f"{self.max_len} (the encoder input) leaves no room for evidence after a "
                              f"{self.max_query_len}-wordpiece query")


# -- the knowledge-augmented encoder ----------------------------------------------------------

class KnowledgeAugmentedEncoder(nn.Module):
    """A BERT with its MLM head (a Hugging Face BertForMaskedLM), scoring masked positions only."""

    def __init__(self, mlm: nn.Module, tokenizer, fresh_head: bool = False):
        super().__init__()
        if not (hasattr(mlm, "bert") and hasattr(mlm, "cls")):
            raise RalmError(f"the knowledge-augmented encoder must be a BERT masked LM, got {type(mlm).__name__}")
        self.mlm = mlm
        self.tokenizer = tokenizer
        self.fresh_head = fresh_head  # the checkpoint had no MLM head: it starts untrained
        self.register_state_dict_post_hook(_untie_state)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike | None = None) -> "KnowledgeAugmentedEncoder":
        """A BERT directory (`None` or "default": the offline default MiniLM); a missing MLM head
        (e.g. sentence-transformers MiniLM) starts fresh, its output layer tied to the word embeddings."""
        from transformers import AutoTokenizer, BertForMaskedLM

        path = default_model_path() if path in (None, "", "default") else str(path)

        try:
            mlm, info = BertForMaskedLM.from_pretrained(path, output_loading_info=True, **ENCODER_OVERRIDES)
            tokenizer = AutoTokenizer.from_pretrained(path, use_fast=True)
        except (OSError, ValueError) as e:
            raise RalmError(f"could not load encoder {path!r}: {first_line(e)}") from None
        return cls(mlm, tokenizer, fresh_head=any(k.startswith("cls.") for k in info["missing_keys"]))

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, attention_mask: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        """[N, L] x3, positions [N, M] -> MLM logits at those positions [N, M, V]."""
        h = self.mlm.bert(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask).last_hidden_state  # [N, L, H]
        h = h.gather(1, positions.unsqueeze(-1).expand(-1, -1, h.shape[-1]))  # [N, M, H]
        return self.mlm.cls(h)  # [N, M, V]

    def save_pretrained(self, out: str | os.PathLike) -> None:
        """A plain Hugging Face BertForMaskedLM directory (weights, config, tokenizer)."""
        with atomic_path(out) as tmp:
            tmp.mkdir()
            self.mlm.save_pretrained(str(tmp))
            self.tokenizer.save_pretrained(str(tmp))


def _untie_state(module: nn.Module, state: dict, prefix: str, local_metadata) -> None:
    """The MLM decoder shares its weight with the word embeddings (and its bias with the head's
    bias); safetensors refuses tensors that share memory, so checkpoints get a copy of each."""
    seen = set()
    for key in [k for k in state if k.startswith(prefix)]:
        ptr = state[key].data_ptr()
        if ptr in seen:
            state[key] = state[key].clone()
        seen.add(ptr)


# -- the maths, as plain functions --------------------------------------------------------------

def relevance_log_probs(query: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """log p(z|x): [B, D], [B, K, D] -> log-softmax over candidates of the inner products [B, K]."""
    with full_precision(query.device):  # inside autocast even fp32 inputs would run in bf16
        return torch.einsum("bd,bkd->bk", query.float(), docs.float()).log_softmax(-1)


def masked_token_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(y_j|z,x): logits [B, K, M, V], labels [B, M] -> [B, K, M]."""
    index = labels[:, None, :, None].expand(-1, logits.shape[1], -1, 1)  # [B, K, M, 1]
    return logits.float().log_softmax(-1).gather(-1, index).squeeze(-1)


def marginal_nll(log_pz: torch.Tensor, log_py: torch.Tensor, label_mask: torch.Tensor) -> torch.Tensor:
    """-Σ_j log Σ_z p(z|x) p(y_j|z,x) per example, in log space.

    log_pz [B, K], log_py [B, K, M], label_mask [B, M] (False at padding) -> [B].
    """
    per_token = torch.logsumexp(log_pz.unsqueeze(-1) + log_py, dim=1)  # [B, M]
    return -torch.where(label_mask, per_token, torch.zeros_like(per_token)).sum(-1)


def retrieval_utility(log_pz: torch.Tensor, log_py: torch.Tensor, label_mask: torch.Tensor) -> torch.Tensor:
    """log p(y|z*,x) - log p(y|null,x) per example [B], z* the most relevant retrieved block
    (the null document is the last candidate). Positive when evidence helps the encoder."""
    log_py = torch.where(label_mask.unsqueeze(1), log_py, torch.zeros_like(log_py)).sum(-1)  # [B, K]
    top = log_pz[:, :-1].argmax(-1)  # [B]
    return (log_py.gather(1, top.unsqueeze(1)).squeeze(1) - log_py[:, -1]).detach()


def span_in_top_block(examples: Sequence[MaskedSentence], blocks: BlockStore, rows: np.ndarray,
                      log_pz: torch.Tensor) -> np.ndarray:
    """Whether z*, the most relevant retrieved block, holds every masked wordpiece of x [B]:
    the encoder can copy only what the evidence holds, so this falling towards 0 means the
    retriever has stopped finding useful evidence."""
    top = log_pz[:, :-1].argmax(-1).tolist()  # [B]
    return np.array([block_holds_span(e, blocks, int(r[t])) for e, r, t in zip(examples, rows, top)])


def block_holds_span(example: MaskedSentence, blocks: BlockStore, row: int) -> bool:
    """Whether every masked wordpiece of x occurs in the body of block `row`."""
    return set(example.labels) <= set(blocks.body(row).tolist())


def select_candidates(rows: np.ndarray, doc_index: np.ndarray, source_docs: Sequence[int] | None, k: int) -> np.ndarray:
    """The first k search results per example that do not come from the example's own
    document (a trivial retrieval would let the encoder copy the masked span); with
    `source_docs` None simply the first k.

    rows [B, R] (ranked; -1 = no result), doc_index [N] -> [B, k] block rows.
    """
    out = np.empty((len(rows), k), dtype=np.int64)
    for b, ranked in enumerate(rows):
        ranked = ranked[ranked >= 0]
        kept = (ranked if source_docs is None else ranked[np.asarray(doc_index[ranked]) != source_docs[b]])[:k]
        if len(kept) < k:
            raise RalmError(f"only {len(kept)} non-trivial blocks among {len(ranked)} retrieved for k={k}; "
                            f"lower -k or use a larger corpus")
        out[b] = kept
    return out


def trivial_margin(doc_index: np.ndarray) -> int:
    """How many extra results to ask the index for: the most blocks any one document has."""
    return int(np.bincount(np.asarray(doc_index)).max()) if len(doc_index) else 0


def read_pairs(encoder: KnowledgeAugmentedEncoder, examples: Sequence[MaskedSentence],
               bodies: Sequence[Sequence[np.ndarray]], cfg: RealmConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MLM logits of `[CLS] x [SEP] z_body [SEP]` at x's masked positions, for the same number
    K of evidence bodies per example (the MLM warm-up reads one, REALM k + 1).

    Returns logits [B, K, M, V], labels [B, M], label_mask [B, M].
    """
    tok = encoder.tokenizer
    cls_id, sep_id, pad_id = tok.cls_token_id, tok.sep_token_id, tok.pad_token_id or 0
    b, k = len(examples), len(bodies[0])
    x_len = cfg.max_query_len - 2
    seqs, types = [], []
    for e, zs in zip(examples, bodies):
        for body in zs:
            ids, tt, _ = join_query_evidence(e.ids, body, cls_id=cls_id, sep_id=sep_id, max_len=cfg.max_len, max_query_len=x_len)
            seqs.append(ids)
            types.append(tt)
    kept = [[p for p in e.positions if p < x_len] for e in examples]
    if any(not p for p in kept):
        raise RalmError(f"an example has no masked wordpiece within the first {x_len} wordpieces")
    m = max(len(p) for p in kept)
    positions = torch.zeros(b, m, dtype=torch.long)
    labels = torch.zeros(b, m, dtype=torch.long)
    label_mask = torch.zeros(b, m, dtype=torch.bool)
    for i, (e, p) in enumerate(zip(examples, kept)):
        positions[i, : len(p)] = torch.tensor(p) + 1  # after [CLS]
        labels[i, : len(p)] = torch.tensor(e.labels[: len(p)])
        label_mask[i, : len(p)] = True
    dev = next(encoder.parameters()).device
    pos = positions.repeat_interleave(k, dim=0)  # [B*K, M]

    def run(rows: list[int]) -> torch.Tensor:  # [G, M, V] for G pairs of similar length
        ids, mask = pad_rows([seqs[r] for r in rows], pad_id)  # [G, L]
        tt, _ = pad_rows([types[r] for r in rows], 0)
        return encoder(ids.to(dev), tt.to(dev), mask.to(dev), pos[rows].to(dev))

    logits = by_length([len(x) for x in seqs], run, length_group(dev))  # [B*K, M, V]
    return rearrange(logits, "(b k) m v -> b k m v", b=b), labels.to(dev), label_mask.to(dev)


# -- the model ----------------------------------------------------------------------------------

@dataclass
class RealmOutput:
    nll: torch.Tensor  # [B] -Σ_j log Σ_z p(z|x) p(y_j|z,x)
    tokens: torch.Tensor  # [B] masked wordpieces per example
    utility: torch.Tensor  # [B] retrieval utility (no gradient)
    log_pz: torch.Tensor  # [B, K]
    rows: np.ndarray  # [B, K-1] retrieved block rows (the null document is not a row)


class Realm(nn.Module):
    def __init__(self, retriever: Retriever, encoder: KnowledgeAugmentedEncoder, cfg: RealmConfig):
        super().__init__()
        if tokenizer_fingerprint(retriever.tokenizer) != tokenizer_fingerprint(encoder.tokenizer):
            raise RalmError("the retriever and the knowledge-augmented encoder must share one wordpiece vocabulary")
        self.retriever = retriever
        self.encoder = encoder
        self.cfg = cfg
        tok = retriever.tokenizer
        self.cls_id, self.sep_id, self.pad_id = tok.cls_token_id, tok.sep_token_id, tok.pad_token_id or 0

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def embed_query(self, examples: Sequence[MaskedSentence]) -> torch.Tensor:
        """Query tower over `[CLS] x [SEP]` -> [B, D]."""
        x_len = self.cfg.max_query_len - 2
        ids, mask = pad_rows([[self.cls_id, *e.ids[:x_len], self.sep_id] for e in examples], self.pad_id)  # [B, Lq]
        return self.retriever.query(ids.to(self.device), mask.to(self.device))

    def embed_candidates(self, blocks: BlockStore, rows: np.ndarray) -> torch.Tensor:
        """Current document tower over the candidate blocks and the null document -> [B, K, D]."""
        b, k = rows.shape
        null = np.array([self.cls_id, self.sep_id])  # the empty block
        tokens = [blocks.tokens[int(r)] for r in rows.reshape(-1)] + [null]

        def run(group: list[int]) -> torch.Tensor:  # [G, D] for G blocks of similar length
            ids, mask = pad_rows([tokens[i] for i in group], self.pad_id)
            return self.retriever.doc(ids.to(self.device), mask.to(self.device))

        d = by_length([len(t) for t in tokens], run, length_group(self.device))  # [B*k + 1, D]
        retrieved = rearrange(d[:-1], "(b k) d -> b k d", b=b)
        return torch.cat([retrieved, d[-1].expand(b, 1, -1)], dim=1)  # [B, k + 1, D]

    def relevance(self, query: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
        """log p(z|x) [B, K] from query [B, D] and candidates [B, K, D] (the null document last)."""
        if self.cfg.null_doc:
            return relevance_log_probs(query, docs)
        # without it the null document is still read (the utility metric compares with it) but never chosen
        return F.pad(relevance_log_probs(query, docs[:, :-1]), (0, 1), value=float("-inf"))

    def read(self, examples: Sequence[MaskedSentence], blocks: BlockStore, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Encoder logits at the masked positions for every (x, z) pair, z the retrieved blocks
        and the null document last.

        Returns logits [B, K, M, V], labels [B, M], label_mask [B, M].
        """
        bodies = [[blocks.body(int(r)) for r in ranked] + [np.zeros(0, np.int64)] for ranked in rows]
        return read_pairs(self.encoder, examples, bodies, self.cfg)

    def forward(self, examples: Sequence[MaskedSentence], blocks: BlockStore,
                search: Callable[[torch.Tensor, int], np.ndarray]) -> RealmOutput:
        """`search(query [B, D], n) -> block rows [B, n]` is MIPS over the (possibly stale) index."""
        q = self.embed_query(examples)  # [B, D]
        trivial = self.cfg.exclude_trivial
        n = self.cfg.k + (trivial_margin(blocks.doc_index) if trivial else 0)
        rows = select_candidates(search(q.detach(), n), blocks.doc_index,
                                 [e.doc for e in examples] if trivial else None, self.cfg.k)  # [B, k]
        log_pz = self.relevance(q, self.embed_candidates(blocks, rows))  # [B, K]
        logits, labels, label_mask = self.read(examples, blocks, rows)
        log_py = masked_token_log_probs(logits, labels)  # [B, K, M]
        return RealmOutput(marginal_nll(log_pz, log_py, label_mask), label_mask.sum(-1),
                           retrieval_utility(log_pz, log_py, label_mask), log_pz, rows)
