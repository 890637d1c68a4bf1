"""`ralm index build|check|upgrade|add|delete|compact`, `ralm search` and `ralm eval retrieval`:
indexes over a corpus, their documents, and what they retrieve."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ralm.atomic import check_output
from ralm.commands.from_config import config_command
from ralm.commands.shared import (DeviceOpt, DtypeOpt, ExcludeOpt, IncludeOpt, JsonOpt, MoreArgs, OldSpellings, check_faiss_spec, check_models,
                                  check_npy, check_runtime, corpus_files, corpus_option, flag_option, index_option, index_path, main_rank,
                                  positionals, positive, quiet_libraries, removed_on_error, runtime)
from ralm.configs import CORPUS_HELP, option
from ralm.data.geometry import GEOMETRY
from ralm.data.qa import check_length
from ralm.console import out, print_hits, print_json, print_summary
from ralm.defaults import EMBED_BATCH, FAISS_AUTO, INDEX_KIND, RETRIEVAL_KS, SEARCH_K
from ralm.errors import RalmError, plural
from ralm.retrieval.search.query import QueryConfig

BATCH_HELP = "blocks embedded per forward pass (memory against speed)"


@dataclass(frozen=True)
class IndexBuildConfig:
    """`ralm index build`'s settings (the library's: retrieval.index.build.build_index)."""

    kind: str = option(INDEX_KIND, "what each version holds: hybrid (a dense and a BM25 side, searched fused), dense or bm25",
                       old=("--retriever",))
    faiss: str = option(FAISS_AUTO, "the dense side's search: auto (exact below 250,000 blocks, else IVF-SQ8 with lists chosen "
                        "from N), exact, or a faiss index: Flat, IVF1024,Flat, HNSW32 ...")
    dim: int = option(0, "0: the encoder's own vectors, no projection (keeps its recall); N: a fresh PCA-initialised "
                      f"projection to N (REALM's {GEOMETRY.dim})")
    batch_size: int = option(EMBED_BATCH, BATCH_HELP)
    replace: bool = option(False, "into an index holding live updates (`index add/delete`, a server's writes, compacted or "
                           "not): drop them, the new version holding CORPUS alone (refused without it)", flag="--replace")


@dataclass(frozen=True)
class IndexUpgradeConfig:
    """`ralm index upgrade`'s settings (retrieval.index.build.upgrade_index)."""

    kind: str = option(INDEX_KIND, "the kind to upgrade to (hybrid: add the missing side)", old=("--retriever",))
    batch_size: int = option(EMBED_BATCH, BATCH_HELP)


@dataclass(frozen=True)
class SearchConfig:
    """`ralm search`'s settings: the query config its searcher holds (SEARCH_K passages; nothing is read)."""

    query: QueryConfig = option(default_factory=functools.partial(QueryConfig, k=SEARCH_K), omit=("min_confidence",))


@dataclass(frozen=True)
class EvalRetrievalConfig:
    ks: str = option(",".join(map(str, RETRIEVAL_KS)), "comma-separated cut-offs")
    query: QueryConfig = option(default_factory=QueryConfig, omit=("k", "min_confidence"))  # k: --ks; nothing is read

index_app = typer.Typer(no_args_is_help=True, help="Build indexes over a corpus, upgrade them, add and delete documents, compact their logs.")


