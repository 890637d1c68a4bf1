"""Does the REALM block format cost the default dense index recall? Recall@k of the default
document tower (the bundled MiniLM, its own vectors) over the same blocks written four ways:

  pair288   [CLS] title [SEP] body [SEP], up to 288 wordpieces: what `ralm index build` encodes
  pair256   the same, cut to 256 (the sentence-transformers model's max_seq_length)
  text288   [CLS] title body [SEP]: the title's [SEP] dropped, as sentence-transformers users
            encode "title text"
  text256   both: exactly the plain model's input of benchmarks/retrieval/squad_retrieval.py

  python benchmarks/retrieval/block_format.py --corpus ../shared/data/squad_corpus.jsonl \\
      ../shared/data/squad_dev_official_corpus.jsonl --questions ../shared/data/squad_dev.jsonl \\
      ../shared/data/squad_dev_official.jsonl --distractors 3000 --work runs/block_format

For CPU time the corpus is a subset: every paragraph some question was written on (its
`doc_id`) plus `--distractors` others drawn at random (seed 0). Blocks are ralm's own (split
between sentences); the four variants differ only in the tokens the document tower reads.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
import torch


def subset(corpora: list[str], gold: set[str], distractors: int, out: Path) -> Path:
    from ralm.atomic import atomic_path

    docs = [json.loads(line) for path in corpora for line in Path(path).read_text(encoding="utf-8").splitlines()]
    others = [d for d in docs if d["id"] not in gold]
    keep = [d for d in docs if d["id"] in gold] + random.Random(0).sample(others, min(distractors, len(others)))
    with atomic_path(out) as tmp:
        tmp.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in keep), encoding="utf-8")
    return out


def variants(blocks, sep_id: int) -> dict[str, list[np.ndarray]]:
    def cut(row: np.ndarray, n: int) -> np.ndarray:
        return row if len(row) <= n else np.concatenate([row[: n - 1], [sep_id]])

    rows = [np.asarray(blocks.tokens[i]) for i in range(len(blocks))]
    joined = [np.delete(r, int(blocks.body_start[i]) - 1) for i, r in enumerate(rows)]  # the title's [SEP] out
    return {"pair288": rows, "pair256": [cut(r, 256) for r in rows],
            "text288": joined, "text256": [cut(r, 256) for r in joined]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", nargs="+", required=True)
    ap.add_argument("--questions", nargs="+", required=True)
    ap.add_argument("--distractors", type=int, default=3000)
    ap.add_argument("--work", required=True)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    from ralm.data.blocks import ensure_block_store
    from ralm.data.qa import has_answer, read_questions
    from ralm.eval.metrics import recall_at_k
    from ralm.retrieval.towers.encoders import Retriever
    from ralm.retrieval.towers.encoding import encode_rows

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    question_sets = {Path(q).name: read_questions(q) for q in args.questions}
    gold = {q.extra.get("doc_id") for qs in question_sets.values() for q in qs}
    corpus = work / "corpus.jsonl"
    if not corpus.is_file():
        subset(args.corpus, gold, args.distractors, corpus)
    retriever = Retriever.from_pretrained(None)
    _, blocks = ensure_block_store(work / "blocks", corpus, retriever.tokenizer)
    texts = [blocks.record(i)["text"] for i in range(len(blocks))]
    queries = {name: retriever.encode_queries([q.question for q in qs], dtype=args.dtype) for name, qs in question_sets.items()}
    result: dict = {"blocks": len(blocks), "dtype": args.dtype}
    for variant, rows in variants(blocks, retriever.tokenizer.sep_token_id).items():
        emb = np.zeros((len(rows), retriever.dim), dtype=np.float32)
        encode_rows(retriever.doc, rows, np.array([len(r) for r in rows]), out=emb, description=variant, dtype=args.dtype)
        matrix = torch.from_numpy(emb)
        for name, qs in question_sets.items():
            top = torch.topk(queries[name] @ matrix.T, min(100, len(rows)), dim=1).indices.numpy()
            hits = [[has_answer(texts[int(j)], q.answers) for j in row] for q, row in zip(qs, top)]
            result[f"{variant}/{name}"] = {k: round(v, 2) for k, v in recall_at_k(hits, (1, 5, 20, 100)).items()}
            print(json.dumps({f"{variant}/{name}": result[f"{variant}/{name}"]}), flush=True)
    (work / "result.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
