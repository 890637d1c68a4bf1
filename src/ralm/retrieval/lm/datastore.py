"""The kNN-LM datastore (Khandelwal et al., 2020): keys, an LM's final hidden state at every
position of a text, and values, the token that followed, searched by L2 distance. The LM side
(computing the keys, mixing the neighbours into p_LM) is models/knnlm.py.

Dimensions: N entries, D key dim, Q queries, K neighbours.

Datastore directory (built resumably, published atomically):
  STORE/manifest.json   format, count, dim, LM fingerprint, text fingerprint, faiss spec, context
  STORE/keys.npy        float16 [N, D] final hidden state before the output layer at position i
  STORE/values.npy      int32 [N] the token that followed (tokens[i + 1])
  STORE/faiss.index     Flat (exact) for small stores, IVF-PQ for large ones (L2)
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable

import numpy as np

from ralm.atomic import read_manifest, read_npy
from ralm.data.resumable import PartialBuild, build_hint
from ralm.defaults import NPROBE
from ralm.errors import RalmError
from ralm.retrieval.backends.exact import check_k
from ralm.retrieval.backends.faiss_index import FaissIndex, ivf_lists
from ralm.rundir import find_model, is_model_dir

FORMAT = "ralm.knnlm-store/1"
FLAT_MAX = 1_000_000  # above this many keys the automatic index is IVF-PQ


def model_fingerprint(path: str | os.PathLike) -> str:
    """sha256 of a model directory's config and weights (what a datastore's keys depend on)."""
    path = find_model(path, "model", is_model_dir) or Path(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.suffix in (".json", ".safetensors", ".bin") and "token" not in p.name):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def auto_faiss_spec(count: int, dim: int) -> str:
    if count <= FLAT_MAX:
        return "Flat"
    nlist = ivf_lists(count)
    sub = next(m for m in (64, 32, 16, 8, 4, 2, 1) if dim % m == 0 and dim // m >= 4)
    return f"IVF{nlist},PQ{sub}"


def write_datastore(out: str | os.PathLike, inputs: dict, values: np.ndarray, *, dim: int,
                    keys: Callable[[int, int], np.ndarray], block: int, faiss_spec: str | None = None,
                    model_path: str | os.PathLike = "", show_progress: bool = True) -> Path:
    """Build the datastore `out` from `values` [N] and keys [N, dim] computed `block` rows at a
    time (`keys(start, end)` -> [end - start, dim]). `inputs` (LM and text fingerprints, context)
    sign the build: a rerun with the same inputs resumes after the last finished block, and
    STORE appears only when complete."""
    spec = faiss_spec or auto_faiss_spec(len(values), dim)
    signature = {"format": FORMAT, **inputs, "faiss": spec}
    build = PartialBuild(out, signature)
    build.stage("values.npy", lambda tmp: np.save(tmp, values.astype(np.int32)))
    emb = build.fill("keys.npy", (len(values), dim), np.float16, keys, block=block, show_progress=show_progress,
                     description="datastore keys")
    build.stage("faiss.index", lambda tmp: FaissIndex.build(emb, spec, metric="l2").save(tmp))
    return build.publish({**signature, "count": len(values), "dim": dim, "model_path": str(model_path)})


def read_datastore_manifest(path: str | os.PathLike) -> dict:
    return read_manifest(path, FORMAT, "kNN-LM datastore", build_hint(path, "ralm knnlm build"))


def datastore_summary(path: str | os.PathLike) -> dict:
    """What a build reports of the datastore at `path`."""
    m = read_datastore_manifest(path)
    return {"store": str(path), "entries": m["count"], "dim": m["dim"], "faiss": m["faiss"]}


class Datastore:
    def __init__(self, path: str | os.PathLike, nprobe: int = NPROBE):
        self.path = Path(path)
        self.manifest = read_datastore_manifest(self.path)
        self.keys = read_npy(self.path / "keys.npy")  # [N, D] float16
        self.values = read_npy(self.path / "values.npy")  # [N]
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
