"""The one training loop and the config every trainer's extends (`LoopConfig`). `Trainer.fit`
(train.trainer) builds a trainer's model, optimizer and learning-rate schedule and hands
`TrainLoop` its step function; the loop does everything around it, for every trainer alike:

  resume        model, optimizer, schedule and torch RNG from RUN's newest checkpoint; under
                torchrun the model is wrapped in DDP (every rank runs the loop, rank 0 writes)
  each step     the step function under autocast, backward, gradient clipping (`grad_norm` is
                logged), optimizer and schedule steps, the progress bar
  log_every     the window's metrics, averaged over its steps and over ranks, with the learning
                rates and `steps_per_s`: a line of RUN/metrics.jsonl, and `on_metrics`
  save_every    a checkpoint and the exports in RUN/final (rank 0), then a barrier
  first step    an estimate of the run's wall time, before its metrics (`on_estimate`, by
                default a line to `notify` while progress shows)
  Ctrl-C        (SIGINT or SIGTERM) the step in progress finishes, a checkpoint is saved and
                `TrainingInterrupted` says where; the same call (or command) resumes from it.
                A second Ctrl-C stops at once
  time_limit    the same stop once this process has trained that many seconds (a leg of a
                scheduler's or a lease's wall time); its `reason` says which stopped it
  at the end    a curve per plotted metric, and a TrainResult

`warmup` counts steps in every trainer: the schedules below ramp the learning rate up linearly
over that many steps. Run layout: ralm.rundir.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from ralm.atomic import atomic_path
from ralm.configs import (DTYPE_HELP, DTYPES, LOG_EVERY_HELP, SAVE_EVERY_HELP, SEED_HELP, TIME_LIMIT_HELP, WARMUP_HELP,
                          ConfigError, option)
from ralm.progress import progress_bar, progress_enabled
from ralm.rundir import export_final, metrics_file
from ralm.runtime import SEEDS, autocast, check_finite
from ralm.train.checkpoints import load_checkpoint, save_checkpoint
from ralm.train.parallel import RunContext, all_mean, any_rank, wrap_ddp


# -- the loop's config ---------------------------------------------------------------------

MAX_POSITIONS = 512  # the BERT-family encoders' position embeddings: no block or input is longer


@dataclass(kw_only=True)
class LoopConfig:
    """The fields every trainer config has, which the loop reads: a trainer config subclasses it
    and adds its own fields (keyword-only here, so a config keeps its own required fields first).
    A trainer whose default or help differs redeclares the field after `KW_ONLY`. Construction
    checks the fields, the subclass's own too when it names them in `positive_fields`,
    `non_negative_fields` and `fraction_fields` (in [0, 1])."""

    steps: int = option(1000, "training steps")
    batch_size: int = option(16, "examples per step and rank (under torchrun)")
    lr: float = option(1e-4, "learning rate")
    warmup: int = option(100, WARMUP_HELP)  # steps of linear learning-rate warm-up
    save_every: int = option(200, SAVE_EVERY_HELP)
    log_every: int = option(10, LOG_EVERY_HELP)
    seed: int = option(0, SEED_HELP)
    dtype: str = option("auto", DTYPE_HELP)  # compute dtype (runtime.resolve_dtype); weights stay fp32
    time_limit: float | None = option(None, TIME_LIMIT_HELP, shown="none")

    positive_fields: ClassVar[tuple[str, ...]] = ()
    non_negative_fields: ClassVar[tuple[str, ...]] = ()
    fraction_fields: ClassVar[tuple[str, ...]] = ()
    presets: ClassVar[dict[str, dict]] = {}

    def step_work(self) -> float:
        """One step's compute, relative: a step timed under this config, scaled by the ratio of
        another config's, estimates that one's (the --preset cpu hint). Examples per step here;
        a trainer reading several blocks per example multiplies them in."""
        return self.batch_size

    def __post_init__(self):
        """The checks every trainer config runs before anything loads: the loop's fields and the
        trainer's own. A wrong sign is no typo to train through: a negative learning rate is
        gradient ascent, a negative warm-up a silent no-op. `None` means "not set" and passes;
        NaN fails every check. Messages name the config field."""
        def fail(name: str, what: str) -> None:
            raise ConfigError(name, f"must be {what}, got {getattr(self, name)}")

        for name, value in vars(self).items():  # inf passes `> 0` and trains NaN weights
            if isinstance(value, float) and not math.isfinite(value):
                fail(name, "a finite number")
            if (name == "lr" or name.endswith("_lr")) and isinstance(value, float) and value > FLOAT32_MAX:
                fail(name, f"at most {FLOAT32_MAX:.3g} (the optimiser computes in float32)")
        for name in ("block_len", "max_len", "max_query_len"):
            if isinstance(getattr(self, name, None), int) and getattr(self, name) > MAX_POSITIONS:
                fail(name, f"at most {MAX_POSITIONS} wordpieces (the encoder's positions)")
        for name in ("steps", "batch_size", "lr", "save_every", "log_every", "time_limit", *self.positive_fields):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                fail(name, "positive")
        for name in ("warmup", *self.non_negative_fields):
            if getattr(self, name) is not None and not getattr(self, name) >= 0:
                fail(name, ">= 0")
        for name in self.fraction_fields:
            if not 0 <= getattr(self, name) <= 1:
                fail(name, "in [0, 1]")
        if not isinstance(self.warmup, int):
            fail("warmup", "a whole number of steps")
        if self.dtype not in DTYPES:
            fail("dtype", f"one of {', '.join(DTYPES)}")
        if self.seed not in SEEDS:
            fail("seed", f"a whole number in 0 .. {SEEDS.stop - 1}")


FLOAT32_MAX = float(np.finfo(np.float32).max)


# -- learning-rate schedules (LambdaLR factors of the step) ------------------------------------

Schedule = Callable[[int], float]


def warmup_constant(warmup: int) -> Schedule:
    """Linear warm-up over `warmup` steps, then constant."""
    return lambda s: min(1.0, (s + 1) / max(warmup, 1))


def warmup_linear_decay(steps: int, warmup: int) -> Schedule:
    """Linear warm-up over `warmup` steps, then linear decay to 0 at `steps`."""
    warm = max(1, warmup)
    return lambda s: min((s + 1) / warm, max(0.0, (steps - s) / max(1, steps - warm)))


def warmup_cosine(steps: int, warmup: int, floor: float = 0.1) -> Schedule:
    """Linear warm-up over `warmup` steps, then cosine decay to `floor` at `steps`."""
    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        progress = min(1.0, (s - warmup) / max(1, steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def delayed(schedule: Schedule, delay: int) -> Schedule:
    """0 for the first `delay` steps, then `schedule` from its own step 0 (a parameter group
    that starts training later)."""
    return lambda s: 0.0 if s < delay else schedule(s - delay)


# -- metrics ------------------------------------------------------------------------------

class MetricsLog:
    """Appends one JSON object per logged step to RUN/metrics.jsonl. On resume, entries past
    the checkpoint's step (written after it, then lost to the kill) are dropped."""

    def __init__(self, run: str | os.PathLike, resume_step: int = 0):
        self.path = metrics_file(run)
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
    rows = [json.loads(line) for line in metrics_file(run).read_text().splitlines() if line.strip()]
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


