"""Trainer commands generated from their config dataclasses, as Hugging Face's `HfArgumentParser`
generates its trainers' arguments: every config field (nested configs flattened) becomes an
option with the field's default and help text (ralm.configs.option), so the command line cannot
drift from the library.

Every trainer command also takes --out (the run directory), --preset, --device and --json. An
option given on the command line wins over the preset, which wins over the config's default.
A `ConfigError` naming a field is reported under the field's flag; an interrupted run (Ctrl-C)
prints its checkpoint and the command that resumes it, and exits with code 130.

The trainer modules import torch and the models (seconds), so a group built with
`lazy_trainer_group` generates a trainer's command only when it runs or shows its own help;
`ralm --help` lists the trainers from their one-line summaries.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import shlex
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from typer.core import TyperCommand, TyperGroup

from ralm.atomic import check_output
from ralm.commands.shared import DeviceOpt, JsonOpt, OutOpt, quiet_libraries, renamed_option, runtime, untyped_help_flag
from ralm.configs import ConfigError, Recipe, preset_values
from ralm.console import err, notify, print_train_metrics, print_train_summary
from ralm.errors import RalmError
from ralm.progress import progress_enabled

TIME_LIMIT_EXIT = 75  # EX_TEMPFAIL: not done, and the same command continues it (130 is Ctrl-C's)
RECIPE_HELP = ("a recipe file (JSON: the config's fields, e.g. recipes/reader.json): the run it describes; options given "
               "here override it")


@dataclass(frozen=True)
class TrainerCommand:
    """A trainer command: where its trainer class lives (imported when it runs; its `config` and
    `fit`, ralm.train.trainer), its help, and the line it prints at the end (`done(result, cfg)`)."""

    module: str  # e.g. "ralm.train.ict"
    trainer: str  # the ralm.train.trainer.Trainer subclass in it
    help: str
    done: Callable[[Any, Any], str]
    # build(config class, {option: value}, {options given}) -> config; None: the generic one
    build: Callable[[type, dict, set], Any] | None = None
    # its options that name a model (a directory or a hub name), checked before its module, which
    # imports torch, is: their flags, each a location field of its config (test_from_config checks)
    models: tuple[str, ...] = ()

    def load(self) -> tuple[type, Callable]:
        """(the config class, fit(cfg, run, runtime=, notify=, on_metrics=) -> a TrainResult)."""
        trainer = getattr(importlib.import_module(self.module), self.trainer)
        return trainer.config, trainer.fit


@dataclass(frozen=True)
class ConfigOption:
    """One generated option: config field `name` (inside nested config `parent`, if any)."""

    name: str
    parent: str | None
    decls: tuple[str, ...]
    annotation: Any
    default: Any
    help: str
    shown: str | None
    required: bool
    path: bool  # a file or folder: a Path on the command line, a str in the config
    old: tuple[str, ...] = ()  # spellings from before a rename: still accepted, hidden from help
    bounds: tuple[float, float] | None = None  # (min, max) the command line checks

    @property
    def flag(self) -> str:
        """The spelling errors and docs use: `--seq-len`, `--exclude-same-doc`."""
        return self.decls[0].split("/")[0]


def _annotation(hint: Any) -> Any:
    """`int | None` as typer reads it (Optional[int])."""
    args = typing.get_args(hint)
    if type(None) in args:
        return Optional[next(a for a in args if a is not type(None))]
    return hint


def config_options(config_cls: type) -> list[ConfigOption]:
    """The options of a config's command-line fields, nested configs flattened into their fields
    (but those their parent field's `omit` names)."""
    found: list[ConfigOption] = []

    def walk(cls: type, defaults: Any, parent: str | None, omit: tuple[str, ...] = ()) -> None:
        hints = typing.get_type_hints(cls)
        for f in sorted(dataclasses.fields(cls), key=lambda f: f.kw_only):  # the shared keyword-only fields last
            meta = f.metadata
            if not meta.get("cli", True) or f.name in omit:
                continue
            if defaults is not None:  # a nested config's defaults come from its parent's default instance
                default = getattr(defaults, f.name)
            elif f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = ...
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], default, f.name, meta.get("omit", ()))
                continue
            dash = f.name.replace("_", "-")
            flag = meta.get("flag") or (f"--{dash}/--no-{dash}" if hints[f.name] is bool else f"--{dash}")
            required = default is ... or meta.get("required", False)
            annotation = _annotation(hints[f.name])
            if meta.get("path"):
                annotation = Optional[Path] if default is None else Path
            found.append(ConfigOption(f.name, parent, (flag, *meta.get("aliases", ())), annotation, default,
                                      meta.get("help", ""), meta.get("shown"), required, bool(meta.get("path")),
                                      meta.get("old", ()), meta.get("bounds")))

    walk(config_cls, None, None)
    names = [o.name for o in found]
    if len(names) != len(set(names)):
        raise TypeError(f"{config_cls.__name__}: two fields flatten to one option name")
    return found


