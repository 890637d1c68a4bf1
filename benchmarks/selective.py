"""Selective answering on held-back questions, half of whose articles are removed from the corpus.

The honest unanswerable set: the questions of SQuAD official-dev articles whose paragraphs are
deleted from the index (through its update log, as a user deletes documents); every other
article, related ones included, stays. Questions are split as everywhere in benchmarks/RESULTS.md:
odd lines of squad_dev_official.jsonl are the calibration half, even lines the held-back half.

For each index kind it answers both halves over that index and fits the two-stage confidence
(models/confidence.py: P(an answer is in the blocks read) x P(right | read)) on the calibration
half; the threshold is chosen there on confidences cross-fitted by article (no article helps
predict itself); it reports on the held-back half: the share of answerable and of unanswerable
questions answered, the EM of the answers given, AUROC (answerable vs removed; right vs wrong),
and the risk-coverage curve (PNG) against `--before` (another run's held-back confidences).
The fallback map ("*", for any other kind) is fitted on the default kind's answers with the
reader's own signals. Writes WORK/reader: the reader with the fitted maps, each recording the
reader, k and threshold rule it was fitted with.

    python benchmarks/selective.py --index runs/dev --work runs/selective [--reader DIR] [--kinds hybrid,dense,bm25]
        [--before runs/selective-old]

`--index`: a hybrid index over squad_corpus.jsonl + squad_dev_official_corpus.jsonl (it is not
modified: a linked copy in WORK gets the deletions). Resumes: finished answer files are reused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def removed_articles(questions: list) -> set[str]:
    """Articles holding about half of the questions, taken in the order of a hash of the title."""
    count: dict[str, int] = {}
    for q in questions:
        count[q.extra["title"]] = count.get(q.extra["title"], 0) + 1
    removed, n = set(), 0
    for title in sorted(count, key=lambda t: hashlib.sha1(t.encode()).hexdigest()):
        if n + count[title] <= len(questions) / 2:  # an article that would pass half is skipped
            removed.add(title)
            n += count[title]
    return removed


def index_without(index: Path, work: Path, removed: set[str]) -> Path:
    from ralm.retrieval.search.live import LiveSearcher

    sel = work / "index"
    if not sel.exists():
        shutil.copytree(index, work / "index.tmp", copy_function=os.link)  # published files are never modified in place
        (work / "index.tmp" / "updates.jsonl").unlink(missing_ok=True)
        live = LiveSearcher.open(work / "index.tmp")
        corpus = DATA / "squad_dev_official_corpus.jsonl"
        ids = [json.loads(line)["id"] for line in corpus.read_text().splitlines() if json.loads(line)["title"] in removed]
        live.delete(ids)
        os.rename(work / "index.tmp", sel)
    return sel


def answers(qa, questions, path: Path) -> list[dict]:
    from ralm.eval.openqa import evaluate_qa

    if not path.is_file():
        result = evaluate_qa(qa, questions, predictions=path, show_progress=False)
        (path.with_suffix(".result.json")).write_text(json.dumps(result))
    return [json.loads(line) for line in path.read_text().splitlines()]


def selective_at(conf: np.ndarray, em: np.ndarray, answerable: np.ndarray, t: float) -> dict:
    ans = conf >= t
    return {"threshold": t, "answerable_answered": round(float(ans[answerable].mean()), 4),
            "unanswerable_answered": round(float(ans[~answerable].mean()), 4),
            "answered_em": round(float(em[ans].mean()), 4) if ans.any() else None, "answered": round(float(ans.mean()), 4)}


def choose_threshold(conf: np.ndarray, em: np.ndarray, answerable: np.ndarray, max_risk: float, max_unanswerable: float) -> float:
    """The lowest threshold (most answers) at which at most max_unanswerable of the unanswerable
    questions are answered and the answers given are right at least 1 - max_risk of the time."""
    for t in np.round(np.arange(0.05, 0.96, 0.01), 2):
        s = selective_at(conf, em, answerable, float(t))
        if s["answered_em"] is not None and s["answered_em"] >= 1 - max_risk and s["unanswerable_answered"] <= max_unanswerable:
            return float(t)
    return 0.95


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--reader", default=None, help="reader checkpoint (default: the package's)")
    ap.add_argument("--kinds", default="hybrid,dense,bm25")
    ap.add_argument("--max-unanswerable", type=float, default=0.07,
                    help="the threshold: the lowest at which at most this share of the calibration half's unanswerable "
                         "questions get an answer (a margin under the 10%% target)")
    ap.add_argument("--max-risk", type=float, default=1.0, help="and at which the answers given there are right at least "
                                                               "1 - this of the time (1: no such bound)")
    ap.add_argument("--before", type=Path, default=None, help="a WORK of an earlier run: its held-back curve is drawn as 'before'")
    ap.add_argument("--cal-limit", type=int, default=None, help="N evenly spaced questions of the calibration half")
    ap.add_argument("--heldout-limit", type=int, default=None, help="N evenly spaced questions of the held-back half")
    args = ap.parse_args()

    import torch

    from ralm.data.qa import read_questions
    from ralm.eval.calibration import auroc, cross_fitted, fit_two_stage, risk_coverage, side_features
    from ralm.models.confidence import ANY_KIND, FOUND, Calibrations
    from ralm.models.reader import Reader, save_calibrated
    from ralm.pipeline import OpenQA, open_searcher, resolve_reader
    from ralm.retrieval.index.kinds import DEFAULT_KIND, side_class, sides_of

    start = time.perf_counter()
    args.work.mkdir(parents=True, exist_ok=True)
    lines = (DATA / "squad_dev_official.jsonl").read_text().splitlines(keepends=True)
    halves = {"calibration": _sample(lines[0::2], args.cal_limit), "heldout": _sample(lines[1::2], args.heldout_limit)}
    qs = {}
    for name, part in halves.items():
        f = args.work / f"{name}.jsonl"
        f.write_text("".join(part))
        qs[name] = read_questions(f)
    removed = removed_articles(read_questions(DATA / "squad_dev_official.jsonl"))
    sel = index_without(args.index, args.work, removed)
    source = resolve_reader(args.reader)
    reader = Reader.from_pretrained(source)
    searcher = open_searcher(sel)
    report = {"removed_articles": sorted(removed), "questions": {k: len(v) for k, v in qs.items()},
              "unanswerable_share": {k: round(float(np.mean([q.extra["title"] in removed for q in v])), 4) for k, v in qs.items()},
              "reader": reader.fingerprint(), "kinds": {}}
    fitted = Calibrations({})
    rule = (f"the lowest threshold at which at most {args.max_unanswerable:.0%} of the calibration half's unanswerable "
            "questions get an answer, on confidences cross-fitted by article")
    titles = [q.extra["title"] for q in qs["calibration"]]
    for kind in args.kinds.split(","):
        qa = OpenQA(reader, searcher, side=kind, min_confidence=0.0)
        rows = {name: answers(qa, qs[name], args.work / f"{name}-{kind}.predictions.jsonl") for name in qs}
        sig = {n: [r["signals"] for r in rows[n]] for n in rows}
        em = {n: np.array([r["em"] for r in rows[n]], dtype=float) for n in rows}
        found = {n: np.array([r["answer_in_read"] for r in rows[n]], dtype=float) for n in rows}
        answerable = {n: np.array([q.extra["title"] not in removed for q in qs[n]]) for n in qs}
        calibrated = [s for s in sides_of(kind) if side_class(s).calibrated_scores]
        maps = {kind: (*FOUND, *side_features(sig["calibration"], calibrated=calibrated))}
        if kind == DEFAULT_KIND:
            maps["*"] = ANY_KIND  # the fallback for other kinds: the reader's own signals only
        for name, features in maps.items():
            def fit(rows_, features=features, t=None):
                fitted_with = {"reader": report["reader"], "k": qa.k, "questions": len(rows_), "threshold_rule": rule,
                               **({"threshold": t} if t is not None else {})}
                return fit_two_stage([sig["calibration"][j] for j in rows_], found["calibration"][rows_],
                                     em["calibration"][rows_], found_features=features, fitted_with=fitted_with)

            cal_conf = cross_fitted(sig["calibration"], fit, groups=titles)  # as the held-back half will see it
            t = choose_threshold(cal_conf, em["calibration"], answerable["calibration"], args.max_risk, args.max_unanswerable)
            cal = fit(np.arange(len(titles)), t=t)
            fitted = fitted.with_kind(name, cal)
            new = cal.of_signals(sig["heldout"])
            rc = risk_coverage(new, em["heldout"])
            report["kinds"][name if name == "*" else kind] = {
                **({"fallback_fitted_on": kind} if name == "*" else {}),
                "heldout_em_all": round(100 * float(em["heldout"].mean()), 2),
                "heldout_em_answerable": round(100 * float(em["heldout"][answerable["heldout"]].mean()), 2),
                "threshold_chosen_on_calibration": t,
                **selective_at(new, em["heldout"], answerable["heldout"], t), "aurc": rc["aurc"],
                "auroc_answerable_vs_removed": _round(auroc(new, answerable["heldout"])),
                "auroc_right_vs_wrong": _round(auroc(new, em["heldout"] > 0)),
                "auroc_p_answer_answerable_vs_removed": _round(auroc([s["score"] for s in sig["heldout"]], answerable["heldout"])),
                "at_60_coverage_of_answerable": at_coverage(new, em["heldout"], answerable["heldout"], 0.6),
                "features": {"found": dict(zip(cal.found.features, [round(w, 3) for w in cal.found.weights])),
                             "right": dict(zip(cal.right.features, [round(w, 3) for w in cal.right.weights]))},
            }
            (args.work / f"heldout-{'fallback' if name == '*' else kind}.confidence.jsonl").write_text("".join(
                json.dumps({"confidence": round(float(c), 6), "em": float(e), "answerable": bool(a)}) + "\n"
                for c, e, a in zip(new, em["heldout"], answerable["heldout"])))
            if name != "*":
                _plot(args.work / f"risk_coverage_{kind}.png", _before(args.before, kind), rc, kind)
    shutil.rmtree(args.work / "reader", ignore_errors=True)
    save_calibrated(source, args.work / "reader", fitted.to_json())
    report["seconds"] = round(time.perf_counter() - start, 1)
    report["threads"] = torch.get_num_threads()
    (args.work / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report))


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def at_coverage(conf: np.ndarray, em: np.ndarray, answerable: np.ndarray, share: float) -> dict:
    """The EM of the answers given at the threshold where `share` of the answerable questions
    are answered, and the share of unanswerable ones answered there."""
    t = float(np.quantile(conf[answerable], 1 - share))
    ans = conf >= t
    return {"threshold": round(t, 4), "answered_em": round(float(em[ans].mean()), 4),
            "unanswerable_answered": round(float(ans[~answerable].mean()), 4)}


def _before(work: Path | None, kind: str) -> dict | None:
    """The risk-coverage curve of another run's held-back confidences, if it has them."""
    from ralm.eval.calibration import risk_coverage

    path = None if work is None else work / f"heldout-{kind}.confidence.jsonl"
    if path is None or not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return risk_coverage([r["confidence"] for r in rows], [r["em"] for r in rows])


def _sample(lines: list[str], n: int | None) -> list[str]:
    """n evenly spaced lines (every article keeps its share), or all of them."""
    if n is None or n >= len(lines):
        return lines
    return [lines[i] for i in np.linspace(0, len(lines) - 1, n).astype(int)]


def _plot(path: Path, old: dict | None, new: dict, kind: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    if old is not None:
        ax.plot(old["coverage"], old["risk"], label=f"before (AURC {old['aurc']:.3f})", color="0.5")
    ax.plot(new["coverage"], new["risk"], label=f"after: two-stage confidence (AURC {new['aurc']:.3f})", color="C0")
    ax.set_xlabel("coverage (share of questions answered)")
    ax.set_ylabel("risk (share of answers that are wrong)")
    ax.set_title(f"risk-coverage, {kind}, held-back half\n(half of the questions have no answer in the corpus)", fontsize=9)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
