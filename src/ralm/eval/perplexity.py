"""Perplexity of a causal LM, a kNN-LM and RETRO (with or without retrieval) on a token stream.

Every token but the first is predicted exactly once, with at least seq_len - stride tokens of
context (data/chunks.py `context_windows`). Perplexity is reported per wordpiece and per
whitespace-separated word of the text (exp(total NLL / words): the WikiText convention,
comparable across tokenisers).
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from ralm.data.chunks import TokenStream, context_windows, window_batches
from ralm.defaults import KNN_K, KNN_LAMBDA, KNN_TEMPERATURE, LM_BATCH, RETRO_BATCH
from ralm.errors import RalmError
from ralm.models.knnlm import interpolate, knn_target_prob, lm_states
from ralm.models.lm import context
from ralm.progress import progress_bar
from ralm.retrieval.lm.chunkdb import text_neighbours
from ralm.retrieval.lm.datastore import Datastore
from ralm.runtime import Runtime, autocast


def perplexity_report(nll: np.ndarray, words: int) -> dict:
    """Token- and word-level perplexity from per-token NLLs (nats)."""
    total = float(np.sum(nll, dtype=np.float64))
    return {"tokens": int(len(nll)), "words": int(words), "nll": round(total / max(len(nll), 1), 5),
            "ppl": round(math.exp(total / max(len(nll), 1)), 3), "word_ppl": round(math.exp(total / max(words, 1)), 3)}


def lm_nll(model, stream: TokenStream, *, seq_len: int, stride: int, runtime: Runtime, batch_size: int = LM_BATCH,
           show_progress: bool = True) -> np.ndarray:
    """NLL [T - 1] of each next token under a causal LM (`features` / `head` interface)."""
    n = len(stream.tokens) - 1
    nll = np.empty(n, dtype=np.float64)
    with progress_bar(show_progress) as bar:
        task = bar.add_task("scoring", total=n)
        for pos, _, logp in lm_states(model, stream.tokens, start=0, end=n, seq_len=seq_len, stride=stride, runtime=runtime,
                                      batch_size=batch_size):
            nll[pos] = -logp.cpu().numpy()
            bar.advance(task, len(pos))
    return nll


def lm_perplexity(model, stream: TokenStream, *, seq_len: int | None = None, stride: int | None = None,
                  runtime: Runtime | None = None, batch_size: int = LM_BATCH, show_progress: bool = True,
                  device: torch.device | str | None = None, dtype: str | torch.dtype | None = None) -> dict:
    """Perplexity report of a causal LM on `stream`; the window defaults to the model's training
    length, the stride to half of it. `runtime`: where the model (already there) runs and its
    compute dtype (None: the CPU, auto dtype; the older `device`/`dtype` still work, see
    `Runtime.of`)."""
    rt = Runtime.of(runtime, device=device, dtype=dtype)
    seq_len, stride = context(model, seq_len, stride)
    nll = lm_nll(model, stream, seq_len=seq_len, stride=stride, runtime=rt, batch_size=batch_size, show_progress=show_progress)
    return perplexity_report(nll, stream.words)


def check_grid(lambdas, temperatures) -> None:
    """The (λ, temperature) grid of knnlm_eval, checked before any model loads (NaN fails too)."""
    if not lambdas or any(not 0 <= x <= 1 for x in lambdas):
        raise RalmError(f"lmbda must be in [0, 1], got {list(lambdas)}")
    if not temperatures or any(not 0 < t < math.inf for t in temperatures):
        raise RalmError(f"temperature must be a positive finite number, got {list(temperatures)}")


def knnlm_eval(model, store: Datastore, stream: TokenStream, *, k: int = KNN_K, lambdas=(KNN_LAMBDA,), temperatures=(KNN_TEMPERATURE,),
               seq_len: int | None = None, stride: int | None = None, runtime: Runtime | None = None,
               batch_size: int = LM_BATCH, exact_distances: bool = True, show_progress: bool = True, search_batch: int = 2048,
               device: torch.device | str | None = None, dtype: str | torch.dtype | None = None) -> dict:
    """Perplexity of the LM alone and interpolated with p_kNN for each (λ, temperature): the
    neighbours are searched once, so a grid costs no more than one setting. Hidden states are
    searched `search_batch` at a time: faiss is several times faster on large query blocks.
    The window defaults to the model's training length, the stride to half of it. `runtime`:
    as `lm_perplexity`'s (the datastore is searched on the CPU)."""
    check_grid(lambdas, temperatures)
    rt = Runtime.of(runtime, device=device, dtype=dtype)
    start = time.perf_counter()
    p_lm, p_knn = knnlm_log_probs(model, store, stream, k=k, temperatures=temperatures, seq_len=seq_len, stride=stride,
                                  runtime=rt, batch_size=batch_size, exact_distances=exact_distances, show_progress=show_progress,
                                  search_batch=search_batch)
    result = {"lm": perplexity_report(-p_lm, stream.words), "k": k, "seconds": round(time.perf_counter() - start, 1), "knn": []}
    for i, t in enumerate(temperatures):
        for lmbda in lambdas:
            logp = interpolate(torch.from_numpy(p_lm), torch.from_numpy(p_knn[i]), lmbda).double().numpy()
            result["knn"].append({"lmbda": lmbda, "temperature": t, **perplexity_report(-logp, stream.words)})
    return result


