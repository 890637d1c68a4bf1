"""Micro-batching: concurrent requests that arrive within a few milliseconds share one model
call (one query-tower forward, one index scan), which is where a CPU or GPU gains throughput.
Batches run one at a time on a worker thread, so index swaps happen between them."""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Hashable, Sequence


class MicroBatcher:
    def __init__(self, run: Callable[[Hashable, Sequence[Any]], Sequence[Any]], max_batch: int = 32,
                 max_wait: float = 0.003):
        self.run, self.max_batch, self.max_wait = run, max_batch, max_wait
        self._queue: asyncio.Queue | None = None
        self._worker: asyncio.Task | None = None

    async def submit(self, key: Hashable, item: Any) -> Any:
        """Queue `item` with requests of the same `key`; returns its own result (or raises)."""
        if self._queue is None:
            self._queue = asyncio.Queue()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._work())
        future = asyncio.get_running_loop().create_future()
        await self._queue.put((key, item, future))
        return await future

    async def _work(self) -> None:
        while True:
            pending = [await self._queue.get()]
            await asyncio.sleep(self.max_wait)  # let the rest of a burst arrive
            while len(pending) < self.max_batch and not self._queue.empty():
                pending.append(self._queue.get_nowait())
            groups: dict[Hashable, list] = {}
            for key, item, future in pending:
                groups.setdefault(key, []).append((item, future))
            for key, members in groups.items():
                try:
                    results = await asyncio.to_thread(self.run, key, [m[0] for m in members])
                except Exception as e:  # every request of the batch gets the error
                    for _, future in members:
                        if not future.done():
                            future.set_exception(e)
                    continue
                for (_, future), result in zip(members, results):
                    if not future.done():
                        future.set_result(result)
