"""Corpus encoding and exact search split across ranks (torchrun).

Encoding: each rank embeds its contiguous rows in pieces of at most `piece_rows`, each piece
written atomically into a staging folder named after the model, the blocks and the world
size; a restarted job skips the pieces that exist. Rank 0 assembles the pieces into one
embeddings file when all are complete.

Search: each rank holds only its rows of the matrix (on its GPU); a query batch is searched
locally and the global top-k is merged from an all-gather of every rank's top-k, which is
exactly the single-process result.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ralm.atomic import atomic_path
from ralm.distributed import DistEnv, shard_range
from ralm.errors import RalmError
from ralm.retrieval.towers.encoding import encode_rows
from ralm.retrieval.backends.exact import ExactIndex, check_k, merge_topk
from ralm.runtime import Runtime


class RowView:
    """rows[offset + i] as a 0-based indexable (for encoding one piece of a token store)."""

    def __init__(self, rows, offset: int):
        self.rows, self.offset = rows, offset

    def __getitem__(self, i: int):
        return self.rows[self.offset + i]


def piece_ranges(n: int, env: DistEnv, piece_rows: int) -> list[tuple[int, int]]:
    lo, hi = shard_range(n, env.rank, env.world)
    return [(a, min(a + piece_rows, hi)) for a in range(lo, hi, piece_rows)]


def piece_path(staging: Path, a: int, b: int) -> Path:
    return staging / f"rows-{a:012d}-{b:012d}.npy"


def encode_pieces(encode, tokens, lengths: np.ndarray, *, dim: int, staging: Path, env: DistEnv, runtime: Runtime,
                  batch_size: int = 64, pad_id: int = 0, piece_rows: int = 1 << 20, show_progress: bool = True) -> int:
    """Embed this rank's missing pieces into `staging` under `runtime` (this rank's device);
    returns how many pieces it encoded."""
    staging.mkdir(parents=True, exist_ok=True)
    done = 0
    for a, b in piece_ranges(len(lengths), env, piece_rows):
        target = piece_path(staging, a, b)
        if target.is_file():
            continue  # finished before a restart
        with atomic_path(target) as tmp:
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(b - a, dim))
            encode_rows(encode, RowView(tokens, a), lengths[a:b], out=out, batch_size=batch_size, runtime=runtime, pad_id=pad_id,
                        show_progress=show_progress and env.is_main, description=f"embedding rows {a}-{b}")
            out.flush()
            del out
        done += 1
    return done


def assemble_pieces(staging: Path, n: int, dim: int, *, out: Path, world: int, piece_rows: int) -> None:
    """Concatenate every rank's pieces, in row order, into `out` [n, dim]."""
    emb = np.lib.format.open_memmap(out, mode="w+", dtype=np.float32, shape=(n, dim))
    for rank in range(world):
        for a, b in piece_ranges(n, DistEnv(rank, world), piece_rows):
            path = piece_path(staging, a, b)
            if not path.is_file():
                raise RalmError(f"{staging}: piece {a}-{b} is missing; run the build again to finish it")
            emb[a:b] = np.load(path, mmap_mode="r", allow_pickle=False)
    emb.flush()


class ShardedExactIndex:
    """Exact MIPS where rank r holds rows shard_range(N, r, world); same results on every rank."""

    def __init__(self, embeddings: np.ndarray, env: DistEnv, device: torch.device | str | None = None,
                 dtype: str | torch.dtype | None = None, *, runtime: Runtime | None = None):
        """`runtime`: this rank's (its device holds its shard; None: the CPU, auto dtype; the older
        `device`/`dtype` still work, see `Runtime.of`)."""
        runtime = Runtime.of(runtime, device=device, dtype=dtype)
        self.env = env
        self.count, self.dim = embeddings.shape
        self.lo, self.hi = shard_range(self.count, env.rank, env.world)
        self.local = ExactIndex(embeddings[self.lo : self.hi], runtime=runtime) if self.hi > self.lo else None
        self.device = runtime.device

    def search(self, queries, k: int) -> tuple[np.ndarray, np.ndarray]:
        check_k(k)
        q = np.asarray(queries, dtype=np.float32)
        k = min(k, self.count)
        if self.local is not None:
            s, i = self.local.search(q, k)
            s, i = torch.from_numpy(s), torch.from_numpy(i) + self.lo
        else:
            s, i = torch.empty(len(q), 0), torch.empty(len(q), 0, dtype=torch.long)
        # Pad to k columns (a shard may be smaller than k) so every rank sends the same shape.
        pad = k - s.shape[1]
        s = torch.cat([s, torch.full((len(q), pad), float("-inf"))], 1)
        i = torch.cat([i, torch.full((len(q), pad), -1, dtype=torch.long)], 1)
        comm = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        gathered_s = [torch.empty_like(s, device=comm) for _ in range(self.env.world)]
        gathered_i = [torch.empty_like(i, device=comm) for _ in range(self.env.world)]
        dist.all_gather(gathered_s, s.to(comm))
        dist.all_gather(gathered_i, i.to(comm))
        all_s, all_i = torch.cat(gathered_s, 1).cpu(), torch.cat(gathered_i, 1).cpu()
        all_i = torch.where(torch.isinf(all_s), torch.iinfo(torch.long).max, all_i)  # padding sorts last
        best_s, best_i = merge_topk(all_s, all_i, k)
        return best_s.numpy(), best_i.numpy()
