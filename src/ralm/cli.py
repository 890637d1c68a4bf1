"""The `ralm` command line: parse options, call the library, print. Nothing else lives here.

The command groups are in ralm/commands/ (index and search, language models, conversion); the
training, question-answering and serving commands are below. Input errors (`RalmError`) print
one line and exit with code 2; warnings about accepted input (`RalmWarning`) print one
`warning:` line.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ralm.commands.convert import convert_app, export
from ralm.commands.index import eval_retrieval, index_app, search
from ralm.commands.lm import knnlm_app, lm_app, retro_app
from ralm.commands.shared import (DeviceOpt, DtypeOpt, LimitOpt, MinConfidenceOpt, TextHelp, WarmupHelp, positive,
                                  quiet_libraries, runtime, token_limit, torch_device)
from ralm.console import (err, notify, out, print_answer, print_lm_train, print_reliability, print_train_metrics,
                          print_train_summary)
from ralm.defaults import HYBRID_ALPHA, READ_K
from ralm.errors import RalmError, RalmWarning

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
                  help="Retrieval-augmented language models on your own corpus.")
eval_app = typer.Typer(no_args_is_help=True, help="Evaluate retrieval and question answering.")
app.add_typer(index_app, name="index")
app.command()(search)
app.add_typer(eval_app, name="eval")
eval_app.command("retrieval")(eval_retrieval)

@app.command()
def demo(
    k: int = typer.Option(READ_K, "-k", help="passages read per question (as `ralm ask`)"),
    rebuild: bool = typer.Option(False, "--rebuild", help="rebuild the cached demo index"),
    min_confidence: float = MinConfidenceOpt,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = typer.Option(False, "--json"),
):
    """Index the bundled demo corpus (cached) and answer its sample questions with the package's reader, with evidence."""
    from ralm.demo import run_demo

    quiet_libraries()
    start = time.perf_counter()
    path, built, results = run_demo(*runtime(device, dtype), positive("-k", k), rebuild, min_confidence=min_confidence)
    if as_json:
        print(json.dumps([{"question": q.question, **a.to_json(), "evidence": [{**e.to_json(), "score": round(e.retrieval_score, 6)}
                                                                             for e in a.evidence]} for q, a in results], ensure_ascii=False))
        return
    err.print(f"{'built' if built else 'reusing cached'} demo index at {path} ({time.perf_counter() - start:.1f} s)")
    for _, answer in results:
        print_answer(answer)


