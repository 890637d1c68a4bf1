"""The `ralm` command line: parse options, call the library, print. Nothing else lives here.

Input errors (`RalmError`) print one line and exit with code 2; warnings about accepted input
(`RalmWarning`) print one `warning:` line.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from ralm.errors import RalmError, RalmWarning
from ralm.eval.calibration import MIN_CONFIDENCE

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
                  help="Retrieval-augmented language models on your own corpus.")
index_app = typer.Typer(no_args_is_help=True, help="Build indexes over a corpus.")
eval_app = typer.Typer(no_args_is_help=True, help="Evaluate retrieval and question answering.")
app.add_typer(index_app, name="index")
app.add_typer(eval_app, name="eval")

out = Console()
err = Console(stderr=True)


def _device(name: str):
    from ralm.runtime import resolve_device

    return resolve_device(name)


def _runtime(device: str, dtype: str):
    """(torch device, compute dtype) from --device and --dtype; `--dtype bf16` on a CPU
    without native bf16 is an input error here, before any model loads."""
    from ralm.runtime import resolve_dtype

    dev = _device(device)
    return dev, resolve_dtype(dtype, dev)


def _quiet_libraries() -> None:
    """Library progress bars (transformers' weight loading, bm25s) would drown ours."""
    import transformers

    transformers.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()


def _print_hits(hits, title: str) -> None:
    table = Table(title=title, show_lines=True, expand=True)
    table.add_column("#", width=3)
    table.add_column("score", width=8)
    table.add_column("evidence")
    for rank, h in enumerate(hits, 1):
        text = h.text if len(h.text) <= 400 else h.text[:400] + "…"
        table.add_row(str(rank), f"{h.score:.3f}", f"[bold]{h.title}[/bold] [dim]({h.id})[/dim]\n{text}")
    out.print(table)


def _main_rank() -> bool:
    """False on the ranks other than 0 under torchrun: they compute, rank 0 prints."""
    from ralm.distributed import dist_env

    return dist_env().is_main


def _positive(name: str, value: int) -> int:
    if value <= 0:
        raise RalmError(f"{name} must be a positive integer, got {value}")
    return value


DeviceOpt = typer.Option("auto", "--device", help="auto (CUDA when present), cpu, cuda, cuda:1 ...")
DtypeOpt = typer.Option("auto", "--dtype", help="compute dtype: auto (bf16 on CUDA and on CPUs with native bf16, "
                        "else fp32), fp32 or bf16; weights and checkpoints stay fp32")
MinConfidenceOpt = typer.Option(MIN_CONFIDENCE, "--min-confidence",
                                help="below this calibrated confidence the answer is 'no answer found in the corpus' "
                                     "(0 always answers; an uncalibrated reader always answers)")


@index_app.command("build")
def index_build(
    corpus: Path = typer.Argument(..., help="JSONL {id,title,text}, TSV with a header, or a folder of .txt files"),
    out_dir: Path = typer.Option(..., "--out", help="index directory (created, or given a new version)"),
    model: Optional[str] = typer.Option(None, "--model", help="retriever checkpoint, HF model directory or hub name (default: bundled MiniLM)"),
    retriever: str = typer.Option("dense", "--retriever", help="dense or bm25"),
    faiss: Optional[str] = typer.Option(None, "--faiss", help="also build a faiss index: Flat, IVF1024,Flat, HNSW32 ..."),
    dim: int = typer.Option(0, "--dim", help="0: the encoder's own vectors, no projection (keeps its recall); "
                            "N: a fresh PCA-initialised projection to N (REALM's 128)"),
    batch_size: int = typer.Option(64, "--batch-size"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = typer.Option(False, "--json"),
):
    """Split a corpus into REALM blocks and index them (dense embeddings or BM25)."""
    from ralm.retrieval.build import build_index

    _quiet_libraries()
    start = time.perf_counter()
    main_rank = _main_rank()  # under torchrun every rank encodes; rank 0 reports
    dev, dt = _runtime(device, dtype)
    index, version = build_index(corpus, out_dir, kind=retriever, model=model, dim=dim or None, faiss_spec=faiss,
                                 batch_size=_positive("--batch-size", batch_size), device=dev,
                                 show_progress=main_rank, dtype=dt)
    if not main_rank:
        return
    manifest = index.version_manifest(version)
    summary = {"index": str(out_dir), "version": version, "retriever": retriever, "blocks": manifest["count"],
               "dim": manifest.get("dim"), "faiss": manifest.get("faiss"), "dtype": manifest.get("dtype"),
               "seconds": round(time.perf_counter() - start, 1)}
    if as_json:
        print(json.dumps(summary))
    else:
        out.print(f"[green]built[/green] {out_dir} {version}: {summary['blocks']} blocks, {retriever}"
                  f"{', dim ' + str(summary['dim']) if summary['dim'] else ''} in {summary['seconds']} s")


@app.command()
def search(
    index_dir: Path = typer.Argument(..., help="index directory from `ralm index build`"),
    query: str = typer.Argument(...),
    k: int = typer.Option(5, "-k", "--k", help="number of passages"),
    model: Optional[str] = typer.Option(None, "--model", help="retriever checkpoint (default: the one the index was built with)"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = typer.Option(False, "--json", help="print [{id, title, score, text}]"),
):
    """Search an index with a free-text query."""
    from ralm.retrieval.searcher import Searcher

    _quiet_libraries()
    _positive("-k", k)
    if not query.strip():
        raise RalmError("the query is empty")
    dev, dt = _runtime(device, dtype)
    hits = Searcher.open(index_dir, model=model, device=dev, dtype=dt).search([query], k)[0]
    if not _main_rank():
        return
    if as_json:
        print(json.dumps([h.to_json() for h in hits], ensure_ascii=False))
    else:
        _print_hits(hits, query)


@eval_app.command("retrieval")
def eval_retrieval(
    index_dir: Path = typer.Option(..., "--index"),
    questions: Path = typer.Option(..., "--questions", help="JSONL {id, question, answers}"),
    ks: str = typer.Option("1,5,20,100", "--ks", help="comma-separated cut-offs"),
    limit: Optional[int] = typer.Option(None, "--limit", help="first N questions only"),
    predictions: Optional[Path] = typer.Option(None, "--predictions", help="write per-question results (JSONL)"),
    model: Optional[str] = typer.Option(None, "--model"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = typer.Option(False, "--json"),
):
    """recall@k: a question counts when a top-k passage contains a normalised answer."""
    from ralm.data.qa import read_questions
    from ralm.eval.retrieval import evaluate_retrieval
    from ralm.retrieval.searcher import Searcher

    _quiet_libraries()
    try:
        cutoffs = sorted({_positive("--ks", int(x)) for x in ks.split(",") if x.strip()})
    except ValueError:
        raise RalmError(f"--ks must be comma-separated integers, got {ks!r}") from None
    if not cutoffs:
        raise RalmError("--ks names no cut-off")
    qs = read_questions(questions)
    if limit is not None:
        qs = qs[: _positive("--limit", limit)]
    dev, dt = _runtime(device, dtype)
    searcher = Searcher.open(index_dir, model=model, device=dev, dtype=dt)
    main_rank = _main_rank()
    result = evaluate_retrieval(searcher, qs, cutoffs, predictions=predictions if main_rank else None, show_progress=main_rank)
    if not main_rank:
        return
    if as_json:
        print(json.dumps(result))
    else:
        table = Table(title=f"retrieval on {questions.name} ({result['questions']} questions, {result['retriever']})")
        for key in (f"recall@{c}" for c in cutoffs):
            table.add_column(key)
        table.add_row(*(f"{result[f'recall@{c}']:.1f}" for c in cutoffs))
        out.print(table)
        out.print(f"{result['seconds']} s")


@app.command()
def demo(
    k: int = typer.Option(5, "-k", help="passages read per question (5, as `ralm ask`)"),
    rebuild: bool = typer.Option(False, "--rebuild", help="rebuild the cached demo index"),
    min_confidence: float = MinConfidenceOpt,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = typer.Option(False, "--json"),
):
    """Index the bundled demo corpus (cached) and answer its sample questions with the package's reader, with evidence."""
    from ralm.demo import run_demo

    _quiet_libraries()
    start = time.perf_counter()
    path, built, results = run_demo(*_runtime(device, dtype), _positive("-k", k), rebuild, min_confidence=min_confidence)
    if as_json:
        print(json.dumps([{"question": q.question, **a.to_json(), "evidence": [{**e.to_json(), "score": round(e.retrieval_score, 6)}
                                                                             for e in a.evidence]} for q, a in results], ensure_ascii=False))
        return
    err.print(f"{'built' if built else 'reusing cached'} demo index at {path} ({time.perf_counter() - start:.1f} s)")
    for _, answer in results:
        _print_answer(answer)


def _print_train_metrics(record: dict) -> None:
    parts = [f"step {record['step']}"] + [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in record.items() if k != "step" and v is not None]
    err.print("  ".join(parts), highlight=False)


def _print_train_summary(summary: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary))
    else:
        out.print(f"[green]done[/green] {summary['run']}: {summary['steps']} steps; exported {summary['retriever']}"
                  + (f" and {summary['encoder']}" if "encoder" in summary else ""))


@app.command()
def ict(
    corpus: Path = typer.Option(..., "--corpus", help="JSONL {id,title,text}, TSV with a header, or a folder of .txt files"),
    run: Path = typer.Option(..., "--out", help="run directory (created, or resumed from its last checkpoint)"),
    model: str = typer.Option("default", "--model", help="retriever checkpoint or HF BERT directory (default: bundled MiniLM)"),
    dim: int = typer.Option(128, "--dim", help="retrieval dimension of a fresh projection"),
    steps: int = typer.Option(1000, "--steps"),
    batch_size: int = typer.Option(32, "--batch-size", help="queries per step and rank; the other blocks of all ranks' batches are the negatives"),
    lr: float = typer.Option(1e-4, "--lr"),
    warmup: int = typer.Option(100, "--warmup", help="linear learning-rate warm-up steps"),
    keep_sentence: float = typer.Option(0.1, "--keep-sentence", help="share of positives that keep the pseudo-query sentence"),
    block_len: int = typer.Option(288, "--block-len", help="wordpieces per evidence block"),
    save_every: int = typer.Option(200, "--save-every", help="checkpoint (and export) interval in steps"),
    log_every: int = typer.Option(10, "--log-every"),
    seed: int = typer.Option(0, "--seed"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = typer.Option(False, "--json", help="print a JSON summary at the end"),
):
    """Warm-start both retriever towers with the Inverse Cloze Task (exports RUN/final/retriever)."""
    from ralm.train.ict import IctConfig, train_ict

    _quiet_libraries()
    cfg = IctConfig(str(corpus), model=model, dim=dim, steps=steps, batch_size=batch_size, lr=lr, warmup=warmup,
                    keep_sentence=keep_sentence, block_len=block_len, save_every=save_every, log_every=log_every, seed=seed,
                    dtype=dtype)
    summary = train_ict(cfg, run, _device(device), notify=lambda m: err.print(m, highlight=False),
                        on_metrics=_print_train_metrics)
    if _main_rank():  # under torchrun every rank trains; rank 0 reports
        _print_train_summary(summary, as_json)


@app.command()
def pretrain(
    corpus: Path = typer.Option(..., "--corpus", help="the pre-training corpus (also the retrieval corpus)"),
    run: Path = typer.Option(..., "--out", help="run directory (created, or resumed from its last checkpoint)"),
    init: Optional[Path] = typer.Option(None, "--init", help="an ICT run (or retriever checkpoint) to start both towers from"),
    model: str = typer.Option("default", "--model", help="HF BERT directory for the encoder (default: bundled MiniLM)"),
    index: Optional[Path] = typer.Option(None, "--index", help="an existing dense index over --corpus to start from (else one is built in RUN/index)"),
    dim: int = typer.Option(128, "--dim", help="retrieval dimension of a fresh projection"),
    steps: int = typer.Option(1000, "--steps"),
    batch_size: int = typer.Option(8, "--batch-size", help="masked sentences per step and rank (under torchrun)"),
    k: int = typer.Option(8, "-k", "--k", help="retrieved blocks per example (the null document is added)"),
    lr: float = typer.Option(5e-5, "--lr"),
    warmup: int = typer.Option(100, "--warmup", help="linear learning-rate warm-up steps"),
    retriever_lr: Optional[float] = typer.Option(None, "--retriever-lr", help="the towers' learning rate (default: --lr)"),
    retriever_warmup: int = typer.Option(0, "--retriever-warmup", help="steps that train the encoder alone before the towers (an encoder with a fresh MLM head first learns to read evidence)"),
    masking: str = typer.Option("salient", "--masking", help="salient (entities and dates, spaCy) or random (15% of wordpieces)"),
    refresh: str = typer.Option("async", "--refresh", help="async (separate index-builder process), sync (in-process) or none"),
    refresh_every: int = typer.Option(100, "--refresh-every", help="steps between index refreshes"),
    max_len: int = typer.Option(352, "--max-len", help="encoder input length: [CLS] x [SEP] block [SEP]"),
    block_len: int = typer.Option(288, "--block-len", help="wordpieces per evidence block (as the --index was built)"),
    save_every: int = typer.Option(200, "--save-every", help="checkpoint (and export) interval in steps"),
    log_every: int = typer.Option(10, "--log-every"),
    seed: int = typer.Option(0, "--seed"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = typer.Option(False, "--json", help="print a JSON summary at the end"),
):
    """REALM pre-training: salient-span masking, retrieval over a refreshed index, marginal MLM
    (exports RUN/final/retriever and RUN/final/encoder)."""
    from ralm.train.pretrain import PretrainConfig
    from ralm.train.pretrain import pretrain as run_pretrain

    _quiet_libraries()
    cfg = PretrainConfig(str(corpus), init=str(init) if init else None, model=model, index=str(index) if index else None,
                         dim=dim, steps=steps, batch_size=batch_size, k=k, lr=lr, warmup=warmup, retriever_warmup=retriever_warmup,
                         retriever_lr=retriever_lr, masking=masking, refresh=refresh, refresh_every=refresh_every, max_len=max_len, block_len=block_len, save_every=save_every,
                         log_every=log_every, seed=seed, dtype=dtype)
    summary = run_pretrain(cfg, run, _device(device), notify=lambda m: err.print(m, highlight=False),
                           on_metrics=_print_train_metrics)
    if _main_rank():  # under torchrun every rank trains; rank 0 reports
        _print_train_summary(summary, as_json)


# -- language models: `ralm lm`, `ralm retro`, `ralm knnlm` (models/lm.py, retro.py, knnlm.py) --

lm_app = typer.Typer(no_args_is_help=True, help="Small causal Transformer LMs (the kNN-LM base model).")
retro_app = typer.Typer(no_args_is_help=True, help="RETRO: chunk database, training, perplexity, generation.")
knnlm_app = typer.Typer(no_args_is_help=True, help="kNN-LM: datastore of LM hidden states, interpolated perplexity.")
app.add_typer(lm_app, name="lm")
app.add_typer(retro_app, name="retro")
app.add_typer(knnlm_app, name="knnlm")

TextHelp = "a corpus (.jsonl/.tsv/folder; same-title records form one article) or a raw .txt/.raw file (WikiText)"
LimitOpt = typer.Option(None, "--limit-tokens", help="use only this many leading wordpieces of the text")


def _limit(value: Optional[int]) -> Optional[int]:
    return None if value is None else _positive("--limit-tokens", value)


def _print_lm_train(summary: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary))
    else:
        out.print(f"[green]done[/green] {summary['run']}: {summary['steps']} steps, loss {summary['loss']}, "
                  f"{summary['parameters'] / 1e6:.2f}M parameters, {summary['seconds']} s; model in {summary['run']}/model")


def _print_perplexity(title: str, rows: list[tuple[str, dict]], as_json: bool, extra: dict) -> None:
    if as_json:
        print(json.dumps({**extra, **{name: r for name, r in rows}}))
        return
    table = Table(title=title)
    for col in ("model", "wordpiece ppl", "word ppl", "tokens"):
        table.add_column(col)
    for name, r in rows:
        table.add_row(name, f"{r['ppl']:.2f}", f"{r['word_ppl']:.2f}", str(r["tokens"]))
    out.print(table)


@lm_app.command("train")
def lm_train(
    text: Path = typer.Option(..., "--text", help=TextHelp),
    run: Path = typer.Option(..., "--out", help="run directory (created, or resumed from its last checkpoint)"),
    dim: int = typer.Option(256, "--dim"),
    layers: int = typer.Option(4, "--layers"),
    heads: int = typer.Option(4, "--heads"),
    seq_len: int = typer.Option(256, "--seq-len", help="training context in wordpieces"),
    steps: int = typer.Option(2000, "--steps"),
    batch_size: int = typer.Option(16, "--batch-size"),
    lr: float = typer.Option(1e-3, "--lr"),
    warmup: int = typer.Option(100, "--warmup"),
    tokenizer: str = typer.Option("", "--tokenizer", help="HF tokenizer directory (default: the bundled MiniLM wordpieces, 30522)"),
    limit_tokens: Optional[int] = LimitOpt,
    save_every: int = typer.Option(200, "--save-every"),
    log_every: int = typer.Option(10, "--log-every"),
    seed: int = typer.Option(0, "--seed"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = typer.Option(False, "--json"),
):
    """Train a causal Transformer LM on a text (exports RUN/model)."""
    from ralm.models.lm import LMConfig
    from ralm.train.lm import LMTrainConfig, train_lm

    _quiet_libraries()
    cfg = LMTrainConfig(text=str(text), model=LMConfig(dim=dim, layers=layers, heads=heads, max_len=_positive("--seq-len", seq_len)),
                        steps=steps, batch_size=batch_size, lr=lr, warmup=warmup, tokenizer=tokenizer,
                        limit_tokens=_limit(limit_tokens), save_every=save_every, log_every=log_every, seed=seed,
                        dtype=dtype)
    _print_lm_train(train_lm(cfg, run, _device(device), on_metrics=_print_train_metrics), as_json)


@lm_app.command("eval")
def lm_eval(
    model: Path = typer.Option(..., "--model", help="`ralm lm train` run/model directory or a local HF causal-LM directory"),
    text: Path = typer.Option(..., "--text", help=TextHelp),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="context window (default: the model's training length)"),
    stride: Optional[int] = typer.Option(None, "--stride", help="new tokens per window (default: seq-len / 2)"),
    limit_tokens: Optional[int] = LimitOpt,
    batch_size: int = typer.Option(16, "--batch-size"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = typer.Option(False, "--json"),
):
    """Perplexity of a causal LM on a text."""
    from ralm.data.chunks import tokenize_text
    from ralm.eval.perplexity import lm_nll, perplexity_report
    from ralm.models.lm import load_lm

    _quiet_libraries()
    dev, dt = _runtime(device, dtype)
    lm, tok = load_lm(model)
    seq = _positive("--seq-len", seq_len or lm.cfg.max_len)
    stream = tokenize_text(text, tok, _limit(limit_tokens))
    report = perplexity_report(lm_nll(lm.to(dev), stream, seq, _positive("--stride", stride or seq // 2), dev,
                                      _positive("--batch-size", batch_size), dtype=dt), stream.words)
    _print_perplexity(f"perplexity on {text.name}", [("lm", report)], as_json, {})


@retro_app.command("build-db")
def retro_build_db(
    corpus: Path = typer.Argument(..., help=TextHelp),
    db: Path = typer.Option(..., "--out", help="chunk DB directory (must not exist; an interrupted build resumes)"),
    model: Optional[str] = typer.Option(None, "--model", help="frozen key encoder: HF BERT directory (default: bundled MiniLM, mean-pooled)"),
    chunk_len: int = typer.Option(64, "--chunk-len"),
    faiss: Optional[str] = typer.Option(None, "--faiss", help="faiss index over the keys (e.g. IVF1024,Flat); default exact search"),
    limit_tokens: Optional[int] = LimitOpt,
    batch_size: int = typer.Option(64, "--batch-size"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = typer.Option(False, "--json"),
):
    """Cut a corpus into chunks, embed them with a frozen BERT and store them memory-mapped."""
    from ralm.atomic import read_json
    from ralm.retrieval.chunkdb import build_chunk_db

    _quiet_libraries()
    dev, dt = _runtime(device, dtype)
    start = time.perf_counter()
    path = build_chunk_db(corpus, db, model=model, chunk_len=chunk_len, faiss_spec=faiss, limit_tokens=_limit(limit_tokens),
                          batch_size=_positive("--batch-size", batch_size), device=dev, dtype=dt)
    m = read_json(path / "manifest.json")
    summary = {"db": str(path), "chunks": m["count"], "tokens": m["tokens"], "dim": m["dim"], "faiss": m["faiss"],
               "seconds": round(time.perf_counter() - start, 1)}
    if as_json:
        print(json.dumps(summary))
    else:
        out.print(f"[green]built[/green] {path}: {summary['chunks']} chunks of {chunk_len} ({summary['tokens']} tokens), "
                  f"keys dim {summary['dim']} in {summary['seconds']} s")


@retro_app.command("train")
def retro_train(
    db: Path = typer.Option(..., "--db", help="chunk DB from `ralm retro build-db`"),
    text: Path = typer.Option(..., "--text", help=TextHelp),
    run: Path = typer.Option(..., "--out", help="run directory (created, or resumed from its last checkpoint)"),
    retrofit: Optional[Path] = typer.Option(None, "--retrofit", help="start from a `ralm lm train` model and train only the "
                                            "CCA layers and neighbour encoder (its decoder stays frozen; sizes come from it)"),
    dim: Optional[int] = typer.Option(None, "--dim", help="[default: 256, or the --retrofit LM's]"),
    layers: Optional[int] = typer.Option(None, "--layers", help="[default: 4, or the --retrofit LM's]"),
    heads: Optional[int] = typer.Option(None, "--heads", help="[default: 4, or the --retrofit LM's]"),
    seq_len: int = typer.Option(256, "--seq-len", help="training length, a multiple of the chunk length"),
    neighbours: int = typer.Option(2, "--neighbours", "-k"),
    cca_start: int = typer.Option(1, "--cca-start", help="first decoder layer (0-based) with chunked cross-attention"),
    cca_every: int = typer.Option(3, "--cca-every", help="then every n-th layer"),
    encoder_layers: int = typer.Option(2, "--encoder-layers"),
    exclude_same_doc: bool = typer.Option(True, "--exclude-same-doc/--keep-same-doc", help="drop neighbours from the training chunk's own article"),
    steps: int = typer.Option(2000, "--steps"),
    batch_size: int = typer.Option(16, "--batch-size"),
    lr: float = typer.Option(1e-3, "--lr"),
    warmup: int = typer.Option(100, "--warmup"),
    limit_tokens: Optional[int] = LimitOpt,
    save_every: int = typer.Option(200, "--save-every"),
    log_every: int = typer.Option(10, "--log-every"),
    seed: int = typer.Option(0, "--seed"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = typer.Option(False, "--json"),
):
    """Train RETRO on a text, with neighbours from the chunk DB looked up once and cached."""
    from ralm.atomic import read_json
    from ralm.models.lm import FORMAT as LM_FORMAT, model_dir
    from ralm.models.retro import RetroConfig
    from ralm.train.lm import RetroTrainConfig, train_retro

    _quiet_libraries()
    if not (db / "manifest.json").is_file():
        raise RalmError(f"{db}: not a chunk DB (no manifest.json); build one with `ralm retro build-db`")
    given = {"dim": dim, "layers": layers, "heads": heads}
    sizes = {"dim": 256, "layers": 4, "heads": 4, **{name: v for name, v in given.items() if v is not None}}
    if retrofit is not None:
        found = model_dir(retrofit, LM_FORMAT)
        if found is None:
            raise RalmError(f"{retrofit}: --retrofit needs a model from `ralm lm train`")
        lm_cfg = read_json(found / "config.json")
        for name, value in given.items():
            if value is not None and value != lm_cfg[name]:
                raise RalmError(f"--{name} {value} differs from the --retrofit LM's {name} {lm_cfg[name]}; leave it out")
        sizes = {name: lm_cfg[name] for name in RetroConfig.decoder_sizes}
    model_cfg = RetroConfig(**sizes, chunk_len=read_json(db / "manifest.json")["chunk_len"],
                            neighbours=_positive("--neighbours", neighbours), cca_start=cca_start, cca_every=cca_every,
                            encoder_layers=encoder_layers, max_len=_positive("--seq-len", seq_len))
    cfg = RetroTrainConfig(text=str(text), db=str(db), model=model_cfg, exclude_same_document=exclude_same_doc,
                           retrofit=str(retrofit or ""),
                           steps=steps, batch_size=batch_size, lr=lr, warmup=warmup, limit_tokens=_limit(limit_tokens),
                           save_every=save_every, log_every=log_every, seed=seed, dtype=dtype)
    _print_lm_train(train_retro(cfg, run, _device(device), on_metrics=_print_train_metrics), as_json)


@retro_app.command("eval")
def retro_eval(
    model: Path = typer.Option(..., "--model", help="`ralm retro train` run (or its model directory)"),
    db: Path = typer.Option(..., "--db"),
    text: Path = typer.Option(..., "--text", help=TextHelp),
    no_retrieval: bool = typer.Option(False, "--no-retrieval", help="switch retrieval off (CCA layers skipped)"),
    stride: Optional[int] = typer.Option(None, "--stride", help="new tokens per window, a multiple of the chunk length (default: half the training length)"),
    limit_tokens: Optional[int] = LimitOpt,
    batch_size: int = typer.Option(8, "--batch-size"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = typer.Option(False, "--json"),
):
    """Perplexity of RETRO on a text, with retrieval from the DB or with retrieval off."""
    from ralm.data.chunks import tokenize_text
    from ralm.eval.perplexity import perplexity_report, retro_nll
    from ralm.models.retro import load_retro
    from ralm.retrieval.chunkdb import ChunkDB, text_neighbours

    _quiet_libraries()
    dev, dt = _runtime(device, dtype)
    retro, tok = load_retro(model)
    m = retro.cfg.chunk_len
    step = _positive("--stride", stride or max(m, retro.cfg.max_len // 2 // m * m))
    if step % m:
        raise RalmError(f"--stride must be a multiple of the chunk length {m}, got {step}")
    chunk_db = ChunkDB(db, dev, dtype=dt)
    stream = tokenize_text(text, tok, _limit(limit_tokens))
    neighbours = None if no_retrieval else text_neighbours(chunk_db, stream, retro.cfg.neighbours, exclude_same_doc=False)
    report = perplexity_report(retro_nll(retro.to(dev), chunk_db, stream, neighbours, step, dev,
                                         _positive("--batch-size", batch_size), dtype=dt), stream.words)
    _print_perplexity(f"RETRO perplexity on {text.name}", [("retro" + (" (retrieval off)" if no_retrieval else ""), report)],
                      as_json, {"retrieval": not no_retrieval})


@retro_app.command("generate")
def retro_generate(
    prompt: str = typer.Argument(...),
    model: Path = typer.Option(..., "--model"),
    db: Path = typer.Option(..., "--db"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="nucleus sampling (default: greedy)"),
    temperature: float = typer.Option(1.0, "--temperature"),
    seed: int = typer.Option(0, "--seed"),
    device: str = DeviceOpt,
    as_json: bool = typer.Option(False, "--json"),
):
    """Continue a prompt with RETRO and show the neighbours each completed chunk retrieved."""
    import torch

    from ralm.models.retro import generate, load_retro
    from ralm.retrieval.chunkdb import ChunkDB

    _quiet_libraries()
    if top_p is not None and not 0 < top_p <= 1:
        raise RalmError(f"--top-p must be in (0, 1], got {top_p}")
    if temperature <= 0:
        raise RalmError(f"--temperature must be positive, got {temperature}")
    dev = _device(device)
    retro, tok = load_retro(model)
    text, used = generate(retro.to(dev), ChunkDB(db, dev), tok, prompt, _positive("--max-new-tokens", max_new_tokens),
                          top_p, temperature, torch.Generator().manual_seed(seed), dev)
    if as_json:
        print(json.dumps({"prompt": prompt, "continuation": text, "retrieved": used}, ensure_ascii=False))
        return
    out.print(f"[bold]{prompt}[/bold] {text}")
    for i, u in enumerate(used):
        out.print(f"[dim]chunk {i}:[/dim] {u['chunk']}")
        for j, nb in enumerate(u["neighbours"]):
            out.print(f"   [cyan]neighbour {j}:[/cyan] {nb[:300]}")


@knnlm_app.command("build")
def knnlm_build(
    model: Path = typer.Option(..., "--model", help="`ralm lm train` run/model directory or a local HF causal-LM directory"),
    text: Path = typer.Option(..., "--text", help=TextHelp),
    store: Path = typer.Option(..., "--out", help="datastore directory (must not exist; an interrupted build resumes)"),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="context window (default: the model's training length)"),
    stride: Optional[int] = typer.Option(None, "--stride", help="new tokens per window (default: seq-len / 2)"),
    faiss: Optional[str] = typer.Option(None, "--faiss", help="faiss spec; default Flat up to 1M keys, else IVF-PQ"),
    limit_tokens: Optional[int] = LimitOpt,
    batch_size: int = typer.Option(16, "--batch-size"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = typer.Option(False, "--json"),
):
    """Store (LM final hidden state -> next token) for every position of a text, with a faiss index."""
    from ralm.data.chunks import tokenize_text
    from ralm.models.knnlm import build_datastore
    from ralm.models.lm import load_lm

    _quiet_libraries()
    start = time.perf_counter()
    dev, dt = _runtime(device, dtype)
    lm, tok = load_lm(model)
    seq = _positive("--seq-len", seq_len or lm.cfg.max_len)
    stream = tokenize_text(text, tok, _limit(limit_tokens))
    path = build_datastore(lm.to(dev), model, stream, store, seq, _positive("--stride", stride or seq // 2), faiss,
                           _positive("--batch-size", batch_size), dev, dtype=dt)
    from ralm.atomic import read_json

    m = read_json(path / "manifest.json")
    summary = {"store": str(path), "entries": m["count"], "dim": m["dim"], "faiss": m["faiss"], "seconds": round(time.perf_counter() - start, 1)}
    if as_json:
        print(json.dumps(summary))
    else:
        out.print(f"[green]built[/green] {path}: {m['count']} keys of dim {m['dim']}, {m['faiss']} index, {summary['seconds']} s")


@knnlm_app.command("eval")
def knnlm_eval_cmd(
    model: Path = typer.Option(..., "--model"),
    store: Path = typer.Option(..., "--store"),
    text: Path = typer.Option(..., "--text", help=TextHelp),
    lmbda: str = typer.Option("0.25", "--lmbda", help="interpolation weight of p_kNN; comma-separated to compare several"),
    k: int = typer.Option(1024, "-k", "--k", help="neighbours per token"),
    temperature: str = typer.Option("1", "--temperature", help="softmax temperature over -distance; comma-separated to compare several"),
    nprobe: int = typer.Option(32, "--nprobe", help="IVF lists searched (approximate stores)"),
    seq_len: Optional[int] = typer.Option(None, "--seq-len"),
    stride: Optional[int] = typer.Option(None, "--stride"),
    limit_tokens: Optional[int] = LimitOpt,
    batch_size: int = typer.Option(16, "--batch-size"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = typer.Option(False, "--json"),
):
    """Perplexity of the LM alone and of the kNN-LM interpolation."""
    from ralm.data.chunks import tokenize_text
    from ralm.eval.perplexity import knnlm_eval
    from ralm.retrieval.datastore import Datastore
    from ralm.models.lm import load_lm

    _quiet_libraries()
    try:
        lambdas = [float(x) for x in lmbda.split(",") if x.strip()]
        temperatures = [float(x) for x in temperature.split(",") if x.strip()]
    except ValueError:
        raise RalmError(f"--lmbda and --temperature must be comma-separated numbers, got {lmbda!r}, {temperature!r}") from None
    if not lambdas or any(not 0 <= x <= 1 for x in lambdas):
        raise RalmError(f"--lmbda must be numbers in [0, 1], got {lmbda!r}")
    if not temperatures or any(t <= 0 for t in temperatures):
        raise RalmError(f"--temperature must be positive numbers, got {temperature!r}")
    dev, dt = _runtime(device, dtype)
    lm, tok = load_lm(model)
    ds = Datastore(store, nprobe=_positive("--nprobe", nprobe))
    ds.check_model(model)
    seq = _positive("--seq-len", seq_len or lm.cfg.max_len)
    stream = tokenize_text(text, tok, _limit(limit_tokens))
    res = knnlm_eval(lm.to(dev), ds, stream, _positive("-k", k), lambdas, temperatures, seq,
                     _positive("--stride", stride or seq // 2), dev, _positive("--batch-size", batch_size), dtype=dt)
    rows = [("lm", res["lm"])] + [(f"knn-lm (λ={r['lmbda']}, T={r['temperature']}, k={k})", r) for r in res["knn"]]
    _print_perplexity(f"kNN-LM perplexity on {text.name}", rows, as_json, {"k": k, "seconds": res["seconds"]})


# -- open-domain QA: `ralm finetune`, `ralm dpr`, `ralm eval qa`, `ralm ask` (models/reader.py) --

def _open_qa(model: Optional[str], index_dir: Path, k: int, hybrid: Optional[Path], alpha: float, device: str, dtype: str,
             min_confidence: float):
    from ralm.eval.openqa import OpenQA, open_searcher, resolve_reader
    from ralm.models.reader import Reader

    dev, dt = _runtime(device, dtype)
    reader = Reader.from_pretrained(resolve_reader(model)).to(dev)
    searcher = open_searcher(index_dir, model=model, hybrid=hybrid, alpha=alpha, device=dev, dtype=dt)
    return OpenQA(reader, searcher, _positive("-k", k), dev, dt, min_confidence)


HybridOpt = typer.Option(None, "--hybrid", help="a BM25 index over the same corpus to fuse with a dense --index")
AlphaOpt = typer.Option(0.5, "--alpha", help="hybrid weight of the dense score (1 - alpha for BM25)")
ModelOpt = typer.Option(None, "--model", help="fine-tuning RUN or reader checkpoint (default: the package's general reader)")


@app.command("train-reader")
def train_reader_cmd(
    questions: Path = typer.Option(..., "--questions", help="JSONL {id, question, answers} + the passage: 'context', or 'doc_id' with --corpus"),
    corpus: Optional[Path] = typer.Option(None, "--corpus", help="the corpus the questions' doc_id refer to"),
    run: Path = typer.Option(..., "--out", help="run directory (created, or resumed from its last checkpoint)"),
    init: Optional[str] = typer.Option(None, "--init", help="reader checkpoint or HF encoder dir (default: bundled MiniLM)"),
    steps: int = typer.Option(5000, "--steps"),
    batch_size: int = typer.Option(32, "--batch-size", help="questions per step and rank (under torchrun)"),
    lr: float = typer.Option(1e-4, "--lr"),
    max_len: int = typer.Option(384, "--max-len", help="reader input length: [CLS] question [SEP] window [SEP]"),
    stride: int = typer.Option(128, "--stride", help="wordpieces between the starts of a passage's windows"),
    trainable_layers: Optional[int] = typer.Option(None, "--trainable-layers", help="train only the top N layers (default: all)"),
    limit: Optional[int] = typer.Option(None, "--limit", help="first N training questions only"),
    save_every: int = typer.Option(500, "--save-every"),
    log_every: int = typer.Option(10, "--log-every"),
    seed: int = typer.Option(0, "--seed"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = typer.Option(False, "--json", help="print a JSON summary at the end"),
):
    """Train the span reader on each question's gold passage, SQuAD-style (exports RUN/final/reader)."""
    from ralm.train.reader import ReaderTrainConfig, train_reader

    _quiet_libraries()
    cfg = ReaderTrainConfig(str(questions), corpus=str(corpus) if corpus else None, init=init, steps=steps,
                            batch_size=batch_size, lr=lr, max_len=max_len, stride=stride, trainable_layers=trainable_layers,
                            limit=limit, save_every=save_every, log_every=log_every, seed=seed, dtype=dtype)
    summary = train_reader(cfg, run, _device(device))
    if not _main_rank():  # under torchrun every rank trains; rank 0 reports
        return
    if as_json:
        print(json.dumps(summary))
    else:
        out.print(f"[green]done[/green] {run}: {summary['steps']} steps, {100 * summary['answerable_share']:.1f}% of "
                  f"questions had a gold span; exported {run / 'final' / 'reader'} (continue open-domain with "
                  f"`ralm finetune --init {run}`)")


@app.command()
def finetune(
    questions: Path = typer.Option(..., "--questions", help="training questions, JSONL {id, question, answers}"),
    index_dir: Path = typer.Option(..., "--index", help="dense or BM25 index over the evidence corpus (kept fixed)"),
    run: Path = typer.Option(..., "--out", help="run directory (created, or resumed from its last checkpoint)"),
    init: Optional[str] = typer.Option(None, "--init", help="ICT/pre-training RUN, retriever checkpoint, reader, or HF encoder dir"),
    steps: int = typer.Option(1000, "--steps"),
    batch_size: int = typer.Option(8, "--batch-size", help="questions per step and rank (under torchrun)"),
    k: int = typer.Option(5, "-k", "--k", help="retrieved blocks read per question"),
    lr: float = typer.Option(3e-5, "--lr", help="reader learning rate"),
    retriever_lr: float = typer.Option(1e-5, "--retriever-lr", help="query-tower learning rate"),
    train_retriever: bool = typer.Option(True, "--train-retriever/--freeze-retriever", help="fine-tune the query tower through p(z|x)"),
    max_len: int = typer.Option(384, "--max-len", help="reader input length: [CLS] question [SEP] block [SEP]"),
    trainable_layers: Optional[int] = typer.Option(None, "--trainable-layers", help="train only the reader's top N layers (small checkpoints, faster on CPU)"),
    limit: Optional[int] = typer.Option(None, "--limit", help="first N training questions only"),
    save_every: int = typer.Option(200, "--save-every"),
    log_every: int = typer.Option(10, "--log-every"),
    seed: int = typer.Option(0, "--seed"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = typer.Option(False, "--json", help="print a JSON summary at the end"),
):
    """Fine-tune the span reader (and the query tower) for open-domain QA (exports RUN/final/reader)."""
    from ralm.train.finetune import FinetuneConfig
    from ralm.train.finetune import finetune as run_finetune

    _quiet_libraries()
    cfg = FinetuneConfig(str(questions), str(index_dir), init=init, steps=steps, batch_size=batch_size, k=k, lr=lr,
                         retriever_lr=retriever_lr, train_retriever=train_retriever, max_len=max_len,
                         trainable_layers=trainable_layers, limit=limit,
                         save_every=save_every, log_every=log_every, seed=seed, dtype=dtype)
    summary = run_finetune(cfg, run, _device(device))
    if not _main_rank():  # under torchrun every rank trains; rank 0 reports
        return
    if as_json:
        print(json.dumps(summary))
    else:
        out.print(f"[green]done[/green] {run}: {summary['steps']} steps, {100 * summary['answerable_share']:.1f}% of "
                  f"questions had an answer among their top-{k} blocks; exported {run / 'final'}")


@app.command()
def dpr(
    questions: Path = typer.Option(..., "--questions", help="training questions, JSONL {id, question, answers}"),
    corpus: Path = typer.Option(..., "--corpus", help="the evidence corpus (positives and negatives are mined from it with BM25)"),
    run: Path = typer.Option(..., "--out", help="run directory (created, or resumed from its last checkpoint)"),
    model: Optional[str] = typer.Option(None, "--model", help="initial encoder: HF dir or retriever checkpoint (default: bundled MiniLM)"),
    dim: int = typer.Option(128, "--dim", help="retrieval dimension of a fresh projection"),
    steps: int = typer.Option(1000, "--steps"),
    batch_size: int = typer.Option(16, "--batch-size", help="questions per step and rank (in-batch negatives from all ranks)"),
    hard_negatives: int = typer.Option(1, "--hard-negatives", help="BM25 hard negatives per question"),
    bm25_depth: int = typer.Option(50, "--bm25-depth", help="BM25 depth searched for positives and negatives"),
    lr: float = typer.Option(2e-5, "--lr"),
    limit: Optional[int] = typer.Option(None, "--limit", help="first N training questions only"),
    save_every: int = typer.Option(200, "--save-every"),
    log_every: int = typer.Option(10, "--log-every"),
    seed: int = typer.Option(0, "--seed"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = typer.Option(False, "--json", help="print a JSON summary at the end"),
):
    """Train a DPR retriever (both towers, in-batch + BM25 hard negatives); exports RUN/final/retriever."""
    from ralm.train.dpr import DPRConfig, train_dpr

    _quiet_libraries()
    cfg = DPRConfig(str(questions), str(corpus), model=model, dim=dim or None, steps=steps, batch_size=batch_size,
                    hard_negatives=hard_negatives, bm25_depth=bm25_depth, lr=lr, limit=limit, save_every=save_every,
                    log_every=log_every, seed=seed, dtype=dtype)
    summary = train_dpr(cfg, run, _device(device))
    if not _main_rank():  # under torchrun every rank trains; rank 0 reports
        return
    if as_json:
        print(json.dumps(summary))
    else:
        out.print(f"[green]done[/green] {run}: {summary['steps']} steps on {summary['trainable_questions']} questions with a "
                  f"BM25 positive; index it with `ralm index build CORPUS --model {run / 'final' / 'retriever'} --out DIR`")


@eval_app.command("qa")
def eval_qa(
    model: Optional[str] = ModelOpt,
    index_dir: Path = typer.Option(..., "--index", help="dense or BM25 index"),
    questions: Path = typer.Option(..., "--questions", help="JSONL {id, question, answers}"),
    k: int = typer.Option(5, "-k", "--k", help="retrieved blocks read per question"),
    hybrid: Optional[Path] = HybridOpt,
    alpha: float = AlphaOpt,
    limit: Optional[int] = typer.Option(None, "--limit", help="first N questions only"),
    predictions: Optional[Path] = typer.Option(None, "--predictions", help="per-question JSONL (default: ./<questions>-<index>.predictions.jsonl)"),
    calibrate: bool = typer.Option(False, "--calibrate", help="fit the reader's confidence calibration on these (held-back) "
                                                              "questions and save it in the reader's config.json"),
    batch_size: int = typer.Option(8, "--batch-size", help="questions per reader batch"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = typer.Option(False, "--json"),
):
    """EM / F1 (SQuAD normalisation, max over gold answers) and recall@1/5/20 of open-domain QA."""
    from ralm.data.qa import read_questions
    from ralm.eval.openqa import evaluate_qa, resolve_reader
    from ralm.models.reader import write_calibration

    _quiet_libraries()
    qs = read_questions(questions)
    if limit is not None:
        qs = qs[: _positive("--limit", limit)]
    qa = _open_qa(model, index_dir, k, hybrid, alpha, device, dtype, min_confidence=0.0)
    name = f"{questions.stem}-{index_dir.name}" + (f"-hybrid-{hybrid.name}" if hybrid else "")
    predictions = predictions or Path(f"{name}.predictions.jsonl")  # the current directory, never the model's
    result = evaluate_qa(qa, qs, (1, 5, 20), _positive("--batch-size", batch_size), predictions, calibrate=calibrate)
    result = {**result, "index": str(index_dir), "hybrid": str(hybrid) if hybrid else None, "predictions": str(predictions)}
    if calibrate:
        write_calibration(resolve_reader(model), qa.calibration.to_json())
        result["calibration"] = str(resolve_reader(model) / "config.json")
    if as_json:
        print(json.dumps(result))
        return
    table = Table(title=f"open-domain QA on {questions.name} ({result['questions']} questions, top-{k} read)")
    for key in ("em", "f1", "recall@1", "recall@5", "recall@20"):
        table.add_column(key.upper() if len(key) == 2 else key)
    table.add_row(*(f"{result[key]:.1f}" for key in ("em", "f1", "recall@1", "recall@5", "recall@20")))
    out.print(table)
    if "reliability" in result:
        _print_reliability(result["reliability"])
    if calibrate:
        out.print(f"calibration fitted on {len(qs)} questions, saved in {result['calibration']}")
    out.print(f"{result['seconds']} s; predictions in {predictions}")


def _print_reliability(rel: dict) -> None:
    table = Table(title=f"confidence vs exact match (ECE {rel['ece']:.3f})")
    for col in ("confidence bin", "questions", "mean confidence", "share correct"):
        table.add_column(col)
    for b in rel["bins"]:
        table.add_row(f"{b['lo']:.1f}-{b['hi']:.1f}", str(b["count"]), f"{b['confidence']:.3f}", f"{b['accuracy']:.3f}")
    out.print(table)
    for t in rel["at"]:
        acc = "-" if t["accuracy"] is None else f"{100 * t['accuracy']:.1f}% correct"
        out.print(f"confidence >= {t['min_confidence']}: {100 * t['answered']:.1f}% of questions answered, {acc}")


@app.command()
def ask(
    question: str = typer.Argument(...),
    model: Optional[str] = ModelOpt,
    index_dir: Path = typer.Option(..., "--index", help="dense or BM25 index"),
    k: int = typer.Option(5, "-k", "--k", help="retrieved blocks read"),
    hybrid: Optional[Path] = HybridOpt,
    alpha: float = AlphaOpt,
    min_confidence: float = MinConfidenceOpt,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = typer.Option(False, "--json", help="print {answer, no_answer, score, confidence, evidence: [{id, title, text, retrieval_score, span}]}"),
):
    """Answer a question with evidence: the best span over the top-k blocks."""
    _quiet_libraries()
    if not question.strip():
        raise RalmError("the question is empty")
    answer = _open_qa(model, index_dir, k, hybrid, alpha, device, dtype, min_confidence).answer([question])[0]
    if as_json:
        print(json.dumps(answer.to_json(), ensure_ascii=False))
        return
    _print_answer(answer)


def _print_answer(answer) -> None:
    from rich.text import Text

    out.print(f"[bold]Q:[/bold] {answer.question}")
    confidence = "uncalibrated" if answer.confidence is None else f"confidence {answer.confidence:.2f}"
    if answer.no_answer:
        best = answer.evidence[answer.best].span_text
        out.print(f"[bold yellow]A: no answer found in the corpus[/bold yellow]  [dim](best guess {best!r}, {confidence})[/dim]")
    else:
        out.print(f"[bold green]A: {answer.answer}[/bold green]  [dim]({confidence}, p = {answer.score:.3f})[/dim]")
    table = Table(show_lines=True, expand=True)
    for col, width in (("#", 3), ("p(z|x)", 7), ("p(span)", 7), ("evidence", None)):
        table.add_column(col, width=width)
    for rank, e in enumerate(answer.evidence, 1):
        body = Text.assemble((e.title, "bold"), (f" ({e.id})\n", "dim"))
        text = Text(e.text)
        if e.span:
            text.stylize("bold black on yellow" if rank - 1 == answer.best else "underline", *e.span)
        body.append_text(text)
        table.add_row(str(rank), f"{e.retrieval_prob:.3f}", f"{e.span_prob:.3f}", body)
    out.print(table)


@app.command()
def serve(
    index_dir: Path = typer.Option(..., "--index", help="index directory (dense or BM25); new versions are swapped in live"),
    model: Optional[str] = ModelOpt,
    bm25: Optional[Path] = typer.Option(None, "--bm25", help="a BM25 index over the same corpus (enables bm25 and hybrid)"),
    host: str = typer.Option("127.0.0.1", "--host", help="bind address (loopback by default)"),
    port: int = typer.Option(8000, "--port"),
    allowed_host: list[str] = typer.Option([], "--allowed-host", metavar="NAME", help="a host name clients use for this server, beside "
                                           "localhost and the --host address (repeatable; '*' accepts any Host header)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="RALM_API_KEY", help="protect POST/DELETE /documents"),
    min_confidence: float = MinConfidenceOpt,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
):
    """Serve /ask, /search, /documents, /health, /stats and a web page (FastAPI + uvicorn)."""
    import uvicorn

    from ralm.eval.openqa import resolve_reader
    from ralm.serve.app import create_app
    from ralm.serve.service import ServeConfig, Service

    _quiet_libraries()
    if not 0 < port < 65536:
        raise RalmError(f"--port must be in 1..65535, got {port}")
    svc = Service(ServeConfig(index=str(index_dir), model=model or str(resolve_reader(None)), bm25=str(bm25) if bm25 else None,
                              api_key=api_key, host=host, allowed_hosts=tuple(allowed_host), min_confidence=min_confidence),
                  *_runtime(device, dtype))
    err.print(f"serving {index_dir} ({svc.stats()['corpus_blocks']} blocks, retrievers: {', '.join(svc.retrievers())}"
              f", reader {svc.cfg.model}) on http://{host}:{port}")
    uvicorn.run(create_app(svc), host=host, port=port, log_level="warning")


# -- interop: `ralm convert hf-realm` (convert/hf_realm.py) -------------------------------------

convert_app = typer.Typer(no_args_is_help=True, help="Import checkpoints saved by other libraries.")
app.add_typer(convert_app, name="convert")


@convert_app.command("hf-realm")
def convert_hf_realm_cmd(
    src: Path = typer.Argument(..., help="a Hugging Face REALM directory (transformers 4.x: RealmEmbedder, RealmScorer, "
                                         "RealmKnowledgeAugEncoder, RealmReader or RealmForOpenQA)"),
    run: Path = typer.Option(..., "--out", help="run directory: writes RUN/final/{retriever,encoder,reader} (those the source holds)"),
    doc_embedder: Optional[Path] = typer.Option(None, "--doc-embedder", help="RealmForOpenQA only: a RealmEmbedder/RealmScorer "
                                                "directory for the document tower (default: a copy of the query embedder)"),
    as_json: bool = typer.Option(False, "--json", help="print the conversion summary as JSON"),
):
    """Convert Hugging Face REALM weights (safetensors or pytorch_model.bin, weights only) into our checkpoints."""
    from ralm.convert.hf_realm import convert_hf_realm

    _quiet_libraries()
    summary = convert_hf_realm(src, run, doc_embedder)
    if as_json:
        print(json.dumps(summary))
        return
    out.print(f"[green]converted[/green] {src} ({summary['architecture']}) -> "
              + ", ".join(f"{name}: {path}" for name, path in summary["components"].items()))
    if "doc_tower" in summary:
        out.print(f"document tower: {summary['doc_tower']}")
    if summary["ignored_tensors"]:
        out.print(f"[dim]{len(summary['ignored_tensors'])} unused tensors dropped (see {run / 'final' / 'conversion.json'})[/dim]")


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    if issubclass(category, RalmWarning):  # a message for the user, not a code location
        err.print(f"[yellow]warning:[/yellow] {message}", highlight=False, soft_wrap=True)
    else:
        (file or sys.stderr).write(warnings.formatwarning(message, category, filename, lineno, line))


def main() -> None:
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            app()
        except RalmError as e:
            err.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
            sys.exit(2)
