"""Approximate (or exact Flat) MIPS with faiss, behind the same search interface as ExactIndex.

Given the float32 vectors the index was built from (`source`, memory-mapped), a search takes
faiss's best k + RESCORE and rescores them exactly, so scores are exact inner products and the
order is exact within that shortlist, however coarsely the index stores its codes (SQ8, PQ).

`--faiss auto` (the default of `ralm index build`) keeps exact search below APPROX_MIN_BLOCKS
and builds IVF-SQ8 above, with the number of lists chosen from N (`auto_spec`).
"""

from __future__ import annotations

import math
import os
import re
import warnings
from pathlib import Path

import numpy as np
import torch

from ralm.atomic import atomic_path
from ralm.defaults import FAISS_AUTO
from ralm.errors import RalmError, RalmWarning
from ralm.retrieval.backends.exact import RESCORE, check_k, rescore


def faiss_module():
    """The faiss module, imported when first needed (exact search never loads it)."""
    import faiss

    return faiss


POINTS_PER_CLUSTER = 39  # faiss's k-means warns below this many training points per centroid
TRAIN_VECTORS = 262_144  # vectors a faiss index trains on, unless its lists need more
_IVF = re.compile(r"IVF(\d+)")
FACTORY_DIMS = (64, 96, 128, 256, 384, 768, 1024)  # the usual embedding sizes, to parse a spec before the model loads
AUTO = FAISS_AUTO  # a spec chosen from the number of vectors (auto_spec)
# Below this many blocks exact search answers within the latency target on 2 CPU cores (fp32 scan of
# N x 384: ~15 ms at 100k, ~150 ms at 1M; benchmarks/scale/scale.py), so small indexes stay exact.
APPROX_MIN_BLOCKS = 250_000
HNSW_LISTS = 16_384  # from this many IVF lists (N >= ~10M) the coarse quantizer is an HNSW graph
# From this many lists the coarse centroids come from two-level k-means (`train`): one k-means over
# 16,384 lists costs training points x lists x dim per iteration, hours on 2 CPU cores.
TWO_LEVEL_LISTS = HNSW_LISTS
# Graph search width when an HNSW graph of the lists' centroids picks each vector's list. faiss's
# 16 misplaced about 9% of 10M vectors in lists no query probes (recall@10 0.91 whatever nprobe;
# 64: 0.979, benchmarks/scale/scale.py); a search of nprobe lists widens it to nprobe anyway.
QUANTIZER_EF_SEARCH = 64
# A loaded IVF's lists are memory-mapped from its file, not read: IVF4096,SQ8 over 1M vectors
# (398 MB) opened in 0.47 s, now 0.01 s, and a server's RSS holds only the lists its queries
# probe. Safe because a published file is never written again (a new version is a new file)
# and, on POSIX, a mapped file pruned with its version stays readable; Windows refuses to
# delete a mapped file, so there it is read whole.
MAP_LISTS = os.name == "posix"


def ivf_lists(n: int) -> int:
    """The IVF list count for n vectors: the power of two nearest 4 sqrt(n) (faiss's advice: 4-16 sqrt(n))."""
    return 1 << round(math.log2(4 * math.sqrt(n)))


def training_count(index) -> int:
    """Vectors to train a faiss index on: TRAIN_VECTORS, or POINTS_PER_CLUSTER a list where an IVF
    has more lists than that covers (16,384 lists at 10M blocks: 638,976; fewer leave lists poorly
    placed, and faiss warns)."""
    ivf = _ivf_of(index)
    return max(TRAIN_VECTORS, POINTS_PER_CLUSTER * (ivf.nlist if ivf is not None else 0))


def _ivf_of(index):
    """The IVF inside a faiss index (behind a pre-transform or refinement), or None."""
    try:
        return faiss_module().extract_index_ivf(index)
    except RuntimeError:  # not an IVF index
        return None