def knnlm_log_probs(model, store: Datastore, stream: TokenStream, *, runtime: Runtime, k: int = KNN_K,
                    temperatures=(KNN_TEMPERATURE,), seq_len: int | None = None, stride: int | None = None,
                    batch_size: int = LM_BATCH, exact_distances: bool = True, show_progress: bool = True,
                    search_batch: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """Per next token of `stream`: (log p_LM [T - 1], p_kNN [len(temperatures), T - 1]), for
    scoring chosen positions (interpolate with models.knnlm.interpolate)."""
    check_grid((0.0,), temperatures)
    seq_len, stride = context(model, seq_len, stride)
    n = len(stream.tokens) - 1
    p_lm, p_knn = np.empty(n, dtype=np.float64), np.empty((len(temperatures), n), dtype=np.float64)
    pending: list[tuple[np.ndarray, np.ndarray]] = []

    def flush() -> None:
        pos = np.concatenate([p for p, _ in pending])
        dist, values = store.search(np.concatenate([h for _, h in pending]), k, exact_distances)
        targets = torch.from_numpy(stream.tokens[pos + 1].astype(np.int64))
        for i, t in enumerate(temperatures):
            p_knn[i, pos] = knn_target_prob(torch.from_numpy(dist), torch.from_numpy(values), targets, t).double().numpy()
        bar.advance(task, len(pos))
        pending.clear()

    with progress_bar(show_progress) as bar:
        task = bar.add_task("kNN-LM scoring", total=n)
        for pos, hidden, logp in lm_states(model, stream.tokens, start=0, end=n, seq_len=seq_len, stride=stride,
                                           runtime=runtime, batch_size=batch_size):
            p_lm[pos] = logp.double().cpu().numpy()
            pending.append((np.asarray(pos), hidden.float().cpu().numpy()))
            if sum(len(p) for p, _ in pending) >= search_batch:
                flush()
        if pending:
            flush()
    return p_lm, p_knn


def retro_perplexity(model, db, stream: TokenStream, *, retrieval: bool = True, stride: int | None = None,
                     runtime: Runtime | None = None, batch_size: int = RETRO_BATCH, show_progress: bool = True,
                     device: torch.device | str | None = None, dtype: str | torch.dtype | None = None) -> dict:
    """Perplexity report of RETRO on `stream`, with neighbours from chunk DB `db` (retrieved
    once, cached in the DB, under the DB's own runtime) or with retrieval off. The stride, a
    multiple of the chunk length, defaults to half the training length. `runtime`: as
    `lm_perplexity`'s."""
    rt = Runtime.of(runtime, device=device, dtype=dtype)
    m = model.cfg.chunk_len
    stride = stride or max(m, model.cfg.max_len // 2 // m * m)
    if stride % m:
        raise RalmError(f"stride must be a multiple of the chunk length {m}, got {stride}")
    neighbours = (text_neighbours(db, stream, k=model.cfg.neighbours, exclude_same_doc=False, show_progress=show_progress)
                  if retrieval else None)
    nll = retro_nll(model, db, stream, neighbours=neighbours, stride=stride, runtime=rt, batch_size=batch_size,
                    show_progress=show_progress)
    return perplexity_report(nll, stream.words)


@torch.inference_mode()
def retro_nll(model, db, stream: TokenStream, *, neighbours: np.ndarray | None, stride: int, runtime: Runtime,
              batch_size: int = RETRO_BATCH, show_progress: bool = True) -> np.ndarray:
    """NLL [T - 1] under RETRO; `neighbours` [T // m, k] chunk ids of the stream's complete
    chunks, or None for retrieval off. Windows start on chunk boundaries."""
    device = runtime.device
    m, seq_len = model.cfg.chunk_len, model.cfg.max_len
    tokens = stream.tokens
    n = len(tokens) - 1
    nll = np.empty(n, dtype=np.float64)
    with progress_bar(show_progress) as bar:
        task = bar.add_task("scoring" + ("" if neighbours is not None else " (retrieval off)"), total=n)
        for part in window_batches(context_windows(0, n, seq_len=seq_len, stride=stride, align=m), batch_size):
            ids = torch.from_numpy(np.stack([tokens[a:b] for a, b, _ in part]).astype(np.int64)).to(device)  # [B, L]
            targets = torch.from_numpy(np.stack([tokens[a + 1 : b + 1] for a, b, _ in part]).astype(np.int64)).to(device)
            nb = mask = None
            if neighbours is not None:
                chunks = ids.shape[1] // m
                nb_ids = np.stack([neighbours[a // m : a // m + chunks] for a, _, _ in part])  # [B, n, k]
                nb, mask = (torch.from_numpy(x).to(device) for x in db.values(nb_ids))
            with autocast(device, runtime.dtype):
                logits = model(ids, nb, mask)  # [B, L, V], fp32 logits (RetroModel's head)
            logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]  # [B, L]
            for row, (a, b, s) in enumerate(part):
                nll[s:b] = -logp[row, s - a :].double().cpu().numpy()
            bar.advance(task, sum(b - s for _, b, s in part))
    return nll
