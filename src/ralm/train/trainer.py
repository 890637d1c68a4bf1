"""The trainer template: a trainer is its config, its model and data (`build`) and its `step`;
`fit` does the rest, the same for every trainer:

  start      RUN created or checked (its config, inputs, the checkpoint to resume from), device,
             compute dtype and seed (train.parallel.start_run)
  build      the trainer's model and data; `start_projection` PCA-initialises a fresh retrieval
             projection once (not on resume: the checkpoint holds it)
  optimizer  AdamW over the trainable parameters and a LambdaLR of `schedule()` (overridable)
  loop       train.loop.TrainLoop: resume, steps, metrics, checkpoints, exports to RUN/final
             (`exports()`), Ctrl-C, plots
  result     `result(done)`: the loop's TrainResult with the trainer's own fields

A new trainer is one module: a LoopConfig subclass with its extra fields and a Trainer subclass
naming it; defining the class registers it (`Trainer.registry`, `discover()`).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from typing import Callable, ClassVar, Mapping, Sequence

import torch
from torch import nn

from ralm.data.blocks import BlockStore
from ralm.data.qa import read_questions
from ralm.retrieval.towers.projection import init_projection
from ralm.rundir import record_leg
from ralm.runtime import Runtime
from ralm.train.loop import LoopConfig, Schedule, StepEstimate, TrainLoop, TrainResult, warmup_constant
from ralm.train.parallel import RunContext, start_run


class Trainer:
    """Subclass with `name` (the command that runs it: `pretrain`; RUN/final/trainer.json's kind), `config` (its LoopConfig
    subclass), `build` and `step`; override the other methods where the trainer differs."""

    name: ClassVar[str]
    config: ClassVar[type[LoopConfig]]
    plots: ClassVar[Sequence[str]] = ("loss",)  # metrics drawn at the end
    lr_names: ClassVar[Sequence[str]] = ("lr",)  # one logged name per parameter group
    registry: ClassVar[dict[str, type[Trainer]]] = {}
    grad_clip: float = 1.0
    ctx: RunContext  # set by `fit` before `build`
    loop: TrainLoop  # set by `fit` before `started`

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            Trainer.registry[cls.name] = cls

    def __init__(self, cfg: LoopConfig):
        """Read what must fail before RUN is made (a bad question file) here."""
        self.cfg = cfg

    # -- what a trainer provides ------------------------------------------------------------

    def build(self) -> nn.Module:
        """The model to train, on `self.ctx.device`, with its data prepared on `self`."""
        raise NotImplementedError

    def step(self, i: int) -> tuple[torch.Tensor | None, dict[str, float]]:
        """Batch `i`'s loss (None: nothing to learn on any rank) and this rank's metrics; call
        the model through `self.loop.ddp`."""
        raise NotImplementedError

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=self.cfg.lr, weight_decay=0.01)

    def schedule(self) -> Schedule | list[Schedule]:
        """The learning-rate factor of each step (one per parameter group, or one for all)."""
        return warmup_constant(self.cfg.warmup)

    def started(self) -> None:
        """After the resume (`self.loop.resumed` holds the checkpoint's extra state), before step 0."""

    def exports(self) -> Mapping[str, object]:
        """What RUN/final holds: {part: anything with `save_pretrained(dir)`}."""
        return {}

    def log_extra(self, record: dict) -> dict:
        """Fields added to a logged metrics record."""
        return {}

    def checkpoint_extra(self) -> dict:
        """State saved with a checkpoint, back as `self.loop.resumed`."""
        return {}

    def result(self, done: TrainResult) -> TrainResult:
        return done

    def close(self) -> None:
        """Stop what `build` started (always called)."""

    # -- the template -------------------------------------------------------------------------

    @classmethod
    def fit(cls, cfg: LoopConfig, run: str | os.PathLike, device: torch.device | None = None, *, runtime: Runtime | None = None,
            show_progress: bool = True, notify: Callable[[str], None] | None = None,
            on_metrics: Callable[[dict], None] | None = None, on_estimate: Callable[[StepEstimate], None] | None = None,
            made_by: dict | None = None, **inputs) -> TrainResult:
        """Train (or resume) the run at `run`. Under torchrun every rank trains on its
        `batch_size` share of a `batch_size x world` global batch; rank 0 writes the run.
        `runtime`: where and how it trains, resolved once here (None: `device`, by default the
        CPU, with `cfg.dtype`; see `start_run`). `on_estimate` hears the wall-time estimate after
        the first step (rank 0; None: a line to `notify` while progress shows). `made_by` (the
        command line and recipe that started it) goes to RUN/legs.jsonl and every export's
        made_by.json. `inputs` go to the trainer's constructor."""
        trainer = cls(cfg, **inputs)
        trainer.ctx = start_run(run, cfg, runtime, device=device, show_progress=show_progress, notify=notify)
        try:
            model = trainer.build()
            optimizer = trainer.optimizer(model)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, trainer.schedule())
            trainer.loop = TrainLoop(trainer.ctx, cfg, model, optimizer, scheduler=scheduler, lr_names=cls.lr_names,
                                     grad_clip=trainer.grad_clip)
            if trainer.ctx.env.is_main:
                record_leg(trainer.ctx.path, made_by or {"command": None, "api": f"{cls.__module__}.{cls.__name__}.fit"},
                           trainer.loop.step)
            trainer.started()
            done = trainer.loop.run(trainer.step, cls.name, exports=trainer.exports(), plots=cls.plots, log_extra=trainer.log_extra,
                                    checkpoint_extra=trainer.checkpoint_extra, on_metrics=on_metrics,
                                    on_estimate=on_estimate)
        finally:
            trainer.close()
        return trainer.result(done)


class QuestionTrainer(Trainer):
    """A trainer on a question file (config fields `questions` and `limit`), read before RUN is
    made so that a bad file fails first."""

    def __init__(self, cfg: LoopConfig):
        super().__init__(cfg)
        self.questions = read_questions(cfg.questions)[: cfg.limit]


def start_projection(ctx: RunContext, retriever, blocks: BlockStore, sample: int = 4096) -> None:
    """PCA-initialise a fresh retrieval projection from `sample` blocks (rank 0, not on resume:
    the checkpoint holds the trained one; DDP then broadcasts rank 0's weights)."""
    if ctx.env.is_main and not retriever.cfg.projection_ready and ctx.resume is None:
        init_projection(retriever, blocks, runtime=ctx.runtime, sample=sample, show_progress=ctx.show_progress)
    retriever.cfg.projection_ready = True


def discover() -> dict[str, type[Trainer]]:
    """Every trainer of ralm.train, found by importing its modules: {name: class}."""
    import ralm.train

    for module in pkgutil.iter_modules(ralm.train.__path__):
        importlib.import_module(f"ralm.train.{module.name}")
    return {name: cls for name, cls in Trainer.registry.items() if cls.__module__.startswith("ralm.train.")}
