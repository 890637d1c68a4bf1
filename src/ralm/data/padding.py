"""Right-padding token rows into one batch: the id and attention-mask tensors every encoder reads.

Shapes: B batch, L length.
"""

from __future__ import annotations

from typing import Sequence

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
