"""The layout of a run directory, in one place for the trainers that write it and the options
that read one (`--init RUN`, `--encoder RUN`, `--model RUN`).

  RUN/config.json                 the trainer's dataclass config
  RUN/inputs.json                 its path fields: absolute path and content fingerprint (resume)
  RUN/checkpoints/step-000100/    model.safetensors + optimizer.safetensors + trainer.json
  RUN/checkpoints/LATEST          name of the newest complete checkpoint
  RUN/metrics.jsonl               one JSON object per logged step
  RUN/<metric>.png                its curve, drawn at the end
  RUN/final/<part>/               the exported models (retriever, encoder, reader), each a
                                  directory its class's `from_pretrained` reads
  RUN/final/trainer.json          {"step", "kind"}: the trainer and step of that export
The language models export RUN/model instead (models.lm.model_dir reads it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Mapping

from ralm.atomic import write_json


def config_file(run: str | os.PathLike) -> Path:
    return Path(run) / "config.json"


def inputs_file(run: str | os.PathLike) -> Path:
    return Path(run) / "inputs.json"


def checkpoints_dir(run: str | os.PathLike) -> Path:
    return Path(run) / "checkpoints"


def metrics_file(run: str | os.PathLike) -> Path:
    return Path(run) / "metrics.jsonl"


def final_dir(run: str | os.PathLike, part: str = "") -> Path:
    """RUN/final, or the exported `part` in it."""
    return Path(run) / "final" / part if part else Path(run) / "final"


def export_final(run: str | os.PathLike, step: int, kind: str, parts: Mapping[str, object]) -> None:
    """Save each model (anything with `save_pretrained`) as RUN/final/<name>, then trainer.json."""
    for name, model in parts.items():
        model.save_pretrained(final_dir(run, name))
    write_json(final_dir(run) / "trainer.json", {"step": step, "kind": kind})


def find_model(path: str | os.PathLike, part: str, accept: Callable[[Path], bool]) -> Path | None:
    """The `part` a path names: RUN/final/<part> of a run, else the path itself; None when
    `accept` takes neither."""
    return next((p for p in (final_dir(path, part), Path(path)) if accept(p)), None)