@app.command()
def ict(
    corpus: Path = typer.Option(..., "--corpus", help="JSONL {id,title,text}, TSV with a header, or a folder of .txt files"),
    run: Path = typer.Option(..., "--out", help="run directory (created, or resumed from its last checkpoint)"),
    model: str = typer.Option("default", "--model", help="retriever checkpoint or HF BERT directory (default: bundled MiniLM)"),
    dim: int = typer.Option(128, "--dim", help="retrieval dimension of a fresh projection"),
    steps: int = typer.Option(1000, "--steps"),
    batch_size: int = typer.Option(32, "--batch-size", help="queries per step and rank; the other blocks of all ranks' batches are the negatives"),
    lr: float = typer.Option(1e-4, "--lr"),
    warmup: int = typer.Option(100, "--warmup", help=WarmupHelp),
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

    quiet_libraries()
    cfg = IctConfig(str(corpus), model=model, dim=dim, steps=steps, batch_size=batch_size, lr=lr, warmup=warmup,
                    keep_sentence=keep_sentence, block_len=block_len, save_every=save_every, log_every=log_every, seed=seed,
                    dtype=dtype)
    result = train_ict(cfg, run, torch_device(device), notify=notify, on_metrics=print_train_metrics)
    print_train_summary(result, as_json, f"{result.steps} steps; exported {result.retriever}")


@app.command()
def pretrain(
    corpus: Path = typer.Option(..., "--corpus", help="the pre-training corpus (also the retrieval corpus)"),
    run: Path = typer.Option(..., "--out", help="run directory (created, or resumed from its last checkpoint)"),
    init: Optional[Path] = typer.Option(None, "--init", help="an ICT run (or retriever checkpoint) to start both towers from"),
    model: str = typer.Option("default", "--model", help="HF BERT directory for the towers without --init/--index and the encoder without --encoder (default: bundled MiniLM)"),
    encoder: Optional[Path] = typer.Option(None, "--encoder", help="the encoder's start: an `ralm mlm` run or a BERT masked-LM directory"),
    mlm_warmup: int = typer.Option(300, "--mlm-warmup", help="MLM warm-up steps (in RUN/mlm) when the encoder has no MLM head; 0: none"),
    index: Optional[Path] = typer.Option(None, "--index", help="an existing dense index over --corpus to start from (else one is built in RUN/index)"),
    dim: int = typer.Option(128, "--dim", help="retrieval dimension of a fresh projection"),
    steps: int = typer.Option(1000, "--steps"),
    batch_size: int = typer.Option(8, "--batch-size", help="masked sentences per step and rank (under torchrun)"),
    k: int = typer.Option(8, "-k", "--k", help="retrieved blocks per example (the null document is added)"),
    lr: float = typer.Option(5e-5, "--lr"),
    warmup: int = typer.Option(100, "--warmup", help=WarmupHelp),
    retriever_lr: float = typer.Option(1e-5, "--retriever-lr", help="the towers' learning rate (slower than the encoder's: see docs/pretraining.md)"),
    retriever_warmup: int = typer.Option(200, "--retriever-warmup", help="steps that train the encoder alone before the towers (it first learns to read evidence)"),
    masking: str = typer.Option("salient", "--masking", help="salient (entities and dates, spaCy) or random (15% of wordpieces)"),
    null_doc: bool = typer.Option(True, "--null-doc/--no-null-doc", help="the empty block among the candidates"),
    exclude_trivial: bool = typer.Option(True, "--exclude-trivial/--no-exclude-trivial", help="drop retrieved blocks of the masked sentence's own document"),
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

    quiet_libraries()
    cfg = PretrainConfig(str(corpus), init=str(init) if init else None, model=model, encoder=str(encoder) if encoder else None,
                         mlm_warmup=mlm_warmup, index=str(index) if index else None,
                         dim=dim, steps=steps, batch_size=batch_size, k=k, lr=lr, warmup=warmup, retriever_warmup=retriever_warmup,
                         retriever_lr=retriever_lr, masking=masking, null_doc=null_doc, exclude_trivial=exclude_trivial, refresh=refresh, refresh_every=refresh_every, max_len=max_len, block_len=block_len, save_every=save_every,
                         log_every=log_every, seed=seed, dtype=dtype)
    result = run_pretrain(cfg, run, torch_device(device), notify=notify, on_metrics=print_train_metrics)
    print_train_summary(result, as_json, f"{result.steps} steps; exported {result.retriever} and {result.encoder}")


@app.command()
def mlm(
    corpus: Path = typer.Option(..., "--corpus", help="the pre-training corpus"),
    run: Path = typer.Option(..., "--out", help="run directory (created, or resumed from its last checkpoint)"),
    model: str = typer.Option("default", "--model", help="HF BERT directory (default: bundled MiniLM)"),
    steps: int = typer.Option(300, "--steps"),
    head_steps: int = typer.Option(100, "--head-steps", help="first steps that train the MLM head alone"),
    batch_size: int = typer.Option(16, "--batch-size", help="masked sentences per step and rank (under torchrun)"),
    lr: float = typer.Option(1e-4, "--lr"),
    warmup: int = typer.Option(30, "--warmup", help=f"{WarmupHelp} (in each phase)"),
    masking: str = typer.Option("salient", "--masking", help="salient (entities and dates, spaCy) or random (15% of wordpieces)"),
    evidence: float = typer.Option(0.5, "--evidence", help="share of sentences read with their own block (the others with none)"),
    keep_sentence: float = typer.Option(0.5, "--keep-sentence", help="share of those blocks that still hold the sentence"),
    max_len: int = typer.Option(352, "--max-len", help="encoder input length: [CLS] x [SEP] block [SEP]"),
    block_len: int = typer.Option(288, "--block-len", help="wordpieces per block"),
    save_every: int = typer.Option(100, "--save-every"),
    log_every: int = typer.Option(10, "--log-every"),
    seed: int = typer.Option(0, "--seed"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = typer.Option(False, "--json", help="print a JSON summary at the end"),
):
    """MLM warm-up of REALM's knowledge-augmented encoder (head first, then the whole encoder);
    exports RUN/final/encoder for `ralm pretrain --encoder`."""
    from ralm.train.mlm import MlmConfig, warm_up_encoder

    quiet_libraries()
    cfg = MlmConfig(str(corpus), model=model, steps=steps, head_steps=head_steps, batch_size=batch_size, lr=lr, warmup=warmup,
                    masking=masking, evidence=evidence, keep_sentence=keep_sentence, max_len=max_len, block_len=block_len, save_every=save_every,
                    log_every=log_every, seed=seed, dtype=dtype)
    result = warm_up_encoder(cfg, run, torch_device(device), notify=notify, on_metrics=print_train_metrics)
    print_train_summary(result, as_json, f"{result.steps} steps; exported {result.encoder}")


# -- language models: `ralm lm`, `ralm retro`, `ralm knnlm` (commands/lm.py; their trainers here) --

app.add_typer(lm_app, name="lm")
app.add_typer(retro_app, name="retro")
app.add_typer(knnlm_app, name="knnlm")


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
    warmup: int = typer.Option(100, "--warmup", help=WarmupHelp),
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

    quiet_libraries()
    cfg = LMTrainConfig(text=str(text), model=LMConfig(dim=dim, layers=layers, heads=heads, max_len=positive("--seq-len", seq_len)),
                        steps=steps, batch_size=batch_size, lr=lr, warmup=warmup, tokenizer=tokenizer,
                        limit_tokens=token_limit(limit_tokens), save_every=save_every, log_every=log_every, seed=seed,
                        dtype=dtype)
    print_lm_train(train_lm(cfg, run, torch_device(device), notify=notify, on_metrics=print_train_metrics), as_json)


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
    warmup: int = typer.Option(100, "--warmup", help=WarmupHelp),
    limit_tokens: Optional[int] = LimitOpt,
    save_every: int = typer.Option(200, "--save-every"),
    log_every: int = typer.Option(10, "--log-every"),
    seed: int = typer.Option(0, "--seed"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = typer.Option(False, "--json"),
):
    """Train RETRO on a text, with neighbours from the chunk DB looked up once and cached."""
    from ralm.models.retro import training_config
    from ralm.train.lm import RetroTrainConfig, train_retro

    quiet_libraries()
    model_cfg = training_config(db, retrofit, dim=dim, layers=layers, heads=heads, neighbours=positive("--neighbours", neighbours),
                                cca_start=cca_start, cca_every=cca_every, encoder_layers=encoder_layers,
                                max_len=positive("--seq-len", seq_len))
    cfg = RetroTrainConfig(text=str(text), db=str(db), model=model_cfg, exclude_same_document=exclude_same_doc,
                           retrofit=str(retrofit or ""),
                           steps=steps, batch_size=batch_size, lr=lr, warmup=warmup, limit_tokens=token_limit(limit_tokens),
                           save_every=save_every, log_every=log_every, seed=seed, dtype=dtype)
    print_lm_train(train_retro(cfg, run, torch_device(device), notify=notify, on_metrics=print_train_metrics), as_json)


# -- open-domain QA: `ralm finetune`, `ralm dpr`, `ralm eval qa`, `ralm ask` (models/reader.py) --

def _open_qa(model: Optional[str], index_dir: Path, k: int, hybrid: Optional[Path], alpha: float, device: str, dtype: str,
             min_confidence: float):
    from ralm.pipeline import OpenQA

    dev, dt = runtime(device, dtype)
    return OpenQA.open(index_dir, model, positive("-k", k), hybrid, alpha, dev, dt, min_confidence)


HybridOpt = typer.Option(None, "--hybrid", help="a BM25 index over the same corpus to fuse with a dense --index")
AlphaOpt = typer.Option(HYBRID_ALPHA, "--alpha", help="hybrid weight of the dense score (1 - alpha for BM25)")
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
    warmup: int = typer.Option(500, "--warmup", help=f"{WarmupHelp} (then linear decay to 0)"),
    max_len: int = typer.Option(384, "--max-len", help="reader input length: [CLS] question [SEP] window [SEP] (a reader given to --init is read at it too)"),
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

    quiet_libraries()
    cfg = ReaderTrainConfig(str(questions), corpus=str(corpus) if corpus else None, init=init, steps=steps,
                            batch_size=batch_size, lr=lr, warmup=warmup, max_len=max_len, stride=stride, trainable_layers=trainable_layers,
                            limit=limit, save_every=save_every, log_every=log_every, seed=seed, dtype=dtype)
    result = train_reader(cfg, run, torch_device(device), notify=notify, on_metrics=print_train_metrics)
    print_train_summary(result, as_json, f"{result.steps} steps, {100 * result.answerable_share:.1f}% of questions had "
                                          f"a gold span; exported {result.reader} (continue open-domain with "
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
    warmup: int = typer.Option(100, "--warmup", help=f"{WarmupHelp} (then linear decay to 0)"),
    max_len: int = typer.Option(384, "--max-len", help="reader input length: [CLS] question [SEP] block [SEP] (a reader given to --init is read at it too)"),
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

    quiet_libraries()
    cfg = FinetuneConfig(str(questions), str(index_dir), init=init, steps=steps, batch_size=batch_size, k=k, lr=lr,
                         retriever_lr=retriever_lr, train_retriever=train_retriever, warmup=warmup, max_len=max_len,
                         trainable_layers=trainable_layers, limit=limit,
                         save_every=save_every, log_every=log_every, seed=seed, dtype=dtype)
    result = run_finetune(cfg, run, torch_device(device), notify=notify, on_metrics=print_train_metrics)
    print_train_summary(result, as_json, f"{result.steps} steps, {100 * result.answerable_share:.1f}% of questions had "
                                          f"an answer among their top-{k} blocks; exported {result.reader}")


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
    warmup: int = typer.Option(100, "--warmup", help=f"{WarmupHelp} (then linear decay to 0)"),
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

    quiet_libraries()
    cfg = DPRConfig(str(questions), str(corpus), model=model, dim=dim or None, steps=steps, batch_size=batch_size,
                    hard_negatives=hard_negatives, bm25_depth=bm25_depth, lr=lr, warmup=warmup, limit=limit, save_every=save_every,
                    log_every=log_every, seed=seed, dtype=dtype)
    result = train_dpr(cfg, run, torch_device(device), notify=notify, on_metrics=print_train_metrics)
    print_train_summary(result, as_json, f"{result.steps} steps on {result.trainable_questions} questions with a BM25 "
                                          f"positive; index it with `ralm index build CORPUS --model {result.retriever} --out DIR`")


@eval_app.command("qa")
def eval_qa(
    model: Optional[str] = ModelOpt,
    index_dir: Path = typer.Option(..., "--index", help="dense or BM25 index"),
    questions: Path = typer.Option(..., "--questions", help="JSONL {id, question, answers}"),
    k: int = typer.Option(READ_K, "-k", "--k", help="retrieved blocks read per question"),
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
    from ralm.eval.openqa import default_predictions_path, evaluate_qa
    from ralm.models.reader import write_calibration
    from ralm.pipeline import resolve_reader

    quiet_libraries()
    qs = read_questions(questions)
    if limit is not None:
        qs = qs[: positive("--limit", limit)]
    qa = _open_qa(model, index_dir, k, hybrid, alpha, device, dtype, min_confidence=0.0)
    predictions = predictions or default_predictions_path(questions, index_dir, hybrid)
    result = evaluate_qa(qa, qs, (1, 5, 20), positive("--batch-size", batch_size), predictions, calibrate=calibrate)
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
        print_reliability(result["reliability"])
    if calibrate:
        out.print(f"calibration fitted on {len(qs)} questions, saved in {result['calibration']}")
    out.print(f"{result['seconds']} s; predictions in {predictions}")


@app.command()
def ask(
    question: Optional[str] = typer.Argument(None, help="the question; without it, questions are read from stdin, one a line, "
                                                        "and answered as they come with the models loaded once"),
    model: Optional[str] = ModelOpt,
    index_dir: Path = typer.Option(..., "--index", help="dense or BM25 index"),
    k: int = typer.Option(READ_K, "-k", "--k", help="retrieved blocks read"),
    hybrid: Optional[Path] = HybridOpt,
    alpha: float = AlphaOpt,
    min_confidence: float = MinConfidenceOpt,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = typer.Option(False, "--json", help="print {answer, no_answer, score, confidence, evidence: [{id, title, text, "
                                                       "retrieval_score, span}]} (one line per question when read from stdin)"),
):
    """Answer a question with evidence: the most probable answer over the top-k blocks."""
    quiet_libraries()
    if question is not None and not question.strip():
        raise RalmError("the question is empty")
    qa = _open_qa(model, index_dir, k, hybrid, alpha, device, dtype, min_confidence)
    for q in [question] if question is not None else _stdin_questions():
        answer = qa.answer([q])[0]
        if as_json:
            print(json.dumps(answer.to_json(), ensure_ascii=False), flush=True)
        else:
            print_answer(answer)


def _stdin_questions():
    """Non-empty lines of stdin; on a terminal, a prompt before each."""
    prompt = sys.stdin.isatty()
    if prompt:
        err.print("ready: one question a line, Ctrl-D to end")
    while True:
        if prompt:
            err.print("[bold]?[/bold] ", end="")
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.strip()


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

    from ralm.pipeline import resolve_reader
    from ralm.serve.app import create_app
    from ralm.serve.service import ServeConfig, Service

    quiet_libraries()
    if not 0 < port < 65536:
        raise RalmError(f"--port must be in 1..65535, got {port}")
    svc = Service(ServeConfig(index=str(index_dir), model=model or str(resolve_reader(None)), bm25=str(bm25) if bm25 else None,
                              api_key=api_key, host=host, allowed_hosts=tuple(allowed_host), min_confidence=min_confidence),
                  *runtime(device, dtype))
    err.print(f"serving {index_dir} ({svc.stats()['corpus_blocks']} blocks, retrievers: {', '.join(svc.retrievers())}"
              f", reader {svc.cfg.model}) on http://{host}:{port}")
    uvicorn.run(create_app(svc), host=host, port=port, log_level="warning")


app.add_typer(convert_app, name="convert")
app.command()(export)


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
