"""`ralm lm`, `ralm retro` and `ralm knnlm`: language models with retrieval, their chunk DB and
datastore, perplexity and generation; `lm train` and `retro train` are generated from their
configs (commands/from_config.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from ralm.atomic import check_output
from ralm.commands.from_config import TrainerCommand, config_command, config_options, lazy_trainer_group
from ralm.commands.shared import (DeviceOpt, DtypeOpt, JsonOpt, LimitOpt, MoreArgs, OldSpellings, check_faiss_spec, check_models, corpus_option, flag_option,
                                  optional_positive, positionals, positive, quiet_libraries, removed_on_error, runtime, token_limit)
from ralm.configs import TEXT_HELP, option
from ralm.console import out, print_json, print_perplexity, print_summary
from ralm.defaults import (CHUNK_LEN, EMBED_BATCH, KNN_K, KNN_LAMBDA, KNN_TEMPERATURE, LM_BATCH, MAX_NEW_TOKENS, NPROBE, RETRO_BATCH,
                           SAMPLE_TEMPERATURE)
from ralm.errors import RalmError

SEQ_BATCH_HELP = "sequences per forward pass (memory against speed; the result does not change)"


@dataclass(frozen=True)
class LmBatchConfig:
    """`ralm lm eval`'s and `ralm knnlm build`'s settings (eval.perplexity.lm_perplexity, models.knnlm.build_datastore)."""

    batch_size: int = option(LM_BATCH, SEQ_BATCH_HELP)


@dataclass(frozen=True)
class KnnlmEvalConfig(LmBatchConfig):
    """`ralm knnlm eval`'s settings (eval.perplexity.knnlm_eval; the datastore's nprobe)."""

    lmbda: str = option(f"{KNN_LAMBDA:g}", "interpolation weight of p_kNN; comma-separated to compare several")
    k: int = option(KNN_K, "neighbours per token", flag="-k", aliases=("--k",))
    temperature: str = option(f"{KNN_TEMPERATURE:g}", "softmax temperature over -distance; comma-separated to compare several")
    nprobe: int = option(NPROBE, "IVF lists searched (approximate stores)")


@dataclass(frozen=True)
class RetroDbConfig:
    """`ralm retro build-db`'s settings (retrieval.lm.chunkdb.build_chunk_db)."""

    chunk_len: int = option(CHUNK_LEN, "wordpieces per chunk (RETRO: 64)")
    batch_size: int = option(EMBED_BATCH, "chunks embedded per forward pass")


@dataclass(frozen=True)
class RetroEvalConfig:
    """`ralm retro eval`'s settings (eval.perplexity.retro_perplexity)."""

    batch_size: int = option(RETRO_BATCH, SEQ_BATCH_HELP)


@dataclass(frozen=True)
class RetroGenerateConfig:
    """`ralm retro generate`'s settings (models.retro.generate)."""

    max_new_tokens: int = option(MAX_NEW_TOKENS, "wordpieces to generate")
    temperature: float = option(SAMPLE_TEMPERATURE, "softmax temperature of the sampling (with --top-p)")
    seed: int = option(0, "seed of the sampling")



def _lm_done(result, _cfg) -> str:
    return (f"{result.steps} steps, loss {result.loss}, {result.parameters / 1e6:.2f}M parameters, {result.seconds} s; "
            f"model in {result.run}/final/model")


def _retro_config(config_cls: type, values: dict, given: set):
    """RetroTrainConfig with its model sized by the options, the chunk DB (chunk length) and, when
    retro-fitting, the LM's decoder sizes wherever an option left them at their default."""
    from ralm.models.retro import RetroConfig, training_config

    model = {o.name for o in config_options(config_cls) if o.parent == "model"}
    inherited = set(RetroConfig.decoder_sizes) - given if values["retrofit"] else set()
    sizes = {name: values[name] for name in model - inherited}
    return config_cls(**{k: v for k, v in values.items() if k not in model},
                      model=training_config(values["db"], values["retrofit"] or None, **sizes))


