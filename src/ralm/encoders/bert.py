"""BERT, small and self-contained: the encoder of the retriever towers and the reader, with
Hugging Face's parameter names, so the same safetensors load into it and into `BertModel`.

transformers' BERT modelling module imports more than torch itself does (its loading pulls in
torch.distributed, dynamo and scipy); a one-shot `ralm ask` spent most of its time there.
tests/test_bert.py checks this module against `transformers.BertModel` on the same weights,
with and without padding.

Weights load without copies: `ralm.atomic.read_weights` maps the file and views its tensors, and the
model is built on the meta device and takes those views (`assign=True`), so nothing is
initialised at random only to be overwritten, and pages are read as the forward pass needs them.

Shapes: B batch, L length, H hidden size, A heads, Dh = H / A head size, F FFN size.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from ralm.errors import RalmError


@dataclass
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.0
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    model_type: str = "bert"

    @classmethod
    def from_dict(cls, raw: dict) -> "BertConfig":
        known = {f.name for f in fields(cls)}
        cfg = cls(**{k: v for k, v in raw.items() if k in known})
        cfg._raw = dict(raw)
        return cfg

    def to_dict(self) -> dict:
        """The Hugging Face config this was read from, with this module's fields."""
        return {**getattr(self, "_raw", {}), **{f.name: getattr(self, f.name) for f in fields(self)}}


def supports(encoder: dict) -> bool:
    """Whether a Hugging Face config describes the BERT this module implements."""
    return (encoder.get("model_type", "bert") == "bert" and encoder.get("hidden_act", "gelu") == "gelu"
            and encoder.get("position_embedding_type", "absolute") == "absolute"
            and not encoder.get("is_decoder") and not encoder.get("add_cross_attention"))


class Linear(nn.Linear):
    """nn.Linear, without the random init on the meta device: the checkpoint supplies the
    weights, and torch's init functions on meta tensors would import torch._dynamo (seconds)."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class LayerNorm(nn.LayerNorm):
    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


@dataclass
class BertOutput:
    last_hidden_state: torch.Tensor  # [B, L, H]
    pooler_output: torch.Tensor  # [B, H]


class Embeddings(nn.Module):
    def __init__(self, cfg: BertConfig, device=None):
        super().__init__()
        self.word_embeddings = Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id, device=device)
        self.position_embeddings = Embedding(cfg.max_position_embeddings, cfg.hidden_size, device=device)
        self.token_type_embeddings = Embedding(cfg.type_vocab_size, cfg.hidden_size, device=device)
        self.LayerNorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, device=device)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # [L]
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(x))  # [B, L, H]


class SelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig, device=None):
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.query = Linear(cfg.hidden_size, cfg.hidden_size, device=device)
        self.key = Linear(cfg.hidden_size, cfg.hidden_size, device=device)
        self.value = Linear(cfg.hidden_size, cfg.hidden_size, device=device)
        self.dropout = cfg.attention_probs_dropout_prob

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, length, h = x.shape
        q, k, v = (proj(x).view(b, length, self.heads, h // self.heads).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))  # [B, A, L, Dh] each
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0)
        return y.transpose(1, 2).reshape(b, length, h)  # [B, L, H]


class DenseNorm(nn.Module):
    """Linear -> dropout -> residual add -> LayerNorm (HF's BertSelfOutput and BertOutput)."""

    def __init__(self, d_in: int, cfg: BertConfig, device=None):
        super().__init__()
        self.dense = Linear(d_in, cfg.hidden_size, device=device)
        self.LayerNorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, device=device)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: BertConfig, device=None):
        super().__init__()
        self.self = SelfAttention(cfg, device)
        self.output = DenseNorm(cfg.hidden_size, cfg, device)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, mask), x)


class Intermediate(nn.Module):
    def __init__(self, cfg: BertConfig, device=None):
        super().__init__()
        self.dense = Linear(cfg.hidden_size, cfg.intermediate_size, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))  # [B, L, F]


class Layer(nn.Module):
    def __init__(self, cfg: BertConfig, device=None):
        super().__init__()
        self.attention = BertAttention(cfg, device)
        self.intermediate = Intermediate(cfg, device)
        self.output = DenseNorm(cfg.intermediate_size, cfg, device)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, mask)  # [B, L, H]
        return self.output(self.intermediate(x), x)


class Encoder(nn.Module):
    def __init__(self, cfg: BertConfig, device=None):
        super().__init__()
        self.layer = nn.ModuleList(Layer(cfg, device) for _ in range(cfg.num_hidden_layers))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, mask)
        return x


class Pooler(nn.Module):
    def __init__(self, cfg: BertConfig, device=None):
        super().__init__()
        self.dense = Linear(cfg.hidden_size, cfg.hidden_size, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x[:, 0]))  # [B, H]


class Bert(nn.Module):
    """`BertModel(input_ids, attention_mask, token_type_ids)` -> last_hidden_state, pooler_output."""

    def __init__(self, cfg: BertConfig, device=None):
        super().__init__()
        self.config = cfg
        self.embeddings = Embeddings(cfg, device)
        self.encoder = Encoder(cfg, device)
        self.pooler = Pooler(cfg, device)
        self._register_load_state_dict_pre_hook(_drop_position_ids)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> BertOutput:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.embeddings(input_ids, token_type_ids)  # [B, L, H]
        mask = None
        if attention_mask is not None:
            # [B, 1, 1, L] additive: -inf would give NaN rows for all-padding inputs
            mask = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        x = self.encoder(x, mask)
        return BertOutput(x, self.pooler(x))


def _drop_position_ids(state: dict, prefix: str, *args) -> None:
    """Older transformers saved the position-id buffer; this model computes positions."""
    state.pop(prefix + "embeddings.position_ids", None)


def bert_from_config(encoder: dict, device: torch.device | str | None = None) -> Bert:
    """An untrained Bert of a Hugging Face config; on the meta device (no memory, no random
    init) for a checkpoint to be assigned into."""
    cfg = BertConfig.from_dict(encoder)
    if cfg.hidden_size % cfg.num_attention_heads:
        raise RalmError(f"hidden_size {cfg.hidden_size} is not a multiple of num_attention_heads {cfg.num_attention_heads}")
    return Bert(cfg, device)  # passed to each layer: a `with torch.device(...)` block would import torch._dynamo
