"""Reliability plot of a calibrated reader: share of exact matches per confidence bin, from the
predictions of `ralm eval qa` with a calibrated reader (each row has "confidence" and "em").

  python benchmarks/qa/reliability.py HELDOUT.predictions.jsonl --out benchmarks/figures/reader_reliability.png

Plot the questions the calibration was NOT fitted on: on its own fit set isotonic regression
is calibrated by construction.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from ralm.eval.calibration import reliability

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import calibrated_predictions  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("predictions", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--bins", type=int, default=10)
    args = ap.parse_args()
    rows = calibrated_predictions(args.predictions)
    rel = reliability([r["confidence"] for r in rows], [r["em"] for r in rows], bins=args.bins)

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(5, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    width = 1 / args.bins
    top.bar([b["lo"] for b in rel["bins"]], [b["accuracy"] for b in rel["bins"]], width=width, align="edge",
            edgecolor="black", alpha=0.7, label="share correct (EM)")
    top.plot([b["confidence"] for b in rel["bins"]], [b["accuracy"] for b in rel["bins"]], "o", color="black",
             label="at the bin's mean confidence")
    top.plot([0, 1], [0, 1], "--", color="gray", label="perfect calibration")
    top.set_ylabel("share of answers correct")
    top.set_title(f"{args.predictions.stem}: {len(rows)} questions, ECE {rel['ece']:.3f}")
    top.legend(loc="upper left", fontsize=8)
    bottom.bar([b["lo"] for b in rel["bins"]], [b["count"] for b in rel["bins"]], width=width, align="edge", edgecolor="black")
    bottom.set_xlabel("calibrated confidence")
    bottom.set_ylabel("questions")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(json.dumps({"questions": len(rows), **rel}))


if __name__ == "__main__":
    main()