def build_config(config_cls: type, values: dict, _given: set) -> Any:
    """The config from option values: a nested config from its fields' options over its default
    instance (which gives the fields it has no option for)."""
    top, nested = {}, {}
    for o in config_options(config_cls):
        if o.parent is None:
            top[o.name] = values[o.name]
        else:
            nested.setdefault(o.parent, {})[o.name] = values[o.name]
    hints = typing.get_type_hints(config_cls)
    made = {}
    for f in dataclasses.fields(config_cls):
        if f.name in nested:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            made[f.name] = (dataclasses.replace(default, **nested[f.name]) if dataclasses.is_dataclass(default)
                            else hints[f.name](**nested[f.name]))
    return config_cls(**top, **made)


def flag_of(options: list[ConfigOption], field: str) -> str:
    """The flag a config field is spelled with (`--` + the field name when it has no option)."""
    return next((o.flag for o in options if o.name == field), "--" + field.replace("_", "-"))


def flagged(options: list[ConfigOption], e: ConfigError) -> RalmError:
    """A config field's error as the command line says it: under the field's flag."""
    return RalmError(f"{flag_of(options, e.field)} {e.problem}")


def _typer_option(o: ConfigOption, *, recipe: bool = False):
    """The typer option of a config field; with `recipe`, a required one may come from the recipe
    file instead, so the command checks it (`_check_required`), not click."""
    if o.required and recipe:
        return typer.Option(None, *o.decls, help=o.help + " [required, unless the recipe sets it]", show_default=False)
    if o.required:
        return typer.Option(..., *o.decls, help=o.help)
    shown = o.shown if o.shown is not None else o.default not in (None, "")
    metavar = "" if o.annotation is bool else None  # a flag takes no value: no `<bool>` beside it in help
    low, high = o.bounds or (None, None)
    return typer.Option(o.default, *o.decls, help=o.help, show_default=shown, metavar=metavar, min=low, max=high)


def _old_name(o: ConfigOption) -> str:
    return f"{o.name}__old"


