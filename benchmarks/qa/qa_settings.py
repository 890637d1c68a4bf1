"""EM / F1 of open-domain QA over a grid of reading settings, from one pass of the reader:
blocks read per question (k) and the hybrid weight alpha, for dense, BM25 and hybrid retrieval.
Chooses ralm's defaults (ralm/defaults.py) on held-back questions.

  python benchmarks/qa/qa_settings.py --index runs/dev --questions runs/calibration.jsonl --work runs/tune/cal.json

Per question it retrieves the top 100 of both sides of a hybrid index (the fusion candidates of
ralm.retrieval.search.fusion) and reads, once, every block that any setting of the grid reads
(about 20 per question) with the pipeline's `read_blocks`, keeping what its `pick_answer` needs of
each block, so each setting's answer is `OpenQA.answer`'s. The blocks are batched as a question's
union, not as each setting's top k, so bf16 rounding may move a few answers. The dump is kept in
--work; a rerun only scores.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

KS = (3, 5, 8, 10)
ALPHAS = (0.3, 0.4, 0.5, 0.6, 0.7)
DEPTH = 100  # the fusion's default (ralm/defaults.py FUSION_DEPTH)


@torch.inference_mode()
def dump(qa, questions, show_progress: bool = True) -> list[dict]:
    """Per question: both retrievers' scores over the union of their top DEPTH, and what the reader
    found in each block some setting of the grid reads."""
    from ralm.pipeline import read_blocks
    from ralm.progress import track
    from ralm.retrieval.search.fusion import Fusion, candidates, fuse_weighted

    hs = qa.searcher
    snap = hs.current
    out = []
    for q in track(questions, len(questions), "reading", enabled=show_progress):
        encoded = {s: hs.encode([q.question], s) for s in ("dense", "bm25")}
        lists = {s: hs.side_search(encoded[s], DEPTH, snap, s) for s in encoded}
        c = candidates(hs, encoded, lists, i=0, snap=snap)  # as the fusion of `ralm search` draws them
        rows, dense, bm25 = c.rows, c.scores["dense"], c.scores["bm25"]
        b_scores, b_rows = (x[:, : max(KS)] for x in lists["bm25"])  # BM25 alone
        read = set(b_rows[0].tolist()) | set(rows[np.argsort(-dense, kind="stable")[: max(KS)]].tolist())
        for a in ALPHAS:
            weights = Fusion(alpha=a).side_weights(("dense", "bm25"))
            read |= set(rows[np.argsort(-fuse_weighted({"dense": dense, "bm25": bm25}, {}, weights), kind="stable")[: max(KS)]].tolist())
        read = sorted(read)
        blocks = read_blocks(qa.reader, [q.question] * len(read), [snap.blocks.record(r)["text"] for r in read],
                             runtime=qa.runtime)
        out.append({"answers": list(q.answers), "rows": rows.tolist(), "dense": dense.tolist(), "bm25": bm25.tolist(),
                    "bm25_rows": b_rows[0].tolist(), "bm25_scores": b_scores[0].tolist(),
                    "read": {str(r): {"log_norm": b.log_norm, "spans": [[s.score, s.text] for s in b.spans]}
                             for r, b in zip(read, blocks)}})
    return out


def score(data: list[dict], system: str, k: int, alpha: float = 0.5) -> tuple[float, float]:
    """EM, F1 (percent) of `pick_answer` over the dump, reading the top k of `system`."""
    from ralm.eval.metrics import exact_match, f1
    from ralm.pipeline import ReadBlock, Span, pick_answer
    from ralm.retrieval.search.fusion import Fusion, fuse_weighted

    weights = Fusion(alpha=alpha).side_weights(("dense", "bm25"))
    em = f1_sum = 0.0
    for d in data:
        rows, dense, bm25 = np.array(d["rows"]), np.array(d["dense"], np.float32), np.array(d["bm25"], np.float32)
        if system == "bm25":
            s, r = np.array(d["bm25_scores"][:k], np.float32), np.array(d["bm25_rows"][:k])
        else:
            fused = dense if system == "dense" else fuse_weighted({"dense": dense, "bm25": bm25}, {}, weights)
            top = np.argsort(-fused, kind="stable")[:k]
            s, r = fused[top], rows[top]
        blocks = [ReadBlock([Span(f, text, None) for f, text in b["spans"]], b["log_norm"]) for b in (d["read"][str(int(x))] for x in r)]
        pred = pick_answer(torch.log_softmax(torch.from_numpy(s), 0), blocks).answer
        em += exact_match(pred, d["answers"])
        f1_sum += f1(pred, d["answers"])
    return round(100 * em / len(data), 2), round(100 * f1_sum / len(data), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", required=True, help="a hybrid index (dense and BM25 sides)")
    ap.add_argument("--questions", required=True)
    ap.add_argument("--model", default=None, help="reader (default: the package's)")
    ap.add_argument("--work", type=Path, required=True, help="the dump (JSON), written once and reused")
    args = ap.parse_args()

    from ralm.atomic import atomic_path
    from ralm.data.qa import read_questions
    from ralm.pipeline import OpenQA

    if not args.work.is_file():
        qa = OpenQA.open(args.index, args.model)
        data = dump(qa, read_questions(args.questions))
        with atomic_path(args.work) as tmp:
            tmp.write_text(json.dumps(data))
    data = json.loads(args.work.read_text())
    result = {}
    for k in KS:
        result[f"dense/k{k}"], result[f"bm25/k{k}"] = score(data, "dense", k), score(data, "bm25", k)
        for a in ALPHAS:
            result[f"hybrid{a}/k{k}"] = score(data, "hybrid", k, a)
        print(json.dumps({key: v for key, v in result.items() if key.endswith(f"/k{k}")}), flush=True)
    print(json.dumps({"questions": len(data), "em_f1": result}, indent=1))


if __name__ == "__main__":
    main()
