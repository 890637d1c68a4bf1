"""ICT warm start, then REALM pre-training with the asynchronous index builder, on the first
N paragraphs of the SQuAD corpus (CPU-sized by default). Copies the curves to
benchmarks/figures/ and prints a JSON summary (wall times, steps/s, first/last metrics).

    python benchmarks/realm/pretrain_squad.py --paragraphs 300 --ict-steps 100 --steps 700
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import DATA, FIGURES, run  # noqa: E402


def window_mean(rows: list[dict], key: str, first: bool, n: int) -> float:
    vals = [r[key] for r in rows if r.get(key) is not None]
    part = vals[:n] if first else vals[-n:]
    return round(sum(part) / len(part), 4)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--corpus", default=str(DATA / "squad_corpus.jsonl"))
    p.add_argument("--paragraphs", type=int, default=300)
    p.add_argument("--work", default="/tmp/ralm-bench-pretrain")
    p.add_argument("--ict-steps", type=int, default=100)
    p.add_argument("--ict-batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=700)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--max-len", type=int, default=160)
    p.add_argument("--block-len", type=int, default=96)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--retriever-warmup", type=int, default=200)
    p.add_argument("--retriever-lr", type=float, default=1e-5)
    p.add_argument("--refresh-every", type=int, default=50)
    p.add_argument("--device", default="cpu")
    p.add_argument("--figures", default=str(FIGURES))
    args = p.parse_args()

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / f"squad{args.paragraphs}.jsonl"
    if not corpus.is_file():
        with open(args.corpus) as src:
            corpus.write_text("".join(line for _, line in zip(range(args.paragraphs), src)))
    ralm = [sys.executable, "-m", "ralm"]
    ict_s = run([*ralm, "ict", "--corpus", str(corpus), "--out", str(work / "ict"), "--steps", str(args.ict_steps),
                 "--batch-size", str(args.ict_batch_size), "--warmup", "30", "--save-every", str(args.ict_steps),
                 "--log-every", "10", "--block-len", str(args.block_len), "--device", args.device], work / "ict.log")
    pre_s = run([*ralm, "pretrain", "--corpus", str(corpus), "--out", str(work / "realm"), "--init", str(work / "ict"),
                 "--steps", str(args.steps), "--batch-size", str(args.batch_size), "-k", str(args.k),
                 "--max-len", str(args.max_len), "--block-len", str(args.block_len), "--lr", str(args.lr), "--warmup", "50",
                 "--retriever-warmup", str(args.retriever_warmup), "--retriever-lr", str(args.retriever_lr), "--refresh", "async",
                 "--refresh-every", str(args.refresh_every), "--save-every", "100", "--log-every", "10",
                 "--device", args.device], work / "realm.log")

    figures = Path(args.figures)
    figures.mkdir(parents=True, exist_ok=True)
    for stage, keys in (("ict", ["loss", "in_batch_accuracy"]), ("realm", ["loss", "retrieval_utility", "span_in_top", "staleness", "p_null", "steps_per_s"])):
        for key in keys:
            shutil.copyfile(work / stage / f"{key}.png", figures / f"pretrain_{stage}_{key}.png")
    ict_rows = [json.loads(line) for line in (work / "ict" / "metrics.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (work / "realm" / "metrics.jsonl").read_text().splitlines()]
    refreshes = [json.loads(line) for line in (work / "realm" / "refresh.log").read_text().splitlines() if line.startswith("{")]
    published = [r for r in refreshes if r.get("event") == "published"]
    summary = {
        "paragraphs": args.paragraphs, "device": args.device,
        "ict": {"steps": args.ict_steps, "batch_size": args.ict_batch_size, "wall_s": ict_s,
                "loss_first": window_mean(ict_rows, "loss", True, 2), "loss_last": window_mean(ict_rows, "loss", False, 2),
                "acc_first": window_mean(ict_rows, "in_batch_accuracy", True, 2), "acc_last": window_mean(ict_rows, "in_batch_accuracy", False, 2),
                "steps_per_s": window_mean(ict_rows, "steps_per_s", False, len(ict_rows))},
        "realm": {"steps": args.steps, "batch_size": args.batch_size, "k": args.k, "wall_s": pre_s,
                  "loss_first": window_mean(rows, "loss", True, 2), "loss_last": window_mean(rows, "loss", False, 2),
                  "utility_first": window_mean(rows, "retrieval_utility", True, 2),
                  "utility_last": window_mean(rows, "retrieval_utility", False, 2),
                  "utility_max_window": max(r["retrieval_utility"] for r in rows),
                  "span_in_top_first": window_mean(rows, "span_in_top", True, 10),
                  "span_in_top_last": window_mean(rows, "span_in_top", False, 10),
                  "staleness_mean": window_mean(rows, "staleness", True, len(rows)),
                  "steps_per_s": window_mean(rows, "steps_per_s", False, len(rows)),
                  "versions_published": len(published),
                  "refresh_s": [r["seconds"] for r in published]},
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