@index_app.command("build", cls=OldSpellings)
@config_command
def index_build(
    more: list[str] = MoreArgs,  # `ralm index build CORPUS`, the older spelling
    *,
    corpus: Optional[Path] = corpus_option(),
    out_dir: Path = typer.Option(..., "--out", help="index directory (created, or given a new version)"),
    include: list[str] = IncludeOpt,
    exclude: list[str] = ExcludeOpt,
    model: Optional[str] = typer.Option(None, "--model", help="retriever checkpoint, HF model directory or hub name (default: bundled MiniLM)"),
    cfg: IndexBuildConfig,
    embeddings: Optional[Path] = typer.Option(None, "--embeddings", help="precomputed block embeddings (.npy [blocks, dim], "
                                              "row i = block i) made by --model's document tower: imported, not encoded"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = JsonOpt,
):
    """Split a corpus into REALM blocks and index them: dense embeddings and BM25, in one version."""
    start = time.perf_counter()
    corpus = Path(positionals("index build", more, options={"--corpus": corpus}, old=("--corpus",))["--corpus"])
    check_output("--out", out_dir, [("--corpus", corpus), ("--model", model), ("--embeddings", embeddings)], directory=True)
    files = corpus_files(corpus, include, exclude)
    kind, faiss, dim, batch_size = cfg.kind, cfg.faiss, cfg.dim, positive("--batch-size", cfg.batch_size)
    check_models(model)
    check_faiss_spec("--faiss", faiss)
    check_npy("--embeddings", embeddings)
    check_runtime(device, dtype)
    from ralm.retrieval.index.live_updates import check_rebuild

    check_rebuild(out_dir, replace=cfg.replace)  # before torch loads; the build checks again
    from ralm.retrieval.backends.faiss_index import AUTO, FACTORY_DIMS, check_spec
    from ralm.retrieval.index.build import build_index

    quiet_libraries()
    reports = main_rank()  # under torchrun every rank encodes; rank 0 reports
    rt = runtime(device, dtype)
    spec = None if faiss == "exact" else faiss
    if spec not in (None, AUTO):
        check_spec(spec, (dim,) if dim > 0 else FACTORY_DIMS)
    if embeddings is not None:
        from ralm.retrieval.index.dense_side import holds_dense

        if not holds_dense(kind):
            raise RalmError(f"--embeddings: a {kind} index has no dense side to import them into")
        if dim > 0:
            raise RalmError("--embeddings keep the dimension of the model that made them; --dim adds an untrained projection")
        if not embeddings.is_file():
            raise RalmError(f"--embeddings {embeddings}: no such file")
    with removed_on_error(out_dir):
        index, version = build_index(corpus, out_dir, kind=kind, model=model, dim=dim or None, faiss_spec=spec, files=files,
                                     batch_size=batch_size, runtime=rt, show_progress=reports,
                                     embeddings=embeddings, replace=cfg.replace)
    if not reports:
        return
    summary = {**index.summary(version), "seconds": round(time.perf_counter() - start, 1)}
    print_summary(summary, as_json, f"[green]built[/green] {out_dir} {version}: {plural(summary['blocks'], 'block')}, {kind}"
                  f"{', dim ' + str(summary['dim']) if summary['dim'] else ''} in {summary['seconds']} s")


@index_app.command("check", cls=OldSpellings)
def index_check(
    more: list[str] = MoreArgs,  # `ralm index check DIR`, the older spelling
    *,
    index_dir: Optional[Path] = index_option(),
    as_json: bool = JsonOpt,
):
    """Verify that the index serves: its files, manifests and update log, against their checksums.

    Every version's files against its manifest (sizes, shapes, dtypes, checksums, no NaN/inf in
    the embeddings), the manifest against its own checksum, its sides known and present, and the
    update log: every record against its checksum, every live state against the one its record
    holds. A fault is one line naming the file and exit code 2."""
    index_dir = index_path(_index_given("index check", more, index_dir))
    from ralm.atomic import manifest_file, read_json
    from ralm.retrieval.index.kinds import side_class
    from ralm.retrieval.index.store import IndexDir
    from ralm.retrieval.index.verify import check_corpus_copies, check_full, check_manifest
    from ralm.retrieval.search.update_log import UpdateLog

    index = IndexDir(index_dir)
    latest = index.latest()
    named = index.versions()
    # a version is named only when complete and LATEST moves to it at once (store.py publish):
    # an older one in LATEST is a flipped digit, or a publish cut off between the two
    if named and latest != named[-1]:
        raise RalmError(f"{index.root / 'LATEST'} names {latest}, but {named[-1]} is newer and complete: LATEST is damaged, or "
                        f"a publish was cut off before it moved; publish anew (`ralm index compact --index {index_dir}`, or a build)")
    versions = []
    for name in named:
        manifest = index.version(name)
        path = index.version_path(name)
        checked = check_full(path, manifest.files)
        if len(index.blocks(manifest.blocks)) != manifest.count:
            raise RalmError(f"{path}: its entry count differs from its block store's; the index is damaged: rebuild it")
        try:  # sides this ralm knows, making a kind, each with its files
            kind = manifest.kind
            missing = next((side for side in manifest.sides if not side_class(side).files(path)), None)
        except RalmError as e:
            raise RalmError(f"{path}: {e}; the index is damaged: rebuild it") from None
        if missing is not None:
            raise RalmError(f"{path}: its manifest names a {missing} side, whose files are missing; the index is damaged: rebuild it")
        sealed = check_manifest(manifest_file(path), read_json(manifest_file(path)))  # last: what it says was checked first
        versions.append({"version": name, "files": checked, "verified": manifest.files is not None, "kind": kind,
                         "retriever": kind, "manifest_checksum": sealed})
    copies = check_corpus_copies(index.root)
    log = UpdateLog(index.root).check()
    unverified = [v["version"] for v in versions if not v["verified"]]
    unsealed = [v["version"] for v in versions if v["verified"] and not v["manifest_checksum"]]
    summary = {"index": str(index_dir), "kind": index.kind, "retriever": index.kind, "latest": latest, "versions": versions,
               "logged_updates": len(log.records), "log_checksums": log.checksums or not log.records, "sound": True}
    cut = f"; the log ends in {log.size - log.end} bytes of an append cut off by a crash (never acknowledged)" if log.size > log.end else ""
    if unsealed:
        cut += f"; the manifests of {', '.join(unsealed)} predate manifest checksums"
    if not summary["log_checksums"]:
        cut += "; the update log predates record checksums (its records unverified until a compaction writes it anew)"
    print_summary(summary, as_json, f"[green]sound[/green] {index_dir}: {plural(len(versions), 'version')}, latest {latest}, "
                  f"{plural(sum(v['files'] for v in versions) + copies, 'file')} verified"
                  + (f", {plural(len(log.records), 'logged update')}" if log.records else "")
                  + (f"; {', '.join(unverified)} predate file inventories (rebuild to verify them)" if unverified else "") + cut)


@config_command
def search(
    query: Optional[str] = typer.Argument(None, help="free text (required)", show_default=False),
    more: list[str] = MoreArgs,  # `ralm search DIR QUERY`, the older spelling: QUERY comes second
    *,
    index_dir: Optional[Path] = index_option(),
    cfg: SearchConfig,
    model: Optional[str] = typer.Option(None, "--model", help="retriever checkpoint (default: the one the index was built with)"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = flag_option("--json", help="print [{id, title, score, text, found_by}]"),
):
    """Search an index with a free-text query (every side it holds, fused, with its live documents)."""
    given = positionals("search", [query, *more], options={"--index": index_dir}, takes=("QUERY",), old=("--index",))
    index_dir, query = Path(given["--index"]), given["QUERY"]
    if query is None:
        raise RalmError("missing QUERY; the spelling is `ralm search --index DIR QUERY`")
    if not query.strip():
        raise RalmError("the query is empty")
    check_length(query, "the query")
    index_path(index_dir)
    check_models(model)
    check_runtime(device, dtype)
    from ralm.retrieval.search.live import LiveSearcher

    quiet_libraries()
    rt = runtime(device, dtype)
    hits = LiveSearcher.open(index_dir, model=model, query=cfg.query, runtime=rt).search([query])[0]
    if not main_rank():
        return
    if as_json:
        print_json([h.to_json() for h in hits], ensure_ascii=False)
    else:
        print_hits(hits, query)


@config_command
def eval_retrieval(
    more: list[str] = MoreArgs,  # `ralm eval retrieval DIR`: named as a mistake, with the spelling meant
    *,
    index_dir: Optional[Path] = index_option(),
    questions: Optional[Path] = typer.Option(None, "--questions", help="JSONL {id, question, answers} (required)", show_default=False),
    cfg: EvalRetrievalConfig,
    limit: Optional[int] = typer.Option(None, "--limit", help="first N questions only"),
    predictions: Optional[Path] = typer.Option(None, "--predictions", help="write per-question results (JSONL)"),
    model: Optional[str] = typer.Option(None, "--model", help="retriever checkpoint for the dense side (default: the one the "
                                        "index was built with)"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = JsonOpt,
):
    """recall@k: a question counts when a top-k passage contains a normalised answer."""
    from ralm.data.qa import read_questions

    given = positionals("eval retrieval", more, options={"--index": index_dir, "--questions": questions})
    index_dir, questions = Path(given["--index"]), Path(given["--questions"])
    ks = cfg.ks
    try:
        cutoffs = sorted({positive("--ks", int(x)) for x in ks.split(",") if x.strip()})
    except ValueError:
        raise RalmError(f"--ks must be comma-separated integers, got {ks!r}") from None
    if not cutoffs:
        raise RalmError("--ks names no cut-off")
    if predictions is not None:
        check_output("--predictions", predictions, [("--questions", questions), ("--index", index_dir), ("--model", model)])
    qs = read_questions(questions)
    if limit is not None:
        qs = qs[: positive("--limit", limit)]
    index_path(index_dir)
    check_models(model)
    check_runtime(device, dtype)
    from ralm.eval.retrieval import evaluate_retrieval
    from ralm.retrieval.search.live import LiveSearcher

    quiet_libraries()
    rt = runtime(device, dtype)
    searcher = LiveSearcher.open(index_dir, model=model, query=cfg.query, runtime=rt)
    reports = main_rank()
    result = evaluate_retrieval(searcher, qs, ks=cutoffs, predictions=predictions if reports else None, show_progress=reports)
    if not reports:
        return
    if as_json:
        print_json(result)
        return
    table = Table(title=f"retrieval on {questions.name} ({result['questions']} questions, {result['kind']})")
    for c in cutoffs:
        table.add_column(f"recall@{c}")
    table.add_row(*(f"{result[f'recall@{c}']:.1f}" for c in cutoffs))
    out.print(table)
    out.print(f"{result['seconds']} s")


@index_app.command("upgrade", cls=OldSpellings)
@config_command
def index_upgrade(
    more: list[str] = MoreArgs,  # `ralm index upgrade DIR`, the older spelling
    *,
    index_dir: Optional[Path] = index_option("an index directory (e.g. a dense index built before indexes were hybrid)"),
    cfg: IndexUpgradeConfig,
    model: Optional[str] = typer.Option(None, "--model", help="encoder for a dense side added to a BM25 index (default: bundled MiniLM)"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = JsonOpt,
):
    """Publish a version with the sides the index lacks (BM25 over a dense index: seconds), keeping its files and live updates."""
    start = time.perf_counter()
    index_dir = index_path(_index_given("index upgrade", more, index_dir))
    kind, batch_size = cfg.kind, positive("--batch-size", cfg.batch_size)
    check_models(model)
    check_runtime(device, dtype)
    from ralm.retrieval.index.build import upgrade_index
    from ralm.retrieval.index.store import IndexDir

    quiet_libraries()
    before = IndexDir(index_dir).latest()
    rt = runtime(device, dtype)
    index, version = upgrade_index(index_dir, kind=kind, model=model, batch_size=batch_size, runtime=rt)
    summary = {**index.summary(version), "seconds": round(time.perf_counter() - start, 1), "upgraded": version != before}
    if summary["upgraded"]:
        line = f"[green]upgraded[/green] {index_dir} to {summary['kind']} ({version}) in {summary['seconds']} s"
    else:
        line = f"nothing to do: {index_dir} ({version}) already holds every side of a {kind} index ({summary['kind']})"
    print_summary(summary, as_json, line)


@index_app.command("add", cls=OldSpellings)
def index_add(
    more: list[str] = MoreArgs,  # `ralm index add DIR CORPUS`, the older spelling
    *,
    index_dir: Optional[Path] = index_option("index directory"),
    corpus: Optional[Path] = corpus_option(f"documents to add or replace: {CORPUS_HELP}"),
    include: list[str] = IncludeOpt,
    exclude: list[str] = ExcludeOpt,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = JsonOpt,
):
    """Add or replace documents (every side of the index), durably, through the index's update log; no server needed."""
    given = positionals("index add", more, options={"--index": index_dir, "--corpus": corpus},
                        old=("--index", "--corpus"))
    index_dir, corpus = Path(given["--index"]), Path(given["--corpus"])
    files = corpus_files(corpus, include, exclude)
    index_path(index_dir)
    check_runtime(device, dtype)
    from ralm.data.corpus import read_corpus, sectioned_files
    from ralm.retrieval.search.live import LiveSearcher

    quiet_libraries()
    docs = list(read_corpus(corpus, files=files))
    rt = runtime(device, dtype)
    live = LiveSearcher.open(index_dir, runtime=rt)
    ids, gone = live.replace_files(docs, sectioned_files(corpus, files=files))
    summary = {"index": str(index_dir), "added": len(ids), "deleted": len(gone), "blocks": len(live), "index_version": live.current.name}
    print_summary(summary, as_json, f"[green]added[/green] {plural(len(ids), 'document')} to {index_dir}"
                  + (f" (and deleted {plural(len(gone), 'section')} their files no longer hold)" if gone else "")
                  + f": {plural(len(live), 'block')} searchable")


@index_app.command("delete")
def index_delete(
    ids: list[str] = typer.Argument(..., help="document ids; a file's name (guide.md) deletes its every section and page "
                                    "(guide.md#setup, paper.pdf#page=2), a section's id that section alone"),
    *,
    index_dir: Optional[Path] = index_option("index directory"),
    as_json: bool = JsonOpt,
):
    """Delete documents by id (every side of the index), durably, through the index's update log."""
    if index_dir is None and len(ids) > 1:  # `ralm index delete DIR ID...`, the older spelling
        index_dir, ids = Path(ids[0]), ids[1:]
    if index_dir is None:
        raise RalmError(f"missing option --index (read {ids[0]!r} as ID); the spelling is `ralm index delete --index DIR ID...`")
    index_path(index_dir)
    from ralm.retrieval.search.live import LiveSearcher

    quiet_libraries()
    live = LiveSearcher.open(index_dir)
    ids = list(dict.fromkeys(ids))
    named = {i: live.documents_named(i) for i in ids}
    missing = [i for i, found in named.items() if not found]
    if missing:
        raise RalmError(f"{index_dir} holds no document {missing[0]!r}" + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else ""))
    deleted = live.delete(ids)
    files = [i for i, found in named.items() if found != [i]]  # names of files: their sections went too
    summary = {"index": str(index_dir), "deleted": len(deleted), "blocks": len(live), "index_version": live.current.name,
               "documents": deleted}
    print_summary(summary, as_json, f"[green]deleted[/green] {plural(summary['deleted'], 'document')} from {index_dir}"
                  + (f" (every section of {', '.join(files)})" if files else "") + f": {plural(len(live), 'block')} searchable")


@index_app.command("compact", cls=OldSpellings)
def index_compact(
    more: list[str] = MoreArgs,  # `ralm index compact DIR`, the older spelling
    *,
    index_dir: Optional[Path] = index_option("index directory"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = JsonOpt,
):
    """Fold the update log into a new index version (nothing is embedded again); safe while in use.

    Opening the index then reads a short log; a server or other commands may use the index meanwhile."""
    index_dir = index_path(_index_given("index compact", more, index_dir))
    from ralm.retrieval.search.compaction import compact_index
    from ralm.retrieval.search.live import LiveSearcher

    quiet_libraries()
    rt = runtime(device, dtype)
    done = compact_index(LiveSearcher.open(index_dir, runtime=rt), show_progress=main_rank())
    summary = done.to_json()
    if done.version is None:
        print_summary(summary, as_json, f"{index_dir}: nothing to compact (the update log holds no update), {plural(done.blocks, 'block')}")
    else:
        print_summary(summary, as_json, f"[green]compacted[/green] {plural(done.folded, 'logged update')} of {index_dir} into {done.version}: "
                      f"{plural(done.blocks, 'block')} in {done.seconds} s")


def _index_given(command: str, more: list[str], index_dir: Optional[Path]) -> Path:
    """--index of a command that takes no other positional (`ralm index check DIR` is its older spelling)."""
    return Path(positionals(command, more, options={"--index": index_dir}, old=("--index",))["--index"])