def _window_mean(values: list[float]) -> float:
    """Mean over the window's steps that had the metric (NaN when none had)."""
    kept = [v for v in values if not math.isnan(v)]
    return float(np.mean(kept)) if kept else float("nan")


# -- interruption and time estimate --------------------------------------------------------

class TrainingInterrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C (SIGINT) or SIGTERM, or at its `time_limit` (seconds; None: by a
    signal), after saving `checkpoint` at `step` (None on ranks other than 0); calling the
    trainer again with the same config and run directory resumes from it."""

    def __init__(self, step: int, checkpoint: Path | None, time_limit: float | None = None):
        self.step, self.checkpoint, self.time_limit = step, checkpoint, time_limit
        super().__init__(f"{self.reason} at step {step}; checkpoint {checkpoint}")

    @property
    def reason(self) -> str:
        return "interrupted" if self.time_limit is None else f"stopped at the time limit ({self.time_limit:g} s)"


class StopRequest:
    """While entered (in the main thread), SIGINT and SIGTERM ask the loop to stop between steps
    instead of killing the step in progress, which could leave the weights half-updated; a
    second signal raises KeyboardInterrupt at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, notify: Callable[[str], None]):
        self.notify, self.requested, self._old = notify, False, {}

    def _handle(self, signum, _frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.notify(f"{signal.Signals(signum).name}: saving a checkpoint after this step (again to stop at once)")

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *_exc) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)


