"""EM / F1 of open-domain QA over a grid of reading settings, from one pass of the reader:
blocks read per question (k) and the hybrid weight alpha, for dense, BM25 and hybrid retrieval.
Chooses ralm's defaults (ralm/defaults.py) on held-back questions.

  python benchmarks/qa_settings.py --index runs/dev --questions runs/calibration.jsonl --work runs/tune/cal.json

Per question it retrieves the top 100 of both sides of a hybrid index (the fusion candidates of
ralm.retrieval.search.fusion) and reads, once, every block that any
setting of the grid reads (about 20 per question), keeping each block's `N_BEST` spans and
log-normaliser: exactly what `OpenQA.answer` uses, so each setting's answer is `pick_answer`'s.
Each block is read whole, as `ralm eval qa` does, but alone, not batched with the question's other
blocks, so bf16 rounding may move a few answers. The dump is kept in --work; a rerun only scores.
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
    """Per question: both retrievers' scores over the union of their top DEPTH, and the reader's
    best spans in each block some setting of the grid reads."""
    from ralm.models.reader import NEG, top_spans, valid_spans
    from ralm.pipeline import N_BEST
    from ralm.progress import track
    from ralm.retrieval.search.fusion import candidates, fuse_weighted
    from ralm.runtime import autocast

    hs, reader = qa.searcher, qa.reader
    snap = hs.current
    blocks = snap.blocks
    out = []
    for q in track(questions, len(questions), "reading", enabled=show_progress):
        encoded = {s: hs.encode([q.question], s) for s in ("dense", "bm25")}
        lists = {s: hs.side_search(encoded[s], DEPTH, snap, s) for s in encoded}
        c = candidates(hs, encoded, lists, 0, snap)  # as the fusion of `ralm search` draws them
        rows, dense, bm25 = c.rows, c.scores["dense"], c.scores["bm25"]
        b_scores, b_rows = (x[:, : max(KS)] for x in lists["bm25"])  # BM25 alone
        read = set(b_rows[0].tolist()) | set(rows[np.argsort(-dense, kind="stable")[: max(KS)]].tolist())
        for a in ALPHAS:
            read |= set(rows[np.argsort(-fuse_weighted({"dense": dense, "bm25": bm25}, {}, a), kind="stable")[: max(KS)]].tolist())
        read = sorted(read)
        batch = reader.featurize([q.question] * len(read), [blocks.record(r)["text"] for r in read], max_len=reader.max_read_len)
        with autocast(qa.device, qa.dtype):
            scores = reader(batch.to(qa.device))
        f, start, width, log_norm = (t.cpu() for t in top_spans(scores, valid_spans(batch, reader.cfg.max_span_width), N_BEST))
        spans = {}
        for n, r in enumerate(read):
            has = batch.evidence_end[n] > batch.evidence_start[n]
            spans[str(r)] = {"log_norm": float(log_norm[n]),
                             "spans": [[float(f[n, j]), reader.span_text(batch, n, int(start[n, j]), int(width[n, j]))[0]]
                                       for j in range(f.shape[1]) if has and f[n, j] > NEG / 2]}
        out.append({"answers": list(q.answers), "rows": rows.tolist(), "dense": dense.tolist(), "bm25": bm25.tolist(),
                    "bm25_rows": b_rows[0].tolist(), "bm25_scores": b_scores[0].tolist(), "read": spans})
    return out


def score(data: list[dict], system: str, k: int, alpha: float = 0.5) -> tuple[float, float]:
    """EM, F1 (percent) of `pick_answer` over the dump, reading the top k of `system`."""
    from ralm.eval.metrics import exact_match, f1
    from ralm.pipeline import pick_answer
    from ralm.retrieval.search.fusion import fuse_weighted

    em = f1_sum = 0.0
    for d in data:
        rows, dense, bm25 = np.array(d["rows"]), np.array(d["dense"], np.float32), np.array(d["bm25"], np.float32)
        if system == "bm25":
            s, r = np.array(d["bm25_scores"][:k], np.float32), np.array(d["bm25_rows"][:k])
        else:
            fused = dense if system == "dense" else fuse_weighted({"dense": dense, "bm25": bm25}, {}, alpha)
            top = np.argsort(-fused, kind="stable")[:k]
            s, r = fused[top], rows[top]
        reads = [d["read"][str(int(x))] for x in r]
        n = max(1, max(len(b["spans"]) for b in reads))
        f = torch.full((len(reads), n), -1e4)
        texts = []
        for j, b in enumerate(reads):
            f[j, : len(b["spans"])] = torch.tensor([v for v, _ in b["spans"]])
            texts.append([(t, None) for _, t in b["spans"]] + [None] * (n - len(b["spans"])))
        log_norm = torch.tensor([b["log_norm"] for b in reads])
        _, best, shown = pick_answer(torch.log_softmax(torch.from_numpy(s), 0), f, log_norm, texts)
        pred = texts[best][shown[best]][0] if best is not None else ""
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
