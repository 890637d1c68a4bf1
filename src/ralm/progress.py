"""Progress bars for long jobs (rich), silenced with `enabled=False` or RALM_NO_PROGRESS=1."""

from __future__ import annotations

import os
import sys
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

T = TypeVar("T")


def progress_enabled(enabled: bool = True) -> bool:
    return enabled and os.environ.get("RALM_NO_PROGRESS", "") in ("", "0")


def progress_bar(enabled: bool = True) -> Progress:
    """A rich Progress writing to stderr, so stdout stays clean for --json output."""
    from rich.console import Console

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(file=sys.stderr),
        disable=not progress_enabled(enabled),
        transient=False,
    )


def track(items: Iterable[T], total: int | None, description: str, enabled: bool = True) -> Iterator[T]:
    """Iterate `items`, advancing a bar by one per item."""
    with progress_bar(enabled) as bar:
        task = bar.add_task(description, total=total)
        for item in items:
            yield item
            bar.advance(task)
