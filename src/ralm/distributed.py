"""torch.distributed for `torchrun`: one process per GPU (NCCL) or per CPU worker (gloo).

`torchrun --nproc_per_node N -m ralm ...` sets RANK / WORLD_SIZE / LOCAL_RANK; every command
calls `dist_env()`, which initialises the process group once. Without those variables
everything runs as a world of one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def device(self, requested: torch.device) -> torch.device:
        """Each rank takes its own GPU; CPU stays CPU."""
        if requested.type == "cuda" and self.active:
            return torch.device("cuda", self.local_rank)
        return requested

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def broadcast_object(self, obj):
        """Rank 0's value of `obj`, on every rank."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def dist_env(backend: str | None = None) -> DistEnv:
    """The process group from torchrun's environment, initialised on first use."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistEnv()
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":  # each rank's barriers and broadcasts on its own GPU, not all on GPU 0
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    return DistEnv(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def shard_range(n: int, rank: int, world: int) -> tuple[int, int]:
    """Contiguous rows [lo, hi) of rank `rank` out of `world`, sizes differing by at most one."""
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)
