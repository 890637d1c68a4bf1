"""Data parallelism for every trainer under torchrun (DistributedDataParallel).

The global batch is `batch_size x world`: `rank_batch` gives each rank its slice of the same
seeded global batch, so a run's data order does not depend on how many processes share it.
`gather_with_grad` lets contrastive losses (ICT, DPR) use every rank's passages as in-batch
negatives, with gradients flowing back to the rank that encoded them.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ralm.distributed import DistEnv
from ralm.train.loop import batch_indices


def rank_batch(step: int, batch_size: int, n: int, seed: int, env: DistEnv) -> np.ndarray:
    """Example indices of this rank's part of global batch `step` (batch_size per rank)."""
    idx = batch_indices(step, batch_size * env.world, n, seed)
    return idx[env.rank * batch_size : (env.rank + 1) * batch_size]


def wrap_ddp(model: nn.Module, env: DistEnv, device: torch.device) -> nn.Module:
    """DDP around `model` when several ranks train (gradients are averaged across ranks)."""
    if not env.active:
        return model
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   find_unused_parameters=False)


def gather_with_grad(x: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """[B, D] on each rank -> [B * world, D], rank order, differentiable."""
    if not env.active:
        return x
    import torch.distributed.nn.functional as dist_fn

    return torch.cat(dist_fn.all_gather(x), 0)


def in_batch_contrastive(query: torch.Tensor, passages: torch.Tensor, env: DistEnv) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over every rank's passages; query i's positive is passage i of this rank.

    query [B, D]; passages [B + extra, D] (positives first, then hard negatives).
    Returns (mean NLL over this rank's queries, accuracy).
    """
    everyone = gather_with_grad(passages.contiguous(), env)  # [W * P, D]
    scores = query @ everyone.T  # [B, W * P]
    target = torch.arange(len(query), device=query.device) + env.rank * len(passages)
    return F.cross_entropy(scores, target), (scores.argmax(1) == target).float().mean()


def all_mean(value: float, env: DistEnv) -> float:
    """The mean of a logged scalar over ranks (for metrics printed by rank 0)."""
    if not env.active:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item() / env.world)
