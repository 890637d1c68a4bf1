"""Exact maximum inner product search in torch: chunked matmul + top-k, merged across chunks.

On CUDA the whole matrix lives on the device in bf16 (13M x 128 = 3.3 GB). On CPU it is read
chunk by chunk from a (possibly memory-mapped) float32 array, so RAM stays bounded, or, with
dtype bf16 (the default where the CPU has native bf16: 2.3x faster on 1M rows; indexes under
CPU_BF16_MIN_ROWS stay fp32), held in RAM as a bf16 copy (half the fp32 size). On CPU the bf16
scores only pick a shortlist: its best `k + RESCORE` candidates are rescored in fp32 from the
float32 array, so returned scores are exact and ids equal fp32 search unless a true top-k row
fell outside that shortlist.

A full `topk` over rows of millions of scores is what makes naive MIPS slow. `grouped_topk`
takes the maximum of each group of G scores, keeps the k groups with the highest maxima and
ranks only their k*G scores. This is still exact: an element of the top k has at most k-1
larger elements, so at most k-1 groups have a larger maximum than its own group.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from ralm.errors import RalmError
from ralm.runtime import Runtime, full_precision

RESCORE = 16  # extra bf16 candidates rescored in fp32 on CPU
# Below this many rows a CPU search is a few ms in fp32 and the bf16 copy and rescoring do not pay.
CPU_BF16_MIN_ROWS = 65_536
# The CPU bf16 scan's block: 128 queries x 65,536 rows (measured best of 64-1,024 x 16k-256k on
# 1M x 128); fewer queries scan more rows per block, up to the whole matrix for one query.
CPU_QUERY_BLOCK = 128
CPU_SCORE_BLOCK = 128 * 65_536


def check_k(k: int) -> None:
    if not isinstance(k, int) or k <= 0:
        raise RalmError(f"k must be a positive integer, got {k!r}")


def merge_topk(scores: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the k best of [Q, M] candidate scores/ids (ties broken by lower id, as argsort)."""
    k = min(k, scores.shape[1])
    # Sort by id first so that equal scores keep the smaller id after a stable sort.
    order = torch.argsort(ids, dim=1, stable=True)
    scores, ids = scores.gather(1, order), ids.gather(1, order)
    top = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    return scores.gather(1, top), ids.gather(1, top)


