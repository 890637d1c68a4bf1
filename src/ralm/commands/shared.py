"""What every `ralm` command shares: the --device and --dtype options, the torchrun rank that
prints, and the checks that name a flag."""

from __future__ import annotations

from typing import Optional

import typer

from ralm.configs import DTYPE_HELP, LIMIT_TOKENS_HELP
from ralm.errors import RalmError
from ralm.models.confidence import MIN_CONFIDENCE

DeviceOpt = typer.Option("auto", "--device", help="auto (CUDA when present), cpu, cuda, cuda:1 ...")
DtypeOpt = typer.Option("auto", "--dtype", help=DTYPE_HELP)
JsonOpt = typer.Option(False, "--json", help="print the result as JSON on stdout")
OutOpt = typer.Option(..., "--out", help="run directory (created, or resumed from its last checkpoint)")
LimitOpt = typer.Option(None, "--limit-tokens", help=LIMIT_TOKENS_HELP)
RetrieverOpt = typer.Option(None, "--retriever", help="search one side of the index: dense or bm25 (default: every side it "
                            "holds, fused: hybrid)")
MinConfidenceOpt = typer.Option(MIN_CONFIDENCE, "--min-confidence", min=0.0, max=1.0,
                                help="below this calibrated confidence the answer is 'no answer found in the corpus' "
                                     "(0 always answers; an uncalibrated reader always answers)")


def refuse_second_index(option: str, given, index) -> None:
    """--hybrid / --bm25 named a second (BM25) index; an index now holds both sides itself."""
    if given is not None:
        raise RalmError(f"{option} is no longer needed: an index holds its dense and BM25 sides together and every command "
                        f"uses both; run `ralm index upgrade {index}` once to add the BM25 side to an older dense index")


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
    """Library progress bars (transformers' weight loading, bm25s) would drown ours."""
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
