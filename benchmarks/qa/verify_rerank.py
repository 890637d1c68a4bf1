"""Would the verifier choose the answer better than p(a|x) does? EM when each question's answer is
the candidate of highest p(a|x) * P(supported)^beta among its top M, for several beta.

Reads as `OpenQA.answer` does (the top k of the index's sides, each block with its title). A
question's candidates are `pick_answer`'s answer, then its answer once the spans of the answers
before are taken out of the blocks (each block keeps its normaliser and null, so the others' p(a|x)
is unchanged); each is checked by `check_answers` on its own best block's sentence, as served.
beta = 0 is the pipeline's own answer. Choose on the calibration half (odd lines of
squad_dev_official.jsonl), never on the held-out half or a check.

    python benchmarks/qa/verify_rerank.py --index runs/dev --questions runs/calibration.jsonl [--model READER]

Prints per M the share of questions with a right answer among the top M (the ceiling of any
choice), then one JSON line per (M, beta): EM (percent), and the share of questions whose answer
changed.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

BETAS = (0.0, 0.25, 0.5, 1.0, 2.0)
MS = (2, 3, 5)


def candidates(qa, questions: list[str], m: int) -> list[list[tuple[str, float, float]]]:
    """Per question, its top m answers: (text, p(a|x), the verifier's P(supported))."""
    import numpy as np
    import torch

    from ralm.data.qa import normalize_answer
    from ralm.pipeline import check_answers, pick_answer, read_blocks

    snap = qa.searcher.current
    ranked = qa.searcher.rank(questions, qa.k, snap, query=qa.query)
    k = min(qa.k, ranked.rows.shape[1])
    records = [[snap.blocks.record(int(r)) for r in rows[:k]] for rows in ranked.rows]
    read = read_blocks(qa.reader, [q for q in questions for _ in range(k)], [r["text"] for rec in records for r in rec],
                       titles=[r["title"] for rec in records for r in rec], runtime=qa.runtime)
    log_pz = torch.log_softmax(torch.from_numpy(np.asarray(ranked.scores[:, :k], dtype=np.float32)), -1)  # [Q, k]
    readings = []
    for qi in range(len(questions)):
        blocks, mine = read[qi * k : qi * k + k], []
        for _ in range(m):
            r = pick_answer(log_pz[qi], blocks)
            if r.best is None:
                break
            mine.append(r)
            taken = normalize_answer(r.answer)
            blocks = [replace(b, spans=[s for s in b.spans if normalize_answer(s.text) != taken]) for b in blocks]
        readings.append(mine)
    flat = [(qi, r) for qi, mine in enumerate(readings) for r in mine]
    checks = check_answers(qa.reader, [questions[qi] for qi, _ in flat], [r for _, r in flat],
                           [records[qi] for qi, _ in flat], runtime=qa.runtime)
    out: list[list[tuple[str, float, float]]] = [[] for _ in questions]
    for (qi, r), c in zip(flat, checks):
        out[qi].append((r.answer, r.score, c.get("p_verify", 1.0)))
    return out


def main() -> None:
    import torch

    from ralm.data.qa import read_questions
    from ralm.eval.metrics import exact_match
    from ralm.pipeline import OpenQA
    from ralm.progress import track

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", required=True)
    ap.add_argument("--questions", required=True)
    ap.add_argument("--model", default=None, help="reader (default: the package's)")
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    qa = OpenQA.open(args.index, args.model)
    if qa.reader.verify_head is None:
        raise SystemExit("this reader has no verifier")
    questions = read_questions(args.questions)
    cands: list[list[tuple[str, float, float]]] = []
    with torch.inference_mode():
        for b in track(range(0, len(questions), args.batch), -(-len(questions) // args.batch), "reading"):
            cands += candidates(qa, [q.question for q in questions[b : b + args.batch]], max(MS))
    for m in MS:
        among = sum(any(exact_match(c[0], q.answers) for c in cs[:m]) for q, cs in zip(questions, cands))
        print(json.dumps({"candidates": m, "right_among": round(100 * among / len(questions), 2)}), flush=True)
        for beta in BETAS:
            em = changed = 0
            for q, c in zip(questions, cands):
                if not c:
                    continue
                pick = max(c[:m], key=lambda x: x[1] * x[2] ** beta)
                em += exact_match(pick[0], q.answers)
                changed += pick[0] != c[0][0]
            print(json.dumps({"candidates": m, "beta": beta, "em": round(100 * em / len(questions), 2),
                              "changed": round(100 * changed / len(questions), 2)}), flush=True)


if __name__ == "__main__":
    main()
