"""kNN-LM (Khandelwal et al., 2020): p(w | x) = λ p_kNN(w | x) + (1 - λ) p_LM(w | x), where
p_kNN is a softmax over the negative squared L2 distances of the k nearest datastore keys to
the LM's final hidden state for x, summed per value token.

Dimensions: N datastore entries, D LM hidden size, Q queries, K neighbours, V vocabulary.

Datastore directory (built resumably, published atomically):
  STORE/manifest.json   format, count, dim, LM fingerprint, text fingerprint, faiss spec, context
  STORE/keys.npy        float16 [N, D] final hidden state before the output layer at position i
  STORE/values.npy      int32 [N] the token that followed (tokens[i + 1])
  STORE/faiss.index     Flat (exact) for small stores, IVF-PQ for large ones (L2)
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

import numpy as np
import torch

from ralm.atomic import read_manifest
from ralm.data.chunks import TokenStream, context_windows, window_batches
from ralm.data.resumable import PartialBuild, build_hint
from ralm.errors import RalmError
from ralm.retrieval.exact import check_k
from ralm.retrieval.faiss_index import FaissIndex
from ralm.runtime import autocast, resolve_dtype

FORMAT = "ralm.knnlm-store/1"
FLAT_MAX = 1_000_000  # above this many keys the automatic index is IVF-PQ


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
        raise RalmError(f"--lmbda must be in [0, 1], got {lmbda}")
    if lmbda == 0.0:
        return lm_logprobs.float()
    if lmbda == 1.0:
        return knn_probs.float().log()
    return torch.logaddexp(math.log(lmbda) + knn_probs.float().log(), math.log1p(-lmbda) + lm_logprobs.float())


# -- hidden states of a text --------------------------------------------------------------

@torch.inference_mode()
def lm_states(model, tokens: np.ndarray, start: int, end: int, seq_len: int, stride: int, device: torch.device,
              batch_size: int = 16, dtype: str | torch.dtype | None = None):
    """Yield (positions [P], hidden [P, D], log p_LM(next token) [P]) for positions start..end-1
    of `tokens` (end <= len - 1), each with >= seq_len - stride tokens of context."""
    for part in window_batches(context_windows(start, end, seq_len, stride), batch_size):
        ids = torch.from_numpy(np.stack([tokens[a:b] for a, b, _ in part]).astype(np.int64)).to(device)  # [B, L]
        with autocast(device, resolve_dtype(dtype, device)):
            hidden = model.features(ids)  # [B, L, D]
        logp = torch.log_softmax(model.head(hidden), dim=-1)  # [B, L, V], fp32 logits
        for row, (a, b, s) in enumerate(part):
            nxt = torch.from_numpy(tokens[s + 1 : b + 1].astype(np.int64)).to(device)
            yield np.arange(s, b), hidden[row, s - a :].float(), logp[row, s - a :].gather(-1, nxt[:, None])[:, 0]


# -- the datastore ------------------------------------------------------------------------

def model_fingerprint(path: str | os.PathLike) -> str:
    """sha256 of a model directory's config and weights (what a datastore's keys depend on)."""
    path = Path(path)
    path = path / "model" if (path / "model" / "config.json").is_file() else path
    h = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.suffix in (".json", ".safetensors", ".bin") and "token" not in p.name):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def auto_faiss_spec(count: int, dim: int) -> str:
    if count <= FLAT_MAX:
        return "Flat"
    nlist = 1 << int(round(math.log2(4 * math.sqrt(count))))
    sub = next(m for m in (64, 32, 16, 8, 4, 2, 1) if dim % m == 0 and dim // m >= 4)
    return f"IVF{nlist},PQ{sub}"


def build_datastore(model, model_path: str | os.PathLike, stream: TokenStream, out: str | os.PathLike, seq_len: int = 512,
                    stride: int = 256, faiss_spec: str | None = None, batch_size: int = 16,
                    device: torch.device | None = None, show_progress: bool = True,
                    dtype: str | torch.dtype | None = None) -> Path:
    """Keys = LM hidden states at every position of `stream` but the last, values = next tokens.
    Resumable: finished blocks of keys survive a crash; STORE appears only when complete."""
    device = device or torch.device("cpu")
    n = len(stream.tokens) - 1
    if n <= 0:
        raise RalmError("the text has fewer than two tokens")
    dim = model.dim
    spec = faiss_spec or auto_faiss_spec(n, dim)
    signature = {"format": FORMAT, "model": model_fingerprint(model_path), "text": stream.fingerprint(),
                 "seq_len": seq_len, "stride": stride, "faiss": spec}
    build = PartialBuild(out, signature)
    build.stage("values.npy", lambda tmp: np.save(tmp, stream.tokens[1:].astype(np.int32)))

    def keys(start: int, end: int) -> np.ndarray:
        rows = np.empty((end - start, dim), dtype=np.float16)
        for pos, hidden, _ in lm_states(model, stream.tokens, start, end, seq_len, stride, device, batch_size, dtype):
            rows[pos - start] = hidden.cpu().numpy()
        return rows

    block = max(stride, (65_536 // stride) * stride)
    emb = build.fill("keys.npy", (n, dim), np.float16, keys, block=block, show_progress=show_progress,
                     description="datastore keys")
    build.stage("faiss.index", lambda tmp: FaissIndex.build(emb, spec, metric="l2").save(tmp))
    return build.publish({**signature, "count": n, "dim": dim, "model_path": str(model_path)})


class Datastore:
    def __init__(self, path: str | os.PathLike, nprobe: int = 32):
        self.path = Path(path)
        self.manifest = read_manifest(self.path, FORMAT, "kNN-LM datastore", build_hint(self.path, "ralm knnlm build"))
        self.keys = np.load(self.path / "keys.npy", mmap_mode="r", allow_pickle=False)  # [N, D] float16
        self.values = np.load(self.path / "values.npy", mmap_mode="r", allow_pickle=False)  # [N]
        self.index = FaissIndex.load(self.path / "faiss.index", self.manifest["faiss"])
        self.index.set_search_params(nprobe=nprobe)

    def __len__(self) -> int:
        return int(self.manifest["count"])

    def check_model(self, model_path: str | os.PathLike) -> None:
        if model_fingerprint(model_path) != self.manifest["model"]:
            raise RalmError(f"{self.path} was built with another LM ({self.manifest['model_path']}); its keys do not fit {model_path}")

    def search(self, queries: np.ndarray, k: int, exact_distances: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """queries [Q, D] -> (squared L2 distances [Q, K], value tokens [Q, K]; -1 where none).
        With an approximate index, `exact_distances` recomputes distances from the stored keys
        (the paper found full-precision distances better than quantised ones)."""
        check_k(k)
        dist, ids = self.index.search(queries, k)
        if exact_distances and self.manifest["faiss"] != "Flat":
            keys = self.keys[np.maximum(ids, 0).reshape(-1)].astype(np.float32).reshape(*ids.shape, -1)  # [Q, K, D]
            dist = ((keys - queries[:, None, :]) ** 2).sum(-1)
        dist = np.where(ids >= 0, dist, np.inf).astype(np.float32)
        return dist, np.where(ids >= 0, np.asarray(self.values)[np.maximum(ids, 0)], -1).astype(np.int64)
