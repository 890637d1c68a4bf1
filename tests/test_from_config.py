"""The trainer commands are generated from their configs: their defaults are the configs' own,
and the options every command shares mean the same thing everywhere (docs/cli.md)."""

import dataclasses
import re
import typing
from pathlib import Path

import pytest
import typer

from ralm.cli import app
from ralm.commands.from_config import config_options, trainer_command
from ralm.commands.lm import lm_app, retro_app
from ralm.commands.train import TRAINERS
from ralm.configs import DTYPE_HELP, preset_values, with_preset

ROOT = Path(__file__).resolve().parents[1]
ALL_TRAINERS = {**TRAINERS, "lm train": lm_app.info.cls.registry["train"],
                "retro train": retro_app.info.cls.registry["train"]}
REQUIRED = {"corpus": "c.jsonl", "questions": "q.jsonl", "index": "idx", "text": "t.txt", "db": "db"}


def _params(command) -> dict[str, object]:
    return {p.name: p for p in command.params}


def _commands(group, ctx, prefix=()):
    """(name path, click command) of every command under a group, the lazy trainers included."""
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if hasattr(cmd, "list_commands"):
            yield from _commands(cmd, typer.Context(cmd, parent=ctx, info_name=name), (*prefix, name))
        else:
            yield (*prefix, name), cmd


