"""Checkpoints of a run (atomic, resumable) and the config check that lets a run resume.

A run resumes when its config is the one it started with, except the fields in
RESUMABLE_CHANGES. Path fields (ralm.configs) are compared by what they name, not by their
string: data by content fingerprint (RUN/inputs.json), so a run started from one folder resumes
from another and a corpus edited in place is refused; models and indexes by absolute path.

Checkpoints hold tensors in safetensors and the rest in JSON: nothing is unpickled on resume.
A checkpoint is written in a hidden `checkpoints/.step-N-<pid>@...tmp` folder (ralm.atomic);
one a killed run left behind is removed when the run starts again. Paths: ralm.rundir.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, is_dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ralm.atomic import atomic_path, read_json, remove_stale_temps, write_json, write_text
from ralm.configs import PATH_KINDS, path_fields
from ralm.data.corpus import corpus_fingerprint
from ralm.distributed import dist_env
from ralm.errors import RalmError
from ralm.rundir import checkpoints_dir, config_file, inputs_file

# Options a user may change when resuming (train longer, save more often, a leg's own time, its
# input workers: train-reader's weights are the same with any number).
RESUMABLE_CHANGES = {"steps", "save_every", "log_every", "dtype", "time_limit", "workers"}


# -- optimizer state as safetensors + JSON ----------------------------------------------------

def _optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    state = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, slots in state["state"].items():
        for name, value in slots.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{pid}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{name}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _optimizer_state(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for key, value in list(tensors.items()) + list(meta["scalars"].items()):
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = value
    return {"state": state, "param_groups": meta["param_groups"]}


# -- checkpoints --------------------------------------------------------------------------

def world_size() -> int:
    """Processes training together (torchrun), 1 without it."""
    return dist_env().world


def save_checkpoint(run: str | os.PathLike, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
                    scheduler=None, extra: dict | None = None, keep: int = 2) -> Path:
    """Write RUN/checkpoints/step-N atomically, then move LATEST to it; keep the last `keep`."""
    ckdir = checkpoints_dir(run)
    name = f"step-{step:06d}"
    with atomic_path(ckdir / name) as tmp:
        tmp.mkdir()
        save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(tmp / "model.safetensors"))
        meta = {"step": step, "extra": extra or {}, "torch_rng": torch.get_rng_state().tolist(), "world": world_size()}
        if optimizer is not None:
            tensors, opt_meta = _optimizer_tensors(optimizer)
            save_file(tensors, str(tmp / "optimizer.safetensors"))
            meta["optimizer"] = opt_meta
        if scheduler is not None:
            meta["scheduler"] = scheduler.state_dict()
        (tmp / "trainer.json").write_text(json.dumps(meta) + "\n")
    write_text(ckdir / "LATEST", name + "\n")
    for old in sorted(p for p in ckdir.glob("step-*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return ckdir / name


def latest_checkpoint(run: str | os.PathLike) -> Path | None:
    f = checkpoints_dir(run) / "LATEST"
    if not f.is_file():
        return None
    path = f.parent / f.read_text().strip()
    return path if (path / "trainer.json").is_file() else None


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    scheduler=None) -> dict:
    """Restore model (+ optimizer, scheduler, torch RNG) in place; returns trainer.json."""
    path = Path(path)
    meta = read_json(path / "trainer.json")
    # The global batch is per-rank batch x ranks: another count would silently change the run.
    saved, now = meta.get("world", 1), world_size()
    if saved != now:
        raise RalmError(f"{path} was saved by {saved} process(es) but this run has {now}; resume with "
                        f"`torchrun --nproc_per_node {saved}` (or without torchrun for 1), or start a new run directory")
    model.load_state_dict(load_file(str(path / "model.safetensors")), strict=True)
    if optimizer is not None and "optimizer" in meta:
        optimizer.load_state_dict(_optimizer_state(load_file(str(path / "optimizer.safetensors")), meta["optimizer"]))
    if scheduler is not None and "scheduler" in meta:
        scheduler.load_state_dict(meta["scheduler"])
    torch.set_rng_state(torch.tensor(meta["torch_rng"], dtype=torch.uint8))
    return meta


# -- starting or resuming a run ---------------------------------------------------------------

def _warmup_in_steps(old: dict) -> dict:
    """A config.json from when DPR, fine-tuning and reader training took `warmup` as a share of
    the steps, with the warm-up in steps that share gave (int(share x steps))."""
    share = old.get("warmup")
    if isinstance(share, float) and 0 <= share < 1 and isinstance(old.get("steps"), int):
        return {**old, "warmup": int(share * old["steps"])}
    return old


def run_inputs(config) -> dict[str, dict]:
    """{field: {"kind", "path", "fingerprint"}} of a config's set path fields: the absolute path
    (the value as given when it names no file, e.g. a hub model), and for data its fingerprint."""
    found = {}
    for kind in PATH_KINDS:
        for name, value in path_fields(config, kind).items():
            path = Path(value)
            entry = {"kind": kind, "path": str(path.resolve()) if path.exists() else value}
            if kind == "content":
                entry["fingerprint"] = corpus_fingerprint(path) if path.exists() else None
            found[name] = entry
    return found


def _same_input(old: dict | None, new: dict) -> bool:
    if old is None:
        return False
    if new.get("fingerprint") and old.get("fingerprint"):
        return new["fingerprint"] == old["fingerprint"]
    if not Path(old["path"]).is_absolute() and old.get("fingerprint") is None and Path(old["path"]).resolve() == Path(new["path"]):
        return True  # recorded as given, missing then (the run stopped on it): the same path, made since
    return new["path"] == old["path"]


def prepare_run(run: str | os.PathLike, config) -> Path | None:
    """Create RUN (saving its config) or check that an existing RUN was started with the same
    config; returns the checkpoint to resume from, if any."""
    run = Path(run)
    if run.exists() and not run.is_dir():
        raise RalmError(f"run directory {run} is a file; choose a directory (new, or a run to resume)")
    cfg = asdict(config) if is_dataclass(config) else dict(config)
    inputs = run_inputs(config) if is_dataclass(config) else {}
    saved = config_file(run)
    if saved.is_file():
        raw = read_json(saved)
        old = _warmup_in_steps(raw)
        old_inputs = read_json(inputs_file(run)) if inputs_file(run).is_file() else {}
        changed = {k for k in set(old) | set(cfg) if old.get(k) != cfg.get(k) and k not in RESUMABLE_CHANGES}
        changed -= {k for k in changed & set(inputs) if _same_input(old_inputs.get(k), inputs[k])}
        if "warmup" in changed and old is not raw:
            raise RalmError(f"{run} was started with warmup {raw['warmup']} (a share of its {raw['steps']} steps), "
                            f"i.e. {old['warmup']} warm-up steps; resume with warmup {old['warmup']}")
        if changed:
            raise RalmError(f"{run} was started with a different config ({', '.join(sorted(changed))}); "
                            "start a new run directory")
        edited = sorted(k for k, entry in inputs.items() if k in old_inputs and not _same_input(old_inputs[k], entry))
        if edited:
            raise RalmError(f"{run} was started with other inputs: {', '.join(f'{k} {cfg[k]}' for k in edited)} named "
                            "other content then (fingerprint or absolute path); start a new run directory")
    run.mkdir(parents=True, exist_ok=True)
    write_json(saved, cfg)
    write_json(inputs_file(run), inputs)
    remove_stale_temps(checkpoints_dir(run))  # a killed run's half-written checkpoint (can be GBs)
    return latest_checkpoint(run)
