"""The inputs of the next steps, made while this process trains on the current one.

A step's inputs (which questions, the texts read, tokenised windows, gold spans, generated
records) depend on its number alone, so worker processes can make steps i+1, i+2, ... while the
GPU runs step i, as a DataLoader's workers make batches (torch.utils.data: forked workers, two
steps ahead each). With no workers they are made in this process when asked for, and either way
step i gets what `prepare(i)` returns: a run trains the same weights with any number of workers.
Workers run CPU code only (they are forked after CUDA may have started, which they never touch),
so they need the fork start method (`can_fork`: Linux, macOS; not Windows).
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Callable, Generic, Iterator, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset

from ralm.errors import RalmError

T = TypeVar("T")


def can_fork() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


class _Steps(Dataset):
    def __init__(self, prepare: Callable[[int], T], start: int, stop: int):
        self.prepare, self.start, self.stop = prepare, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, j: int) -> tuple[int, T]:
        return self.start + j, self.prepare(self.start + j)


def _as_is(item):
    return item


class Prefetcher(Generic[T]):
    """`get(i)` for i = start, start + 1, ... < stop, in order: `prepare(i)`, made ahead by
    `workers` processes (0: made here, when asked for)."""

    def __init__(self, prepare: Callable[[int], T], *, start: int, stop: int, workers: int = 0):
        self.prepare, self.next = prepare, start
        self._it: Iterator[tuple[int, T]] | None = None
        if workers > 0 and stop > start:
            # forked workers would each start the tokenizers' thread pool: one tokenising thread apiece
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            # its own generator: the workers' seeds are drawn from it, not from torch's global one,
            # which the training steps' dropout draws from
            loader = DataLoader(_Steps(prepare, start, stop), batch_size=None, shuffle=False, num_workers=workers,
                                collate_fn=_as_is, multiprocessing_context="fork", prefetch_factor=2,
                                generator=torch.Generator().manual_seed(0))
            self._it = iter(loader)

    def get(self, i: int) -> T:
        if i != self.next:
            raise RalmError(f"step {i} asked for, but the inputs made ahead are for step {self.next}")
        self.next += 1
        if self._it is None:
            return self.prepare(i)
        got, value = next(self._it)
        assert got == i, (got, i)  # the loader yields the steps in order
        return value

    def close(self) -> None:
        self._it = None  # the DataLoader's iterator shuts its workers down when dropped