def train(index, sample: np.ndarray, *, seed: int = 0) -> None:
    """Train a faiss index on `sample` [S, D] float32. An IVF of TWO_LEVEL_LISTS lists or more
    gets its coarse centroids from faiss's two-level k-means (sqrt(lists) clusters, each split in
    proportion to its points: about 2 sqrt(lists) inner products a point and iteration instead of
    `lists`); faiss then trains the rest (the SQ8 ranges) with those centroids in place."""
    faiss, ivf = faiss_module(), _ivf_of(index)
    if ivf is not None and ivf.nlist >= TWO_LEVEL_LISTS and ivf.quantizer.ntotal == 0:
        from faiss.contrib.clustering import two_level_clustering

        # Spherical for inner product, as MIPS over unit-norm embeddings wants; a split rounded a
        # few points short of faiss's 39 a centroid only warns, hence the lower floor.
        centroids, _ = two_level_clustering(sample, math.isqrt(ivf.nlist), ivf.nlist, seed=seed,
                                            spherical=ivf.metric_type == faiss.METRIC_INNER_PRODUCT,
                                            min_points_per_centroid=POINTS_PER_CLUSTER // 2)
        ivf.quantizer.train(centroids)
        ivf.quantizer.add(centroids)
    index.train(sample)
    if ivf is not None and hasattr(quantizer := faiss.downcast_index(ivf.quantizer), "hnsw"):
        quantizer.hnsw.efSearch = QUANTIZER_EF_SEARCH  # saved with the index


def auto_spec(n: int) -> str | None:
    """What `--faiss auto` builds for n blocks: None (exact search) below APPROX_MIN_BLOCKS, else
    IVF-SQ8 (a byte per dimension: a quarter of the float32 vectors, rescored exactly from them).
    From HNSW_LISTS lists on, the lists are found through an HNSW graph of their centroids, as
    faiss advises for millions of vectors: adding 10M vectors to 16,384 lists is then a graph
    search per vector, not 16,384 inner products."""
    if n < APPROX_MIN_BLOCKS:
        return None
    lists = ivf_lists(n)
    return f"IVF{lists}{'_HNSW32' if lists >= HNSW_LISTS else ''},SQ8"


def check_spec(spec: str, dims: tuple[int, ...] = FACTORY_DIMS) -> None:
    """Refuse a factory string faiss cannot parse, before any encoding: it must build for at
    least one of `dims` (the embedding dimension is only known once the model loads)."""
    faiss, last = faiss_module(), ""
    for d in dims:
        try:
            faiss.index_factory(d, spec, faiss.METRIC_INNER_PRODUCT)
            return
        except RuntimeError as e:
            last = _faiss_message(e)
    raise RalmError(f"--faiss {spec!r} is not a faiss index_factory string faiss can build ({last})")


def _faiss_message(e: RuntimeError) -> str:
    """faiss's C++ error without its source location: "Error in <function> at <file>:<line>: <what>"."""
    text = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    return re.sub(r"^Error in .* at \S+: ", "", text)


def fit_spec(spec: str, n: int) -> str:
    """`spec` with an IVF cluster count that `n` vectors can train: faiss refuses more clusters
    than points (IVF1024 on 284 blocks would fail after the whole corpus was encoded), so such
    a count is cut to n / 39 (faiss's advice: 39 points per centroid), and a warning says so."""
    m = _IVF.search(spec)
    if not m or int(m.group(1)) <= n:
        return spec
    fitted = f"{spec[:m.start()]}IVF{max(1, n // POINTS_PER_CLUSTER)}{spec[m.end():]}"
    warnings.warn(RalmWarning(f"--faiss {spec!r}: {n} blocks cannot train {m.group(1)} clusters; building {fitted!r} "
                              f"({POINTS_PER_CLUSTER} points per cluster)"), stacklevel=2)
    return fitted


class FaissIndex:
    def __init__(self, index, spec: str, source: np.ndarray | None = None):
        self.index = index
        self.spec = spec
        self.source = source  # the float32 vectors [N, D] it was built from: a shortlist is rescored from them

    @property
    def count(self) -> int:
        return self.index.ntotal

    @property
    def dim(self) -> int:
        return self.index.d

    def __repr__(self) -> str:
        return f"FaissIndex({self.spec!r}, rows={self.count}, dim={self.dim})"

    @classmethod
    def build(cls, embeddings: np.ndarray, spec: str = "Flat", *, metric: str = "ip",
              train_size: int | None = None, seed: int = 0, add_chunk: int = 262_144) -> "FaissIndex":
        """`spec` is a faiss index_factory string: "Flat", "IVF1024,Flat", "HNSW32", "IVF4096,PQ32"...
        `train_size`: vectors sampled to train it (None: `training_count`)."""
        faiss = faiss_module()
        metric_id = {"ip": faiss.METRIC_INNER_PRODUCT, "l2": faiss.METRIC_L2}.get(metric)
        if metric_id is None:
            raise RalmError(f"metric must be 'ip' or 'l2', got {metric!r}")
        n, d = embeddings.shape
        spec = fit_spec(spec, n)
        try:
            index = faiss.index_factory(d, spec, metric_id)
        except RuntimeError as e:
            raise RalmError(f"bad faiss spec {spec!r}: {_faiss_message(e)}") from None
        if not index.is_trained:
            rng = np.random.default_rng(seed)
            size = training_count(index) if train_size is None else train_size
            sample = np.sort(rng.choice(n, size=min(n, size), replace=False))
            try:
                train(index, np.ascontiguousarray(embeddings[sample], dtype=np.float32), seed=seed)
            except RuntimeError as e:  # e.g. a PQ with more centroids than training points
                raise RalmError(f"faiss cannot train {spec!r} on {n} vectors of dimension {d}: "
                                f"{_faiss_message(e)}") from None
        for start in range(0, n, add_chunk):
            index.add(np.ascontiguousarray(embeddings[start : start + add_chunk], dtype=np.float32))
        return cls(index, spec)

    def _ivf(self):
        return _ivf_of(self.index)

    def default_search_params(self) -> dict:
        """Recall-minded defaults (faiss's own, nprobe=1 and efSearch=16, lose many neighbours).
        IVF probes 1/32 of its lists (at least 16): on 1M MiniLM-like vectors (IVF4096,SQ8,
        benchmarks/scale/scale.py) recall@10 against exact search is 0.992; 1/16 gave 0.995 at twice
        the latency, 1/64 0.983."""
        params = {}
        if (ivf := self._ivf()) is not None:
            params["nprobe"] = min(ivf.nlist, max(16, ivf.nlist // 32))
        if hasattr(self.index, "hnsw"):
            params["ef_search"] = 128
        return params

    @property
    def lists(self) -> int | None:
        """An IVF index's number of inverted lists (the most `nprobe` can probe); None for others."""
        ivf = self._ivf()
        return None if ivf is None else int(ivf.nlist)

    def search_params(self) -> dict:
        """The search parameters in use, as `set_search_params` takes them."""
        params = {}
        if (ivf := self._ivf()) is not None:
            params["nprobe"] = int(ivf.nprobe)
        if hasattr(self.index, "hnsw"):
            params["ef_search"] = int(self.index.hnsw.efSearch)
        return params

    def set_search_params(self, nprobe: int | None = None, ef_search: int | None = None) -> None:
        if nprobe is not None and (ivf := self._ivf()) is not None:
            ivf.nprobe = nprobe
        if ef_search is not None and hasattr(self.index, "hnsw"):
            self.index.hnsw.efSearch = ef_search

    def search(self, queries, k: int) -> tuple[np.ndarray, np.ndarray]:
        """queries [Q, D] -> (scores [Q, k], row ids [Q, k]); L2 indexes return squared distances."""
        check_k(k)
        q = np.ascontiguousarray(np.asarray(queries, dtype=np.float32))
        if q.ndim != 2 or q.shape[1] != self.dim:
            raise RalmError(f"queries must have shape [Q, {self.dim}], got {q.shape}")
        if self.source is None:
            scores, ids = self.index.search(q, min(k, self.count))
            return scores, ids.astype(np.int64)
        _, cand = self.index.search(q, min(k + RESCORE, self.count))  # [Q, k + RESCORE]; -1: fewer found
        scores, ids = rescore(self.source, torch.from_numpy(q), torch.from_numpy(cand.astype(np.int64)), min(k, self.count))
        return scores.numpy(), ids.numpy()

    def save(self, path: str | os.PathLike) -> None:
        with atomic_path(path) as tmp:
            faiss_module().write_index(self.index, str(tmp))

    @classmethod
    def load(cls, path: str | os.PathLike, spec: str, source: np.ndarray | None = None) -> "FaissIndex":
        """`source`: the float32 vectors it was built from, to rescore with."""
        if not Path(path).is_file():
            raise RalmError(f"faiss index not found: {path}")
        faiss = faiss_module()
        index = faiss.read_index(str(path), (faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY) if MAP_LISTS else 0)
        if source is not None and source.shape != (index.ntotal, index.d):
            raise RalmError(f"{path}: faiss index of {index.ntotal} x {index.d}, its vectors are {source.shape}; rebuild the index")
        return cls(index, spec, source)
