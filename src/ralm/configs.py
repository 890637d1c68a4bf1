"""What a trainer config's fields say about themselves: their help text, how the command line
spells them, which are input files, and the presets a config offers.

Each default and help text lives once, in the config dataclass (`option(...)` below); the
`ralm` trainer commands are generated from the fields (ralm.commands.generated), as Hugging
Face's `HfArgumentParser` generates its trainers' arguments, so the command line cannot drift
from the library. Errors about a field name the field (`ConfigError`); the command line
reports them under the option's flag.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from typing import Any, Mapping

from ralm.errors import RalmError

DTYPE_HELP = ("compute dtype: auto (bf16 on CUDA and on CPUs with native bf16, else fp32), fp32 or bf16; "
              "weights and checkpoints stay fp32")
WARMUP_HELP = "steps of linear learning-rate warm-up"
CORPUS_HELP = "JSONL {id,title,text}, TSV with a header, a .txt, Markdown, HTML or PDF file, or a folder of them"
QUESTIONS_HELP = "training questions, JSONL {id, question, answers}"
TEXT_HELP = "a corpus (.jsonl/.tsv/folder; same-title records form one article) or a raw .txt/.raw file (WikiText)"
LOG_EVERY_HELP = "steps per logged line of metrics (means over those steps)"
SAVE_EVERY_HELP = "checkpoint (and export) interval in steps"
TIME_LIMIT_HELP = ("seconds this leg may train: then a checkpoint is saved and the run stops as after Ctrl-C, to be "
                   "resumed by the same command (a scheduler's or a lease's wall time)")
SEED_HELP = "seed of the data order, fresh weights and masking"
LIMIT_HELP = "first N training questions only"
LIMIT_TOKENS_HELP = "use only this many leading wordpieces of the text"
MASKING_HELP = "salient (entities and dates, spaCy) or random (15% of wordpieces)"
SPACY_HELP = ("the spaCy pipeline that finds sentences and salient spans: an installed package or a pipeline "
              "directory (e.g. an entity ruler for your own entities)")

# Path fields: "content" is data a run reads (a resumed run compares it by content fingerprint,
# so a run started from one folder resumes from another), "location" a model, index or store it
# starts from or writes into (compared by the absolute path it named).
PATH_KINDS = ("content", "location")


DTYPES = ("auto", "fp32", "bf16")
_DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


class ConfigError(RalmError):
    """A config field holds a value it cannot take; `field` names it, `problem` says why."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field} {problem}")
        self.field, self.problem = field, problem


def check_device_name(name: str | None) -> None:
    """--device spelled as a device ralm runs on; whether this machine has it is the Runtime's
    check (with torch): this one runs before torch is imported."""
    if name not in (None, "") and not _DEVICE.fullmatch(name):
        raise RalmError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}")


def check_dtype_name(name: str | None) -> None:
    if name not in (None, "") and name not in DTYPES:
        raise ConfigError("dtype", f"must be one of {', '.join(DTYPES)}, got {name!r}")


def option(default: Any = dataclasses.MISSING, help: str = "", *, flag: str | None = None, aliases: tuple[str, ...] = (),
           old: tuple[str, ...] = (), shown: str | None = None, path: str | None = None, cli: bool = True, required: bool = False,
           bounds: tuple[float, float] | None = None, omit: tuple[str, ...] = (), default_factory: Any = dataclasses.MISSING) -> Any:
    """A config field with its help text. `flag` spells the option when it is not the field's
    name (`--seq-len` for max_len; "--on/--off" for a boolean), `aliases` adds other spellings
    (`-k`), `old` spellings from before a rename that still work, hidden from help, `shown` is the default as help shows it ("bundled MiniLM" for "default"), `path`
    marks a file or folder (PATH_KINDS), `cli=False` keeps a field off the command line,
    `required` makes the command line ask for a field whose default only stands for "not set",
    `bounds` is the (min, max) the command line checks, and `omit`, of a nested config, names
    its fields a command does not take (they keep the default instance's values)."""
    if path is not None and path not in PATH_KINDS:
        raise ValueError(f"path must be one of {PATH_KINDS}")
    metadata = {"help": help, "flag": flag, "aliases": aliases, "old": old, "shown": shown, "path": path, "cli": cli,
                "required": required, "bounds": bounds, "omit": omit}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def path_fields(config, kind: str) -> dict[str, str]:
    """{field: value} of the config's set path fields of `kind` (nested configs included)."""
    found = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            found.update(path_fields(value, kind))
        elif f.metadata.get("path") == kind and value not in (None, ""):
            found[f.name] = str(value)
    return found


