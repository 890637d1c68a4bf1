"""One way to write anything a crash could half-write: write beside the target, fsync,
then rename over it. Readers see the old file or the new one, never a mix.

A write in progress lives in a hidden temp folder named after its writer,
`.<label>-<pid>@<machine>~<random>.tmp`; a writer that is killed leaves it behind, and the next
write into the same folder removes it (see `remove_stale_temps`).

The readers here turn a damaged file (truncated, overwritten) into a RalmError naming it.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import re
import shutil
import socket
import stat
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from ralm.errors import RalmError, first_line

_OWNED_TEMP = re.compile(r"^\..+-(\d+)@([^~]+)~[^~]+\.tmp$")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush a file, or every file under a folder, to disk before it is renamed into place."""
    for f in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


@functools.cache
def _machine() -> str:
    """The host name and, on Linux, the pid namespace: two containers on one host may share
    a host name, but a pid only means something inside its namespace."""
    try:
        namespace = re.sub(r"\D", "", os.readlink("/proc/self/ns/pid"))  # "pid:[4026531836]"
    except OSError:
        namespace = ""
    return socket.gethostname() + (f".{namespace}" if namespace else "")


def temp_dir(parent: Path, label: str) -> Path:
    """A new hidden folder in `parent` whose name records this process as its writer."""
    return Path(tempfile.mkdtemp(prefix=f".{label}-{os.getpid()}@{_machine()}~", suffix=".tmp", dir=parent))


def _writer_is_gone(name: str) -> bool:
    """True only when the folder's writer ran on this machine and its pid no longer exists.

    A live writer keeps its folder; so does one from another machine sharing the disk (its pid
    means nothing here), and a dead writer whose pid was reused (kept, never wrongly removed)."""
    m = _OWNED_TEMP.match(name)
    if os.name != "posix" or not m or m.group(2) != _machine() or int(m.group(1)) <= 0:
        return False
    try:
        os.kill(int(m.group(1)), 0)  # signal 0: only asks whether the pid exists
    except ProcessLookupError:
        return True
    except PermissionError:  # it exists, run by another user
        return False
    return False


def remove_stale_temps(parent: str | os.PathLike) -> list[Path]:
    """Remove the temp folders that killed writers left in `parent`; returns what was removed."""
    parent = Path(parent)
    stale = [p for p in parent.glob(".*@*~*.tmp") if p.is_dir() and _writer_is_gone(p.name)] if parent.is_dir() else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust writers (safetensors) report one


def _named_os_error(e: Exception, target: Path) -> OSError | None:
    """A write's failure as an OSError naming `target`, or None to let `e` through: an OSError
    without a file name (a full disk), a library's wrapped one (safetensors: "... (os error
    28)"), numpy's short write ("N requested and M written")."""
    if isinstance(e, OSError) and e.filename is None:
        return OSError(e.errno, e.strerror, str(target)) if e.errno is not None else OSError(errno.EIO, str(e), str(target))
    found = _OS_ERROR.search(str(e)) if not isinstance(e, OSError) else None
    return OSError(int(found.group(1)), os.strerror(int(found.group(1))), str(target)) if found else None


def _check_replaceable(target: Path) -> None:
    """A device, FIFO or socket at `target` is refused: renaming a file over it would replace
    the node itself (as root, `--predictions /dev/null` would turn the device into a file)."""
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return
    except OSError:  # a path through a file, a loop of links: the write names it
        return
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise RalmError(f"{target} is not a regular file (a device, FIFO or socket); ralm writes its outputs to files: "
                        "name a file path")


_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")


def _artifact(folder: Path) -> str | None:
    """What `folder` is when ralm reads it as a whole: an index (its manifest beside versions/),
    another ralm artifact (a ralm manifest: an index version, a block store, a chunk DB, a
    datastore) or a model directory (config.json beside weights: ralm's, Hugging Face's); else None."""
    try:
        manifest = manifest_file(folder)
        if manifest.is_file():
            if (folder / "versions").is_dir():
                return "an index directory"
            try:
                fmt = str(json.loads(manifest.read_bytes()).get("format", ""))
            except (ValueError, AttributeError):  # not JSON, not an object: no manifest of ralm's
                fmt = ""
            family = fmt.removeprefix("ralm.").split("/")[0] if fmt.startswith("ralm.") else None
            if family is not None:
                return "an index directory" if family == "index" else f"a ralm {family} directory"
        if (folder / "config.json").is_file() and (any((folder / w).is_file() for w in _WEIGHTS)
                                                   or any(folder.glob("model-*-of-*.safetensors"))):
            return "a model directory"
    except OSError:  # a folder this user cannot read: not one ralm could have read either
        return None
    return None


