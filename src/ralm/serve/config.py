"""`ralm serve`'s one config: what a server serves (the index, the reader), how it answers
(`query`: the QueryConfig of every /ask and /search, each request naming its own k and side),
where it listens and whom it answers, and how it follows the index. The command's options are
generated from its fields (commands/from_config.py); light, so the CLI imports it at start-up."""

from __future__ import annotations

from dataclasses import InitVar, dataclass

from ralm.configs import ConfigError, option
from ralm.defaults import COMPACT_AFTER, MAX_BODY_MB, SERVE_HOST
from ralm.retrieval.search.query import QueryConfig


@dataclass
class ServeConfig:
    index: str | None = option(None, cli=False)  # the index directory served (the command's --index); new versions swap in live
    model: str | None = option(None, cli=False)  # a fine-tuning run (RUN/final/reader) or a reader, for /ask (the command's --model)
    query: QueryConfig = option(default_factory=QueryConfig, omit=("k", "side"))  # k and side: each request's own
    api_key: str | None = option(None, cli=False)  # protects POST/DELETE /documents (the command's --api-key, RALM_API_KEY)
    host: str = option(SERVE_HOST, "bind address (loopback by default)")  # Host headers naming it are accepted
    port: int = option(8000, "TCP port")
    allowed_hosts: tuple[str, ...] = option((), cli=False)  # more Host header names to accept ("*": any; --allowed-host)
    max_body_mb: int = option(MAX_BODY_MB, "the largest request body in MiB (a PDF sent to POST /documents/file)")
    max_body_bytes: int | None = option(None, cli=False)  # the same in bytes, for a limit under a MiB; None: max_body_mb's
    compact_after: int = option(COMPACT_AFTER, "compact the index's update log into a new version once it holds this many "
                                "updates (0: never; `ralm index compact` does it by hand)")
    poll_seconds: float = option(0.25, cli=False)  # how often the index (LATEST, the update log) is checked
    min_confidence: InitVar[float | None] = None  # the older spelling of query.min_confidence

    def __post_init__(self, min_confidence: float | None):
        self.query = self.query.given(min_confidence=min_confidence)  # checked at start-up, not on the first /ask
        if not 0 < self.port < 65536:
            raise ConfigError("port", f"must be in 1..65535, got {self.port}")
        if self.max_body_mb <= 0:
            raise ConfigError("max_body_mb", f"must be a positive integer, got {self.max_body_mb}")
        if self.compact_after < 0:
            raise ConfigError("compact_after", f"must be 0 (never) or a number of update records, got {self.compact_after}")

    @property
    def body_limit(self) -> int:
        """The largest request body read, in bytes."""
        return self.max_body_mb << 20 if self.max_body_bytes is None else self.max_body_bytes
