"""`ralm eval evidence`: REALM's evidence gain on held-out text (eval/evidence.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ralm.commands.shared import DeviceOpt, DtypeOpt, JsonOpt, quiet_libraries, runtime
from ralm.console import print_summary
from ralm.defaults import EVIDENCE_BATCH, EVIDENCE_SENTENCES, REALM_K


def eval_evidence(
    *,
    model: Path = typer.Option(..., "--model", help="a `ralm pretrain` run (its final/retriever and final/encoder) or a "
                               "retriever directory (then give --encoder)"),
    encoder: Optional[Path] = typer.Option(None, "--encoder", help="the knowledge-augmented encoder (default: the run's)"),
    index: Path = typer.Option(..., "--index", help="dense index over the pre-training corpus, built with the run's "
                               "document tower (`ralm index build CORPUS --model RUN/final/retriever --kind dense`)"),
    corpus: Path = typer.Option(..., "--corpus", help="held-out corpus (JSONL {id, title, text}, TSV or a folder of .txt)"),
    k: Optional[int] = typer.Option(None, "-k", "--k", help=f"retrieved blocks per sentence (default {REALM_K}, as pre-training)"),
    limit: Optional[int] = typer.Option(None, "--limit", help="masked sentences scored, spread over the corpus "
                                        f"(default {EVIDENCE_SENTENCES}; 0: all)"),
    cache: Optional[Path] = typer.Option(None, "--cache", help="keep the held-out corpus' blocks and spaCy pass here"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help=f"sentences per forward pass (default {EVIDENCE_BATCH})"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = JsonOpt,
):
    """REALM's evidence gain: the masked salient-span loss with the retrieved blocks vs with the null block only."""
    from ralm.eval.evidence import EvidenceConfig, evidence_gain

    quiet_libraries()
    values = {name: v for name, v in (("k", k), ("batch_size", batch_size), ("cache", cache and str(cache))) if v is not None}
    if limit is not None:
        values["limit"] = limit or None  # 0: every sentence
    cfg = EvidenceConfig(str(model), str(encoder or model), str(index), str(corpus), **values)  # a bad field: cli.main names its flag
    s = evidence_gain(cfg, runtime(device, dtype))
    print_summary(s.to_json(), as_json, summary_line(s))


def summary_line(s) -> str:
    """The line `eval evidence` prints for its EvidenceScores."""
    # articles are the units resampled: from one, every draw is the same and the interval says nothing
    interval = (f"95% interval {s.gain_ci95[0]:+.4f} to {s.gain_ci95[1]:+.4f} over {s.articles:,} articles" if s.articles > 1
                else "one article: no interval")
    return (f"evidence gain {s.evidence_gain:+.4f} nats per masked wordpiece ({interval}; null only {s.loss_null:.4f}, with "
            f"retrieval {s.loss_retrieved:.4f}); retrieval helps {100 * s.helped_share:.1f}% of {s.sentences} "
            f"sentences ({s.wordpieces} masked wordpieces)")
