"""The reader alone: closed reading of each question's gold paragraph (one block, nothing
retrieved), EM/F1 by the pipeline's own answer rule (`read_blocks` + `pick_answer`); the ceiling
the reader puts on open-domain answers, measured apart from retrieval.

    python benchmarks/reader/gold_reading.py --questions Q.jsonl --corpus C.jsonl [--reader DIR] --predictions OUT.jsonl

Questions name their paragraph by "doc_id" in the corpus. Per-question rows go to --predictions
(for benchmarks/reader/compare.py); the summary is printed as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=Path, required=True)
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--reader", default=None, help="reader checkpoint (default: the package's)")
    ap.add_argument("--predictions", type=Path, required=True)
    ap.add_argument("--batch-size", type=int, default=16)
    args = ap.parse_args()

    import torch

    from ralm.data.qa import read_questions
    from ralm.eval.metrics import exact_match, f1
    from ralm.models.reader import Reader
    from ralm.pipeline import pick_answer, read_blocks, resolve_reader
    from ralm.runtime import resolve_dtype

    start = time.perf_counter()
    questions = read_questions(args.questions)
    texts = {d["id"]: d["text"] for d in map(json.loads, args.corpus.read_text(encoding="utf-8").splitlines())}
    reader = Reader.from_pretrained(resolve_reader(args.reader)).eval()
    device = torch.device("cpu")
    dtype = resolve_dtype("auto", device)
    rows = []
    with torch.inference_mode():
        for i in range(0, len(questions), args.batch_size):
            chunk = questions[i : i + args.batch_size]
            blocks = read_blocks(reader, [q.question for q in chunk], [texts[q.extra["doc_id"]] for q in chunk],
                                 device=device, dtype=dtype)
            for q, block in zip(chunk, blocks):
                answer = pick_answer(torch.zeros(1), [block]).answer
                rows.append({"id": q.id, "prediction": answer, "em": exact_match(answer, q.answers),
                             "f1": round(f1(answer, q.answers), 4)})
    args.predictions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    n = len(rows)
    print(json.dumps({"questions": n, "em": round(100 * sum(r["em"] for r in rows) / n, 2),
                      "f1": round(100 * sum(r["f1"] for r in rows) / n, 2), "dtype": str(dtype).removeprefix("torch."),
                      "seconds": round(time.perf_counter() - start, 1)}))


if __name__ == "__main__":
    main()
