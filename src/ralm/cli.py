"""The `ralm` command line: parse options, call the library, print. Nothing else lives here.

The command groups are in ralm/commands/ (index and search, language models, conversion, the
trainers generated from their configs); the question-answering and serving commands are below.
Input errors (`RalmError`) print one line and exit with code 2, a config field's error under
its flag; warnings about accepted input (`RalmWarning`) print one `warning:` line.
"""

from __future__ import annotations

import functools
import itertools
import os
import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from ralm.atomic import check_output
from ralm.commands.convert import convert_app, export
from ralm.commands.evidence import eval_evidence
from ralm.commands.from_config import config_command, lazy_trainer_group
from ralm.commands.index import eval_retrieval, index_app, search
from ralm.commands.lm import knnlm_app, lm_app, retro_app
from ralm.commands.shared import (DeviceOpt, DtypeOpt, JsonOpt, MoreArgs, OldSpellings, check_models, check_runtime, finite_floats, untyped_help_flag,
                                  flag_option, index_option, index_path, os_error_line, positionals, positive, quiet_libraries,
                                  refuse_second_index, runtime)
from ralm.commands.train import TRAINERS
from ralm.console import err, out, print_answer, print_json, print_reliability
from ralm.configs import ConfigError, option
from ralm.data.qa import check_length, read_question_line
from ralm.defaults import MAX_UNANSWERABLE, QA_BATCH, READ_K
from ralm.errors import RalmError, RalmWarning, plural
from ralm.retrieval.search.query import QueryConfig
from ralm.serve.config import ServeConfig
from ralm.serve.listen import listen

# `ralm --help` lists what a newcomer runs first, then the trainers, then the rest
app = typer.Typer(cls=lazy_trainer_group(TRAINERS, first=("demo", "ask", "search", "index", "eval", "serve")), add_completion=False,
                  no_args_is_help=True, pretty_exceptions_show_locals=False, help="Retrieval-augmented language models on your own corpus.")


