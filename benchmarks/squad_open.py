"""SQuAD-open: one fine-tuned reader, several retrievers (BM25, dense, hybrid, DPR, ICT, REALM).

Runs the `ralm` commands below, times each, and appends one JSON line per command to --log.
Retrieval is over the whole squad_corpus.jsonl; the subsets are deterministic (seeded shuffle).

  python benchmarks/squad_open.py subsets --out /tmp/squad-open        # train / dev subsets
  python benchmarks/squad_open.py finetune --index /tmp/runs/squad-bm25 --run RUN -- --steps 100 ...
  python benchmarks/squad_open.py eval --run RUN --retriever bm25=/tmp/runs/squad-bm25 \
      --retriever dense=/tmp/runs/squad-dense --retriever hybrid=/tmp/runs/squad-dense+/tmp/runs/squad-bm25
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def run(cmd: list[str], log: Path, label: str) -> dict:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = round(time.perf_counter() - start, 1)
    if proc.returncode != 0:
        sys.exit(f"{label} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    record = {"label": label, "command": " ".join(cmd), "wall_seconds": seconds, "result": result}
    with open(log, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record))
    return record


def subsets(args) -> None:
    """train_sub.jsonl: 20,000 shuffled training questions; dev500.jsonl: 500 shuffled dev questions."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)  # one generator, train first: the order matters
    for src, name, n in (("squad_train.jsonl", "train_sub.jsonl", 20000), ("squad_dev.jsonl", "dev500.jsonl", 500)):
        lines = (Path(args.data) / src).read_text().splitlines()
        rng.shuffle(lines)
        (out / name).write_text("\n".join(lines[:n]) + "\n")


def finetune(args) -> None:
    cmd = ["ralm", "finetune", "--questions", args.questions, "--index", args.index, "--out", args.run, "--json", *args.extra]
    run(cmd, Path(args.log), f"finetune {Path(args.index).name}")


def evaluate(args) -> None:
    for spec in args.retriever:
        name, _, where = spec.partition("=")
        dense, _, bm25 = where.partition("+")
        cmd = ["ralm", "eval", "qa", "--model", args.run, "--index", dense, "--questions", args.questions,
               "--limit", str(args.limit), "-k", str(args.k), "--json"]
        if bm25:
            cmd += ["--hybrid", bm25]
        run(cmd, Path(args.log), f"eval qa {name}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="stage", required=True)
    s = sub.add_parser("subsets")
    s.add_argument("--data", default=str(DATA))
    s.add_argument("--out", required=True)
    f = sub.add_parser("finetune")
    f.add_argument("--questions", required=True)
    f.add_argument("--index", required=True)
    f.add_argument("--run", required=True)
    f.add_argument("--log", default="squad_open.jsonl")
    f.add_argument("extra", nargs="*", help="more `ralm finetune` options, after --")
    e = sub.add_parser("eval")
    e.add_argument("--run", required=True)
    e.add_argument("--questions", default=str(DATA / "squad_dev.jsonl"))
    e.add_argument("--retriever", action="append", required=True, help="name=INDEX or name=DENSE+BM25 (hybrid)")
    e.add_argument("--limit", type=int, default=200)
    e.add_argument("-k", type=int, default=5)
    e.add_argument("--log", default="squad_open.jsonl")
    args = p.parse_args()
    {"subsets": subsets, "finetune": finetune, "eval": evaluate}[args.stage](args)


if __name__ == "__main__":
    main()
