"""Old keyword spellings the library still accepts after a rename (docs/cli.md, "Names"): a
caller written before `side` (what a query searches) was split from `retriever` keeps working."""

from __future__ import annotations

import functools
from typing import Callable


def renamed_keywords(**renames: str) -> Callable[[Callable], Callable]:
    """`@renamed_keywords(retriever="side")`: a call passing `retriever=` passes `side=`; both
    at once is refused, as any keyword given twice is."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{fn.__qualname__}() got both {new}= and {old}=, its old name")
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)
        return call
    return wrap
