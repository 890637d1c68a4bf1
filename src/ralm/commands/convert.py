"""`ralm convert`: checkpoints saved by other libraries into ralm's (convert/)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ralm.atomic import check_output
from ralm.commands.shared import JsonOpt, flag_option, quiet_libraries
from ralm.console import out, print_json, print_summary

convert_app = typer.Typer(no_args_is_help=True, help="Import checkpoints saved by other libraries.")


@convert_app.command("hf-realm")
def convert_hf_realm_cmd(
    src: Path = typer.Argument(..., help="a Hugging Face REALM directory (transformers 4.x: RealmEmbedder, RealmScorer, "
                                         "RealmKnowledgeAugEncoder, RealmReader or RealmForOpenQA)"),
    run: Path = typer.Option(..., "--out", help="run directory: writes RUN/final/{retriever,encoder,reader} (those the source holds)"),
    doc_embedder: Optional[Path] = typer.Option(None, "--doc-embedder", help="RealmForOpenQA only: a RealmEmbedder/RealmScorer "
                                                "directory for the document tower (default: a copy of the query embedder)"),
    as_json: bool = flag_option("--json", help="print the conversion summary as JSON"),
):
    """Convert Hugging Face REALM weights (safetensors or pytorch_model.bin, weights only) into our checkpoints."""
    check_output("--out", run, [("SRC", src), ("--doc-embedder", doc_embedder)], directory=True)
    from ralm.convert.hf_realm import convert_hf_realm

    quiet_libraries()
    summary = convert_hf_realm(src, run, doc_embedder)
    if as_json:
        print_json(summary)
        return
    out.print(f"[green]converted[/green] {src} ({summary['architecture']}) -> "
              + ", ".join(f"{name}: {path}" for name, path in summary["components"].items()))
    if "doc_tower" in summary:
        out.print(f"document tower: {summary['doc_tower']}")
    if summary["ignored_tensors"]:
        out.print(f"[dim]{len(summary['ignored_tensors'])} unused tensors dropped (see {run / 'final' / 'conversion.json'})[/dim]")


def export(
    source: Path = typer.Argument(..., help="a retriever or reader checkpoint, or a run (its RUN/final/retriever or RUN/final/reader)"),
    fmt: str = typer.Option(..., "--format", help="sentence-transformers (retrievers), hf (plain Hugging Face directories) or package (a reader in fp16 shards, as the package ships its own)"),
    dest: Path = typer.Option(..., "--out", help="the new directory to write"),
    *,
    part: Optional[str] = typer.Option(None, "--part", help="retriever or reader: which model of a run to export (needed when the "
                                       "run holds both)"),
    as_json: bool = JsonOpt,
):
    """Export a trained retriever or reader as directories sentence-transformers and transformers load.

    A retriever's query and document towers, or a reader, written as those libraries load them,
    as they are (docs/interop.md)."""
    check_output("--out", dest, [("SOURCE", source)], directory=True)
    from ralm.convert.export import export_model

    quiet_libraries()
    summary = export_model(source, dest, fmt, part=part)
    print_summary(summary, as_json, f"[green]exported[/green] {summary['kind']} {summary['source']} as {fmt}: "
                  + ", ".join(f"{name} {path}" for name, path in summary["parts"].items()))
