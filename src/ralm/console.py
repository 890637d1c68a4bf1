"""What `ralm` commands print: the consoles (results on stdout, progress and notes on stderr)
and the tables and lines several commands share."""

from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.table import Table

from ralm.errors import RalmError

# Into a file or a pipe (a log, a CI run) a line stays one line: rich would wrap it at 80 columns,
# splitting a command it suggests. Tables keep their layout.
out = Console(soft_wrap=not sys.stdout.isatty())
err = Console(stderr=True, soft_wrap=not sys.stderr.isatty())


def print_json(obj, ensure_ascii: bool = True) -> None:
    """`obj` as one JSON line on stdout. NaN and inf are not JSON: a result holding one comes
    from damaged weights or embeddings, and is refused rather than printed as a bare `NaN`."""
    try:
        line = json.dumps(obj, ensure_ascii=ensure_ascii, allow_nan=False)
    except ValueError:
        raise RalmError("the result holds a non-finite number (NaN or inf): the index or model is damaged; "
                        "`ralm index check DIR` names a damaged index file") from None
    print(line)


def print_summary(summary: dict, as_json: bool, line: str) -> None:
    """A command's result: `summary` as one JSON line with --json, else `line` for a person."""
    if as_json:
        print_json(summary)
    else:
        out.print(line)


def print_hits(hits, title: str) -> None:
    table = Table(title=title, show_lines=True, expand=True)
    table.add_column("#", width=3)
    table.add_column("score", width=8)
    table.add_column("evidence")
    for rank, h in enumerate(hits, 1):
        text = h.text if len(h.text) <= 400 else h.text[:400] + "…"
        found = f", {' + '.join(h.found_by)}" if h.found_by else ""
        table.add_row(str(rank), f"{h.score:.3f}", f"[bold]{h.title}[/bold] [dim]({h.id}{found})[/dim]\n{text}")
    out.print(table)


def print_perplexity(title: str, rows: list[tuple[str, dict]], as_json: bool, extra: dict) -> None:
    if as_json:
        print_json({**extra, **{name: r for name, r in rows}})
        return
    table = Table(title=title)
    for col in ("model", "wordpiece ppl", "word ppl", "tokens"):
        table.add_column(col)
    for name, r in rows:
        table.add_row(name, f"{r['ppl']:.2f}", f"{r['word_ppl']:.2f}", str(r["tokens"]))
    out.print(table)


def print_train_metrics(record: dict) -> None:
    parts = [f"step {record['step']}"] + [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in record.items() if k != "step" and v is not None]
    err.print("  ".join(parts), highlight=False)


def print_train_summary(result, as_json: bool, done: str) -> None:
    """A trainer's result (train.loop.TrainResult): its fields as JSON, or the line `done`."""
    from dataclasses import asdict

    from ralm.distributed import dist_env

    if dist_env().is_main:  # under torchrun every rank trains; rank 0 reports
        print_summary(asdict(result), as_json, f"[green]done[/green] {result.run}: {done}")


def notify(message: str) -> None:
    err.print(message, highlight=False)


SHOWN = 3  # evidence blocks printed per answer, besides the answer's own; --json lists every block read


def print_answer(answer) -> None:
    from rich.text import Text

    out.print(f"[bold]Q:[/bold] {answer.question}")
    confidence = "uncalibrated" if answer.confidence is None else f"confidence {answer.confidence:.2f}"
    if answer.no_answer:
        best = answer.evidence[answer.best].span_text
        out.print(f"[bold yellow]A: no answer found in the corpus[/bold yellow]  [dim](best guess {best!r}, {confidence})[/dim]")
    else:
        # p(answer): the reader's probability of this answer summed over the blocks read (Answer.score)
        out.print(f"[bold green]A: {answer.answer}[/bold green]  [dim]({confidence}, p(answer) = {answer.score:.3f})[/dim]")
    table = Table(show_lines=True, expand=True)
    for col, width in (("#", 3), ("p(z|x)", 7), ("p(span)", 7), ("evidence", None)):
        table.add_column(col, width=width)
    shown = [j for j in range(len(answer.evidence)) if j < SHOWN or j == answer.best]
    for rank, e in ((j + 1, answer.evidence[j]) for j in shown):
        found = f", found by {' + '.join(e.found_by)}" if len(e.found_by) else ""
        body = Text.assemble((e.title, "bold"), (f" ({e.id}{found})\n", "dim"))
        text = Text(e.text)
        if e.span:
            text.stylize("bold black on yellow" if rank - 1 == answer.best else "underline", *e.span)
        body.append_text(text)
        table.add_row(str(rank), f"{e.retrieval_prob:.3f}", f"{e.span_prob:.3f}", body)
    out.print(table)
    if len(answer.evidence) > len(shown):
        out.print(f"[dim]{len(answer.evidence) - len(shown)} more blocks read (--json lists them all)[/dim]")


def print_reliability(rel: dict) -> None:
    table = Table(title=f"confidence vs exact match (ECE {rel['ece']:.3f})")
    for col in ("confidence bin", "questions", "mean confidence", "share correct"):
        table.add_column(col)
    for b in rel["bins"]:
        table.add_row(f"{b['lo']:.1f}-{b['hi']:.1f}", str(b["count"]), f"{b['confidence']:.3f}", f"{b['accuracy']:.3f}")
    out.print(table)
    for t in rel["at"]:
        acc = "-" if t["accuracy"] is None else f"{100 * t['accuracy']:.1f}% correct"
        out.print(f"confidence >= {t['min_confidence']}: {100 * t['answered']:.1f}% of questions answered, {acc}")