def check_output(option: str, output: str | os.PathLike, inputs: Iterable[tuple[str, object]] = (), *,
                 directory: bool = False) -> None:
    """Refuse an output path the user gave (`--predictions`, `--out`) that would destroy what
    ralm reads: the same file (or folder) as one of the command's `inputs`, (option, path) pairs
    such as ("--questions", path), also under another name (a link), or a path inside an index,
    a model or another ralm artifact directory (`--predictions INDEX/manifest.json` would leave
    an index that no longer opens). An input that is no path (a hub model name, None) is skipped.
    With `directory` (every `--out`: a directory is written there), an existing file is refused.
    Cheap (a few stat calls): the CLI checks its outputs before it imports torch."""
    for name, given in inputs:
        if isinstance(given, (str, os.PathLike)) and given != "" and _same_file(output, given):
            raise RalmError(f"{option} {output} is what {name} reads ({given}); ralm never writes over an input: "
                            "name another path")
    if directory and os.path.lexists(output) and not os.path.isdir(output):
        raise RalmError(f"{option} {output} is a file; {option} names the directory to write: name a new one")
    found = [(folder, what) for folder in Path(os.path.realpath(output)).parents if (what := _artifact(folder))]
    if found:
        folder, what = found[-1]  # the outermost: INDEX, not INDEX/versions/v000001
        raise RalmError(f"{option} {output} lies inside {folder}, {what}, which ralm never writes into: name a path "
                        "outside it")


def _same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):  # either does not exist (a new output), or is no path at all
        return False


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `target`; on success it replaces `target` atomically.

    Works for files and for directories (a directory target must not exist yet, or is
    replaced by a rename-aside so a reader never sees it missing for longer than a rename).
    """
    target = Path(target)
    _check_replaceable(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(target.parent)
    tmp = temp_dir(target.parent, target.name)
    # mkdtemp made a directory; callers writing a file get the path of a file inside it.
    inner = tmp / target.name
    try:
        try:
            yield inner
        except Exception as e:  # a full disk names no file: name the target, for the one-line error
            named = _named_os_error(e, target)
            if named is not None:
                raise named from e
            raise
        if not inner.exists():
            raise FileNotFoundError(f"nothing was written to {inner}")
        fsync_tree(inner)
        if inner.is_dir() and target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.rename(target, old)
            os.rename(inner, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(inner, target)
        _fsync_dir(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def file_lock(path: str | os.PathLike, *, shared: bool = False, blocking: bool = True) -> Iterator[bool]:
    """Hold an inter-process lock on `path` (fcntl.flock on a file created if missing):
    exclusive for a writer, shared for readers. Yields True once held; False when `blocking` is
    off and another process holds it. The kernel drops the lock when its holder dies, so a
    killed writer never leaves it held. Locks are per open file, so two threads of one process
    exclude each other too, and a thread must not take the lock it already holds."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:  # a directory this user cannot write (or a read-only disk): read it unlocked
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        yield True
        return
    try:
        mode = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if blocking else fcntl.LOCK_NB)
        try:
            fcntl.flock(fd, mode)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the lock


def write_text(target: str | os.PathLike, text: str) -> None:
    with atomic_path(target) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(target: str | os.PathLike, obj) -> None:
    write_text(target, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_model_dir(out: str | os.PathLike, tensors: dict, tokenizer, *, fmt: str, config: dict,
                    metadata: dict[str, str] | None = None) -> None:
    """A model directory (config.json with its format tag, model.safetensors, tokenizer),
    published atomically: what every ralm model's `save_pretrained` writes. `metadata` goes into
    the safetensors header (facts about the weights, e.g. their fingerprint)."""
    from safetensors.torch import save_file

    with atomic_path(out) as tmp:
        tmp.mkdir()
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={**(metadata or {}), "format": fmt})
        tokenizer.save_pretrained(str(tmp))
        (tmp / "config.json").write_text(json.dumps({"format": fmt, **config}, indent=2) + "\n")


_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64", "I32": "int32",
           "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def safetensors_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The string metadata in a .safetensors file's header (read alone: a few hundred bytes)."""
    import struct

    with open(path, "rb") as f:
        try:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(min(n, _MAX_HEADER)))
            meta = header.get("__metadata__") or {} if isinstance(header, dict) else None
        except (ValueError, struct.error) as e:
            raise RalmError(f"{path}: not a safetensors file ({e})") from None
        if not isinstance(meta, dict):
            raise RalmError(f"{path} is damaged (its safetensors header is not an object of tensors and metadata)")
        return meta


_MAX_HEADER = 100 << 20  # safetensors' own limit on a header's size


