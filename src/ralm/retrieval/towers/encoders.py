"""The REALM retriever: a query tower and a document tower, each BERT -> pooled vector ->
projection to `dim`. Relevance is the inner product of the two.

Shapes: B batch, L sequence length, H BERT hidden size, D retrieval dim.

Loading Hugging Face encoders is encoders/loading.py; the PCA start of the projection
retrieval/towers/projection.py; encoding a corpus retrieval/towers/encoding.py.

Checkpoint directory (HF-style): config.json (our RetrieverConfig + the BERT config),
model.safetensors (`query.*`, `doc.*`), and the tokenizer files. While the two towers are
still equal (an untrained retriever, e.g. the one every default index saves) only `query.*`
is written, and loading gives the document tower the same weights: half the disk.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ralm.atomic import read_json, read_weights, safetensors_metadata, write_model_dir
from ralm.configs import config_from_file
from ralm.data.corpus import Document
from ralm.data.geometry import GEOMETRY
from ralm.encoders.loading import (assign_weights, default_model_path, encoder_from_config, load_checkpoint_tokenizer, load_hf_encoder,
                                   sentence_transformers_pooling)
from ralm.errors import RalmError
from ralm.runtime import autocast, compute_dtype, full_precision

FORMAT = "ralm.retriever/1"

# Mean squared norm of a projected document vector after initialisation. Relevance scores are
# raw inner products and p(z|x) their softmax: unit-norm sentence vectors (MiniLM) would give
# scores within [-1, 1] and a near-uniform p(z|x), and contrastive training (ICT, DPR) would
# then spend its first steps growing the norms, scrambling the pretrained geometry on the way.
# 20 is the logit scale sentence-transformers models are trained with (20 x cosine).
SCORE_SCALE = 20.0


@dataclass
class RetrieverConfig:
    dim: int | None = GEOMETRY.dim  # None: no projection, keep the BERT hidden size
    pooling: str = "cls"  # "cls" (REALM), "mean" (sentence-transformers models) or "pooler" (tanh pooler over [CLS], HF-REALM)
    normalize: bool = False  # L2-normalise the pooled vector before projecting
    proj_layernorm: bool = False  # HF-REALM's projection is Linear followed by LayerNorm
    pair_sep_id: int | None = None  # HF-REALM: [SEP]'s id; tokens after the first get segment id 1 (BERT's title/body pair)
    query_max_len: int = GEOMETRY.query_len
    block_max_len: int = GEOMETRY.block_len
    projection_init: str = "pca"  # how a fresh projection is set: "pca" (of document vectors) or "random"
    projection_ready: bool = False  # False until the projection was initialised or trained
    # relevance = score_scale * <query, doc>, a fixed logit scale for p(z|x) applied to the query
    # side only, so the index stores the encoder's own vectors (unit norm for MiniLM)
    score_scale: float = 1.0
    base_model: str = ""
    encoder: dict = field(default_factory=dict)  # the BERT config, to rebuild the towers

    def __post_init__(self):
        if self.pooling not in ("cls", "mean", "pooler"):
            raise RalmError(f"pooling must be 'cls', 'mean' or 'pooler', got {self.pooling!r}")
        if self.dim is not None and self.dim <= 0:
            raise RalmError(f"dim must be positive, got {self.dim}")
        if self.projection_init not in ("pca", "random"):
            raise RalmError(f"projection_init must be 'pca' or 'random', got {self.projection_init!r}")
        if not self.score_scale > 0:
            raise RalmError(f"score_scale must be positive, got {self.score_scale}")


def pool(hidden: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """[B, L, H], [B, L] -> [B, H]: the [CLS] vector, or the mean over real tokens (summed in
    fp32: a bf16 sum over 288 tokens would round away the last digits of the mean)."""
    if how == "cls":
        return hidden[:, 0]
    m = mask.unsqueeze(-1).float()  # [B, L, 1]
    return (hidden.float() * m).sum(1) / m.sum(1).clamp(min=1.0)


class Tower(nn.Module):
    """BERT -> pooled [CLS]/mean vector -> (Linear [+ LayerNorm]) -> [B, D] (x `scale`)."""

    def __init__(self, bert: nn.Module, cfg: RetrieverConfig):
        super().__init__()
        self.bert = bert
        self.cfg = cfg
        self.scale = 1.0  # the Retriever sets its query tower's to cfg.score_scale
        hidden = bert.config.hidden_size
        if cfg.dim is not None and cfg.dim > hidden and cfg.projection_init == "pca":
            raise RalmError(f"dim {cfg.dim} exceeds the encoder's hidden size {hidden}; use dim <= {hidden}")
        self.proj = nn.Linear(hidden, cfg.dim) if cfg.dim is not None else nn.Identity()
        self.norm = nn.LayerNorm(cfg.dim, eps=bert.config.layer_norm_eps) if cfg.proj_layernorm and cfg.dim else nn.Identity()

    def segments(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """[B, L] segment ids of BERT's pair encoding, derived from the first [SEP], so a block
        `[CLS] title [SEP] body [SEP]` is encoded as (title, body) and a query (one segment)
        as itself; None (all 0) unless the checkpoint records `pair_sep_id`."""
        if self.cfg.pair_sep_id is None:
            return None
        sep = (input_ids == self.cfg.pair_sep_id).long()
        return ((sep.cumsum(-1) - sep) > 0).long()  # 1 strictly after the first [SEP]

    def pooled(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        segments = self.segments(input_ids)
        extra = {} if segments is None else {"token_type_ids": segments}  # encoders without segments (MPNet) take none
        out = self.bert(input_ids=input_ids, attention_mask=attention_mask, **extra)
        v = out.pooler_output if self.cfg.pooling == "pooler" else pool(out.last_hidden_state, attention_mask, self.cfg.pooling)  # [B, H]
        v = v.float()
        return F.normalize(v, dim=-1) if self.cfg.normalize else v

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        pooled = self.pooled(input_ids, attention_mask)  # [B, H] float32
        with full_precision(pooled.device):  # the projection is cheap: keep fp32 vectors
            v = self.norm(self.proj(pooled))  # [B, D]
        return v * self.scale if self.scale != 1.0 else v


class Retriever(nn.Module):
    """p(z|x) ∝ exp(<query(x), doc(z)>). Holds its tokenizer; holds no index."""

    def __init__(self, query: Tower, doc: Tower, tokenizer, cfg: RetrieverConfig):
        super().__init__()
        self.query = query
        self.query.scale = cfg.score_scale
        self.doc = doc
        self.tokenizer = tokenizer
        self.cfg = cfg
        self._doc_fp: tuple[tuple, str] | None = None

    @property
    def dim(self) -> int:
        return self.cfg.dim or self.doc.bert.config.hidden_size

    def __repr__(self) -> str:
        """One line (nn.Module's tree view: `print(nn.Module.__repr__(retriever))`)."""
        c, enc = self.cfg, self.doc.bert.config
        projection = f"projection {enc.hidden_size}->{c.dim}" if c.dim is not None else "no projection"
        return (f"Retriever(dim={self.dim}, pooling={c.pooling!r}, normalize={c.normalize}, {projection}, "
                f"encoder={getattr(enc, 'model_type', 'bert')} {enc.num_hidden_layers}x{enc.hidden_size}, base_model={c.base_model!r})")

    def forward(self, q_ids: torch.Tensor, q_mask: torch.Tensor, d_ids: torch.Tensor, d_mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both towers in one call ([B, Lq] queries, [B', Ld] documents -> [B, D], [B', D]), so
        DistributedDataParallel sees the whole forward pass of a contrastive step."""
        return self.query(q_ids, q_mask), self.doc(d_ids, d_mask)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    # "[SEP]" or "[CLS]" typed in a query or a document is text, as in an index's blocks
    # (data/blocks.py wordpiece_tokenizer): never a second separator the towers would read
    def tokenize_queries(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        return self.tokenizer(list(texts), padding=True, truncation=True, max_length=self.cfg.query_max_len, return_tensors="pt",
                              split_special_tokens=True)

    def tokenize_documents(self, docs: Sequence[Document | str]) -> dict[str, torch.Tensor]:
        """`[CLS] title [SEP] text [SEP]` as in an index block (a string is a text without a
        title), cut to `block_max_len` wordpieces."""
        titles = ["" if isinstance(d, str) else d.title for d in docs]
        texts = [d if isinstance(d, str) else d.text for d in docs]
        return self.tokenizer(titles, texts, padding=True, truncation=True, max_length=self.cfg.block_max_len, return_tensors="pt",
                              split_special_tokens=True)

    def encode_queries(self, texts: Sequence[str], batch_size: int = 128, dtype: str | torch.dtype | None = None
                       ) -> torch.Tensor:
        """[Q] strings -> [Q, D] float32 on CPU; `dtype` is the compute dtype (None: auto; a
        Runtime's torch.dtype is used as it is, not resolved again)."""
        return self._encode(self.query, self.tokenize_queries, texts, batch_size=batch_size, dtype=dtype)

    def encode_documents(self, docs: Sequence[Document | str], batch_size: int = 64,
                         dtype: str | torch.dtype | None = None) -> np.ndarray:
        """[N] Documents (or texts) -> [N, D] float32: the vectors an index stores for them (of
        a document longer than one block, its first block's)."""
        return self._encode(self.doc, self.tokenize_documents, docs, batch_size=batch_size, dtype=dtype).numpy()

    @torch.inference_mode()
    def _encode(self, tower: Tower, tokenize, items: Sequence, *, batch_size: int,
                dtype: str | torch.dtype | None) -> torch.Tensor:
        if isinstance(items, str):
            raise RalmError("encode a list of texts; wrap a single text in a list")
        items, out, device, training = list(items), [], self.device, tower.training
        tower.eval()  # no dropout, whichever mode loading or training left the model in
        try:
            with autocast(device, compute_dtype(dtype, device)):
                for i in range(0, len(items), batch_size):
                    batch = {k: v.to(device) for k, v in tokenize(items[i : i + batch_size]).items()}
                    out.append(tower(batch["input_ids"], batch["attention_mask"]).float().cpu())  # [B, D]
        finally:
            tower.train(training)
        return torch.cat(out) if out else torch.zeros(0, self.dim)

    # -- fingerprints: an index records the document tower it was built with -----------------
    def doc_fingerprint(self) -> str:
        """A hash of the document tower's weights (and of the vector settings). Hashing ~90 MB
        takes longer than a one-shot search, so the value is kept while no weight changes
        (tensor version counters and storage), and a checkpoint records it in its safetensors header."""
        key = (_vector_settings(self.cfg), _weights_key(self.doc))
        if self._doc_fp is None or self._doc_fp[0] != key:
            self._doc_fp = (key, _fingerprint(self.doc, self.cfg))
        return self._doc_fp[1]

    # -- save / load -------------------------------------------------------------------------
    def save_pretrained(self, out: str | os.PathLike) -> None:
        state = self.state_dict()
        doc = {k: v for k, v in state.items() if k.startswith("doc.")}
        if all(torch.equal(v, state["query." + k[4:]]) for k, v in doc.items()):
            state = {k: v for k, v in state.items() if k not in doc}  # equal towers: stored once
        # hashed afresh, not from the cache: an optimiser that writes without bumping tensor
        # versions (torch's fused AdamW) must not leave a stale fingerprint in a checkpoint
        self._doc_fp = None
        write_model_dir(out, state, self.tokenizer, fmt=FORMAT, config=asdict(self.cfg),
                        metadata={"doc_fingerprint": self.doc_fingerprint()})

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike | None = None, dim: int | None = None,
                        pooling: str | None = None, **overrides) -> "Retriever":
        """Our checkpoint directory, any HF BERT-like model directory, or a hub name.

        `None` or "default" gives the offline default MiniLM. For a plain HF model, pooling
        follows its sentence-transformers config when present (mean for MiniLM), else [CLS].
        `dim` None keeps the encoder's own vectors (an untrained retriever then searches as its
        encoder does, over `[CLS] title [SEP] body [SEP]` blocks); an int adds a fresh projection
        to that size (REALM's 128), PCA-initialised by `ralm index build` or a trainer.
        """
        path = default_model_path() if name_or_path in (None, "", "default") else str(name_or_path)
        if is_retriever_dir(path):
            return _load_ralm(Path(path))
        return _load_hf(path, dim, pooling, overrides)


def is_retriever_dir(path: str | os.PathLike) -> bool:
    p = Path(path) / "config.json"
    return p.is_file() and read_json(p).get("format") == FORMAT


def _vector_settings(cfg: RetrieverConfig) -> str:
    inputs = {"dim": cfg.dim, "pooling": cfg.pooling, "normalize": cfg.normalize}
    if cfg.pair_sep_id is not None:  # other vectors from the same weights; absent: fingerprints of older indexes hold
        inputs["pair_sep_id"] = cfg.pair_sep_id
    return json.dumps(inputs)


def _fingerprint(module: nn.Module, cfg: RetrieverConfig) -> str:
    h = hashlib.sha256(_vector_settings(cfg).encode())
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _weights_key(module: nn.Module) -> tuple:
    """Changes whenever a weight of `module` is modified in place (an optimiser step) or replaced.
    Tensors made under torch.inference_mode keep no version counter; nothing trains them."""
    return tuple((name, t.data_ptr(), -1 if t.is_inference() else t._version)
                 for name, t in module.state_dict(keep_vars=True).items())


def _load_hf(path: str, dim: int | None, pooling: str | None, overrides: dict) -> Retriever:
    bert, tokenizer = load_hf_encoder(path)
    st_pooling, st_normalize = sentence_transformers_pooling(Path(path))
    normalize = overrides.pop("normalize", st_normalize)
    # Unit vectors without a projection score within [-1, 1]: give p(z|x) the 20 x cosine scale
    # a PCA projection gets (see SCORE_SCALE); rankings are unchanged.
    overrides.setdefault("score_scale", SCORE_SCALE if dim is None and normalize else 1.0)
    cfg = RetrieverConfig(
        dim=dim,
        pooling=pooling or st_pooling or "cls",
        normalize=normalize,
        base_model=path,
        encoder=bert.config.to_dict(),
        projection_ready=dim is None,
        **overrides,
    )
    query, doc = Tower(bert, cfg), Tower(copy.deepcopy(bert), cfg)
    if cfg.dim is not None:
        doc.proj.load_state_dict(query.proj.state_dict())  # start the towers symmetric
    return Retriever(query, doc, tokenizer, cfg)


def _load_ralm(path: Path) -> Retriever:
    raw = read_json(path / "config.json")
    raw.pop("format")
    cfg = config_from_file(RetrieverConfig, raw, path / "config.json")
    towers = [Tower(encoder_from_config(cfg.encoder, path / "config.json"), cfg) for _ in range(2)]
    model = Retriever(towers[0], towers[1], load_checkpoint_tokenizer(path), cfg)
    state = read_weights(path)
    if not any(k.startswith("doc.") for k in state):  # saved with equal towers (see the module's docstring)
        # mapped a second time: the towers share the file's pages until training writes one
        state.update({"doc." + k[6:]: v for k, v in read_weights(path).items() if k.startswith("query.")})
    missing, unexpected = assign_weights(model, state, path)
    # Position-id buffers are not always saved; any other gap is a broken checkpoint.
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise RalmError(f"{path}: checkpoint does not match its config (missing {missing[:5]}, unexpected {unexpected[:5]})")
    saved_fp = safetensors_metadata(path / "model.safetensors").get("doc_fingerprint")
    if saved_fp is not None:  # what save_pretrained hashed from these weights
        model._doc_fp = ((_vector_settings(cfg), _weights_key(model.doc)), saved_fp)
    return model
