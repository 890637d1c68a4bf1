"""Padding token rows into batches: right-padded id and mask tensors, and running a model over
groups of rows of similar length so little work goes to padding.

Shapes: B batch, L length.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch


def pad_rows(rows: Sequence[np.ndarray], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad int rows -> input_ids [B, L], attention_mask [B, L]."""
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = 1
    return torch.from_numpy(ids), torch.from_numpy(mask)


def length_group(device: torch.device) -> int:
    """Rows per `by_length` group: few on a CPU, where padding is work the cores do; many on a
    GPU, where each group's kernel launches cost more than its padding (one H200, a reader step of
    256 windows: 16-row groups 0.22 s forward and backward, one group 0.17 s a whole step)."""
    return 16 if device.type == "cpu" else 256


def by_length(lengths: Sequence[int], run: Callable[[list[int]], torch.Tensor], group: int = 16) -> torch.Tensor:
    """run(rows) over groups of `group` rows of similar length (shortest first), the results
    stacked back in input order along dim 0. Each group is padded only to its own longest row, so
    a training step does not spend attention and FFN work on padding; gradients flow as usual."""
    order = np.argsort(np.asarray(lengths), kind="stable")
    out = torch.cat([run(order[i : i + group].tolist()) for i in range(0, len(order), group)])
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.from_numpy(order)] = torch.arange(len(order))
    return out[inverse.to(out.device)]