def with_preset(config_cls, preset: str, *args, **values):
    """`config_cls(*args, **values)` over the preset's values: `with_preset(IctConfig, "cpu",
    "corpus.jsonl")` is a CPU-sized ICT run; "gpu" is the config's own defaults."""
    return config_cls(*args, **{**preset_values(config_cls, preset), **values})


def preset_values(config_cls, preset: str) -> Mapping[str, Any]:
    presets = getattr(config_cls, "presets", {})
    if preset not in ("gpu", *presets):
        raise ConfigError("preset", f"must be one of gpu, {', '.join(presets)}; got {preset!r}")
    return presets.get(preset, {})


RECIPE_FORMAT = "ralm.recipe/1"


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A recipe file: what a trainer command is run with to make an artifact (e.g.
    recipes/reader.json, a reader's), so anyone can rebuild it with the product's own command:

        {"format": "ralm.recipe/1", "command": "train-reader", "about": "...",
         "config": {field: value, ...},          # the trainer config's fields, as in RUN/config.json
         "inputs": {path: "how it is made", ...}}  # optional: the commands that make its input files

    Paths in `config` are read as on the command line (from the current directory). An option
    given on the command line wins over the recipe, which wins over --preset and the defaults."""
    path: str
    command: str
    config: dict
    sha256: str

    @classmethod
    def read(cls, path: str | os.PathLike, *, command: str, config_cls) -> "Recipe":
        import hashlib
        import json

        path = os.fspath(path)
        try:
            data = open(path, "rb").read()
            raw = json.loads(data)
        except OSError as e:
            raise ConfigError("recipe", f"{path}: cannot be read ({e.strerror})") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError("recipe", f"{path}: not JSON ({e})") from None
        if not isinstance(raw, dict) or raw.get("format") != RECIPE_FORMAT or not isinstance(raw.get("config"), dict):
            raise ConfigError("recipe", f"{path}: expected a JSON object with \"format\": \"{RECIPE_FORMAT}\" and a \"config\" object")
        if raw.get("command") != command:
            raise ConfigError("recipe", f"{path} is a recipe for `ralm {raw.get('command')}`, not `ralm {command}`")
        known = {f.name for f in dataclasses.fields(config_cls)}
        unknown = sorted(set(raw["config"]) - known)
        if unknown:
            raise ConfigError("recipe", f"{path}: unknown config field {unknown[0]!r} (the fields are {config_cls.__name__}'s)")
        return cls(path, command, dict(raw["config"]), hashlib.sha256(data).hexdigest())


def config_from_file(cls, raw: dict, where: str | os.PathLike):
    """`cls(**raw)` for a model's config read from a file (`where`: a checkpoint's config.json):
    an unknown field, or a value not of its field's type, is one RalmError naming the file and
    the field, never a failure deep inside the model that reads it."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for name, value in raw.items():
        if name not in known:
            raise RalmError(f"{where}: unknown field {name!r}; the checkpoint is damaged or was written by a newer ralm")
        allowed = typing.get_args(hints[name]) if isinstance(hints[name], types.UnionType) else (hints[name],)
        allowed = tuple(type(None) if t is None else typing.get_origin(t) or t for t in allowed)
        ok = isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)
        if not ok and not (float in allowed and isinstance(value, int) and not isinstance(value, bool)):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
            raise RalmError(f"{where}: field {name!r} must be {names}, got {repr(value)[:60]}; the checkpoint is damaged")
    try:
        return cls(**raw)
    except RalmError as e:
        raise RalmError(f"{where}: {e}") from None

