"""What every `ralm` command shares: the --device and --dtype options, the torchrun rank that
prints, and the checks that name a flag."""

from __future__ import annotations

from typing import Optional

import typer

from ralm.errors import RalmError
from ralm.models.confidence import MIN_CONFIDENCE

DeviceOpt = typer.Option("auto", "--device", help="auto (CUDA when present), cpu, cuda, cuda:1 ...")
DtypeOpt = typer.Option("auto", "--dtype", help="compute dtype: auto (bf16 on CUDA and on CPUs with native bf16, "
                        "else fp32), fp32 or bf16; weights and checkpoints stay fp32")
TextHelp = "a corpus (.jsonl/.tsv/folder; same-title records form one article) or a raw .txt/.raw file (WikiText)"
LimitOpt = typer.Option(None, "--limit-tokens", help="use only this many leading wordpieces of the text")
WarmupHelp = "steps of linear learning-rate warm-up"
MinConfidenceOpt = typer.Option(MIN_CONFIDENCE, "--min-confidence", min=0.0, max=1.0,
                                help="below this calibrated confidence the answer is 'no answer found in the corpus' "
                                     "(0 always answers; an uncalibrated reader always answers)")


def torch_device(name: str):
    from ralm.runtime import resolve_device

    return resolve_device(name)


def runtime(device: str, dtype: str):
    """(torch device, compute dtype) from --device and --dtype; `--dtype bf16` on a CPU
    without native bf16 is an input error here, before any model loads."""
    from ralm.runtime import resolve_dtype

    dev = torch_device(device)
    return dev, resolve_dtype(dtype, dev)


def quiet_libraries() -> None:
    """Library progress bars and notices (transformers' weight loading, bm25s) would drown ours.
    Set through the environment, which transformers reads when it is imported, so a command that
    never needs transformers does not pay for importing it here."""
    import os
    import sys

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        import transformers

        transformers.logging.disable_progress_bar()
        transformers.logging.set_verbosity_error()


def main_rank() -> bool:
    """False on the ranks other than 0 under torchrun: they compute, rank 0 prints."""
    from ralm.distributed import dist_env

    return dist_env().is_main


def positive(name: str, value: int) -> int:
    if value <= 0:
        raise RalmError(f"{name} must be a positive integer, got {value}")
    return value


def optional_positive(name: str, value: Optional[int]) -> Optional[int]:
    return None if value is None else positive(name, value)


def token_limit(value: Optional[int]) -> Optional[int]:
    return optional_positive("--limit-tokens", value)
