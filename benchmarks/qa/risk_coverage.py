"""Risk-coverage curve of a calibrated reader, from the predictions of `ralm eval qa` (each row has
"confidence" and "em"), beside another reader's on the same questions.

  python benchmarks/qa/risk_coverage.py AFTER.predictions.jsonl [--before BEFORE.predictions.jsonl] \
      --out benchmarks/figures/risk_coverage_hybrid.png [--title "hybrid, held-out half"]

Plot questions the confidence was not fitted on (the held-out half of benchmarks/qa/selective.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from ralm.eval.calibration import risk_coverage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import calibrated_predictions  # noqa: E402


def curve(predictions: Path) -> dict:
    rows = calibrated_predictions(predictions)
    return risk_coverage([r["confidence"] for r in rows], [r["em"] for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("after", type=Path)
    ap.add_argument("--before", type=Path, default=None)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--title", default="hybrid, held-out half")
    ap.add_argument("--labels", default="before,after", help="the two curves' names, comma-separated")
    args = ap.parse_args()
    before_name, after_name = args.labels.split(",")
    fig, ax = plt.subplots(figsize=(5.5, 4))
    aurc = {}
    for name, path, color in ((before_name, args.before, "0.5"), (after_name, args.after, "C0")):
        if path is None:
            continue
        rc = curve(path)
        aurc[name] = rc["aurc"]
        ax.plot(rc["coverage"], rc["risk"], label=f"{name} (AURC {rc['aurc']:.3f})", color=color)
    ax.set_xlabel("coverage (share of questions answered)")
    ax.set_ylabel("risk (share of answers that are wrong)")
    ax.set_title(f"risk-coverage, {args.title}\n(half of the questions have no answer in the corpus)", fontsize=9)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(json.dumps({"out": str(args.out), "aurc": aurc}))


if __name__ == "__main__":
    main()
