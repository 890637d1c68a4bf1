"""Which fusion of an index's sides is the default: weighted score fusion (several dense weights)
vs reciprocal rank fusion, with each side alone for reference.

    python benchmarks/qa/fusion.py --index runs/dev --questions runs/calibration.jsonl [--em 300] [--out FILE]

Recall@1/5/20/100 of every setting over the questions; with --em N, EM/F1 of the first N
questions read through the pipeline (reading defaults) for the fused settings. Choose on the
calibration half (odd lines of squad_dev_official.jsonl), then report the choice on the
held-back half and on squad_dev.jsonl. Last stdout line: JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SETTINGS = {"weighted a=0.5": ("weighted", 0.5), "weighted a=0.7": ("weighted", 0.7), "weighted a=0.9": ("weighted", 0.9),
            "rrf": ("rrf", None), "dense": (None, None), "bm25": (None, None)}  # name -> (fusion, dense weight)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--index", required=True)
    ap.add_argument("--questions", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--em", type=int, default=0, help="also EM/F1 of the first N questions for the fused settings")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    args = ap.parse_args()

    from ralm.data.qa import has_answer, read_questions
    from ralm.eval.metrics import recall_at_k
    from ralm.eval.openqa import evaluate_qa
    from ralm.models.reader import Reader, default_reader_path
    from ralm.pipeline import OpenQA, open_searcher
    from ralm.retrieval.search.fusion import Fusion

    questions = read_questions(args.questions)[: args.limit]
    searcher = open_searcher(args.index)
    reader = Reader.from_pretrained(default_reader_path()) if args.em else None
    out = {}
    for name in args.settings.split(","):
        method, alpha = SETTINGS[name]
        side = name if method is None else None
        searcher.fusion = Fusion(method, alpha) if alpha is not None else Fusion(method) if method else Fusion()
        start = time.perf_counter()
        hits = []
        for i in range(0, len(questions), 64):
            batch = questions[i : i + 64]
            for q, found in zip(batch, searcher.search([q.question for q in batch], 100, side)):
                hits.append([has_answer(h.text, q.answers) for h in found])
        row = {k: round(v, 2) for k, v in recall_at_k(hits, (1, 5, 20, 100)).items()}
        row["retrieval_seconds"] = round(time.perf_counter() - start, 1)
        if args.em and method is not None:
            qa = OpenQA(reader, searcher, min_confidence=0.0, side=side)
            r = evaluate_qa(qa, questions[: args.em], show_progress=False)
            row.update(em=r["em"], f1=r["f1"], em_questions=r["questions"], em_seconds=r["seconds"])
        out[name] = row
        print(name, row, flush=True)
    print(json.dumps({"questions": len(questions), "index": args.index, "settings": out}))


if __name__ == "__main__":
    main()
