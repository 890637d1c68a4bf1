"""Two systems' predictions on the same questions, compared per question: the metric of each,
questions gained and lost, the two-sided sign test, and a 95% bootstrap interval of the
difference that resamples articles (questions of one article are not independent).

    python benchmarks/reader/compare.py BEFORE.predictions.jsonl AFTER.predictions.jsonl --questions Q.jsonl [--metric em]

Predictions are `ralm eval qa --predictions` files (or any JSONL with "id" and the metric);
--questions gives each question's article ("title"; questions without one are their own unit).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import article_interval  # noqa: E402


def sign_test(gained: int, lost: int) -> float:
    """Two-sided exact binomial test of gained vs lost at p = 1/2."""
    n, k = gained + lost, min(gained, lost)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def compare(before: dict[str, float], after: dict[str, float], units: dict[str, str]) -> dict:
    ids = [i for i in before if i in after]
    if len(ids) != len(before) or len(ids) != len(after):
        raise SystemExit(f"the two files hold different questions ({len(before)} and {len(after)}, {len(ids)} shared)")
    b, a = np.array([before[i] for i in ids]), np.array([after[i] for i in ids])
    lo, hi = article_interval(a - b, [units.get(i, i) for i in ids])
    gained, lost = int(((a > b)).sum()), int((a < b).sum())
    return {"questions": len(ids), "units": len({units.get(i, i) for i in ids}), "before": round(100 * b.mean(), 2),
            "after": round(100 * a.mean(), 2), "diff": round(100 * (a - b).mean(), 2),
            "diff_ci95_by_article": [round(100 * lo, 2), round(100 * hi, 2)], "gained": gained, "lost": lost,
            "sign_test_p": round(sign_test(gained, lost), 4)}


def read(path: Path, metric: str) -> dict[str, float]:
    return {r["id"]: float(r[metric]) for r in map(json.loads, path.read_text().splitlines())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--questions", type=Path, required=True)
    ap.add_argument("--metric", default="em")
    args = ap.parse_args()
    units = {q["id"]: q.get("title", q["id"]) for q in map(json.loads, args.questions.read_text().splitlines())}
    print(json.dumps(compare(read(args.before, args.metric), read(args.after, args.metric), units)))


if __name__ == "__main__":
    main()