def format_duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds // 3600:.0f} h {seconds % 3600 / 60:02.0f} min"


@dataclass(frozen=True)
class StepEstimate:
    """The run's remaining wall time as timed in this process: `steps` left at `seconds` each;
    `first`: timed on the first step alone (which also pays for lazy set-up)."""

    steps: int
    seconds: float
    first: bool = True

    def line(self) -> str:
        how = "the first step's time" if self.first else "the mean of the first steps"
        return (f"about {self.steps} steps x {self.seconds:.3g} s = {format_duration(self.steps * self.seconds)} "
                f"({how}; checkpoints not counted)")


class WallTimeEstimate:
    """Tells (`tell(StepEstimate)`) the run's remaining wall time as soon as the first step in this
    process is done, before its metrics; then once more, after 5 timed steps or 20 s of them, if
    their mean is more than 30% off the first step's (lazy set-up, a GPU warming up)."""

    def __init__(self, total: int, tell: Callable[[StepEstimate], None]):
        self.total, self.tell = total, tell
        self.begun = time.perf_counter()
        self.start: tuple[int, float] | None = None  # (step, time) at the end of the first step
        self.first = 0.0  # its seconds
        self.told = False

    def after(self, step: int) -> None:
        now = time.perf_counter()
        if self.start is None:
            self.start, self.first = (step, now), now - self.begun
            if step < self.total:
                self.tell(StepEstimate(self.total - step, self.first))
            return
        timed, seconds = step - self.start[0], now - self.start[1]
        if self.told or not (timed >= 5 or seconds >= 20) or step >= self.total:
            return
        self.told = True
        per_step = seconds / timed
        if abs(per_step - self.first) > 0.3 * self.first:
            self.tell(StepEstimate(self.total - step, per_step, first=False))


# -- the loop -----------------------------------------------------------------------------

@dataclass
class TrainResult:
    """What every trainer returns; each adds its own fields (`--json` prints them all)."""

    run: str
    steps: int
    seconds: float  # the loop's wall time in this process (a resumed run: since the resume)
    plots: list[str]


# step(i) -> (the loss to backpropagate, or None when no rank has anything to learn from batch
# i; this rank's metrics of the step, e.g. {"loss": ...}). Runs under the loop's autocast.
Step = Callable[[int], tuple[torch.Tensor | None, dict[str, float]]]


