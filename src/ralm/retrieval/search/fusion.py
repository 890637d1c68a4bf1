"""Fusing the sides of an index (dense and BM25) into one ranking.

For a query, the union of each side's top `depth` rows are the candidates. Each side scores
every candidate: exactly where it can (dense: query · the stored embedding), else a row outside
its list gets the list's lowest score (an upper bound: BM25). Two fusions (FUSIONS):

  weighted  each side's scores min-max normalised over the candidates, mixed with the sides'
            weights (defaults.FUSION_WEIGHTS: dense 0.7, BM25 0.3) normalised over the sides
            fused, times the same mix of the sides' score ranges, which puts fused scores back
            on the retrievers' own scale (it matters for p(z|x));
  rrf       reciprocal rank fusion (Cormack et al., 2009): sum over sides of 1 / (c + rank),
            a row outside a side's list adding nothing, times RRF_SCALE so that p(z|x), the
            softmax of the scores, is not uniform.

Which one is the default (defaults.FUSION) was chosen on held-back questions
(benchmarks/RESULTS.md, "Hybrid retrieval and selective answering").
Shapes: Q queries, C candidates of one query, k results.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from ralm.defaults import FUSION, FUSION_DEPTH, FUSION_WEIGHTS, RRF_C
from ralm.errors import RalmError

RRF_SCALE = 1000.0  # adjacent ranks near the top then differ by ~0.25 nats, as dense neighbours do


@dataclass(frozen=True)
class Ranked:
    """Search results with what selective answering and the evidence list need to know."""
    scores: np.ndarray  # [Q, k] fused scores (one side: its own), best first
    rows: np.ndarray  # [Q, k] block rows of the version searched
    found_by: list[list[tuple[str, ...]]]  # [Q][k]: the sides whose own top list held the block
    top: dict[str, np.ndarray] = field(default_factory=dict)  # side -> [Q] its best score
    agreement: np.ndarray | None = None  # [Q] mean over pairs of sides: the share of one's top k in the other's


@dataclass(frozen=True)
class Fusion:
    """How a searcher fuses its sides (the defaults live in ralm/defaults.py)."""
    method: str = FUSION  # a key of FUSIONS
    alpha: float | None = None  # set: dense weighs alpha and BM25 1 - alpha, whatever `weights` says of them
    depth: int = FUSION_DEPTH  # each side's list that candidates are drawn from
    weights: Mapping[str, float] = field(default_factory=lambda: dict(FUSION_WEIGHTS))  # side -> weight in weighted fusion

    def __post_init__(self):
        if self.method not in FUSIONS:
            raise RalmError(f"unknown fusion {self.method!r}; choose one of {', '.join(FUSIONS)}")
        if self.alpha is not None and not 0.0 <= self.alpha <= 1.0:
            raise RalmError(f"hybrid weight alpha must be in [0, 1], got {self.alpha}")
        for side, w in self.weights.items():
            if not (math.isfinite(w) and w >= 0):
                raise RalmError(f"the fusion weight of side {side!r} must be a finite number >= 0, got {w}")
        if self.depth <= 0:
            raise RalmError(f"fusion depth must be positive, got {self.depth}")

    def side_weights(self, sides: tuple[str, ...]) -> dict[str, float]:
        """Each of `sides`' weight in weighted fusion, normalised to sum to 1 over them (see
        defaults.FUSION_WEIGHTS); dense + BM25 keep alpha and 1 - alpha exactly (their sum is 1.0)."""
        named = {**self.weights, **({"dense": self.alpha, "bm25": 1 - self.alpha} if self.alpha is not None else {})}
        raw = {s: named.get(s, 1 / len(sides)) for s in sides}
        total = sum(raw.values())
        if total <= 0:
            raise RalmError(f"the fusion weights of the sides {', '.join(sides)} are all 0")
        return {s: w / total for s, w in raw.items()}


def minmax(x: np.ndarray) -> np.ndarray:
    """Scale a score vector to [0, 1] (all zeros when it is constant)."""
    span = x.max() - x.min()
    return (x - x.min()) / span if span > 0 else np.zeros_like(x)


def fuse_weighted(scores: dict[str, np.ndarray], ranks: dict[str, np.ndarray], weights: Mapping[str, float]) -> np.ndarray:
    """[C] scores per side -> [C] fused: a convex combination (`weights`: Fusion.side_weights)
    of min-max normalised scores, scaled back to the same mix of the sides' score ranges (on
    [0, 1], p(z|x) would be near uniform over the top k and the reader would ignore how far
    apart the retrievers put them)."""
    span = sum(weights[s] * np.ptp(x) for s, x in scores.items())
    return sum(weights[s] * minmax(x) for s, x in scores.items()) * span


def fuse_rrf(scores: dict[str, np.ndarray], ranks: dict[str, np.ndarray], weights: Mapping[str, float]) -> np.ndarray:
    """[C] ranks per side (0-based; -1: outside its list) -> [C] reciprocal rank fusion."""
    return RRF_SCALE * sum(np.where(r >= 0, 1.0 / (RRF_C + 1 + r), 0.0) for r in ranks.values()).astype(np.float32)


FUSIONS: dict[str, Callable] = {"weighted": fuse_weighted, "rrf": fuse_rrf}


def rank(searcher, queries: list[str], *, k: int, snap, sides: tuple[str, ...], fusion: Fusion = Fusion()) -> Ranked:
    """The top k of each query over `sides` of `searcher`'s `snap` (see the module docstring).
    `searcher` provides encode / side_search / side_scores / is_result (search/searcher.py)."""
    encoded = {s: searcher.encode(queries, s) for s in sides}
    if len(sides) == 1:
        (side,) = sides
        scores, rows = _finite(searcher, side, searcher.side_search(encoded[side], k, snap, side))
        real = searcher.is_result(scores, snap, side)
        found = [[(side,) if r else () for r in row] for row in real]
        return Ranked(scores, rows, found, {side: scores[:, 0] if scores.shape[1] else np.zeros(len(queries))},
                      np.ones(len(queries)))
    lists = {s: _finite(searcher, s, searcher.side_search(encoded[s], max(k, fusion.depth), snap, s)) for s in sides}  # side -> ([Q, d], [Q, d])
    weights = fusion.side_weights(sides)
    out_scores, out_rows, out_found, agreement = [], [], [], []
    for i in range(len(queries)):
        c = candidates(searcher, encoded, lists, i=i, snap=snap)
        fused = FUSIONS[fusion.method](c.scores, c.ranks, weights)
        top = np.argsort(-fused, kind="stable")[:k]
        out_scores.append(fused[top])
        out_rows.append(c.rows[top])
        out_found.append([tuple(s for s in sides if c.ranks[s][j] >= 0) for j in top])
        tops = [set(c.listed[s][:k].tolist()) for s in sides]
        agreement.append(float(np.mean([len(a & b) / max(min(len(a), len(b)), 1) for a, b in itertools.combinations(tops, 2)])))
    n = min([k] + [len(r) for r in out_rows])
    top_of = {s: np.array([lists[s][0][i][0] if lists[s][0].shape[1] else 0.0 for i in range(len(queries))]) for s in sides}
    return Ranked(np.array([s[:n] for s in out_scores], dtype=np.float32).reshape(len(queries), n),
                  np.array([r[:n] for r in out_rows], dtype=np.int64).reshape(len(queries), n),
                  [f[:n] for f in out_found], top_of, np.array(agreement))


def _finite(searcher, side: str, found: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """A side's (scores, rows), refused when a score is NaN or +inf: damaged embeddings or
    weights, never a ranking (-inf marks a hidden row)."""
    scores = found[0]
    if np.isnan(scores).any() or np.isposinf(scores).any():
        root = searcher.index.root
        raise RalmError(f"{root}: the {side} side scored a block NaN or inf: the index or the model is damaged; "
                        f"`ralm index check {root}` names a damaged index file")
    return found


@dataclass(frozen=True)
class Candidates:
    """One query's fusion candidates: the union of every side's real results [C]."""
    rows: np.ndarray  # [C] block rows, ascending
    scores: dict  # side -> [C] its score of each candidate (exact, or its list's floor)
    ranks: dict  # side -> [C] the candidate's rank in that side's list (-1: not in it)
    listed: dict  # side -> that side's real results, best first


def candidates(searcher, encoded: dict, lists: dict, *, i: int, snap) -> Candidates:
    """Query i's candidates, from each side's list (`lists`: side -> (scores [Q, d], rows [Q, d]))."""
    listed, scored = {}, {}
    for s, (sc, rows) in lists.items():
        real = searcher.is_result(sc[i], snap, s)
        listed[s], scored[s] = rows[i][real], sc[i][real]
    cand = np.unique(np.concatenate(list(listed.values())))  # [C]
    scores, ranks = {}, {}
    for s in lists:
        pos = {int(r): j for j, r in enumerate(listed[s])}
        ranks[s] = np.array([pos.get(int(r), -1) for r in cand], dtype=np.int64)  # [C]
        exact = searcher.side_scores(encoded[s], i, cand, snap=snap, side=s)
        full = lists[s][0][i]  # with a short list's fillers, whose score is what a row outside it scores
        floor = float(full.min()) if len(full) else 0.0
        listed_scores = scored[s][np.maximum(ranks[s], 0)] if len(scored[s]) else np.zeros(len(cand), np.float32)
        scores[s] = exact if exact is not None else np.where(ranks[s] >= 0, listed_scores, floor).astype(np.float32)
    return Candidates(cand, scores, ranks, listed)