lm_app = typer.Typer(cls=lazy_trainer_group({"train": TrainerCommand(
    "ralm.train.lm", "LMTrainer", "Train a causal Transformer LM on a text (exports RUN/final/model).", _lm_done)}),
    no_args_is_help=True, help="Small causal Transformer LMs (the kNN-LM base model).")
retro_app = typer.Typer(cls=lazy_trainer_group({"train": TrainerCommand(
    "ralm.train.lm", "RetroTrainer",
    "Train RETRO on a text, with neighbours from the chunk DB looked up once and cached.", _lm_done, build=_retro_config)}),
    no_args_is_help=True, help="RETRO: chunk database, training, perplexity, generation.")
knnlm_app = typer.Typer(no_args_is_help=True, help="kNN-LM: datastore of LM hidden states, interpolated perplexity.")


@lm_app.command("eval")
@config_command
def lm_eval(
    *,
    model: Path = typer.Option(..., "--model", help="`ralm lm train` run/model directory or a local HF causal-LM directory"),
    text: Path = typer.Option(..., "--text", help=TEXT_HELP),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="context window (default: the model's training length)"),
    stride: Optional[int] = typer.Option(None, "--stride", help="new tokens per window (default: seq-len / 2)"),
    limit_tokens: Optional[int] = LimitOpt,
    cfg: LmBatchConfig,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = JsonOpt,
):
    """Perplexity of a causal LM on a text."""
    batch_size = cfg.batch_size
    from ralm.data.chunks import tokenize_text
    from ralm.eval.perplexity import lm_perplexity
    from ralm.models.lm import load_lm

    quiet_libraries()
    rt = runtime(device, dtype)
    lm, tok = load_lm(model)
    report = lm_perplexity(lm.to(rt.device), tokenize_text(text, tok, token_limit(limit_tokens)),
                           seq_len=optional_positive("--seq-len", seq_len), stride=optional_positive("--stride", stride),
                           runtime=rt, batch_size=positive("--batch-size", batch_size))
    print_perplexity(f"perplexity on {text.name}", [("lm", report)], as_json, {})


@retro_app.command("build-db", cls=OldSpellings)
@config_command
def retro_build_db(
    more: list[str] = MoreArgs,  # `ralm retro build-db CORPUS`, the older spelling
    *,
    corpus: Optional[Path] = corpus_option(TEXT_HELP),
    db: Path = typer.Option(..., "--out", help="chunk DB directory (must not exist; an interrupted build resumes)"),
    model: Optional[str] = typer.Option(None, "--model", help="frozen key encoder: HF BERT directory (default: bundled MiniLM, mean-pooled)"),
    cfg: RetroDbConfig,
    faiss: Optional[str] = typer.Option(None, "--faiss", help="faiss index over the keys (e.g. IVF1024,Flat); default exact search"),
    limit_tokens: Optional[int] = LimitOpt,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = JsonOpt,
):
    """Cut a corpus into chunks, embed them with a frozen BERT and store them memory-mapped."""
    corpus = Path(positionals("retro build-db", more, options={"--corpus": corpus}, old=("--corpus",))["--corpus"])
    check_output("--out", db, [("--corpus", corpus), ("--model", model)], directory=True)
    check_models(model)
    check_faiss_spec("--faiss", faiss)
    chunk_len, batch_size = cfg.chunk_len, cfg.batch_size
    from ralm.retrieval.lm.chunkdb import build_chunk_db, chunk_db_summary

    quiet_libraries()
    rt = runtime(device, dtype)
    start = time.perf_counter()
    with removed_on_error(db):
        path = build_chunk_db(corpus, db, model=model, chunk_len=chunk_len, faiss_spec=faiss, limit_tokens=token_limit(limit_tokens),
                              batch_size=positive("--batch-size", batch_size), runtime=rt)
    summary = {**chunk_db_summary(path), "seconds": round(time.perf_counter() - start, 1)}
    print_summary(summary, as_json, f"[green]built[/green] {path}: {summary['chunks']} chunks of {chunk_len} "
                  f"({summary['tokens']} tokens), keys dim {summary['dim']} in {summary['seconds']} s")


