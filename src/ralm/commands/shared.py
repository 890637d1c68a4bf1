"""What every `ralm` command shares: the --device and --dtype options, the torchrun rank that
prints, the checks that name a flag, and what the CLI's error boundary (cli.main) needs: NaN/inf
refused for every float option, filesystem errors as one line, builds that clean up after a
failure."""

from __future__ import annotations

import contextlib
import errno
import math
import re
import shutil
from pathlib import Path
from typing import Iterator, Optional, get_args

import typer

from ralm.configs import (
    DTYPE_HELP,
    LIMIT_TOKENS_HELP,
    check_device_name,
    check_dtype_name,
)
from ralm.errors import RalmError
from ralm.models.confidence import MIN_CONFIDENCE

DeviceOpt = typer.Option("auto", "--device", help="auto (CUDA when present), cpu, cuda, cuda:1 ...")
DtypeOpt = typer.Option("auto", "--dtype", help=DTYPE_HELP)
JsonOpt = typer.Option(False, "--json", help="print the result as JSON on stdout")
OutOpt = typer.Option(..., "--out", help="run directory (created, or resumed from its last checkpoint)")
LimitOpt = typer.Option(None, "--limit-tokens", help=LIMIT_TOKENS_HELP)
SideOpt = typer.Option(None, "--side", help="search one side of the index: dense or bm25 (default: every side it "
                       "holds, fused: hybrid)")
OldSideOpt = typer.Option(None, "--retriever", hidden=True)  # --side's name before the rename (renamed_option)
IncludeOpt = typer.Option([], "--include", metavar="GLOB", help="of a folder: read only the files matching (repeatable; "
                          "a pattern with '/' matches the path in the folder, one without the file name)")
ExcludeOpt = typer.Option([], "--exclude", metavar="GLOB", help="of a folder: leave out the files matching (repeatable)")
MinConfidenceOpt = typer.Option(None, "--min-confidence", min=0.0, max=1.0, show_default=False,
                                help="below this calibrated confidence the answer is 'no answer found in the corpus' "
                                     f"(default: the threshold the side's confidence map was fitted with, else {MIN_CONFIDENCE}; "
                                     "0 always answers; an uncalibrated reader always answers)")


def renamed_option(flag: str, value, old_flag: str, old_value, *, new_given: bool):
    """The value of option `flag`, also spelled `old_flag`, its name before a rename (hidden from
    help): the old spelling's value when given; both spellings given must agree."""
    if old_value is None:
        return value
    if new_given and value != old_value:
        raise RalmError(f"{flag} {value} and {old_flag} {old_value} disagree: give {flag} only ({old_flag} is its old name)")
    return old_value


def side_given(side: str | None, old_side: str | None) -> str | None:
    """The side a query command searches: --side, or --retriever, its old name."""
    return renamed_option("--side", side, "--retriever", old_side, new_given=side is not None)


def refuse_second_index(option: str, given, index) -> None:
    """--hybrid / --bm25 named a second (BM25) index; an index now holds both sides itself."""
    if given is not None:
        raise RalmError(f"{option} is no longer needed: an index holds its dense and BM25 sides together and every command "
                        f"uses both; run `ralm index upgrade {index}` once to add the BM25 side to an older dense index")


# -- checks of the command line that run before the heavy imports (torch, transformers): a
# mistake is named in about a second, not after the models load --

def check_runtime(device: str, dtype: str) -> None:
    """--device and --dtype spelled right (whether this machine has the device is `runtime`'s check)."""
    check_device_name(device)
    check_dtype_name(dtype)


# faiss parses these factory strings, then aborts the process (HNSW0: a C++ assertion, SIGABRT),
# crashes (HNSW1, RR0) or hangs (NSG2) once vectors are added: the smallest count each takes
_FAISS_MIN_COUNT = {"HNSW": 2, "NSG": 3}
_FAISS_COUNT = re.compile(r"^([A-Za-z]+)(\d+)")


def check_faiss_spec(option: str, spec: str | None) -> None:
    """A faiss factory string's counts (IVF lists, HNSW links, PQ sub-quantizers ...) large enough
    to build: a regex over its parts, so it runs before any import; whether faiss parses the rest
    is the library's check (retrieval.backends.faiss_index.check_spec)."""
    for part in re.split(r"[,_]", spec or ""):
        m = _FAISS_COUNT.match(part.strip())
        if m and int(m.group(2)) < _FAISS_MIN_COUNT.get(m.group(1), 1):
            least = _FAISS_MIN_COUNT.get(m.group(1), 1)
            raise RalmError(f"{option} {spec!r}: {m.group(0)} is too small to build (faiss would abort while adding vectors); "
                            f"{m.group(1)} takes {least} or more, e.g. {m.group(1)}{max(least, 32)}")