def config_command(fn: Callable) -> Callable:
    """A command function whose parameter `cfg`, annotated with a config dataclass, stands for
    that config's options (generated as a trainer's, in its place among the function's own
    arguments and options); the function is called with the config built from them, a field's
    ConfigError named by its flag. An option's old spellings are one hidden option that sets
    the same field."""
    hints = typing.get_type_hints(fn)
    config_cls = hints["cfg"]
    options = config_options(config_cls)
    renamed = [o for o in options if o.old]
    params = [inspect.Parameter("_ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)] if renamed else []
    for p in inspect.signature(fn).parameters.values():
        if p.name == "cfg":
            params += [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=_typer_option(o), annotation=o.annotation)
                       for o in options]
            params += [inspect.Parameter(_old_name(o), inspect.Parameter.KEYWORD_ONLY, annotation=Optional[o.annotation],
                                         default=typer.Option(None, *o.old, hidden=True)) for o in renamed]
        else:
            params.append(p.replace(annotation=hints.get(p.name, p.annotation)))

    @functools.wraps(fn)
    def command(*args, **values):
        ctx = values.pop("_ctx", None)
        fields = {o.name: values.pop(o.name) for o in options}
        for o in renamed:  # typer bundles its own click: its ParameterSource is compared by name
            given = ctx.get_parameter_source(o.name).name not in ("DEFAULT", "DEFAULT_MAP")
            fields[o.name] = renamed_option(o.flag, fields[o.name], o.old[0], values.pop(_old_name(o)), new_given=given)
        try:
            cfg = build_config(config_cls, fields, set())
        except ConfigError as e:
            raise flagged(options, e) from None
        return fn(*args, cfg=cfg, **values)

    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {}  # typer reads the signature's
    command.config = config_cls
    return command


def _preset_help(config_cls: type, options: list[ConfigOption]) -> str:
    """--preset's help: what the CPU preset sets, and what a step of it costs (measured for ICT)."""
    cpu = preset_values(config_cls, "cpu")
    sets = ", ".join(f"{flag_of(options, k)} {v}" for k, v in cpu.items())
    return ((f"cpu: a run sized for a few CPU cores ({sets}; ICT's steps take about 16 s each on 2 busy cores, its "
             "200 steps about an hour); " if cpu else "")
            + "gpu: the config's defaults. Options given here override the preset. After its first step a trainer "
              "prints its time estimate")


def _cpu_sized(config_cls: type, trainer: TrainerCommand, values: dict, given: set) -> Any | None:
    """The config `--preset cpu` would give this command line (the options given still win), or
    None where the trainer has no CPU preset or the options given do not go with it."""
    cpu = preset_values(config_cls, "cpu")
    try:
        return (trainer.build or build_config)(config_cls, {**values, **{k: v for k, v in cpu.items() if k not in given}},
                                               given) if cpu else None
    except ConfigError:
        return None


def _estimate_teller(cfg, cpu_cfg, shown: bool) -> Callable[[Any], None]:
    """What a trainer command prints of the loop's wall-time estimate (train.loop.StepEstimate): its
    line, and with the first one, when `cpu_cfg` (the run under --preset cpu) would take less than
    half the time, that run's estimate from the same timed step scaled by its `step_work`. Nothing
    unless `shown`."""
    from ralm.train.loop import format_duration

    def tell(e) -> None:
        if not shown:
            return
        notify(e.line())
        if cpu_cfg is None or not e.first or e.steps < cfg.steps - 1:  # a resumed run keeps its config
            return
        seconds = e.seconds * cpu_cfg.step_work() / cfg.step_work()
        if cpu_cfg.steps * seconds < 0.5 * (e.steps + 1) * e.seconds:
            notify(f"on this CPU try --preset cpu: about {cpu_cfg.steps} steps x {seconds:.3g} s = "
                   f"{format_duration(cpu_cfg.steps * seconds)} (the options given still win)")
    return tell


def _resume_line(e) -> str:
    return (f"{e.reason} at step {e.step}; checkpoint {e.checkpoint}\nresume with: "
            + shlex.join(["ralm", *sys.argv[1:]]))


@functools.cache
def trainer_command(name: str, trainer: TrainerCommand) -> TyperCommand:
    """The click command of a trainer, its options generated from its config."""
    from ralm.train.loop import TrainingInterrupted

    config_cls, train = trainer.load()
    options = config_options(config_cls)
    params = [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)]
    params += [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=_typer_option(o, recipe=True),
                                 annotation=Optional[o.annotation] if o.required else o.annotation) for o in options]
    params += [inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY, default=OutOpt, annotation=Path),
               inspect.Parameter("preset", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[str],
                                 default=typer.Option(None, "--preset", help=_preset_help(config_cls, options),
                                                     metavar="cpu|gpu")),
               inspect.Parameter("recipe", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],
                                 default=typer.Option(None, "--recipe", help=RECIPE_HELP, metavar="FILE")),
               inspect.Parameter("device", inspect.Parameter.KEYWORD_ONLY, default=DeviceOpt, annotation=str),
               inspect.Parameter("as_json", inspect.Parameter.KEYWORD_ONLY, default=JsonOpt, annotation=bool)]

    def command(ctx: typer.Context, **values):
        quiet_libraries()
        # typer bundles its own click: its ParameterSource is compared by name
        given = {o.name for o in options if ctx.get_parameter_source(o.name).name not in ("DEFAULT", "DEFAULT_MAP")}
        run, preset, recipe, device, as_json = (values.pop(k) for k in ("out", "preset", "recipe", "device", "as_json"))
        values.update({o.name: str(values[o.name]) if o.name in given else o.default for o in options if o.path})
        made_by = {"command": shlex.join(["ralm", *sys.argv[1:]])}
        try:
            if recipe is not None:
                book = Recipe.read(recipe, command=name, config_cls=config_cls)
                values.update({k: v for k, v in book.config.items() if k not in given})
                given = given | set(book.config)
                made_by["recipe"] = {"path": book.path, "sha256": book.sha256}
            missing = [o.flag for o in options if o.required and values[o.name] in (None, ...)]
            if missing:
                raise RalmError(f"missing option {missing[0]}: give it, or a --recipe that sets it")
            check_output("--out", run, [(o.flag, values[o.name]) for o in options if o.path], directory=True)
            values.update({k: v for k, v in preset_values(config_cls, preset or "gpu").items() if k not in given})
            cfg = (trainer.build or build_config)(config_cls, values, given)
            rt = runtime(device, cfg.dtype)
            cpu_cfg = _cpu_sized(config_cls, trainer, values, given) if rt.device.type == "cpu" and preset is None else None
            result = train(cfg, run, runtime=rt, notify=notify, on_metrics=print_train_metrics, made_by=made_by,
                           on_estimate=_estimate_teller(cfg, cpu_cfg, shown=not as_json and progress_enabled()))
        except ConfigError as e:
            raise flagged(options, e) from None
        except TrainingInterrupted as e:
            err.print(_resume_line(e), highlight=False, soft_wrap=True)
            raise typer.Exit(130 if e.time_limit is None else TIME_LIMIT_EXIT) from None
        print_train_summary(result, as_json, trainer.done(result, cfg))

    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {}
    command.config = config_cls
    app = typer.Typer(add_completion=False)
    app.command(name, help=trainer.help)(command)
    return untyped_help_flag(typer.main.get_command(app))