@retro_app.command("eval")
@config_command
def retro_eval(
    *,
    model: Path = typer.Option(..., "--model", help="`ralm retro train` run (or its model directory)"),
    db: Path = typer.Option(..., "--db", help="chunk DB from `ralm retro build-db` (the one the model trained with)"),
    text: Path = typer.Option(..., "--text", help=TEXT_HELP),
    no_retrieval: bool = flag_option("--no-retrieval", help="switch retrieval off (CCA layers skipped)"),
    stride: Optional[int] = typer.Option(None, "--stride", help="new tokens per window, a multiple of the chunk length (default: half the training length)"),
    limit_tokens: Optional[int] = LimitOpt,
    cfg: RetroEvalConfig,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = JsonOpt,
):
    """Perplexity of RETRO on a text, with retrieval from the DB or with retrieval off."""
    batch_size = cfg.batch_size
    from ralm.data.chunks import tokenize_text
    from ralm.eval.perplexity import retro_perplexity
    from ralm.models.retro import load_retro
    from ralm.retrieval.lm.chunkdb import ChunkDB

    quiet_libraries()
    rt = runtime(device, dtype)
    retro, tok = load_retro(model)
    report = retro_perplexity(retro.to(rt.device), ChunkDB(db, runtime=rt), tokenize_text(text, tok, token_limit(limit_tokens)),
                              retrieval=not no_retrieval, stride=optional_positive("--stride", stride), runtime=rt,
                              batch_size=positive("--batch-size", batch_size))
    print_perplexity(f"RETRO perplexity on {text.name}", [("retro" + (" (retrieval off)" if no_retrieval else ""), report)],
                     as_json, {"retrieval": not no_retrieval})


@retro_app.command("generate")
@config_command
def retro_generate(
    prompt: str = typer.Argument(..., help="the text to continue"),
    *,
    model: Path = typer.Option(..., "--model", help="`ralm retro train` run (or its model directory)"),
    db: Path = typer.Option(..., "--db", help="chunk DB from `ralm retro build-db` (the one the model trained with)"),
    cfg: RetroGenerateConfig,
    top_p: Optional[float] = typer.Option(None, "--top-p", help="nucleus sampling (default: greedy)"),
    device: str = DeviceOpt,
    as_json: bool = JsonOpt,
):
    """Continue a prompt with RETRO and show the neighbours each completed chunk retrieved."""
    max_new_tokens, temperature, seed = cfg.max_new_tokens, cfg.temperature, cfg.seed
    import torch

    from ralm.models.retro import check_sampling, generate, load_retro
    from ralm.retrieval.lm.chunkdb import ChunkDB

    quiet_libraries()
    check_sampling(top_p, temperature)
    rt = runtime(device, "auto")  # no --dtype: the chunk DB embeds in the automatic dtype, the model decodes in fp32
    retro, tok = load_retro(model)
    text, used = generate(retro.to(rt.device), ChunkDB(db, runtime=rt), tok, prompt,
                          max_new_tokens=positive("--max-new-tokens", max_new_tokens), top_p=top_p, temperature=temperature,
                          generator=torch.Generator().manual_seed(seed), runtime=rt)
    if as_json:
        print_json({"prompt": prompt, "continuation": text, "retrieved": used}, ensure_ascii=False)
        return
    out.print(f"[bold]{prompt}[/bold] {text}")
    for i, u in enumerate(used):
        out.print(f"[dim]chunk {i}:[/dim] {u['chunk']}")
        for j, nb in enumerate(u["neighbours"]):
            out.print(f"   [cyan]neighbour {j}:[/cyan] {nb[:300]}")