def grouped_topk(scores: torch.Tensor, k: int, group: int = 64, queries_last: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of each query's scores -> (values [Q, k], column ids [Q, k]).

    scores is [Q, C], or [C, Q] with queries_last: the layout the CPU bf16 path computes, where
    each group maximum reduces over contiguous rows (a strided reduction is ~8x slower)."""
    c = scores.shape[0] if queries_last else scores.shape[1]
    k = min(k, c)
    if c < 4 * k * group:
        vals, cols = torch.topk(scores, k, dim=0 if queries_last else 1)
        return (vals.T, cols.T) if queries_last else (vals, cols)
    n_groups = -(-c // group)
    if n_groups * group != c:
        pad = (0, 0, 0, n_groups * group - c) if queries_last else (0, n_groups * group - c)
        scores = torch.nn.functional.pad(scores, pad, value=float("-inf"))
    if queries_last:
        rows = scores.view(n_groups, group, -1)  # [C/G, G, Q]
        maxima, grouped = rows.amax(1).T, rows.permute(2, 0, 1)  # [Q, C/G], [Q, C/G, G] (a view)
    else:
        grouped = scores.view(-1, n_groups, group)  # [Q, C/G, G]
        maxima = grouped.amax(-1)
    q = grouped.shape[0]
    best_groups = torch.topk(maxima, k, dim=1).indices  # [Q, k]
    cand = grouped.gather(1, best_groups.unsqueeze(-1).expand(q, k, group)).reshape(q, k * group)  # [Q, k*G]
    vals, pos = torch.topk(cand, k, dim=1)  # [Q, k]
    cols = best_groups.gather(1, pos // group) * group + pos % group
    return vals, cols


def rescore(source: np.ndarray, queries: torch.Tensor, cand: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact fp32 scores of the shortlisted rows cand [Q, S] (-1: no row), read from the float32
    `source` [N, D] (memory-mapped: only those rows are read) -> the best k (scores, ids)."""
    rows, inverse = np.unique(np.maximum(cand.numpy(), 0), return_inverse=True)
    vecs = torch.from_numpy(np.asarray(source[rows], dtype=np.float32))[torch.from_numpy(inverse.reshape(cand.shape))]  # [Q, S, D]
    scores = torch.einsum("qd,qsd->qs", queries.float(), vecs).masked_fill(cand < 0, float("-inf"))  # [Q, S]
    return merge_topk(scores, cand, k)


def _to_tensor(embeddings: np.ndarray, runtime: Runtime, rows: int = 1 << 20) -> torch.Tensor:
    """The matrix as one tensor of the runtime's dtype on its device, converted in slices so a
    memory-mapped float32 file never has to fit in RAM at full precision."""
    out = torch.empty(embeddings.shape, dtype=runtime.dtype, device=runtime.device)
    for start in range(0, len(embeddings), rows):
        out[start : start + rows] = torch.from_numpy(np.array(embeddings[start : start + rows], dtype=np.float32))
    return out


def _scores(q: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
    """q [Q, D] @ chunk [C, D].T. fp32 on CPU goes through numpy's BLAS (OpenBLAS in the numpy
    wheels): on AMD CPUs torch's MKL takes a slower path and runs sgemm at half the speed."""
    if q.device.type == "cpu" and q.dtype == torch.float32 and chunk.dtype == torch.float32:
        return torch.from_numpy(np.matmul(q.numpy(), chunk.numpy().T))
    return q @ chunk.T


class ExactIndex:
    def __init__(self, embeddings: np.ndarray, *, runtime: Runtime | None = None, chunk_size: int | None = None,
                 score_budget: int = 1 << 28, device: torch.device | str | None = None, dtype: str | torch.dtype | None = None):
        """Exact search over `embeddings` [N, D] (float32, possibly memory-mapped). `runtime`: where
        the matrix is held and searched and in which dtype (None: the CPU, auto dtype; the older
        `device`/`dtype` still work, see `Runtime.of`); a CPU index under CPU_BF16_MIN_ROWS rows
        searches in fp32 whatever the runtime's dtype."""
        if embeddings.ndim != 2:
            raise RalmError(f"embeddings must be a [N, D] matrix, got shape {embeddings.shape}")
        runtime = Runtime.of(runtime, device=device, dtype=dtype)
        # Rows per chunk: fixed, or as many as keep a [Q, chunk] score matrix within
        # `score_budget` elements (one pass over the matrix for a single query).
        self.chunk_size = chunk_size
        self.score_budget = score_budget
        self.count, self.dim = embeddings.shape
        if runtime.device.type == "cpu" and self.count < CPU_BF16_MIN_ROWS:
            runtime = replace(runtime, dtype=torch.float32)
        self.runtime = runtime  # what it searches with
        self.device, self.dtype = runtime.device, runtime.dtype
        self._source = embeddings  # float32, possibly memory-mapped: the CPU rescoring reads it
        if self.device.type == "cuda" or self.dtype == torch.bfloat16:
            self._matrix = _to_tensor(embeddings, runtime)
        else:
            self._matrix = embeddings  # stays on disk / in numpy; chunks are viewed on demand

    def __repr__(self) -> str:
        return f"ExactIndex(rows={self.count}, dim={self.dim}, device={self.device}, dtype={self.dtype})"

    def _chunk(self, start: int, end: int) -> torch.Tensor:
        if isinstance(self._matrix, torch.Tensor):
            return self._matrix[start:end]
        part = self._matrix[start:end]
        if part.dtype == np.float32 and part.flags.writeable and part.flags.c_contiguous:
            return torch.from_numpy(part)  # a view: no copy (copy-on-write maps are writeable)
        return torch.from_numpy(np.array(part, dtype=np.float32))

    @torch.inference_mode()
    def search(self, queries, k: int) -> tuple[np.ndarray, np.ndarray]:
        """queries [Q, D] -> (scores [Q, k] float32, row ids [Q, k] int64), best first."""
        check_k(k)
        q = torch.as_tensor(np.asarray(queries, dtype=np.float32) if not isinstance(queries, torch.Tensor) else queries)
        if q.ndim != 2 or q.shape[1] != self.dim:
            raise RalmError(f"queries must have shape [Q, {self.dim}], got {tuple(q.shape)}")
        with full_precision(self.device):  # the matrix dtype decides, not an autocast region around the call
            return self._search(q, k)

    def _search(self, q: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        exact = q.float()
        q = q.to(self.device, self._matrix.dtype if isinstance(self._matrix, torch.Tensor) else torch.float32)
        k = min(k, self.count)
        cpu_bf16 = self.device.type == "cpu" and q.dtype == torch.bfloat16
        shortlist = min(k + RESCORE, self.count) if cpu_bf16 else k
        if cpu_bf16:
            # Cache blocking: a [65,536 x 128] bf16 score block stays in cache between the matmul
            # and its group maxima; with all queries at once the scan runs ~1.6x slower (1M rows).
            step = self.chunk_size or CPU_SCORE_BLOCK // min(q.shape[0], CPU_QUERY_BLOCK)
            cand = torch.cat([self._scan(q[i : i + CPU_QUERY_BLOCK], shortlist, step, rows_first=True)[1]
                              for i in range(0, q.shape[0], CPU_QUERY_BLOCK)])  # [Q, shortlist]
            best_s, best_i = rescore(self._source, exact, cand, k)
        else:
            best_s, best_i = self._scan(q, k, self.chunk_size or max(65_536, self.score_budget // max(q.shape[0], 1)))
        return best_s.cpu().numpy(), best_i.cpu().numpy()

    def _scan(self, q: torch.Tensor, k: int, step: int, rows_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass over the matrix, `step` rows at a time -> the best k (scores [Q, k], ids [Q, k]).
        rows_first: scores computed as [C, Q] (the CPU bf16 layout, see grouped_topk)."""
        best_s = torch.empty(q.shape[0], 0, device=self.device)
        best_i = torch.empty(q.shape[0], 0, dtype=torch.long, device=self.device)
        for start in range(0, self.count, step):
            chunk = self._chunk(start, min(start + step, self.count))
            scores = chunk @ q.T if rows_first else _scores(q, chunk)  # [C, Q] or [Q, C], in the matrix dtype
            vals, cols = grouped_topk(scores, k, queries_last=rows_first)
            best_s, best_i = merge_topk(torch.cat([best_s, vals.float()], 1), torch.cat([best_i, cols + start], 1), k)
        return best_s, best_i

