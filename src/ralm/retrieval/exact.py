"""Exact maximum inner product search in torch: chunked matmul + top-k, merged across chunks.

On CUDA the whole matrix lives on the device in bf16 (13M x 128 = 3.3 GB); on CPU it is read
chunk by chunk from a (possibly memory-mapped) float32 array, so RAM stays bounded.

A full `topk` over rows of millions of scores is what makes naive MIPS slow. `grouped_topk`
takes the maximum of each group of G scores, keeps the k groups with the highest maxima and
ranks only their k*G scores. This is still exact: an element of the top k has at most k-1
larger elements, so at most k-1 groups have a larger maximum than its own group.
"""

from __future__ import annotations

import numpy as np
import torch

from ralm.errors import RalmError


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


def grouped_topk(scores: torch.Tensor, k: int, group: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of each row of scores [Q, C] -> (values [Q, k], column ids [Q, k])."""
    q, c = scores.shape
    k = min(k, c)
    if c < 4 * k * group:
        return torch.topk(scores, k, dim=1)
    n_groups = -(-c // group)
    if n_groups * group != c:
        scores = torch.nn.functional.pad(scores, (0, n_groups * group - c), value=float("-inf"))
    grouped = scores.view(q, n_groups, group)  # [Q, C/G, G]
    best_groups = torch.topk(grouped.amax(-1), k, dim=1).indices  # [Q, k]
    cand = grouped.gather(1, best_groups.unsqueeze(-1).expand(q, k, group)).reshape(q, k * group)  # [Q, k*G]
    vals, pos = torch.topk(cand, k, dim=1)  # [Q, k]
    cols = best_groups.gather(1, pos // group) * group + pos % group
    return vals, cols


class ExactIndex:
    def __init__(self, embeddings: np.ndarray, device: torch.device | None = None, chunk_size: int | None = None,
                 score_budget: int = 1 << 28):
        if embeddings.ndim != 2:
            raise RalmError(f"embeddings must be a [N, D] matrix, got shape {embeddings.shape}")
        self.device = device or torch.device("cpu")
        # Rows per chunk: fixed, or as many as keep a [Q, chunk] score matrix within
        # `score_budget` elements (one pass over the matrix for a single query).
        self.chunk_size = chunk_size
        self.score_budget = score_budget
        self.count, self.dim = embeddings.shape
        if self.device.type == "cuda":
            self._matrix = torch.from_numpy(np.ascontiguousarray(embeddings, dtype=np.float32)).to(self.device, torch.bfloat16)
        else:
            self._matrix = embeddings  # stays on disk / in numpy; chunks are viewed on demand

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
        q = q.to(self.device, self._matrix.dtype if isinstance(self._matrix, torch.Tensor) else torch.float32)
        k = min(k, self.count)
        step = self.chunk_size or max(65_536, self.score_budget // max(q.shape[0], 1))
        best_s = torch.empty(q.shape[0], 0, device=self.device)
        best_i = torch.empty(q.shape[0], 0, dtype=torch.long, device=self.device)
        for start in range(0, self.count, step):
            chunk = self._chunk(start, min(start + step, self.count))
            vals, cols = grouped_topk(q @ chunk.T, k)  # scores [Q, C] stay in the matrix dtype
            best_s, best_i = merge_topk(torch.cat([best_s, vals.float()], 1), torch.cat([best_i, cols + start], 1), k)
        return best_s.cpu().numpy(), best_i.cpu().numpy()