def load_safetensors(path: str | os.PathLike) -> dict:
    """The tensors of a .safetensors file as views of a private (copy-on-write) memory map: no
    read until a page is used, no copy, and writes (training) never reach the file. Each call
    maps the file anew, so two models loaded from it do not share their weights' memory."""
    import mmap
    import struct

    import torch

    path = Path(path)
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            (n,) = struct.unpack("<Q", buf[:8])
            if n > _MAX_HEADER:
                raise ValueError(f"a header of {n} bytes")
            header = json.loads(buf[8 : 8 + n])
        except (ValueError, struct.error, OSError) as e:
            raise RalmError(f"{path} is damaged (not a safetensors file: {e}); restore or re-export the model") from None
    if not isinstance(header, dict):
        raise RalmError(f"{path} is damaged (its safetensors header is not an object); restore or re-export the model")
    base, out = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:  # a header edited or damaged into valid JSON of another shape is the file's damage too
            dtype = getattr(torch, _DTYPES.get(info["dtype"], ""), None)
            if dtype is None:
                raise RalmError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
            start, end = (int(x) for x in info["data_offsets"])
            if not 0 <= start <= end or base + end > len(buf):
                raise RalmError(f"{path} is damaged (tensor {name} at bytes {start}..{end}, past the file); "
                                "restore or re-export the model")
            count = (end - start) // torch.empty(0, dtype=dtype).element_size()
            flat = torch.frombuffer(buf, dtype=dtype, count=count, offset=base + start) if count else torch.empty(0, dtype=dtype)
            out[name] = flat.view(info["shape"])
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise RalmError(f"{path} is damaged (tensor {name!r} in its header: {type(e).__name__} {str(e)[:80]}); "
                            "restore or re-export the model") from None
    return out


def read_weights(model_dir: str | os.PathLike) -> dict:
    """The tensors of a model directory: model.safetensors, or its shards
    model-0000K-of-0000N.safetensors (Hugging Face's naming), as copy-free views (see
    `load_safetensors`). The reader shipped in the package is stored in two shards so that no
    file in the repository passes 30 MB."""
    model_dir = Path(model_dir)
    single = model_dir / "model.safetensors"
    files = [single] if single.is_file() else sorted(model_dir.glob("model-*-of-*.safetensors"))
    if not files:
        raise RalmError(f"{model_dir}: no model.safetensors")
    state = {}
    for f in files:
        state.update(load_safetensors(f))
    return state


def read_json(path: str | os.PathLike) -> dict:
    """A JSON object written by ralm (a manifest, a config)."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except UnicodeDecodeError as e:
        raise RalmError(f"{path} is damaged (not UTF-8 text at byte {e.start}); rebuild it") from None
    except json.JSONDecodeError as e:
        raise RalmError(f"{path} is damaged (not valid JSON: {e.msg}, line {e.lineno}); rebuild it") from None
    if not isinstance(obj, dict):
        raise RalmError(f"{path} is damaged (a JSON {type(obj).__name__}, not an object); rebuild it")
    return obj


def damaged_json(files) -> RalmError | None:
    """The error naming the first of `files` that is not a readable JSON object, or None."""
    for f in map(Path, files):
        if f.suffix == ".json" and f.is_file():
            try:
                read_json(f)
            except RalmError as e:
                return e
    return None


def damaged_file(files, error: Exception) -> RalmError:
    """What a library's failure to read `files` (a tokenizer's, a BM25 index's JSON) means: the
    first of them that is not a readable JSON object, or the failure itself naming them. Called
    only after the library failed, so a sound load costs nothing."""
    files = [Path(f) for f in files]
    damaged = damaged_json(files)
    if damaged is not None:
        return damaged
    first = first_line(error)[:200]
    names = ", ".join(f.name for f in files)
    return RalmError(f"{files[0].parent}: its files ({names}) are damaged ({first}); rebuild or restore them")


def link_or_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """`dst` as a hard link to `src` (published files are never modified in place, so two
    versions can share one), or a copy where the filesystem has no hard links."""
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def manifest_file(folder: str | os.PathLike) -> Path:
    """Where every ralm artifact (index, index version, block store, chunk DB ...) describes
    itself; an artifact is complete once its manifest is there."""
    return Path(folder) / "manifest.json"


def read_manifest(folder: str | os.PathLike, fmt: str | tuple[str, ...], what: str, hint: str = "") -> dict:
    """The manifest of a ralm artifact in format `fmt` (or one of several); `what` names the
    artifact ("index directory", "chunk DB") and `hint` says how to make one, in the errors."""
    path = manifest_file(folder)
    if not path.is_file():
        article = "an" if what[0] in "aeiou" else "a"
        raise RalmError(f"{folder}: not {article} {what} (no manifest.json){hint}")
    manifest = read_json(path)
    if manifest.get("format") not in ((fmt,) if isinstance(fmt, str) else fmt):
        raise RalmError(f"{folder}: unsupported {what} format {manifest.get('format')!r}")
    return manifest


def read_npy(path: str | os.PathLike, mmap_mode: str | None = "r") -> np.ndarray:
    """A .npy array written by ralm, memory-mapped by default; never unpickles."""
    try:
        return np.load(path, mmap_mode=mmap_mode, allow_pickle=False)
    except FileNotFoundError:
        raise RalmError(f"{path} is missing; rebuild it") from None
    except (ValueError, EOFError) as e:  # a truncated header or body, an object array
        raise RalmError(f"{path} is damaged ({e}); rebuild it") from None
