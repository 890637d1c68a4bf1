"""A small decoder-only Transformer LM (nanoGPT-shaped, rotary positions) and the loader
that gives it and any local Hugging Face causal LM one interface: `features(ids)` -> final
hidden states (the kNN-LM key), `head(hidden)` -> logits.

Dimensions: B batch, T tokens, D model dim, Hd heads, Dh head dim, S key/value length,
V vocabulary.

The attention, MLP and block modules here, and the decoder itself, are shared by RETRO
(models/retro.py: RetroLM is a TransformerLM with chunked cross-attention between its blocks).

Model directory: config.json ({"format": "ralm.lm/1", LMConfig}), model.safetensors, tokenizer.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import ClassVar
from pathlib import Path

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ralm.atomic import read_json, read_weights, write_model_dir
from ralm.configs import ConfigError, option
from ralm.errors import RalmError
from ralm.rundir import find_model
from ralm.runtime import full_precision

FORMAT = "ralm.lm/1"


@dataclass
class LMConfig:
    vocab_size: int = option(30522, "vocabulary size (the bundled MiniLM wordpieces)", cli=False)
    dim: int = option(256, "model width")
    layers: int = option(4, "decoder layers")
    heads: int = option(4, "attention heads per layer")
    mlp_ratio: int = option(4, "MLP width as a multiple of dim")
    dropout: float = option(0.0, "dropout rate")
    max_len: int = option(256, "training context in wordpieces (rotary positions work past it, less well)", flag="--seq-len")
    positive: ClassVar[tuple[str, ...]] = ("vocab_size", "dim", "layers", "heads", "max_len")

    def __post_init__(self):
        for name in self.positive:  # first: heads 0 would make the split below divide by zero
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be positive, got {getattr(self, name)}")
        if self.dim % self.heads or (self.dim // self.heads) % 2:
            raise ConfigError("dim", f"{self.dim} must split into {self.heads} heads of even size")


# -- positions ----------------------------------------------------------------------------

def rotary(positions: torch.Tensor, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, Dh/2] for integer positions [S]. Rotating q and k by their positions makes
    q·k depend on the position difference only: relative positions without a bias table."""
    inv = base ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[:, None] * inv[None]  # [S, Dh/2]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [..., S, Dh] rotated pairwise by cs = (cos, sin) [S, Dh/2]."""
    cos, sin = cs
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


# -- layers -------------------------------------------------------------------------------

class Attention(nn.Module):
    """Multi-head attention of x [B, T, D] over `context` [B, S, D] (itself when None).

    `causal` masks the future (self-attention only); `key_mask` [B, S] (True = real) hides
    padding; `q_pos` / `k_pos` rotary tables give relative positions (None: no positions).
    """

    def __init__(self, dim: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.dropout = dropout

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *, causal: bool = False,
                key_mask: torch.Tensor | None = None, q_pos=None, k_pos=None) -> torch.Tensor:
        context = x if context is None else context
        q = rearrange(self.q(x), "b t (h d) -> b h t d", h=self.heads)  # [B, Hd, T, Dh]
        k, v = rearrange(self.kv(context), "b s (two h d) -> two b h s d", two=2, h=self.heads)  # [B, Hd, S, Dh] each
        if q_pos is not None:
            q, k = apply_rotary(q, q_pos), apply_rotary(k, k_pos)
        mask = None if key_mask is None else key_mask[:, None, None, :]  # [B, 1, 1, S]
        if causal and mask is not None:
            mask = mask & torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.out(rearrange(y, "b h t d -> b t (h d)"))  # [B, T, D]


class MLP(nn.Module):
    def __init__(self, dim: int, ratio: int, dropout: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, ratio * dim), nn.GELU(), nn.Linear(ratio * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TransformerBlock(nn.Module):
    """Pre-norm self-attention + MLP; causal in the decoder, bidirectional in RETRO's encoder."""

    def __init__(self, dim: int, heads: int, *, mlp_ratio: int, dropout: float = 0.0, causal: bool = True):
        super().__init__()
        self.causal = causal
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, dropout)
        self.mlp = MLP(dim, mlp_ratio, dropout)

    def forward(self, x: torch.Tensor, pos, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), causal=self.causal, key_mask=key_mask, q_pos=pos, k_pos=pos)
        return x + self.mlp(self.ln2(x))


