"""Progress bars for long jobs (rich), silenced with `enabled=False` or RALM_NO_PROGRESS=1.

When stderr is not a terminal (a job's log file), rich would print a bar only when it ends, so
a plain line per task is written every RALM_PROGRESS_INTERVAL seconds (default 60) instead."""

from __future__ import annotations

import os
import sys
import time
from typing import Iterable, Iterator, TypeVar

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from ralm.errors import RalmError

T = TypeVar("T")


def progress_enabled(enabled: bool = True) -> bool:
    return enabled and os.environ.get("RALM_NO_PROGRESS", "") in ("", "0")


def library_bars_enabled(enabled: bool = True) -> bool:
    """Whether a library's own (tqdm) bars may draw: only on a terminal, since in a log file
    they are carriage-return frames, one line of hundreds of updates."""
    return progress_enabled(enabled) and sys.stderr.isatty()


class LogProgress(Progress):
    """A Progress for a non-terminal console: every `interval` seconds of advances or updates,
    the tasks' lines (the same columns as the bar) are printed once."""

    def __init__(self, *columns, interval: float, **kwargs):
        super().__init__(*columns, **kwargs)
        self.interval = interval
        self._last_line = time.monotonic()

    def _log_lines(self) -> None:
        now = time.monotonic()
        if self.disable or now - self._last_line < self.interval:
            return
        self._last_line = now
        self.console.print(self.make_tasks_table([t for t in self.tasks if t.visible and not t.finished]))

    def advance(self, task_id, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._log_lines()

    def update(self, task_id, **kwargs) -> None:
        super().update(task_id, **kwargs)
        self._log_lines()


def progress_bar(enabled: bool = True) -> Progress:
    """A rich Progress writing to stderr, so stdout stays clean for --json output."""
    from rich.console import Console

    console = Console(file=sys.stderr)
    # fresh columns per bar: rich columns cache their rendering by task id
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TaskProgressColumn(),
               TimeElapsedColumn(), TimeRemainingColumn())
    options = dict(console=console, disable=not progress_enabled(enabled), transient=False)
    if console.is_terminal:
        return Progress(*columns, **options)
    # Jobs that advance in large blocks (a shard of embeddings every few minutes) would get no
    # speed, hence no time remaining, from rich's default 30 s window.
    return LogProgress(*columns, interval=_interval(), speed_estimate_period=3600.0, **options)


def _interval() -> float:
    value = os.environ.get("RALM_PROGRESS_INTERVAL", "60")
    try:
        return float(value)
    except ValueError:
        raise RalmError(f"RALM_PROGRESS_INTERVAL must be a number of seconds, got {value!r}") from None


def track(items: Iterable[T], total: int | None, description: str, enabled: bool = True) -> Iterator[T]:
    """Iterate `items`, advancing a bar by one per item."""
    with progress_bar(enabled) as bar:
        task = bar.add_task(description, total=total)
        for item in items:
            yield item
            bar.advance(task)