class TrainLoop:
    """Construct (resumes the run, wraps DDP: use `.ddp` for forward passes, `.resumed` for the
    checkpoint's extra state), then `run` a step function."""

    def __init__(self, ctx: RunContext, cfg: LoopConfig, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, lr_names: Sequence[str] = ("lr",),
                 grad_clip: float = 1.0):
        self.ctx, self.cfg, self.model = ctx, cfg, model
        self.optimizer, self.scheduler = optimizer, scheduler
        self.lr_names, self.grad_clip = lr_names, grad_clip  # one name per logged parameter group, in order
        self.step, self.resumed = 0, {}
        if ctx.resume is not None:
            meta = load_checkpoint(ctx.resume, model, optimizer, scheduler)
            self.step, self.resumed = meta["step"], meta["extra"]
            ctx.notify(f"resuming from step {self.step}")
        self.ddp = wrap_ddp(model, ctx.env, ctx.device)  # broadcasts rank 0's weights (fresh heads, PCA)
        self.last: dict = {}  # the last logged record

    def run(self, step: Step, kind: str, *, exports: Mapping[str, object] | None = None, plots: Sequence[str] = ("loss",),
            log_extra: Callable[[dict], dict] | None = None, checkpoint_extra: Callable[[], dict] | None = None,
            on_metrics: Callable[[dict], None] | None = None,
            on_estimate: Callable[[StepEstimate], None] | None = None) -> TrainResult:
        """Train from `self.step` to cfg.steps. `kind` names the trainer (progress, trainer.json);
        `exports` are saved in RUN/final with every checkpoint; `log_extra(record)` adds fields to
        a logged record, `checkpoint_extra()` state to a checkpoint (back as `.resumed`);
        `on_estimate` hears the wall-time estimate (WallTimeEstimate)."""
        ctx, cfg = self.ctx, self.cfg
        log = MetricsLog(ctx.path, self.step) if ctx.env.is_main else None
        start = window_start = time.perf_counter()
        window: list[dict[str, float]] = []
        quiet = not ctx.env.is_main or (on_estimate is None and not progress_enabled(ctx.show_progress))
        tell = (lambda _: None) if quiet else on_estimate or (lambda e: ctx.notify(e.line()))
        try:
            with progress_bar(ctx.show_progress) as bar, StopRequest(ctx.notify) as stop:
                task = bar.add_task(f"training ({kind})", total=cfg.steps, completed=self.step)
                first = self.step
                estimate = WallTimeEstimate(cfg.steps, tell)
                while self.step < cfg.steps:
                    window.append(self._one_step(step))
                    self.step += 1
                    if self.step == first + 1:  # a learning rate the model cannot take shows at once
                        check_finite(self.model, f"after step {self.step}")
                    bar.advance(task)
                    estimate.after(self.step)
                    if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                        self.last = self._record(window, time.perf_counter() - window_start, log_extra)
                        if log is not None:
                            log.log(self.last)
                            if on_metrics:
                                on_metrics(self.last)
                        window, window_start = [], time.perf_counter()
                    more = self.step < cfg.steps
                    timed_out = (more and cfg.time_limit is not None
                                 and any_rank(time.perf_counter() - start >= cfg.time_limit, ctx.env))
                    stopping = timed_out or (more and any_rank(stop.requested, ctx.env))
                    if self.step % cfg.save_every == 0 or self.step == cfg.steps or stopping:
                        saved = self._save(kind, exports or {}, checkpoint_extra)
                    if stopping:
                        raise TrainingInterrupted(self.step, saved, cfg.time_limit if timed_out else None)
        finally:
            if log is not None:
                log.close()
        # ~10 logged points per drawn mean, so long and short runs both read
        drawn = plot_metrics(ctx.path, plots, smooth=min(10, max(1, cfg.steps // cfg.log_every // 10))) if log else []
        return TrainResult(str(ctx.path), self.step, round(time.perf_counter() - start, 1), [str(p) for p in drawn])

    def _one_step(self, step: Step) -> dict[str, float]:
        with autocast(self.ctx.device, self.ctx.dtype):
            loss, metrics = step(self.step)
        self.optimizer.zero_grad(set_to_none=True)
        if loss is not None:  # else no rank has gradients: the step leaves the weights alone
            loss.backward()
            metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip))
        self.optimizer.step()
        self.scheduler.step()
        return metrics

    def _record(self, window: list[dict[str, float]], seconds: float, log_extra: Callable[[dict], dict] | None) -> dict:
        keys = dict.fromkeys(k for metrics in window for k in metrics)  # the same on every rank
        record = {"step": self.step, **{k: all_mean(_window_mean([m.get(k, math.nan) for m in window]), self.ctx.env)
                                        for k in keys}}
        record.update(zip(self.lr_names, self.scheduler.get_last_lr()))
        record["steps_per_s"] = round(len(window) / seconds, 4)
        return {**record, **(log_extra(record) if log_extra else {})}

    def _save(self, kind: str, exports: Mapping[str, object], checkpoint_extra: Callable[[], dict] | None) -> Path | None:
        """Rank 0 writes the checkpoint (its path is returned there) and the exports, of finite weights only."""
        check_finite(self.model, f"at step {self.step}")
        path = None
        if self.ctx.env.is_main:
            path = save_checkpoint(self.ctx.path, self.step, self.model, self.optimizer, scheduler=self.scheduler,
                                   extra=checkpoint_extra() if checkpoint_extra else None)
            if exports:
                export_final(self.ctx.path, self.step, kind, exports)
        self.ctx.env.barrier()  # no rank runs ahead of (or resumes past) a checkpoint being written
        return path