def _given_value(args: list[str], flag: str) -> str | None:
    """The value of `flag` in unparsed arguments (`--flag V` or `--flag=V`; the last one wins)."""
    value = None
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            value = arg.partition("=")[2]
        elif arg == flag and i + 1 < len(args):
            value = args[i + 1]
    return value


def _check_early(trainer: TrainerCommand, args: list[str]) -> None:
    """A trainer's --out and model options read from its arguments before they are parsed: its
    options are known only once its module (torch, seconds) is imported, and --out naming a file or
    --model naming nothing are mistakes to name first."""
    from ralm.commands.shared import check_models

    run = _given_value(args, "--out")
    if run:
        check_output("--out", run, directory=True)
    for flag in trainer.models:
        model = _given_value(args, flag)
        if model not in (None, "", "default"):  # "default": the bundled MiniLM
            check_models(model, option=flag)


def lazy_trainer_group(trainers: dict[str, TrainerCommand], *, first: tuple[str, ...] = ()) -> type[TyperGroup]:
    """A typer group class (`typer.Typer(cls=...)`) holding `trainers` besides its own commands; its
    help lists the commands named `first` in that order, then the trainers, then the others (typer
    alone would list the commands, then the groups, in the order they were registered)."""

    class TrainerGroup(TyperGroup):
        _listing = False
        registry = trainers

        def list_commands(self, ctx: typer.Context) -> list[str]:
            own = super().list_commands(ctx)
            return [*(name for name in first if name in own), *trainers, *(name for name in own if name not in first)]

        def resolve_command(self, ctx: typer.Context, args: list[str]):
            if args and args[0] in trainers and "--help" not in args:
                _check_early(trainers[args[0]], args[1:])
            return super().resolve_command(ctx, args)

        def get_command(self, ctx: typer.Context, cmd_name: str):
            trainer = trainers.get(cmd_name)
            if trainer is None:
                return super().get_command(ctx, cmd_name)
            if self._listing:  # the group's help: the summary line, without importing the trainer
                return TyperCommand(cmd_name, help=trainer.help)
            return trainer_command(cmd_name, trainer)

        def format_help(self, ctx: typer.Context, formatter) -> None:
            self._listing = True
            try:
                super().format_help(ctx, formatter)
            finally:
                self._listing = False

    return TrainerGroup
