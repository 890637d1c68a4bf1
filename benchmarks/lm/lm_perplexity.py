"""Perplexity on WikiText-2 (valid, test) of the base LM, the kNN-LM and RETRO with and without
retrieval, plus the WikiText/training-text article overlap. Figures for benchmarks/RESULTS.md.

The models come from the commands in benchmarks/RESULTS.md (RETRO and kNN-LM) (`ralm lm train`,
`ralm knnlm build`, `ralm retro build-db`, `ralm retro train`); this script only evaluates:

  python benchmarks/lm/lm_perplexity.py --lm RUN_LM --store STORE --retro RUN_RETRO --db DB \
      --train-text ../shared/data/squad_corpus.jsonl --limit-tokens 20000 --out results.json

--lm/--store (base LM + kNN-LM over a λ × temperature grid) and --retro/--db (RETRO with and
without retrieval) may be given separately.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

from ralm.data.chunks import read_lm_documents, tokenize_text
from ralm.eval.perplexity import knnlm_eval, retro_perplexity
from ralm.models.lm import load_lm
from ralm.models.retro import load_retro
from ralm.retrieval.lm.chunkdb import ChunkDB, text_neighbours
from ralm.retrieval.lm.datastore import Datastore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import DATA  # noqa: E402

WIKITEXT = DATA / "wikitext-2-raw"


def normalise_title(title: str) -> str:
    """WikiText writes 'M @-@ 82 ( Michigan highway )'; Wikipedia 'M-82 (Michigan highway)'."""
    t = re.sub(r" @(.)@ ", r"\1", title)
    t = re.sub(r"\s+([,.;:)])", r"\1", t)
    return re.sub(r"\(\s+", "(", t).replace("_", " ").strip().lower()


def title_overlap(wikitext: Path, train_text: Path) -> dict:
    train = {normalise_title(d.key) for d in read_lm_documents(train_text)}
    titles = [normalise_title(d.key) for d in read_lm_documents(wikitext)]
    shared = sorted(t for t in titles if t in train)
    return {"articles": len(titles), "in_training_text": len(shared), "shared": shared}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm", help="base LM (with --store: base LM and kNN-LM figures)")
    ap.add_argument("--store")
    ap.add_argument("--retro", help="RETRO run (with --db: retrieval on/off figures)")
    ap.add_argument("--db")
    ap.add_argument("--train-text", required=True)
    ap.add_argument("--splits", default="valid,test")
    ap.add_argument("--limit-tokens", type=int, default=20_000, help="leading wordpieces of each split evaluated")
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--lmbda", default="0.1,0.25,0.5")
    ap.add_argument("--temperature", default="1,3,10,30", help="p_kNN softmax temperatures (grid searched once)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device("cpu")
    lambdas = [float(x) for x in args.lmbda.split(",")]
    temperatures = [float(x) for x in args.temperature.split(",")]
    results = {"limit_tokens": args.limit_tokens, "k": args.k, "splits": {}}
    if args.lm:
        lm, tok = load_lm(args.lm)
        store = Datastore(args.store)
        store.check_model(args.lm)
        results.update(store_entries=len(store), lm_parameters=sum(p.numel() for p in lm.parameters()))
    if args.retro:
        retro, rtok = load_retro(args.retro)
        db = ChunkDB(args.db, device)
        results.update(db_chunks=len(db), retro_parameters=sum(p.numel() for p in retro.parameters()))
    for split in args.splits.split(","):
        path = WIKITEXT / f"wiki.{split}.raw"
        row = {"overlap": title_overlap(path, Path(args.train_text))}
        results["splits"][split] = row
        if args.lm:
            stream = tokenize_text(path, tok, args.limit_tokens, show_progress=False)
            row["knnlm"] = knnlm_eval(lm, store, stream, k=args.k, lambdas=lambdas, temperatures=temperatures, device=device,
                                      show_progress=False)
            print(json.dumps({split: row["knnlm"]}), flush=True)
        if not args.retro:
            continue
        rstream = tokenize_text(path, rtok, args.limit_tokens, show_progress=False)
        start = time.perf_counter()  # the neighbours, retrieved once: retro_perplexity reads them from the DB's cache
        text_neighbours(db, rstream, k=retro.cfg.neighbours, exclude_same_doc=False, show_progress=False)
        row["retro_retrieval_seconds"] = round(time.perf_counter() - start, 1)
        for name, retrieval in (("retro", True), ("retro_off", False)):
            start = time.perf_counter()
            row[name] = retro_perplexity(retro, db, rstream, retrieval=retrieval, device=device, show_progress=False)
            row[name]["seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps({split: {k: row[k] for k in ("retro", "retro_off")}}), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
