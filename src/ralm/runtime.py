"""Device, dtype and seeding choices, passed explicitly into library code (never global)."""

from __future__ import annotations

import random

import numpy as np
import torch


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(name: str | None) -> torch.device:
    """`None`/"auto" picks CUDA when present; anything else is passed to torch."""
    if name in (None, "", "auto"):
        return default_device()
    return torch.device(name)


def compute_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA (tensor cores, no loss scaling needed); fp32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)
