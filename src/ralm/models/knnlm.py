"""kNN-LM (Khandelwal et al., 2020): p(w | x) = λ p_kNN(w | x) + (1 - λ) p_LM(w | x), where
p_kNN is a softmax over the negative squared L2 distances of the k nearest datastore keys to
the LM's final hidden state for x, summed per value token.

The datastore itself (layout, search) is retrieval/lm/datastore.py.

Dimensions: N datastore entries, D LM hidden size, Q queries, K neighbours, V vocabulary.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch

from ralm.data.chunks import TokenStream, context_windows, window_batches
from ralm.defaults import LM_BATCH
from ralm.errors import RalmError
from ralm.models.lm import context
from ralm.retrieval.lm.datastore import model_fingerprint, write_datastore
from ralm.runtime import Runtime, autocast


# -- the maths ----------------------------------------------------------------------------

def knn_distribution(distances: torch.Tensor, values: torch.Tensor, vocab_size: int, temperature: float = 1.0) -> torch.Tensor:
    """p_kNN [Q, V] from squared distances [Q, K] and value tokens [Q, K] (-1: no neighbour)."""
    weights = torch.softmax(_masked_logits(distances, values, temperature), dim=-1)  # [Q, K]
    out = torch.zeros(distances.shape[0], vocab_size, dtype=weights.dtype, device=weights.device)
    return out.scatter_add_(1, values.clamp(min=0), weights)


def knn_target_prob(distances: torch.Tensor, values: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """p_kNN(target) [Q] without the [Q, V] matrix (equals knn_distribution(...)[q, target])."""
    weights = torch.softmax(_masked_logits(distances, values, temperature), dim=-1)  # [Q, K]
    return (weights * (values == targets[:, None])).sum(-1)


def _masked_logits(distances: torch.Tensor, values: torch.Tensor, temperature: float) -> torch.Tensor:
    return (-distances.float() / temperature).masked_fill(values < 0, float("-inf"))


def interpolate(lm_logprobs: torch.Tensor, knn_probs: torch.Tensor, lmbda: float) -> torch.Tensor:
    """log(λ p_kNN + (1 - λ) p_LM), elementwise, stable for p_kNN = 0."""
    if not 0.0 <= lmbda <= 1.0:
        raise RalmError(f"lmbda must be in [0, 1], got {lmbda}")
    if lmbda == 0.0:
        return lm_logprobs.float()
    if lmbda == 1.0:
        return knn_probs.float().log()
    return torch.logaddexp(math.log(lmbda) + knn_probs.float().log(), math.log1p(-lmbda) + lm_logprobs.float())


# -- hidden states of a text --------------------------------------------------------------

@torch.inference_mode()
def lm_states(model, tokens: np.ndarray, *, start: int, end: int, seq_len: int, stride: int, runtime: Runtime,
              batch_size: int = 16):
    """Yield (positions [P], hidden [P, D], log p_LM(next token) [P]) for positions start..end-1
    of `tokens` (end <= len - 1), each with >= seq_len - stride tokens of context."""
    device = runtime.device
    for part in window_batches(context_windows(start, end, seq_len=seq_len, stride=stride), batch_size):
        ids = torch.from_numpy(np.stack([tokens[a:b] for a, b, _ in part]).astype(np.int64)).to(device)  # [B, L]
        with autocast(device, runtime.dtype):
            hidden = model.features(ids)  # [B, L, D]
        logp = torch.log_softmax(model.head(hidden), dim=-1)  # [B, L, V], fp32 logits
        for row, (a, b, s) in enumerate(part):
            nxt = torch.from_numpy(tokens[s + 1 : b + 1].astype(np.int64)).to(device)
            yield np.arange(s, b), hidden[row, s - a :].float(), logp[row, s - a :].gather(-1, nxt[:, None])[:, 0]


# -- the datastore's keys ------------------------------------------------------------------

def build_datastore(model, model_path: str | os.PathLike, stream: TokenStream, out: str | os.PathLike,
                    *, seq_len: int | None = None, stride: int | None = None, faiss_spec: str | None = None,
                    batch_size: int = LM_BATCH, runtime: Runtime | None = None, show_progress: bool = True,
                    device: torch.device | str | None = None, dtype: str | torch.dtype | None = None) -> Path:
    """Keys = LM hidden states at every position of `stream` but the last, values = next tokens;
    the window defaults to the model's training length, the stride to half of it. Resumable:
    finished blocks of keys survive a crash; STORE appears only when complete. `runtime`: where
    the model (already there) runs and its compute dtype (None: the CPU, auto dtype; the older
    `device`/`dtype` still work, see `Runtime.of`)."""
    rt = Runtime.of(runtime, device=device, dtype=dtype)
    seq_len, stride = context(model, seq_len, stride)
    n = len(stream.tokens) - 1
    if n <= 0:
        raise RalmError("the text has fewer than two tokens")

    def keys(start: int, end: int) -> np.ndarray:
        rows = np.empty((end - start, model.dim), dtype=np.float16)
        for pos, hidden, _ in lm_states(model, stream.tokens, start=start, end=end, seq_len=seq_len, stride=stride,
                                        runtime=rt, batch_size=batch_size):
            rows[pos - start] = hidden.cpu().numpy()
        return rows

    inputs = {"model": model_fingerprint(model_path), "text": stream.fingerprint(), "seq_len": seq_len, "stride": stride}
    block = max(stride, (65_536 // stride) * stride)
    return write_datastore(out, inputs, stream.tokens[1:], dim=model.dim, keys=keys, block=block, faiss_spec=faiss_spec,
                           model_path=model_path, show_progress=show_progress)
