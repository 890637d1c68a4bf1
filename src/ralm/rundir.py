"""The layout of a run directory, in one place for the trainers that write it and the options
that read one (`--init RUN`, `--encoder RUN`, `--model RUN`).

  RUN/config.json                 the trainer's dataclass config
  RUN/inputs.json                 its path fields: absolute path and content fingerprint (resume)
  RUN/checkpoints/step-000100/    model.safetensors + optimizer.safetensors + trainer.json
  RUN/checkpoints/LATEST          name of the newest complete checkpoint
  RUN/metrics.jsonl               one JSON object per logged step
  RUN/legs.jsonl                  each start of the run (a leg): its command, recipe, first step
  RUN/<metric>.png                its curve, drawn at the end
  RUN/final/<part>/               the exported models (retriever, encoder, reader, model), each
                                  a directory its class's `from_pretrained` (or `load_lm`) reads
  RUN/final/<part>/made_by.json   what made the part: trainer, step, config, input fingerprints, legs
  RUN/final/trainer.json          the export's manifest (`RunExport`): trainer kind, step, parts
Language-model runs from before RUN/final kept their model in RUN/model; `find_model` still
finds it there.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from ralm.atomic import read_json, write_json, write_text
from ralm.errors import RalmError


def config_file(run: str | os.PathLike) -> Path:
    return Path(run) / "config.json"


def inputs_file(run: str | os.PathLike) -> Path:
    return Path(run) / "inputs.json"


def checkpoints_dir(run: str | os.PathLike) -> Path:
    return Path(run) / "checkpoints"


def metrics_file(run: str | os.PathLike) -> Path:
    return Path(run) / "metrics.jsonl"


def legs_file(run: str | os.PathLike) -> Path:
    return Path(run) / "legs.jsonl"


def record_leg(run: str | os.PathLike, made_by: dict, step: int) -> None:
    """Add this start of the run to RUN/legs.jsonl: `made_by` (the command line, the recipe's
    path and sha256) and the step it starts from (0, or the checkpoint resumed)."""
    path = legs_file(run)
    old = path.read_text(encoding="utf-8") if path.is_file() else ""
    leg = {**made_by, "from_step": step, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_text(path, old + json.dumps(leg, ensure_ascii=False) + "\n")


def made_by(run: str | os.PathLike, kind: str, step: int) -> dict:
    """What made RUN's exports: trainer, step, config, input fingerprints and the legs run."""
    run = Path(run)
    legs = legs_file(run)
    return {"trainer": kind, "step": step,
            "config": read_json(config_file(run)) if config_file(run).is_file() else None,
            "inputs": read_json(inputs_file(run)) if inputs_file(run).is_file() else None,
            "legs": [json.loads(line) for line in legs.read_text(encoding="utf-8").splitlines()] if legs.is_file() else []}


def final_dir(run: str | os.PathLike, part: str = "") -> Path:
    """RUN/final, or the exported `part` in it."""
    return Path(run) / "final" / part if part else Path(run) / "final"


# trainer names written before the registry used the command names
RENAMED_TRAINERS = {"realm": "pretrain", "reader": "train-reader"}


@dataclass(frozen=True)
class RunExport:
    """RUN/final/trainer.json: which trainer exported RUN/final, at which step, and its parts."""

    kind: str  # the trainer's registry name, its command: "ict", "pretrain", "train-reader", "lm", "retro" ...
    step: int
    parts: tuple[str, ...]  # the folders of RUN/final, each one model

    @staticmethod
    def file(run: str | os.PathLike) -> Path:
        return final_dir(run) / "trainer.json"

    def write(self, run: str | os.PathLike) -> None:
        write_json(self.file(run), {"step": self.step, "kind": self.kind, "parts": list(self.parts)})

    @classmethod
    def read(cls, run: str | os.PathLike) -> RunExport:
        """The manifest of RUN/final; one written before `parts` was recorded lists the
        folders RUN/final holds, one naming a trainer by its old name gets its command's."""
        path = cls.file(run)
        if not path.is_file():
            raise RalmError(f"{run}: no exported models (no final/trainer.json); train the run, or name a model directory")
        raw = read_json(path)
        parts = raw.get("parts", sorted(p.name for p in final_dir(run).iterdir() if p.is_dir()))
        if not isinstance(raw.get("kind"), str) or not raw["kind"]:
            raise RalmError(f"{path}: 'kind' must name the trainer, got {raw.get('kind')!r}")
        if not isinstance(raw.get("step"), int) or isinstance(raw["step"], bool) or raw["step"] < 0:
            raise RalmError(f"{path}: 'step' must be a whole number >= 0, got {raw.get('step')!r}")
        if not isinstance(parts, list) or not all(isinstance(p, str) and p and "/" not in p for p in parts):
            raise RalmError(f"{path}: 'parts' must list the folder names of RUN/final, got {parts!r}")
        return cls(RENAMED_TRAINERS.get(raw["kind"], raw["kind"]), raw["step"], tuple(parts))


def export_final(run: str | os.PathLike, step: int, kind: str, parts: Mapping[str, object]) -> None:
    """Save each model (anything with `save_pretrained`) as RUN/final/<name>, with what made it
    (`made_by`: <name>/made_by.json), then the manifest."""
    record = made_by(run, kind, step)
    for name, model in parts.items():
        model.save_pretrained(final_dir(run, name))
        write_json(final_dir(run, name) / "made_by.json", record)
    RunExport(kind, step, tuple(parts)).write(run)


def is_run(path: str | os.PathLike) -> bool:
    """A run directory (it has checkpoints or exports), not a model directory."""
    return checkpoints_dir(path).is_dir() or final_dir(path).is_dir()


def is_model_dir(path: Path) -> bool:
    """A directory a `from_pretrained` may read (it has a config.json)."""
    return (path / "config.json").is_file()


def find_model(path: str | os.PathLike, part: str, accept: Callable[[Path], bool]) -> Path | None:
    """The one place that decides what a path names as model `part`: of a run, RUN/final/<part>
    (for part "model", an older language-model run's RUN/model too); of anything else, the path
    itself. None when `accept` takes none of them."""
    path = Path(path)
    if is_run(path):
        found = (final_dir(path, part), *([path / part] if part == "model" else []))
    else:
        found = (path,)
    return next((p for p in found if accept(p)), None)