@knnlm_app.command("build")
@config_command
def knnlm_build(
    *,
    model: Path = typer.Option(..., "--model", help="`ralm lm train` run/model directory or a local HF causal-LM directory"),
    text: Path = typer.Option(..., "--text", help=TEXT_HELP),
    store: Path = typer.Option(..., "--out", help="datastore directory (must not exist; an interrupted build resumes)"),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="context window (default: the model's training length)"),
    stride: Optional[int] = typer.Option(None, "--stride", help="new tokens per window (default: seq-len / 2)"),
    faiss: Optional[str] = typer.Option(None, "--faiss", help="faiss spec; default Flat up to 1M keys, else IVF-PQ"),
    limit_tokens: Optional[int] = LimitOpt,
    cfg: LmBatchConfig,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = JsonOpt,
):
    """Store (LM final hidden state -> next token) for every position of a text, with a faiss index."""
    check_output("--out", store, [("--model", model), ("--text", text)], directory=True)
    check_models(model, hub=False)
    check_faiss_spec("--faiss", faiss)
    batch_size = cfg.batch_size
    from ralm.data.chunks import tokenize_text
    from ralm.models.knnlm import build_datastore
    from ralm.models.lm import load_lm
    from ralm.retrieval.lm.datastore import datastore_summary

    quiet_libraries()
    start = time.perf_counter()
    rt = runtime(device, dtype)
    lm, tok = load_lm(model)
    with removed_on_error(store):
        path = build_datastore(lm.to(rt.device), model, tokenize_text(text, tok, token_limit(limit_tokens)), store,
                               seq_len=optional_positive("--seq-len", seq_len), stride=optional_positive("--stride", stride),
                               faiss_spec=faiss, batch_size=positive("--batch-size", batch_size), runtime=rt)
    summary = {**datastore_summary(path), "seconds": round(time.perf_counter() - start, 1)}
    print_summary(summary, as_json, f"[green]built[/green] {path}: {summary['entries']} keys of dim {summary['dim']}, "
                  f"{summary['faiss']} index, {summary['seconds']} s")


@knnlm_app.command("eval")
@config_command
def knnlm_eval_cmd(
    *,
    model: Path = typer.Option(..., "--model", help="the LM the datastore was built with (`ralm lm train` run or HF causal-LM directory)"),
    store: Path = typer.Option(..., "--store", help="datastore from `ralm knnlm build`"),
    text: Path = typer.Option(..., "--text", help=TEXT_HELP),
    cfg: KnnlmEvalConfig,
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="context window (default: the model's training length)"),
    stride: Optional[int] = typer.Option(None, "--stride", help="new tokens per window (default: seq-len / 2)"),
    limit_tokens: Optional[int] = LimitOpt,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = JsonOpt,
):
    """Perplexity of the LM alone and of the kNN-LM interpolation."""
    lmbda, k, temperature, nprobe, batch_size = cfg.lmbda, cfg.k, cfg.temperature, cfg.nprobe, cfg.batch_size
    from ralm.data.chunks import tokenize_text
    from ralm.eval.perplexity import check_grid, knnlm_eval
    from ralm.models.lm import load_lm
    from ralm.retrieval.lm.datastore import Datastore

    quiet_libraries()
    try:
        lambdas = [float(x) for x in lmbda.split(",") if x.strip()]
        temperatures = [float(x) for x in temperature.split(",") if x.strip()]
    except ValueError:
        raise RalmError(f"--lmbda and --temperature must be comma-separated numbers, got {lmbda!r}, {temperature!r}") from None
    check_grid(lambdas, temperatures)
    rt = runtime(device, dtype)
    lm, tok = load_lm(model)
    ds = Datastore(store, nprobe=positive("--nprobe", nprobe))
    ds.check_model(model)
    res = knnlm_eval(lm.to(rt.device), ds, tokenize_text(text, tok, token_limit(limit_tokens)), k=positive("-k", k), lambdas=lambdas,
                     temperatures=temperatures, seq_len=optional_positive("--seq-len", seq_len),
                     stride=optional_positive("--stride", stride), runtime=rt, batch_size=positive("--batch-size", batch_size))
    rows = [("lm", res["lm"])] + [(f"knn-lm (λ={r['lmbda']}, T={r['temperature']}, k={k})", r) for r in res["knn"]]
    print_perplexity(f"kNN-LM perplexity on {text.name}", rows, as_json, {"k": k, "seconds": res["seconds"]})
