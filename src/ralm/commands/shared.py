"""What every `ralm` command shares: the --device and --dtype options, the torchrun rank that
prints, the checks that name a flag, and what the CLI's error boundary (cli.main) needs: NaN/inf
refused for every float option, filesystem errors as one line, builds that clean up after a
failure."""

from __future__ import annotations

import contextlib
import errno
import math
import re
import shlex
import shutil
from pathlib import Path
from typing import Iterator, Optional, get_args

import typer
from typer.core import TyperCommand

from ralm.configs import (
    CORPUS_HELP,
    DTYPE_HELP,
    LIMIT_TOKENS_HELP,
    check_device_name,
    check_dtype_name,
)
from ralm.errors import RalmError

DeviceOpt = typer.Option("auto", "--device", help="auto (CUDA when present), cpu, cuda, cuda:1 ...")
DtypeOpt = typer.Option("auto", "--dtype", help=DTYPE_HELP)


def flag_option(*decls: str, help: str, **kwargs):
    """An on/off option (off by default): metavar "" keeps help from printing `<bool>` beside a flag that takes no value."""
    return typer.Option(False, *decls, metavar="", help=help, **kwargs)


JsonOpt = flag_option("--json", help="print the result as JSON on stdout")
OutOpt = typer.Option(..., "--out", help="run directory (created, or resumed from its last checkpoint)")
LimitOpt = typer.Option(None, "--limit-tokens", help=LIMIT_TOKENS_HELP)
IncludeOpt = typer.Option([], "--include", metavar="GLOB", help="of a folder: read only the files matching (repeatable; "
                          "a pattern with '/' matches the path in the folder, one without the file name)")
ExcludeOpt = typer.Option([], "--exclude", metavar="GLOB", help="of a folder: leave out the files matching (repeatable)")


# -- one argument style: what a command reads (an index, a corpus) is an option, --index DIR and
# --corpus PATH, in every command; what it acts on stays positional (QUERY, QUESTION, IDs). The
# older spellings, `ralm search DIR QUERY`, `ralm index build CORPUS`, `ralm index add DIR CORPUS`,
# are read by `positionals` from hidden arguments --

# the positionals past what a command takes: an older spelling's (`ralm search DIR QUERY`), or too many (`positionals`)
MoreArgs = typer.Argument([], hidden=True, show_default=False)


class OldSpellings(TyperCommand):
    """The command class (`app.command(cls=OldSpellings)`) of a command with `MoreArgs`: hidden from
    its usage line too, not only from its argument list."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        return [self.options_metavar, *(piece for param in self.get_params(ctx) if not getattr(param, "hidden", False)
                                         for piece in param.get_usage_pieces(ctx))]


def index_option(help: str = "index directory from `ralm index build`"):
    """--index DIR; `positionals` checks that it is given (or read from an older spelling's positional)."""
    return typer.Option(None, "--index", help=help + " (required)", show_default=False)


def corpus_option(help: str = CORPUS_HELP):
    """--corpus PATH; `positionals` checks that it is given (or read from an older spelling's positional)."""
    return typer.Option(None, "--corpus", help=help + " (required)", show_default=False)


_METAVARS = {"--index": "DIR", "--corpus": "CORPUS", "--questions": "QUESTIONS"}


def positionals(command: str, given: list[str | None], *, options: dict[str, object], takes: tuple[str, ...] = (),
                old: tuple[str, ...] = ()) -> dict[str, object]:
    """The values of `ralm COMMAND`'s `options` (flag -> value, None: not given; every one required)
    and of the positionals it `takes` (their names, e.g. ("QUESTION",); each None when absent),
    from the positionals `given`. `old`: the options its older spelling took as positionals, in
    front of those it takes (`ralm search DIR QUERY`: ("--index",)); one not given as an option
    is read from a positional when there are enough. Too many positionals, or a missing option,
    is one line naming what each positional was read as and the spelling to use."""
    args = [str(a) for a in given if a is not None]
    slots = [*(flag for flag in old if options[flag] is None), *takes]
    if len(args) > len(slots):
        raise RalmError(_too_many(command, args, slots, options, takes))
    values = {**options, **dict.fromkeys(takes)}
    read = dict(zip(slots[len(slots) - len(args):], args))  # from the right: what stays positional is read first
    values.update(read)
    missing = next((flag for flag in options if values[flag] is None), None)
    if missing is not None:
        what = " and ".join(f"{v!r} as {k}" for k, v in read.items())
        usage = " ".join(["ralm", command, *(f"{f} {_METAVARS.get(f, 'VALUE')}" for f in options), *takes])
        raise RalmError(f"missing option {missing}" + (f" (read {what})" if what else "") + f"; the spelling is `{usage}`")
    return values


def _too_many(command: str, args: list[str], slots: list[str], options: dict[str, object], takes: tuple[str, ...]) -> str:
    """`ralm ask idx "question"`: what each positional was read as, and the spelling meant."""
    labels = [f"{slot} {_METAVARS[slot]}" if slot in options else slot for slot in slots]
    took = ("no argument", f"one argument ({', '.join(labels)})", f"{len(slots)} arguments ({', '.join(labels)})")[min(len(slots), 2)]
    given = [flag for flag, v in options.items() if v is not None]
    extra = args[len(slots):]
    read = " and ".join([*(f"{a!r} as {label}" for a, label in zip(args, labels)),
                         f"{', '.join(map(repr, extra))} as {'one' if len(extra) == 1 else len(extra)} too many"])
    rest, meant = list(args), {}
    for flag in (f for f, v in options.items() if v is None):  # the leading positionals were meant as the options not given
        if len(rest) <= len(takes):
            break
        meant[flag] = rest.pop(0)
    if takes and len(rest) > len(takes):  # the words of one question or query, unquoted
        rest = [*rest[:len(takes) - 1], " ".join(rest[len(takes) - 1:])]
    spelled = [x for flag, v in options.items() if v is not None or flag in meant for x in (flag, str(meant.get(flag, v)))]
    return (f"ralm {command} takes {took}" + (f" with {' and '.join(given)} given" if given else "")
            + f", and was given {len(args)}: read {read}; did you mean "
            f"`{shlex.join(['ralm', *command.split(), *spelled, *rest[:len(takes)]])}`?")


def renamed_option(flag: str, value, old_flag: str, old_value, *, new_given: bool):
    """The value of option `flag`, also spelled `old_flag`, its name before a rename (hidden from
    help): the old spelling's value when given; both spellings given must agree."""
    if old_value is None:
        return value
    if new_given and value != old_value:
        raise RalmError(f"{flag} {value} and {old_flag} {old_value} disagree: give {flag} only ({old_flag} is its old name)")
    return old_value


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
    for each in _command_tree(command):
        for param in each.params:
            annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
            if annotation is float or float in get_args(annotation):
                param.callback = _finite(param.callback)
    return command


def _command_tree(command) -> Iterator:
    """A click command and every command below it (a group's subcommands, theirs, ...)."""
    yield command
    for sub in getattr(command, "commands", {}).values():
        yield from _command_tree(sub)


def untyped_help_flag(command):
    """`--help` in the help of a typer command and of its subcommands without `<bool>` beside it,
    as every other flag (`flag_option`): typer makes the help option itself, when help is shown."""
    for each in _command_tree(command):
        each.get_help_option = _untyped(each.get_help_option)
    return command


def _untyped(make):
    def get_help_option(ctx):
        option = make(ctx)
        if option is not None:
            option.metavar = ""
        return option
    return get_help_option


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
