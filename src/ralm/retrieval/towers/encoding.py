"""Encoding many token rows (a corpus' blocks, a text's chunks) with one tower: length-bucketed
batches, padded on a prefetch thread, under one autocast region, written into a (memory-mapped)
output array.

Shapes: B batch, L length, N rows, D output dim.
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import torch

from ralm.data.padding import pad_rows
from ralm.progress import progress_bar
from ralm.runtime import Runtime, autocast


def length_sorted_batches(lengths: np.ndarray, batch_size: int, window: int = 64) -> list[np.ndarray]:
    """Batches of row indices of similar length, so padding is small. Sorting happens inside
    windows of `window` batches, which keeps memory-mapped reads close together."""
    span = batch_size * window
    batches = []
    for start in range(0, len(lengths), span):
        idx = np.arange(start, min(start + span, len(lengths)))
        idx = idx[np.argsort(-lengths[idx], kind="stable")]
        batches.extend(idx[i : i + batch_size] for i in range(0, len(idx), batch_size))
    return batches


def _prefetch(items, depth: int):
    """Yield from `items` while a background thread produces the next `depth` of them: the
    host pads and pins batch i+1 while the device encodes batch i."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def produce():
        try:
            for item in items:
                q.put(item)
        except BaseException as e:  # re-raised in the consumer
            q.put(e)
        q.put(done)

    threading.Thread(target=produce, daemon=True, name="ralm-prefetch").start()
    while (item := q.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item


@torch.inference_mode()
def encode_rows(encode, rows, lengths: np.ndarray, *, out: np.ndarray, batch_size: int = 64,
                runtime: Runtime | None = None, pad_id: int = 0, show_progress: bool = True,
                description: str = "encoding", device: torch.device | str | None = None,
                dtype: str | torch.dtype | None = None) -> np.ndarray:
    """Run `encode(input_ids, attention_mask) -> [B, D]` over every row of `rows` (indexable
    int arrays, e.g. a memory-mapped token store) into `out` [N, D] (may be a memmap).

    Rows are length-bucketed and padded on a prefetch thread. They run on the runtime's device
    under autocast in its dtype (None: the CPU, auto dtype, i.e. bf16 on CPUs with native bf16;
    the older `device`/`dtype` still work, see `Runtime.of`); one autocast region spans all
    batches so each weight is cast to bf16 once, not once per batch. On CUDA inputs come from
    pinned memory and results go back through pinned buffers without stalling.
    """
    runtime = Runtime.of(runtime, device=device, dtype=dtype)
    device, dtype = runtime.device, runtime.dtype
    cuda = device.type == "cuda"

    def batches():
        for batch in length_sorted_batches(lengths, batch_size):
            ids, mask = pad_rows([rows[int(i)] for i in batch], pad_id)
            yield batch, (ids.pin_memory(), mask.pin_memory()) if cuda else (ids, mask)

    pending: list[tuple[np.ndarray, torch.Tensor, torch.cuda.Event]] = []  # results in flight (CUDA)

    def drain(keep: int) -> None:
        while len(pending) > keep:
            rows_done, host, event = pending.pop(0)
            event.synchronize()
            out[rows_done] = host.numpy()

    with progress_bar(show_progress) as bar, autocast(device, dtype):
        task = bar.add_task(description, total=len(lengths))
        for batch, (ids, mask) in _prefetch(batches(), depth=4):
            if cuda:
                ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            vecs = encode(ids, mask).float()  # [B, D]
            if cuda:
                host = torch.empty(vecs.shape, dtype=torch.float32, pin_memory=True)
                host.copy_(vecs, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                pending.append((batch, host, event))
                drain(keep=2)
            else:
                out[batch] = vecs.numpy()
            bar.advance(task, len(batch))
        drain(keep=0)
    return out
