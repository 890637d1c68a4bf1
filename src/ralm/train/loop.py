"""What every trainer shares: checkpoints (atomic, resumable), data order, metrics, plots.

A run directory:
  RUN/config.json                 the trainer's dataclass config
  RUN/checkpoints/step-000100/    model.safetensors + optimizer.safetensors + trainer.json
  RUN/checkpoints/LATEST          name of the newest complete checkpoint
  RUN/metrics.jsonl               one JSON object per logged step
  RUN/*.png                       curves, drawn at the end

Checkpoints hold tensors in safetensors and the rest in JSON: nothing is unpickled on resume.
A checkpoint is written in a hidden `checkpoints/.step-N-<pid>@...tmp` folder (ralm.atomic);
one a killed run left behind is removed when the run starts again.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ralm.atomic import atomic_path, read_json, remove_stale_temps, write_json, write_text
from ralm.distributed import dist_env
from ralm.errors import RalmError
from ralm.runtime import DTYPES


# -- options --------------------------------------------------------------------------------

def check_options(cfg, positive: Iterable[str] = (), non_negative: Iterable[str] = (),
                  fractions: Iterable[str] = (), shares: Iterable[str] = ()) -> None:
    """The checks every trainer config runs before anything loads. A wrong sign is no typo to
    train through: a negative learning rate is gradient ascent, a negative warm-up a silent
    no-op. `fractions` lie in [0, 1]; `shares` (of the steps, e.g. a warm-up) in [0, 1). `None`
    means "not set" and passes; NaN fails every check."""
    def fail(name: str, what: str) -> None:
        raise RalmError(f"--{name.replace('_', '-')} must be {what}, got {getattr(cfg, name)}")

    for name in positive:
        if getattr(cfg, name) is not None and not getattr(cfg, name) > 0:
            fail(name, "positive")
    for name in non_negative:
        if getattr(cfg, name) is not None and not getattr(cfg, name) >= 0:
            fail(name, ">= 0")
    for name in fractions:
        if not 0 <= getattr(cfg, name) <= 1:
            fail(name, "in [0, 1]")
    for name in shares:
        if not 0 <= getattr(cfg, name) < 1:
            fail(name, "in [0, 1)")
    if getattr(cfg, "dtype", "auto") not in DTYPES:
        fail("dtype", f"one of {', '.join(DTYPES)}")


# -- data order ---------------------------------------------------------------------------

def batch_indices(step: int, batch_size: int, n: int, seed: int) -> np.ndarray:
    """Example indices of batch `step`: epochs are seeded permutations, so the order depends
    only on (seed, step) and a resumed run sees exactly the batches it would have seen."""
    if n <= 0:
        raise RalmError("no training examples")
    start = step * batch_size
    out = []
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), n)
        perm = np.random.default_rng([seed, epoch]).permutation(n)
        out.extend(perm[offset : offset + batch_size - len(out)].tolist())
    return np.asarray(out, dtype=np.int64)


def linear_warmup_decay(steps: int, warmup: float):
    """LambdaLR factor: linear warm-up over the first `warmup` share of `steps`, then linear decay to 0."""
    warm = max(1, int(warmup * steps))
    return lambda s: min((s + 1) / warm, max(0.0, (steps - s) / max(1, steps - warm)))


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


def _plain(config) -> dict:
    return asdict(config) if is_dataclass(config) else dict(config)


def save_checkpoint(run: str | os.PathLike, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    scheduler=None, extra: dict | None = None, keep: int = 2) -> Path:
    """Write RUN/checkpoints/step-N atomically, then move LATEST to it; keep the last `keep`."""
    ckdir = Path(run) / "checkpoints"
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
    f = Path(run) / "checkpoints" / "LATEST"
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
                        f"`torchrun --nproc_per_node {saved}` (or without torchrun for 1), or use a new --out")
    model.load_state_dict(load_file(str(path / "model.safetensors")), strict=True)
    if optimizer is not None and "optimizer" in meta:
        optimizer.load_state_dict(_optimizer_state(load_file(str(path / "optimizer.safetensors")), meta["optimizer"]))
    if scheduler is not None and "scheduler" in meta:
        scheduler.load_state_dict(meta["scheduler"])
    torch.set_rng_state(torch.tensor(meta["torch_rng"], dtype=torch.uint8))
    return meta


def prepare_run(run: str | os.PathLike, config) -> Path | None:
    """Create RUN (saving its config) or check that an existing RUN was started with the same
    config; returns the checkpoint to resume from, if any."""
    run = Path(run)
    if run.exists() and not run.is_dir():
        raise RalmError(f"--out {run} is a file; choose a directory (new, or a run to resume)")
    cfg = _plain(config)
    saved = run / "config.json"
    if saved.is_file():
        old = read_json(saved)
        changed = {k for k in set(old) | set(cfg) if old.get(k) != cfg.get(k) and k not in RESUMABLE_CHANGES}
        if changed:
            raise RalmError(f"{run} was started with a different config ({', '.join(sorted(changed))}); use a new --out")
    run.mkdir(parents=True, exist_ok=True)
    write_json(saved, cfg)
    remove_stale_temps(run / "checkpoints")  # a killed run's half-written checkpoint (can be GBs)
    return latest_checkpoint(run)


# Options a user may change when resuming (train longer, save more often).
RESUMABLE_CHANGES = {"steps", "save_every", "log_every", "dtype"}


# -- metrics ------------------------------------------------------------------------------

class MetricsLog:
    """Appends one JSON object per logged step to RUN/metrics.jsonl. On resume, entries past
    the checkpoint's step (written after it, then lost to the kill) are dropped."""

    def __init__(self, run: str | os.PathLike, resume_step: int = 0):
        self.path = Path(run) / "metrics.jsonl"
        kept = [r for r in self.read() if r.get("step", 0) <= resume_step] if resume_step else []
        with atomic_path(self.path) as tmp:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._f = open(self.path, "a", encoding="utf-8")

    def read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def log(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def plot_metrics(run: str | os.PathLike, keys: Iterable[str], smooth: int = 1) -> list[Path]:
    """One PNG per metric key (x = step), from RUN/metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    written = []
    for key in keys:
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if not pts:
            continue
        x, y = np.array(pts, dtype=float).T
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(x, y, alpha=0.35 if smooth > 1 else 1.0, label=key)
        if smooth > 1 and len(y) >= smooth:
            ax.plot(x[smooth - 1 :], np.convolve(y, np.ones(smooth) / smooth, mode="valid"), label=f"{key} (mean of {smooth})")
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        with atomic_path(run / f"{key}.png") as tmp:
            fig.savefig(tmp, format="png", dpi=110)
        plt.close(fig)
        written.append(run / f"{key}.png")
    return written
