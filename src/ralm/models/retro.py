"""RETRO (Borgeaud et al., 2021): a decoder-only Transformer whose chunked cross-attention
(CCA) layers read neighbours retrieved for earlier chunks of the sequence.

Dimensions: B batch, T tokens, D model dim, V vocabulary, m chunk length, n = T // m complete
chunks, k neighbours per chunk, r = 2m tokens per neighbour (the retrieved chunk + its
continuation).

Data flow (paper Fig. 2):
  tokens -> embedding -> decoder blocks; at the first CCA layer the neighbour encoder runs
  once: each neighbour [r] is encoded bidirectionally while cross-attending to the hidden
  states of the chunk it was retrieved for, giving E [B, n, k, r, D]. Every CCA layer then
  lets the tokens of chunk u+1 (shifted: positions u*m + m - 1 ... u*m + 2m - 2) attend to
  E[u], the neighbours of chunk u. Chunk u is complete at position u*m + m - 1, so no token
  ever sees neighbours retrieved with its own future, and the first m - 1 tokens see none.
Positions are rotary everywhere (relative): within the sequence, within each neighbour, and
in CCA. There a neighbour token i (0 <= i < r) sits at offset i from the start of its retrieved
chunk, which stands for chunk u, and attending token j sits at offset m - 1 + j from the start
of chunk u: each token is nearest the neighbour token at its own place in the text, whose
successor (the continuation) is what it predicts.

Model directory: config.json ({"format": "ralm.retro/2", RetroConfig}), model.safetensors,
tokenizer (models/lm.py writes and reads it).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ralm.atomic import read_json
from ralm.configs import ConfigError, option
from ralm.defaults import MAX_NEW_TOKENS, SAMPLE_TEMPERATURE
from ralm.errors import RalmError
from ralm.models.lm import FORMAT as LM_FORMAT
from ralm.models.lm import Attention, LMConfig, TransformerBlock, TransformerLM, _init_weights, load_model_dir, model_dir, rotary
from ralm.retrieval.lm.chunkdb import read_chunk_db_manifest
from ralm.runtime import Runtime

FORMAT = "ralm.retro/2"
OLD_FORMAT = "ralm.retro/1"  # trained with CCA query positions lacking the m - 1 offset: refused, not silently shifted


@dataclass
class RetroConfig(LMConfig):
    """The decoder's sizes (LMConfig, so a trained LM can be retro-fitted) plus retrieval."""
    chunk_len: int = option(64, "wordpieces per chunk (a chunk DB's own)", cli=False)
    neighbours: int = option(2, "neighbours retrieved per chunk", flag="--neighbours", aliases=("-k", "--k"))
    cca_start: int = option(1, "first decoder layer (0-based) with chunked cross-attention")
    cca_every: int = option(3, "then every n-th layer (the paper: every 3rd from layer 6)")
    encoder_layers: int = option(2, "layers of the neighbour encoder")
    positive: ClassVar[tuple[str, ...]] = LMConfig.positive + ("chunk_len", "neighbours", "encoder_layers")
    decoder_sizes: ClassVar[tuple[str, ...]] = ("vocab_size", "dim", "layers", "heads", "mlp_ratio")  # taken from a retro-fitted LM

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.cca_start < self.layers:
            raise ConfigError("cca_start", f"must be in [0, {self.layers}) (the decoder's layers), got {self.cca_start}")
        if self.cca_every <= 0:
            raise ConfigError("cca_every", f"must be positive, got {self.cca_every}")
        if self.max_len % self.chunk_len:
            raise ConfigError("max_len", f"{self.max_len} (the training length) must be a multiple of the chunk length "
                              f"{self.chunk_len}")

    @property
    def cca_layers(self) -> list[int]:
        return list(range(self.cca_start, self.layers, self.cca_every))


def _safe_mask(mask: torch.Tensor) -> torch.Tensor:
    """Rows with no real key would give NaN attention; let them attend to padding instead
    (their outputs are ignored or masked later)."""
    return mask | ~mask.any(-1, keepdim=True)


