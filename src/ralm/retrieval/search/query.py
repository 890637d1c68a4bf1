"""What a query asks of an index: how many blocks, which side(s), how they are fused, and the
confidence below which an answer is withheld. One `QueryConfig` is what `ralm search`, `ask`,
`eval qa` and `serve` generate their query options from (commands/from_config.py) and what a
`Searcher`, an `OpenQA` and the server hold, passed whole: a new query option is one field here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ralm.configs import ConfigError, option
from ralm.defaults import MIN_CONFIDENCE
from ralm.retrieval.search.fusion import Fusion


@dataclass(frozen=True)
class QueryConfig:
    k: int | None = option(None, "blocks retrieved per query: the passages `search` returns, the blocks `ask` and "
                           "`eval qa` read per question", flag="-k", aliases=("--k",))  # None: the caller's (defaults.SEARCH_K, READ_K)
    side: str | None = option(None, "search one side of the index: dense or bm25 (default: every side it holds, fused: "
                              "hybrid)", flag="--side", old=("--retriever",))
    min_confidence: float | None = option(
        None, "below this calibrated confidence the answer is 'no answer found in the corpus' (default: the threshold the "
              f"side's confidence map was fitted with, else {MIN_CONFIDENCE}; 0 always answers; an uncalibrated reader "
              "always answers)", bounds=(0.0, 1.0))
    fusion: Fusion = option(default_factory=Fusion, cli=False)  # how the sides' lists are fused (search/fusion.py)

    def __post_init__(self):
        if self.k is not None and self.k <= 0:
            raise ConfigError("k", f"must be a positive integer, got {self.k}")
        if self.min_confidence is not None and not 0 <= self.min_confidence <= 1:
            raise ConfigError("min_confidence", f"must be in [0, 1], got {self.min_confidence}")

    def given(self, **values) -> "QueryConfig":
        """This config with the fields `values` name that are not None: a call's own k= or side=
        (and the older keyword spellings of the Python API: `OpenQA.open(index, k=5, side="dense")`)."""
        values = {name: v for name, v in values.items() if v is not None}
        return replace(self, **values) if values else self