@pytest.mark.parametrize("name", list(ALL_TRAINERS))
def test_every_trainer_option_defaults_to_its_config_field(name):
    trainer = ALL_TRAINERS[name]
    config_cls, _ = trainer.load()
    command = trainer_command(name.split()[-1], trainer)
    params = _params(command)
    options = config_options(config_cls)
    required = {f.name: REQUIRED[f.name] for f in dataclasses.fields(config_cls)
                if (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                or f.metadata.get("required")}
    cfg = config_cls(**required)  # the library's defaults, built as a Python user builds them
    for o in options:
        param = params[o.name]
        want = getattr(getattr(cfg, o.parent) if o.parent else cfg, o.name)
        assert o.help, f"{name} {o.flag}: no help text"
        if param.required or o.required:  # a trainer's required option may come from --recipe: it checks them itself
            assert o.name in REQUIRED or want in ("", None), f"{name} {o.flag} is required but has a default {want!r}"
            continue
        got = param.default
        assert (str(got) if o.path and got is not None else got) == want, f"{name} {o.flag}: CLI {got!r}, config {want!r}"
        assert param.show_default != "default" and not (param.show_default is True and got == "default")
    # every field a user can set from Python is on the command line, and nothing else is
    flat = {f.name for f in dataclasses.fields(config_cls)} | {o.name for o in options if o.parent}
    hidden = {f.name for f in dataclasses.fields(config_cls) if not f.metadata.get("cli", True)}
    assert {o.name for o in options} >= flat - hidden - {o.parent for o in options if o.parent}
    assert set(params) == {o.name for o in options} | {"out", "preset", "recipe", "device", "as_json"}


@pytest.mark.parametrize("name", list(ALL_TRAINERS))
def test_the_model_options_checked_before_the_import_are_the_configs_model_locations(name):
    """A trainer names the options checked before its module is imported (`models`); each is a
    location field of its config, and every location field is either one of them or an index."""
    trainer = ALL_TRAINERS[name]
    config_cls, _ = trainer.load()
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    locations = {o.flag for o in config_options(config_cls)
                 if o.parent is None and fields[o.name].metadata.get("path") == "location"}
    assert set(trainer.models) <= locations, (name, trainer.models, locations)
    assert locations - set(trainer.models) <= {"--index", "--db", "--tokenizer", "--retrofit"}, (name, locations)


def test_presets_only_name_fields_and_validate_like_any_config():
    for trainer in ALL_TRAINERS.values():
        config_cls, _ = trainer.load()
        fields = {f.name for f in dataclasses.fields(config_cls)}
        assert set(preset_values(config_cls, "cpu")) <= fields
        assert preset_values(config_cls, "gpu") == {}
    from ralm.train.ict import IctConfig

    cpu = with_preset(IctConfig, "cpu", "c.jsonl", steps=7)
    assert (cpu.steps, cpu.batch_size) == (7, preset_values(IctConfig, "cpu")["batch_size"])
    with pytest.raises(Exception, match="preset must be one of gpu, cpu; got 'tpu'"):
        with_preset(IctConfig, "tpu", "c.jsonl")


def _base_type(param) -> type:
    """The Python type typer parses an option into (Optional[T] -> T)."""
    annotation = param.type_descriptor.annotation
    return next((a for a in typing.get_args(annotation) if a is not type(None)), annotation)


def _docs_table() -> dict[str, str]:
    """{option spelling: meaning} from the table of common options in docs/cli.md."""
    text = (ROOT / "docs" / "cli.md").read_text()
    rows = re.findall(r"^\| (`[^|]+) \| ([^|]+) \|", text, flags=re.M)
    return {flag.split()[0]: meaning.strip() for spellings, meaning in rows for flag in re.findall(r"`([^`]+)`", spellings)}


def test_common_options_mean_the_same_thing_in_every_command():
    root = typer.main.get_command(app)
    ctx = typer.Context(root, info_name="ralm")
    commands = dict(_commands(root, ctx))
    assert ("ict",) in commands and ("retro", "train") in commands and ("search",) in commands
    documented = _docs_table()
    for flag in ("--index", "--corpus", "--questions", "--model", "-k", "--out", "--device", "--dtype", "--json", "--preset"):
        assert flag in documented, f"docs/cli.md has no row for {flag}"
    seen = {}
    for path, cmd in commands.items():
        by_flag = {opt: p for p in cmd.params for opt in (*p.opts, *p.secondary_opts)}
        where = "ralm " + " ".join(path)
        if "--json" in by_flag:
            assert by_flag["--json"].is_flag and by_flag["--json"].default is False, where
        if "--device" in by_flag:
            assert by_flag["--device"].default == "auto", where
        if "--dtype" in by_flag:
            assert by_flag["--dtype"].default == "auto" and by_flag["--dtype"].help == DTYPE_HELP, where
        if "-k" in by_flag or "--k" in by_flag:  # how many retrieved items per query, a positive count
            assert by_flag.get("-k") is by_flag.get("--k"), f"{where}: -k and --k must be one option"
            assert _base_type(by_flag["-k"]) is int, where
        for flag in ("--index", "--corpus", "--questions", "--out"):  # files and folders, never free text
            if flag in by_flag:
                assert _base_type(by_flag[flag]) is Path, f"{where} {flag}"
        if "--out" in by_flag and path[-1] != "qa":  # eval qa: where a calibrated copy goes, when asked for one
            assert by_flag["--out"].required, where
        for flag in by_flag:
            seen.setdefault(flag, []).append(where)
        # positional arguments are the command's subject: a query, a question, a prompt, ids, a model to convert; what it
        # reads, an index or a corpus, is --index / --corpus (hidden positionals: the older spellings, docs/cli.md)
        for p in cmd.params:
            assert p.help or p.hidden, f"{where} {p.name}: no help text"
            if p.param_type_name == "argument" and not p.hidden:
                assert p.name in ("query", "question", "prompt", "src", "source", "ids"), f"{where}: {p.name}"
            elif p.param_type_name == "argument":
                assert p.name == "more" and p.nargs == -1, f"{where}: {p.name}"
    assert len(seen["--json"]) >= 20  # every command that reports a result can print it as JSON


def test_a_config_error_is_reported_under_its_flag(ralm, tmp_path):
    code, _, err = ralm("lm", "train", "--text", "t.txt", "--out", tmp_path / "r", "--seq-len", 0)
    assert code == 2 and "--seq-len must be positive, got 0" in err  # LMConfig.max_len, spelled as the CLI spells it
    code, _, err = ralm("ict", "--corpus", "c.jsonl", "--out", tmp_path / "r", "--batch-size", 1)
    assert code == 2 and "--batch-size must be at least 2" in err
    code, _, err = ralm("ict", "--corpus", "c.jsonl", "--out", tmp_path / "r", "--preset", "tpu")
    assert code == 2 and "--preset must be one of gpu, cpu" in err
    assert not (tmp_path / "r").exists()  # refused before any work


def test_preset_cpu_sets_what_the_command_line_leaves_unset(ralm, tmp_path, corpus_file, tiny_bert):
    import json

    from ralm.train.lm import LMTrainConfig

    code, _, err = ralm("lm", "train", "--text", corpus_file, "--out", tmp_path / "r", "--tokenizer", tiny_bert, "--dim", 16,
                        "--layers", 1, "--heads", 2, "--seq-len", 8, "--steps", 2, "--preset", "cpu", "--device", "cpu")
    assert code == 0, err
    saved = json.loads((tmp_path / "r" / "config.json").read_text())
    cpu = preset_values(LMTrainConfig, "cpu")
    assert saved["steps"] == 2 and saved["batch_size"] == cpu["batch_size"] != LMTrainConfig.batch_size
    assert saved["model"]["dim"] == 16 and saved["text"] == str(corpus_file)


def test_the_estimate_and_the_preset_hint_come_before_the_first_metrics(ralm, tmp_path, corpus_file, tiny_bert, monkeypatch):
    from ralm.train.lm import LMTrainConfig

    monkeypatch.setenv("RALM_NO_PROGRESS", "0")
    monkeypatch.setattr(LMTrainConfig, "presets", {"cpu": {"batch_size": 2}})  # an eighth of the default 16 a step
    args = ("lm", "train", "--text", corpus_file, "--tokenizer", tiny_bert, "--dim", 16, "--layers", 1, "--heads", 2,
            "--seq-len", 8, "--steps", 3, "--log-every", 1, "--device", "cpu")
    code, _, err = ralm(*args, "--out", tmp_path / "a")
    err = " ".join(err.split())  # rich wraps long lines
    assert code == 0, err
    estimate, hint, metrics = err.find("about 2 steps x "), err.find("on this CPU try --preset cpu: about 3 steps x "), err.find("step 1 ")
    assert -1 < estimate < hint < metrics, err  # told after the first step's work, before its metrics line
    assert "(the first step's time; checkpoints not counted)" in err

    code, _, err = ralm(*args, "--out", tmp_path / "b", "--preset", "cpu")  # sized for the CPU already: no hint
    assert code == 0 and "about 2 steps x " in " ".join(err.split()) and "try --preset cpu" not in err, err

    code, out, err = ralm(*args, "--out", tmp_path / "c", "--json")
    assert code == 0 and out.startswith("{") and "steps x" not in err and "try --preset" not in err, err
    monkeypatch.setenv("RALM_NO_PROGRESS", "1")
    code, _, err = ralm(*args, "--out", tmp_path / "d")
    assert code == 0 and "steps x" not in err and "try --preset" not in err, err