class EncoderLayer(nn.Module):
    """Bidirectional self-attention over a neighbour, cross-attention to its query chunk, MLP."""

    def __init__(self, cfg: RetroConfig):
        super().__init__()
        self.self_block = TransformerBlock(cfg.dim, cfg.heads, mlp_ratio=cfg.mlp_ratio, dropout=cfg.dropout, causal=False)
        self.ln_cross = nn.LayerNorm(cfg.dim)
        self.cross = Attention(cfg.dim, cfg.heads, cfg.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, chunk: torch.Tensor, pos) -> torch.Tensor:
        # x [BNK, r, D], mask [BNK, r], chunk [BNK, m, D]
        x = self.self_block(x, pos, key_mask=mask)
        return x + self.cross(self.ln_cross(x), chunk)


class NeighbourEncoder(nn.Module):
    def __init__(self, cfg: RetroConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.ln = nn.LayerNorm(cfg.dim)

    def forward(self, emb: torch.Tensor, mask: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
        """emb [B, n, k, r, D] neighbour token embeddings, mask [B, n, k, r], chunks [B, n, m, D]
        hidden states of the chunks they were retrieved for -> E [B, n, k, r, D]."""
        b, n, k, r, _ = emb.shape
        x = rearrange(emb, "b n k r d -> (b n k) r d")
        mask = _safe_mask(rearrange(mask, "b n k r -> (b n k) r"))
        chunk = rearrange(chunks.unsqueeze(2).expand(-1, -1, k, -1, -1), "b n k m d -> (b n k) m d")
        pos = rotary(torch.arange(r, device=emb.device), self.cfg.dim // self.cfg.heads)
        for layer in self.layers:
            x = layer(x, mask, chunk, pos)
        return rearrange(self.ln(x), "(b n k) r d -> b n k r d", b=b, n=n)


class ChunkedCrossAttention(nn.Module):
    """Tokens of chunk u+1 (shifted by m - 1) attend to the encoded neighbours of chunk u."""

    def __init__(self, cfg: RetroConfig):
        super().__init__()
        self.cfg = cfg
        self.ln = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg.dim, cfg.heads, cfg.dropout)

    def forward(self, h: torch.Tensor, enc: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """h [B, T, D], enc [B, n, k, r, D], mask [B, n, k, r] -> residual update [B, T, D]."""
        m, (b, n, k, r, _) = self.cfg.chunk_len, enc.shape
        attending = h[:, m - 1 : m - 1 + n * m]  # [B, L, D]: positions m-1 ... , L <= n*m
        length = attending.shape[1]
        q = rearrange(F.pad(attending, (0, 0, 0, n * m - length)), "b (n m) d -> (b n) m d", n=n)
        kv = rearrange(enc, "b n k r d -> (b n) (k r) d")
        key_mask = rearrange(mask, "b n k r -> (b n) (k r)")
        has_keys = key_mask.any(-1)  # [BN]: chunks whose neighbours were all missing get no update
        head_dim = self.cfg.dim // self.cfg.heads
        q_pos = rotary(torch.arange(m, device=h.device) + m - 1, head_dim)  # the causal shift: offsets m-1 ... 2m-2 in chunk u
        k_pos = rotary(torch.arange(r, device=h.device).repeat(k), head_dim)
        y = self.attn(self.ln(q), kv, key_mask=_safe_mask(key_mask), q_pos=q_pos, k_pos=k_pos)  # [BN, m, D]
        y = rearrange(y * has_keys[:, None, None], "(b n) m d -> b (n m) d", b=b)[:, :length]
        return F.pad(y, (0, 0, m - 1, h.shape[1] - (m - 1) - length))  # back to positions [B, T, D]


class RetroLM(TransformerLM):
    """TransformerLM's decoder (its embedding, blocks, final norm and tied fp32 head, under the
    same weight names, so a trained LM retro-fits) with CCA layers between its blocks. Its
    `features` are the decoder's with retrieval off."""

    model_format: ClassVar[str] = FORMAT

    def __init__(self, cfg: RetroConfig):
        super().__init__(cfg)
        self.cca = nn.ModuleDict({str(i): ChunkedCrossAttention(cfg) for i in cfg.cca_layers})
        self.encoder = NeighbourEncoder(cfg)
        self.cca.apply(_init_weights)
        self.encoder.apply(_init_weights)

    def forward(self, ids: torch.Tensor, neighbours: torch.Tensor | None = None,
                neighbour_mask: torch.Tensor | None = None) -> torch.Tensor:
        """ids [B, T]; neighbours [B, n, k, r] token ids of the neighbours of the n = T // m
        complete chunks (None: retrieval off) and their mask -> logits [B, T, V]."""
        m = self.cfg.chunk_len
        n = ids.shape[1] // m
        if neighbours is not None:
            if neighbours.shape[:2] != (ids.shape[0], n):
                raise RalmError(f"neighbours must cover the {n} complete chunks of each sequence, got shape {tuple(neighbours.shape)}")
            if neighbour_mask is None:
                neighbour_mask = torch.ones_like(neighbours, dtype=torch.bool)
        use_retrieval = neighbours is not None and n > 0
        pos = rotary(torch.arange(ids.shape[1], device=ids.device), self.cfg.dim // self.cfg.heads)
        h = self.drop(self.embed(ids))  # [B, T, D]
        enc = None
        for i, block in enumerate(self.blocks):
            h = block(h, pos)
            if use_retrieval and str(i) in self.cca:
                if enc is None:  # encode the neighbours once, conditioned on this layer's chunk states
                    chunks = rearrange(h[:, : n * m], "b (n m) d -> b n m d", m=m)
                    enc = self.encoder(self.embed(neighbours), neighbour_mask, chunks)  # [B, n, k, r, D]
                h = h + self.cca[str(i)](h, enc, neighbour_mask)
        return self.head(self.ln_f(h))  # [B, T, V]


def retrofit(model: RetroLM, lm: TransformerLM) -> None:
    """Retro-fitting (paper section 4.4): `model` takes the trained LM's embedding, decoder blocks
    and final norm and freezes them, so only the CCA layers and the neighbour encoder train.
    The CCA output projections start at zero: training starts from exactly that LM, and
    retrieval off stays exactly that LM."""
    want, have = model.cfg, lm.cfg
    for name in RetroConfig.decoder_sizes:
        if getattr(want, name) != getattr(have, name):
            raise RalmError(f"cannot retro-fit: the LM has {name} {getattr(have, name)}, the RETRO config {getattr(want, name)}")
    missing, unexpected = model.load_state_dict(lm.state_dict(), strict=False)
    assert not unexpected and all(k.startswith(("cca.", "encoder.")) for k in missing), (missing, unexpected)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(("cca.", "encoder.")))
    for cca in model.cca.values():
        nn.init.zeros_(cca.attn.out.weight)


def training_config(db: str | os.PathLike, retrofit: str | os.PathLike | None = None, **options) -> RetroConfig:
    """The RetroConfig for training over chunk DB `db` (its chunk length) from `options` (None:
    the default). Retro-fitting the LM at `retrofit` takes the decoder's sizes from it; a size
    also given must match."""
    given = {name: value for name, value in options.items() if value is not None}
    if retrofit is not None:
        found = model_dir(retrofit, LM_FORMAT)
        if found is None:
            raise RalmError(f"{retrofit}: retro-fitting needs a model from `ralm lm train`")
        lm_cfg = read_json(found / "config.json")
        for name in RetroConfig.decoder_sizes:
            if name in given and given[name] != lm_cfg[name]:
                raise ConfigError(name, f"{given[name]} differs from the retro-fitted LM's {lm_cfg[name]}; leave it out")
        given.update({name: lm_cfg[name] for name in RetroConfig.decoder_sizes})
    return RetroConfig(chunk_len=read_chunk_db_manifest(db)["chunk_len"], **given)


def load_retro(path: str | os.PathLike) -> tuple[RetroLM, object]:
    """(model, tokenizer) from a RETRO model directory or a `ralm retro train` run."""
    found = model_dir(path, FORMAT)
    if found is None and model_dir(path, OLD_FORMAT) is not None:
        raise RalmError(f"{path}: a RETRO model from an earlier ralm, trained with other cross-attention positions; "
                        f"retrain it with `ralm retro train`")
    if found is None:
        raise RalmError(f"{path}: not a RETRO model (train one with `ralm retro train`)")
    return load_model_dir(found, RetroLM, RetroConfig)


def neighbour_batch(db, neighbour_ids: np.ndarray, device: torch.device | str | None = None, pad_id: int = 0, *,
                    runtime: Runtime | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Neighbour chunk ids [B, n, k] (-1: none) -> tokens [B, n, k, r], mask [B, n, k, r] on the
    runtime's device (None: the CPU; the older `device` still works, see `Runtime.of`)."""
    device = Runtime.of(runtime, device=device).device
    tokens, mask = db.values(neighbour_ids, pad_id)
    return torch.from_numpy(tokens).to(device), torch.from_numpy(mask).to(device)


def check_sampling(top_p: float | None, temperature: float) -> None:
    """generate's sampling settings, checked before any model loads (NaN fails too)."""
    if top_p is not None and not 0 < top_p <= 1:
        raise RalmError(f"top_p must be in (0, 1], got {top_p}")
    if not 0 < temperature < math.inf:
        raise RalmError(f"temperature must be a positive finite number, got {temperature}")


@torch.inference_mode()
def generate(model: RetroLM, db, tokenizer, prompt: str, *, max_new_tokens: int = MAX_NEW_TOKENS, top_p: float | None = None,
             temperature: float = SAMPLE_TEMPERATURE, generator: torch.Generator | None = None,
             runtime: Runtime | None = None, device: torch.device | str | None = None) -> tuple[str, list[dict]]:
    """Greedy (top_p None) or nucleus sampling; a chunk's neighbours are retrieved as soon as it
    is complete. Returns the continuation and the neighbours used [{chunk, neighbours: [text]}].
    `runtime`: where the model (already there) runs (None: the CPU; the older `device` still
    works, see `Runtime.of`); it decodes in its weights' fp32 whatever the runtime's dtype, and
    `db` embeds the chunks under its own runtime."""
    check_sampling(top_p, temperature)
    rt = Runtime.of(runtime, device=device)
    m, k = model.cfg.chunk_len, model.cfg.neighbours
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        raise RalmError("the prompt is empty")
    start, neighbours, used = len(ids), np.zeros((0, k), dtype=np.int64), []
    for _ in range(max_new_tokens):
        window = ids[-model.cfg.max_len :]
        offset = len(ids) - len(window)
        if offset % m:  # keep windows chunk-aligned so neighbours stay attached to their chunks
            window, offset = window[m - offset % m :], offset + m - offset % m
        n_complete = len(ids) // m
        while len(neighbours) < n_complete:  # retrieve for newly completed chunks
            c = len(neighbours)
            chunk = np.asarray(ids[c * m : (c + 1) * m], dtype=np.int32)
            got = db.search(db.embed(chunk, 1), k)
            neighbours = np.concatenate([neighbours, got])
            used.append({"chunk": tokenizer.decode(chunk.tolist()),
                         "neighbours": [tokenizer.decode(db.values(got[0, j : j + 1])[0][0][: m].tolist()) for j in range(k) if got[0, j] >= 0]})
        first = offset // m
        nb, mask = neighbour_batch(db, neighbours[first : first + len(window) // m][None], pad_id=tokenizer.pad_token_id or 0,
                                   runtime=rt)
        logits = model(torch.tensor([window], device=rt.device), nb, mask)[0, -1].float()  # [V]
        ids.append(_next_token(logits, top_p, temperature, generator))
    return tokenizer.decode(ids[start:]), used


def _next_token(logits: torch.Tensor, top_p: float | None, temperature: float, generator) -> int:
    if top_p is None:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1).cpu()
    sorted_p, order = probs.sort(descending=True)
    keep = sorted_p.cumsum(0) - sorted_p < top_p  # the smallest prefix holding top_p of the mass
    sorted_p = sorted_p * keep
    return int(order[torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=generator)])