# -- the model ----------------------------------------------------------------------------

class TransformerLM(nn.Module):
    """Token embedding -> causal blocks -> final LayerNorm -> tied output layer."""

    model_format: ClassVar[str] = FORMAT  # what save_pretrained writes into config.json

    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(TransformerBlock(cfg.dim, cfg.heads, mlp_ratio=cfg.mlp_ratio, dropout=cfg.dropout)
                                    for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.apply(_init_weights)

    @property
    def dim(self) -> int:
        return self.cfg.dim

    def features(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> final hidden states [B, T, D] (the input of the output layer)."""
        pos = rotary(torch.arange(ids.shape[1], device=ids.device), self.cfg.dim // self.cfg.heads)
        x = self.drop(self.embed(ids))  # [B, T, D]
        for block in self.blocks:
            x = block(x, pos)
        return self.ln_f(x)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, D] -> logits [B, T, V], tied to the input embedding. fp32 even under autocast:
        bf16 logits are spaced 1/16 apart near 10, which perplexities and kNN-LM mixing see."""
        with full_precision(hidden.device):
            return hidden.float() @ self.embed.weight.T

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(ids))  # [B, T, V]

    def save_pretrained(self, out: str | os.PathLike, tokenizer) -> None:
        write_model_dir(out, self.state_dict(), tokenizer, fmt=self.model_format, config=asdict(self.cfg))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross-entropy; logits [B, T, V], targets [B, T] (ignore_index skipped)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=ignore_index)


# -- directories --------------------------------------------------------------------------

def model_dir(path: str | os.PathLike, fmt: str) -> Path | None:
    """The model directory of `path` in format `fmt`: the path itself, or a training run's export."""
    def in_format(cand: Path) -> bool:
        return (cand / "config.json").is_file() and read_json(cand / "config.json").get("format") == fmt

    return find_model(path, "model", in_format)


def load_model_dir(path: Path, model_cls, config_cls):
    """(model, tokenizer) from a directory written by write_model_dir."""
    from transformers import AutoTokenizer

    raw = read_json(path / "config.json")
    raw.pop("format")
    model = model_cls(config_cls(**raw))
    try:
        model.load_state_dict(read_weights(path), strict=True)
    except RuntimeError as e:
        raise RalmError(f"{path}: weights do not match config.json ({str(e).splitlines()[0]})") from None
    return model.eval(), AutoTokenizer.from_pretrained(str(path), use_fast=True)


class HFCausalLM(nn.Module):
    """Any Hugging Face causal LM behind the `features` / `head` interface."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.dim = model.config.hidden_size
        self.cfg = LMConfig(vocab_size=model.config.vocab_size, dim=self.dim, layers=1, heads=1,
                            max_len=getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", 1024))

    def features(self, ids: torch.Tensor) -> torch.Tensor:
        # HF appends the last hidden state after the final norm, i.e. the output layer's input.
        return self.model(input_ids=ids, output_hidden_states=True).hidden_states[-1]  # [B, T, D]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(hidden)  # [B, T, V]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(ids))


def context(model, seq_len: int | None = None, stride: int | None = None) -> tuple[int, int]:
    """(window, new tokens per window) for scoring a text with `model`: by default its training
    length, and half of it."""
    seq_len = seq_len or model.cfg.max_len
    return seq_len, stride or seq_len // 2


def load_lm(path: str | os.PathLike):
    """(model, tokenizer) from our LM directory, a `ralm lm train` run, or a local HF causal-LM directory."""
    path = Path(path)
    ours = model_dir(path, FORMAT)
    if ours is not None:
        return load_model_dir(ours, TransformerLM, LMConfig)
    if not (path / "config.json").is_file():
        raise RalmError(f"{path}: not a language model (no config.json; train one with `ralm lm train`)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path))
        tokenizer = AutoTokenizer.from_pretrained(str(path), use_fast=True)
    except (OSError, ValueError) as e:
        raise RalmError(f"could not load causal LM {str(path)!r}: {str(e).strip().splitlines()[0]}") from None
    return HFCausalLM(model).eval(), tokenizer
