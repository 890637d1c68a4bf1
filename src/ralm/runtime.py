"""Device, dtype and seeding choices, passed explicitly into library code (never global)."""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass

import numpy as np
import torch

from ralm.configs import ConfigError, check_device_name, check_dtype_name
from ralm.errors import RalmError

_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(name: str | None) -> torch.device:
    """`None`/"auto" picks CUDA when present; anything else is passed to torch."""
    if name in (None, "", "auto"):
        return default_device()
    check_device_name(name)
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RalmError(f"--device {name}: CUDA is not available on this machine; use --device cpu or auto")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise RalmError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type not in ("cpu", "cuda", "mps") or (device.type == "mps" and not torch.backends.mps.is_available()):
        raise RalmError(f"--device {name}: not a device ralm can run on here; use auto, cpu or cuda")
    return device


def cpu_has_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16), as cpuinfo reports
    it. Elsewhere torch emulates bf16 matmuls, which is slower than fp32."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def resolve_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The compute dtype for `device`: "auto" (or None) is bf16 on CUDA and on CPUs with native
    bf16, fp32 elsewhere; "bf16" where the CPU lacks it is an error, not a silent slowdown."""
    if isinstance(name, torch.dtype):
        name = _NAMES.get(name, str(name))
    check_dtype_name(name)
    if name in (None, "", "auto"):
        return torch.bfloat16 if device.type == "cuda" or (device.type == "cpu" and cpu_has_bf16()) else torch.float32
    if name == "fp32":
        return torch.float32
    if device.type == "cpu" and not cpu_has_bf16():  # bf16
        raise ConfigError("dtype", "bf16: this CPU has no native bf16 (AVX512-BF16 or AMX); use fp32 or auto")
    return torch.bfloat16


@dataclass(frozen=True)
class Runtime:
    """Where and how a job computes, passed as one value: the device, the compute dtype (autocast;
    weights stay fp32) and whether it draws progress bars."""

    device: torch.device
    dtype: torch.dtype
    show_progress: bool = True

    @classmethod
    def resolve(cls, device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                show_progress: bool = True) -> Runtime:
        """From --device and --dtype spellings (None: auto); `bf16` on a CPU without it fails here."""
        resolved = resolve_device(str(device) if isinstance(device, torch.device) else device)
        return cls(resolved, resolve_dtype(dtype, resolved), show_progress)

    @classmethod
    def of(cls, runtime: Runtime | None = None, *, device: str | torch.device | None = None,
           dtype: str | torch.dtype | None = None) -> Runtime:
        """The Runtime a public entry point runs under, resolved there once and passed down:
        `runtime` as given, else one from the older `device=`/`dtype=` keywords, which library
        calls still accept (None: the CPU, as the library always defaulted; the CLI's `auto`
        picks CUDA)."""
        if runtime is None:
            return cls.resolve(device or "cpu", dtype)
        if device is not None or dtype is not None:
            raise RalmError("give runtime= or device=/dtype=, not both")
        return runtime


def compute_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """A torch.dtype (a Runtime's, resolved at the entry point) as it is; a spelling ("auto",
    "fp32", "bf16", None) resolved for `device`, for the public classes used on their own
    (`Retriever.encode_queries`, `ExactIndex`)."""
    return dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, device)


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed precision for a region: weights stay fp32 (the master copy), matmuls run in `dtype`."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def full_precision(device: torch.device):
    """Turn autocast off, for logits whose softmax must not see bf16 rounding (relevance scores,
    marginal likelihoods, perplexities): inside autocast, even `.float()` inputs run in bf16."""
    return torch.autocast(device.type, enabled=False)



def check_finite(model: torch.nn.Module, what: str) -> None:
    """Every weight of `model` finite, else one RalmError counting those that are not: a
    learning rate too high for the model turns its weights to NaN or inf in one step, and a
    model saved in that state answers nothing."""
    bad = sum(int((~torch.isfinite(p)).sum()) for p in model.parameters() if p.is_floating_point())
    if bad:
        total = sum(p.numel() for p in model.parameters())
        raise RalmError(f"{what}: {bad:,} of {total:,} weights are NaN or inf (the training diverged: lower --lr); "
                        "nothing was saved from it")


def dtype_name(dtype: torch.dtype) -> str:
    return _NAMES.get(dtype, str(dtype).replace("torch.", ""))


SEEDS = range(2**32)  # what numpy accepts; torch and random take these too


def seed_everything(seed: int) -> torch.Generator:
    if seed not in SEEDS:
        raise RalmError(f"a seed must be a whole number in 0 .. {SEEDS.stop - 1}, got {seed}")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)
