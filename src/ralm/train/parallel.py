"""Data parallelism for every trainer under torchrun (DistributedDataParallel).

The global batch is `batch_size x world`: `rank_batch` gives each rank its slice of the same
seeded global batch, so a run's data order does not depend on how many processes share it.
`gather_with_grad` lets contrastive losses (ICT, DPR) use every rank's passages as in-batch
negatives, with gradients flowing back to the rank that encoded them.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ralm.configs import ConfigError
from ralm.data.corpus import save_documents
from ralm.distributed import DistEnv, dist_env
from ralm.errors import RalmError
from ralm.runtime import Runtime, dtype_name, full_precision, seed_everything
from ralm.train.checkpoints import prepare_run


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


def rank_slice(batch_size: int, env: DistEnv) -> slice:
    """This rank's rows of a global batch of `batch_size x world` rows."""
    return slice(env.rank * batch_size, (env.rank + 1) * batch_size)


def rank_batch(step: int, batch_size: int, *, n: int, seed: int, env: DistEnv) -> np.ndarray:
    """Example indices of this rank's part of global batch `step` (batch_size per rank)."""
    return batch_indices(step, batch_size * env.world, n, seed)[rank_slice(batch_size, env)]


@dataclass
class RunContext:
    """Where and how this process trains (see `start_run`). Not folded into `Runtime`: besides
    the Runtime (this rank's device, the compute dtype, progress on rank 0 only) it holds the
    run's own facts, which no other job has: RUN, the rank, the checkpoint to resume from."""

    path: Path  # RUN
    env: DistEnv
    runtime: Runtime  # this rank's; resolved once, by the trainer's `fit`
    resume: Path | None  # the checkpoint to resume from
    notify: Callable[[str], None]  # messages for the user, from rank 0 only

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runtime.dtype

    @property
    def show_progress(self) -> bool:
        return self.runtime.show_progress


def start_run(run, config, runtime: Runtime | None = None, *, device: torch.device | None = None, show_progress: bool = True,
              notify: Callable[[str], None] | None = None) -> RunContext:
    """Every trainer's start, alone or under torchrun. Rank 0 creates RUN (or checks that its
    config matches, see `prepare_run`) and every rank resumes from rank 0's LATEST. `runtime`
    (None: `device`, by default the CPU, and `config.dtype`, resolved here) computes in the
    dtype the run records: a `config.dtype` other than auto must be the runtime's."""
    env = dist_env()
    if runtime is None:  # before any work: `bf16` on a CPU without it fails here
        runtime = Runtime.of(device=device, dtype=config.dtype)
    else:
        runtime = Runtime.of(runtime, device=device)  # a device besides it is refused
        if config.dtype not in (None, "", "auto") and config.dtype != dtype_name(runtime.dtype):
            raise ConfigError("dtype", f"{config.dtype}, but the runtime given computes in {dtype_name(runtime.dtype)}")
    runtime = Runtime(env.device(runtime.device), runtime.dtype, show_progress and runtime.show_progress and env.is_main)
    seed_everything(config.seed)  # fresh heads and dropout: the same run twice gives the same numbers
    _documents_to_file(config, run, env)
    resume = env.broadcast_object(prepare_run(run, config) if env.is_main else None)
    return RunContext(Path(run), env, runtime, resume, notify if notify and env.is_main else (lambda _: None))


def _documents_to_file(config, run, env: DistEnv) -> None:
    """A corpus given as documents (as to build_index) is saved as RUN/corpus/<sha>.jsonl and
    `config.corpus` names that file: the run's config.json stays a file's record, and a resume
    with the same documents finds the same file."""
    corpus = getattr(config, "corpus", None)
    if corpus is None or isinstance(corpus, (str, os.PathLike)):
        return
    path = str(save_documents(Path(run) / "corpus", corpus)) if env.is_main else None
    env.barrier()
    config.corpus = env.broadcast_object(path)


@contextmanager
def main_first(env: DistEnv) -> Iterator[None]:
    """Run the block on rank 0, then on the other ranks: they find the files rank 0 prepared
    (run directory, block store, caches) instead of writing them at the same time.
    The block must not call collectives itself."""
    if not env.is_main:
        env.barrier()
    yield
    if env.is_main:
        env.barrier()


def wrap_ddp(model: nn.Module, env: DistEnv, device: torch.device) -> nn.Module:
    """DDP around `model` when several ranks train (gradients are averaged across ranks).

    Some parameters never get a gradient (the BERT pooler under [CLS]/mean pooling), so DDP
    must look for unused parameters; their gradients stay None, as in one process."""
    if not env.active:
        return model
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   find_unused_parameters=True)


class _GatherRows(torch.autograd.Function):
    """all_gather whose backward hands each rank the gradient of its rows summed over every
    rank's loss (an all_reduce: gloo has no reduce_scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        ctx.rows = slice(rank * len(x), (rank + 1) * len(x))
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad[ctx.rows], None, None


def gather_with_grad(x: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """[B, D] on each rank -> [B * world, D], rank order, differentiable."""
    if not env.active:
        return x
    return _GatherRows.apply(x.contiguous(), env.rank, env.world)


def in_batch_contrastive(query: torch.Tensor, passages: torch.Tensor, env: DistEnv) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over every rank's passages; query i's positive is passage i of this rank.

    query [B, D]; passages [B + extra, D] (positives first, then hard negatives).
    Returns (mean NLL over this rank's queries, accuracy).
    """
    everyone = gather_with_grad(passages.float(), env)  # [W * P, D]
    with full_precision(query.device):  # the contrastive softmax must not see bf16 rounding
        scores = query.float() @ everyone.T  # [B, W * P]
    target = torch.arange(len(query), device=query.device) + env.rank * len(passages)
    return F.cross_entropy(scores, target), (scores.argmax(1) == target).float().mean()


def global_mean(local_sum: torch.Tensor, local_count: int, env: DistEnv) -> tuple[torch.Tensor, int]:
    """(this rank's term of the mean over every rank's items, the number of items on all ranks).

    The term is local_sum x world / total count: DDP averages gradients over ranks, so the
    averaged gradient is that of sum / count over the global batch, however the items (answerable
    questions, masked wordpieces) fall on the ranks."""
    total = round(all_mean(float(local_count), env) * env.world)
    return local_sum * (env.world / max(total, 1)), total


def search_rank_queries(index, queries: torch.Tensor, k: int, env: DistEnv) -> tuple[np.ndarray, np.ndarray]:
    """`index.search` for this rank's queries [B, D] -> (scores, rows) [B, k]. Under torchrun
    the index is sharded and answers one query batch on all ranks at once, so every rank
    searches all ranks' queries and keeps its own rows."""
    everyone = gather_with_grad(queries.detach().float(), env)  # [W * B, D]
    scores, rows = index.search(everyone.cpu().numpy(), k)
    part = rank_slice(len(queries), env)
    return scores[part], rows[part]


def any_rank(flag: bool, env: DistEnv) -> bool:
    """True on every rank when `flag` is true on any (so all ranks stop at the same step)."""
    return flag if not env.active else all_mean(float(flag), env) > 0


def all_mean(value: float, env: DistEnv) -> float:
    """The mean of a logged scalar over ranks (for metrics printed by rank 0)."""
    if not env.active:
        return value
    nccl = dist.get_backend() == "nccl"  # NCCL reduces GPU tensors only
    t = torch.tensor([value], dtype=torch.float64, device=torch.cuda.current_device() if nccl else "cpu")
    dist.all_reduce(t)
    return float(t.item() / env.world)