def _version(value: bool) -> None:
    if value:
        from ralm import __version__

        print(f"ralm {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = flag_option("--version", callback=_version, is_eager=True, help="print the version and exit")):
    pass  # the app's own options; its help is the Typer's


@dataclass(frozen=True)
class AskConfig:
    """`ralm ask`'s settings: the query config pipeline.OpenQA answers with (READ_K blocks read)."""

    query: QueryConfig = option(default_factory=functools.partial(QueryConfig, k=READ_K))


@dataclass(frozen=True)
class DemoConfig(AskConfig):
    rebuild: bool = option(False, "rebuild the cached demo index", flag="--rebuild")


@dataclass(frozen=True)
class EvalQaConfig(AskConfig):
    batch_size: int = option(QA_BATCH, "questions per reader batch")
    max_unanswerable: float = option(MAX_UNANSWERABLE, "with --calibrate: the threshold is the lowest confidence at which at "
                                                       "most this share of each set's unanswerable questions are answered")
    coverage: float | None = option(None, "with --calibrate, instead: the threshold is the highest at which at least this share "
                                          "of the questions' answerable ones are answered (a reader judged at the coverage of "
                                          "the one it replaces)", shown="none")



eval_app = typer.Typer(no_args_is_help=True, help="Evaluate retrieval and question answering.")
app.add_typer(index_app, name="index")
app.command(cls=OldSpellings)(search)
app.add_typer(eval_app, name="eval")
eval_app.command("retrieval", cls=OldSpellings)(eval_retrieval)
eval_app.command("evidence")(eval_evidence)

@app.command()
@config_command
def demo(
    *,
    cfg: DemoConfig,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = JsonOpt,
):
    """Index the bundled demo corpus (cached) and answer its sample questions with the package's reader, with evidence."""
    check_runtime(device, dtype)
    from ralm.demo import run_demo

    quiet_libraries()
    start = time.perf_counter()
    path, built, results = run_demo(runtime(device, dtype), query=cfg.query, rebuild=cfg.rebuild)
    if as_json:
        print_json([{**a.to_json(), "evidence": [{**e.to_json(), "score": round(e.retrieval_score, 6)} for e in a.evidence]}
                    for _, a in results], ensure_ascii=False)
        return
    err.print(f"{'built' if built else 'reusing cached'} demo index at {path} ({time.perf_counter() - start:.1f} s)")
    for _, answer in results:
        print_answer(answer)


# -- language models: `ralm lm`, `ralm retro`, `ralm knnlm` (commands/lm.py, their trainers too) --

app.add_typer(lm_app, name="lm")
app.add_typer(retro_app, name="retro")
app.add_typer(knnlm_app, name="knnlm")


# -- open-domain QA: `ralm eval qa`, `ralm ask`, `ralm serve` (pipeline.py; the trainers: commands/train.py) --

def _check_qa(index_dir: Path, *, device: str, dtype: str, hybrid: Optional[Path], model: Optional[str] = None) -> None:
    """What `_open_qa` is given, checked before the heavy imports."""
    refuse_second_index("--hybrid", hybrid, index_dir)
    index_path(index_dir)
    check_models(model, hub=False)  # a reader is a local directory (a run or a checkpoint), never a hub name
    check_runtime(device, dtype)


def _open_qa(model: Optional[str], index_dir: Path, *, query: QueryConfig, device: str, dtype: str):
    from ralm.pipeline import OpenQA

    quiet_libraries()
    return OpenQA.open(index_dir, model, query=query, runtime=runtime(device, dtype))


# an index holds its dense and BM25 sides together now; the old second-index options explain that
HybridOpt = typer.Option(None, "--hybrid", hidden=True)
ModelOpt = typer.Option(None, "--model", help="fine-tuning RUN or reader checkpoint (default: the package's general reader)")


@eval_app.command("qa", cls=OldSpellings)
@config_command
def eval_qa(
    more: list[str] = MoreArgs,  # `ralm eval qa DIR`: named as a mistake, with the spelling meant
    *,
    model: Optional[str] = ModelOpt,
    index_dir: Optional[Path] = index_option("index directory (every side it holds is searched, fused)"),
    questions: Optional[Path] = typer.Option(None, "--questions", help="JSONL {id, question, answers} (required)", show_default=False),
    cfg: EvalQaConfig,
    hybrid: Optional[Path] = HybridOpt,
    limit: Optional[int] = typer.Option(None, "--limit", help="first N questions only"),
    predictions: Optional[Path] = typer.Option(None, "--predictions", help="per-question JSONL (default: ./<questions>-<index>.predictions.jsonl)"),
    calibrate: bool = flag_option("--calibrate", help="fit the confidence map for the kind searched on these held-back "
                                   "questions (answerable ones and ones the corpus cannot answer); needs --out"),
    calibrated_out: Optional[Path] = typer.Option(None, "--out", help="with --calibrate: where to write the calibrated copy of the "
                                                  "reader (the reader given is never modified)"),
    also: list[str] = typer.Option([], "--also", metavar="INDEX=QUESTIONS", help="with --calibrate: more held-back questions over "
                                   "their own index, pooled into the fit (repeatable; e.g. generated corpora of several sizes); "
                                   "questions marked \"unanswerable\": true choose the threshold"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = JsonOpt,
):
    """EM / F1 (SQuAD normalisation, max over gold answers) and recall@1/5/20 of open-domain QA."""
    from ralm.data.qa import read_questions
    from ralm.eval.calibration import check_question_count

    given = positionals("eval qa", more, options={"--index": index_dir, "--questions": questions})
    index_dir, questions = Path(given["--index"]), Path(given["--questions"])
    batch_size = cfg.batch_size
    if calibrate and calibrated_out is None:
        raise RalmError("--calibrate writes a calibrated copy of the reader: give it a new directory with --out")
    if calibrated_out is not None and not calibrate:
        raise RalmError("--out is where --calibrate writes the calibrated reader; add --calibrate or drop --out")
    if calibrated_out is not None and calibrated_out.exists() and (not calibrated_out.is_dir() or any(calibrated_out.iterdir())):
        raise RalmError(f"--out {calibrated_out} exists and is not an empty directory")
    if also and not calibrate:
        raise RalmError("--also adds calibration sets: add --calibrate or drop --also")
    inputs = [("--questions", questions), ("--index", index_dir), ("--model", model),
              *(("--also", path) for spec in also for path in spec.split("=", 1))]
    for flag, output in (("--predictions", predictions), ("--out", calibrated_out)):
        if output is not None:
            check_output(flag, output, inputs)
    if not 0 <= cfg.max_unanswerable <= 1:
        raise RalmError(f"--max-unanswerable must be in [0, 1], got {cfg.max_unanswerable}")
    if cfg.coverage is not None and not (calibrate and 0 < cfg.coverage <= 1):
        raise RalmError(f"--coverage must be in (0, 1], got {cfg.coverage}" if calibrate else "--coverage chooses the threshold "
                        "of --calibrate: add --calibrate or drop --coverage")
    extra_sets = []
    for spec in also:
        where, sep, qfile = spec.partition("=")
        if not sep or not where or not qfile:
            raise RalmError(f"--also takes INDEX=QUESTIONS, got {spec!r}")
        _check_qa(Path(where), device=device, dtype=dtype, hybrid=None)
        extra_sets.append((Path(where), read_questions(qfile)))
    qs = read_questions(questions)
    if limit is not None:
        qs = qs[: positive("--limit", limit)]
    if calibrate:
        check_question_count(len(qs) + sum(len(set_qs) for _, set_qs in extra_sets))  # every set's questions are fitted on
    positive("--batch-size", batch_size)
    _check_qa(index_dir, device=device, dtype=dtype, hybrid=hybrid, model=model)
    from ralm.eval.openqa import default_predictions_path, evaluate_qa
    from ralm.models.reader import save_calibrated
    from ralm.pipeline import resolve_reader

    qa = _open_qa(model, index_dir, query=cfg.query, device=device, dtype=dtype)
    if predictions is None:
        predictions = default_predictions_path(questions, index_dir, qa.kind)
        check_output("--predictions", predictions, inputs)  # the current folder may be an index's
    from ralm.eval.openqa import CalibrationSet
    from ralm.pipeline import OpenQA, open_searcher

    sets = [CalibrationSet(str(where), OpenQA(qa.reader, open_searcher(where, model, query=qa.query, runtime=qa.runtime),
                                              runtime=qa.runtime), set_qs)
            for where, set_qs in extra_sets]
    result = evaluate_qa(qa, qs, ks=(1, 5, 20), batch_size=batch_size, predictions=predictions,
                         calibrate=calibrate, also=sets, max_unanswerable=cfg.max_unanswerable,
                         coverage=cfg.coverage)
    result = {**result, "index": str(index_dir), "predictions": str(predictions)}
    if calibrate:
        save_calibrated(resolve_reader(model), calibrated_out, qa.calibrations.to_json())
        result["calibration"] = str(calibrated_out)
    if as_json:
        print_json(result)
        return
    table = Table(title=f"open-domain QA on {questions.name} ({result['questions']} questions, top-{qa.k} read)")
    for key in ("em", "f1", "recall@1", "recall@5", "recall@20"):
        table.add_column(key.upper() if len(key) == 2 else key)
    table.add_row(*(f"{result[key]:.1f}" for key in ("em", "f1", "recall@1", "recall@5", "recall@20")))
    out.print(table)
    if "reliability" in result:
        print_reliability(result["reliability"])
    if result.get("threshold") is not None:
        em = "-" if result["answered_em"] is None else f"{result['answered_em']:.1f}% EM"
        out.print(f"at the threshold in use, confidence >= {result['threshold']}: {result['answered']:.1f}% of questions "
                  f"answered, {em}")
    if calibrate:
        fitted = sum(v["questions"] for v in result["calibration_fit"]["sets"].values())
        out.print(f"{qa.kind} calibration fitted on {fitted} questions (threshold {result['threshold']}); calibrated reader "
                  f"written to {result['calibration']}")
    out.print(f"{result['seconds']} s; predictions in {predictions}")


@app.command(cls=OldSpellings)
@config_command
def ask(
    question: Optional[str] = typer.Argument(None, help="the question; without it, questions are read from stdin, one a line, "
                                                        "and answered as they come with the models loaded once"),
    more: list[str] = MoreArgs,  # `ralm ask DIR QUESTION`: named as a mistake, with the spelling meant
    *,
    model: Optional[str] = ModelOpt,
    index_dir: Optional[Path] = index_option("index directory (every side it holds is searched, fused)"),
    cfg: AskConfig,
    hybrid: Optional[Path] = HybridOpt,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = flag_option("--json", help="print {question, answer, no_answer, score, confidence, evidence: [{id, title, "
                                                       "text, retrieval_score, span}]} (one line per question when read from stdin)"),
):
    """Answer a question with evidence: the most probable answer over the top-k blocks."""
    given = positionals("ask", [question, *more], options={"--index": index_dir}, takes=("QUESTION",))
    index_dir, question = Path(given["--index"]), given["QUESTION"]
    if question is not None:
        if not question.strip():
            raise RalmError("the question is empty")
        check_length(question, "the question")
    _check_qa(index_dir, device=device, dtype=dtype, hybrid=hybrid, model=model)
    questions = [question] if question is not None else _stdin_questions()
    if question is None and not sys.stdin.isatty():  # piped: the first line is read, and a bad one named, before the models load
        first = next(questions, None)
        if first is None:
            return
        questions = itertools.chain([first], questions)
    qa = _open_qa(model, index_dir, query=cfg.query, device=device, dtype=dtype)
    for q in questions:
        answer = qa.answer([q])[0]
        if as_json:
            print_json(answer.to_json(), ensure_ascii=False)
        else:
            print_answer(answer)


def _stdin_questions():
    """Non-empty lines of stdin; on a terminal, a prompt before each. A line that is not UTF-8 or
    holds more than MAX_QUESTION_CHARS characters stops with one line naming it (stdin:N); each
    line is read a bounded number of bytes at a time (data/qa.py), never an endless one whole."""
    prompt = sys.stdin.isatty()
    if prompt:
        err.print("ready: one question a line, Ctrl-D to end")
    for lineno in itertools.count(1):
        if prompt:
            err.print("[bold]?[/bold] ", end="")
        line = read_question_line(sys.stdin.buffer, "stdin", lineno)
        if line is None:
            return
        if line.strip():
            yield line.strip()


@app.command(cls=OldSpellings)
@config_command
def serve(
    more: list[str] = MoreArgs,  # `ralm serve DIR`: named as a mistake, with the spelling meant
    *,
    index_dir: Optional[Path] = index_option("index directory; new versions are swapped in live"),
    model: Optional[str] = ModelOpt,
    bm25: Optional[Path] = typer.Option(None, "--bm25", hidden=True),
    cfg: ServeConfig,
    allowed_host: list[str] = typer.Option([], "--allowed-host", metavar="NAME", help="a host name clients use for this server, beside "
                                           "localhost and the --host address (repeatable; '*' accepts any Host header)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="RALM_API_KEY", help="protect POST/DELETE /documents"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
):
    """Serve /ask, /search, /documents, /health, /stats and a web page (FastAPI + uvicorn)."""
    index_dir = Path(positionals("serve", more, options={"--index": index_dir})["--index"])
    refuse_second_index("--bm25", bm25, index_dir)
    host, port = cfg.host, cfg.port
    index_path(index_dir)
    check_models(model, hub=False)
    check_runtime(device, dtype)
    sock = listen(host, port)  # bound before the models load: a busy port is named in about a second
    from ralm.pipeline import resolve_reader
    from ralm.serve.app import serve_forever
    from ralm.serve.service import Service

    quiet_libraries()
    svc = Service(replace(cfg, index=str(index_dir), model=model or str(resolve_reader(None)), api_key=api_key,
                          allowed_hosts=tuple(allowed_host)), runtime(device, dtype))
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    serve_forever(svc, host, port, sock=sock, announce=lambda: err.print(
        f"serving on {url} ({index_dir}: {plural(svc.stats()['corpus_blocks'], 'block')}; "
        f"kinds: {', '.join(svc.kinds())}; reader: {svc.cfg.model})", highlight=False))


app.add_typer(convert_app, name="convert")
app.command()(export)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    if issubclass(category, RalmWarning):  # a message for the user, not a code location
        err.print(f"[yellow]warning:[/yellow] {message}", highlight=False, soft_wrap=True)
    else:
        (file or sys.stderr).write(warnings.formatwarning(message, category, filename, lineno, line))


def _fail(message: str, code: int) -> None:
    err.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    sys.exit(code)


def main() -> None:
    """The one error boundary: bad input (RalmError) and the filesystem (OSError) are one line
    and exit code 2; anything else is a bug, one line and exit code 1. RALM_DEBUG=1 shows
    the traceback of every error instead."""
    command = untyped_help_flag(finite_floats(typer.main.get_command(app)))
    debug = os.environ.get("RALM_DEBUG", "") not in ("", "0")
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            command(prog_name="ralm")
        except Exception as e:
            if debug:
                raise
            if isinstance(e, ConfigError):  # a config field's error under its flag (the trainers map their own spellings)
                _fail(escape(f"--{e.field.replace('_', '-')} {e.problem}"), 2)
            if isinstance(e, RalmError):
                _fail(escape(str(e)), 2)
            if isinstance(e, OSError):
                _fail(escape(os_error_line(e)), 2)
            _fail(escape(f"internal error ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); this is a bug in "
                         "ralm: RALM_DEBUG=1 shows the traceback"), 1)