def check_npy(option: str, path: Optional[Path]) -> None:
    """A file given as one numpy array (.npy) is one: an .npz archive or another file is named by
    its first bytes, before any import, not by numpy failing halfway through a build."""
    if path is None:
        return
    if not path.is_file():
        raise RalmError(f"{option} {path}: no such file")
    with open(path, "rb") as f:
        head = f.read(6)
    if head != b"\x93NUMPY":
        what = "a .npz archive (several arrays)" if head.startswith(b"PK") else "not a .npy file"
        raise RalmError(f"{option} {path} is {what}; give one float array [blocks, dim] saved with numpy.save(path, array)")


def check_models(*models: str | Path | None, option: str = "--model", hub: bool = True) -> None:
    """Each model given (None: the default) exists: a local directory, or with `hub` a hub name
    (in the cache when offline); see encoders.locate."""
    from ralm.encoders.locate import check_model_location

    for model in models:
        if model is not None:
            check_model_location(model, option, hub=hub)


def index_path(path: Path) -> Path:
    """An index directory named on the command line holds an index's manifest."""
    from ralm.retrieval.index.manifest import read_index_manifest

    read_index_manifest(path)
    return path


def corpus_files(corpus: Path, include: list[str], exclude: list[str]):
    """The FileFilter of --include/--exclude, with the corpus checked as far as it can be
    without reading it (it exists, its format, a folder holds a file to read)."""
    from ralm.data.corpus import check_corpus
    from ralm.data.formats import FileFilter

    if (include or exclude) and not corpus.is_dir():
        raise RalmError(f"--include and --exclude pick the files of a folder; {corpus} is not a folder")
    files = FileFilter(tuple(include), tuple(exclude))
    check_corpus(corpus, files=files)
    return files


def torch_device(name: str):
    from ralm.runtime import resolve_device

    return resolve_device(name)


def runtime(device: str, dtype: str, show_progress: bool = True):
    """The Runtime (device, compute dtype, progress) of --device and --dtype; `--dtype bf16` on
    a CPU without native bf16 is an input error here, before any model loads."""
    from ralm.runtime import Runtime

    return Runtime.resolve(device, dtype, show_progress)


def quiet_libraries() -> None:
    """Library progress bars and notices (transformers' weight loading, bm25s) would drown ours.
    Set through the environment, which transformers reads when it is imported, so a command that
    never needs transformers does not pay for importing it here."""
    import logging
    import os
    import sys

    logging.getLogger("pypdf").setLevel(logging.ERROR)  # its notes on malformed but readable PDFs
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


def finite_floats(command):
    """Every float option of a typer command (as `typer.main.get_command` makes it) and of its
    subcommands refuses NaN and inf before the command runs: `--lr inf` would train and export
    NaN weights, and NaN passes every range check (`min=`, `max=`)."""
    for sub in getattr(command, "commands", {}).values():
        finite_floats(sub)
    for param in command.params:
        annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
        if annotation is float or float in get_args(annotation):
            param.callback = _finite(param.callback)
    return command


def _finite(callback):
    def check(ctx, param, value):
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(v, float) and not math.isfinite(v):
                raise RalmError(f"{max(param.opts, key=len)} must be a finite number, got {v}")
        return callback(ctx, param, value) if callback else value
    return check


def os_error_line(e: OSError) -> str:
    """A filesystem error as one line naming the path: permission denied, a read-only or full
    disk, a folder where a file is expected, a missing folder."""
    paths = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
    reason = e.strerror or str(e) or type(e).__name__
    hint = {errno.ENOSPC: "; free some space and run it again", errno.EROFS: "; choose a writable folder",
            errno.EACCES: "; check its permissions", errno.EPERM: "; check its permissions"}.get(e.errno, "")
    return f"{paths}: {reason}{hint}" if paths else f"{reason}{hint}"


@contextlib.contextmanager
def removed_on_error(path: Path) -> Iterator[None]:
    """A build's output folder that this command created goes again when the build fails on
    bad input or the filesystem: nothing half-written is left behind. An interrupted build
    (Ctrl-C, a kill) keeps it, so that it resumes."""
    new = not path.exists()
    try:
        yield
    except (RalmError, OSError):
        if new and main_rank():
            shutil.rmtree(path, ignore_errors=True)
        raise
