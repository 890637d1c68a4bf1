"""Calibrate a reader's confidence with the product's commands and measure selective answering on
held-back questions, half of whose articles are removed from the corpus.

The honest unanswerable set: the questions of SQuAD official-dev articles whose paragraphs are
deleted from the index (`ralm index delete`, through its update log, as a user deletes
documents); every other article, related ones included, stays. Questions are split as
everywhere in benchmarks/RESULTS.md: odd lines of squad_dev_official.jsonl are the calibration
half, even lines the held-back half; a removed article's questions are marked "unanswerable".

Beside that SQuAD set the maps are fitted on generated corpora of parallel records of three
sizes (data/siblings.py `write_sibling_corpus`, seeds of their own: never the training
examples, never a check's documents), each indexed by `ralm index build` / `ralm index add`:
  handful   4 corpora alone (a few dozen blocks)
  hundreds  60 corpora (a few hundred blocks)
  large     60 more corpora added live to the SQuAD index with the removed articles
so that a threshold holds on a user's small corpus as on Wikipedia. With --swaps N, each half also
gets N constructed near misses (data/negatives.py, the negatives `ralm train-reader` trains on):
answerable questions of its kept articles asked about another relation ("opened" -> "renovated")
or, where none can be swapped, another entity of the same label that the question's paragraph
does not name, marked unanswerable and asked over the same index: "another attribute's or
another entity's value" as a user's corpus meets it. For each kind, `ralm eval qa
--calibrate --also ...` fits the map and its threshold on them all (cross-fitted leaving whole
articles and generated corpora out; the threshold: at most --max-unanswerable of each set's
unanswerable questions answered, or with --coverage the share of the calibration half's answerable
questions answered), each kind's map added to the reader of the one before, then
`ralm eval qa` reports on the held-back half with the calibrated reader.

    python benchmarks/qa/selective.py --index runs/dev --work runs/selective [--reader DIR] [--kinds hybrid,dense,bm25] [--coverage 0.62] [--swaps 240]

Writes WORK/reader (the calibrated reader) and WORK/report.json. Resumes: finished steps are kept.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import DATA, linked_copy, ralm, read_jsonl, write_jsonl  # noqa: E402

SWAP_SEED = 104
SETS = {"handful": (4, 12, 101), "hundreds": (60, 4, 102), "large": (60, 4, 103)}  # corpora, questions each, seed


def removed_articles(questions: list[dict]) -> set[str]:
    """Articles holding about half of the questions, taken in the order of a hash of the title."""
    count: dict[str, int] = {}
    for q in questions:
        count[q["title"]] = count.get(q["title"], 0) + 1
    removed, n = set(), 0
    for title in sorted(count, key=lambda t: hashlib.sha1(t.encode()).hexdigest()):
        if n + count[title] <= len(questions) / 2:  # an article that would pass half is skipped
            removed.add(title)
            n += count[title]
    return removed


def squad_sets(index: Path, work: Path) -> tuple[Path, dict[str, Path], set[str]]:
    """WORK/index (the index without the removed articles) and the two halves, marked."""
    questions = read_jsonl(DATA / "squad_dev_official.jsonl")
    removed = removed_articles(questions)
    marked = [{**q, "unanswerable": q["title"] in removed} for q in questions]
    halves = {"calibration": write_jsonl(work / "calibration.jsonl", marked[0::2]),
              "heldout": write_jsonl(work / "heldout.jsonl", marked[1::2])}
    sel = work / "index"
    if not (work / "index.deleted").is_file():
        linked_copy(index, sel)
        ids = [d["id"] for d in read_jsonl(DATA / "squad_dev_official_corpus.jsonl") if d["title"] in removed]
        ralm("index", "delete", sel, *ids)
        (work / "index.deleted").write_text(f"{len(ids)} paragraphs of {len(removed)} articles\n")
    return sel, halves, removed


def generated_sets(squad_index: Path, work: Path) -> dict[str, tuple[Path, Path]]:
    """{size: (index, questions)} of the generated corpora."""
    from ralm.data.siblings import write_sibling_corpus

    out = {}
    for size, (corpora, per, seed) in SETS.items():
        folder = work / f"generated-{size}"
        if not folder.exists():
            write_sibling_corpus(folder, corpora=corpora, questions_per_corpus=per, seed=seed)
        index = work / f"index-{size}"
        if size == "large":
            if not (work / "index-large.added").is_file():
                linked_copy(squad_index, index)
                ralm("index", "add", index, folder / "docs")
                (work / "index-large.added").write_text("added\n")
        elif not (index / "LATEST").is_file():
            ralm("index", "build", folder / "docs", "--out", index)
        out[size] = (index, folder / "questions.jsonl")
    return out


def swap_sets(halves: dict[str, Path], work: Path, n: int) -> dict[str, Path]:
    """{half: questions}: n of the half's answerable questions, each asked about another relation
    or else another entity than its paragraph states (seeded per half), marked unanswerable, with
    its article's title (the cross-fitting leaves articles out), "swap": relation | entity and no
    answers (an answer string of the original question in a block read is not the swap's answer)."""
    from ralm.data.masking import load_spacy
    from ralm.data.negatives import entity_pool, entity_swap, relation_swap

    out = {half: work / f"swaps-{half}.jsonl" for half in halves}
    if all(p.is_file() for p in out.values()):
        return out
    paragraphs = {d["id"]: d["text"] for d in read_jsonl(DATA / "squad_dev_official_corpus.jsonl")}
    nlp = load_spacy()
    for seed, (half, questions) in enumerate(halves.items()):
        qs = [q for q in read_jsonl(questions) if not q["unanswerable"]]
        docs = list(nlp.pipe([q["question"] for q in qs], batch_size=256))
        pool = entity_pool(docs)
        rng = np.random.default_rng([SWAP_SEED, seed])
        rows = []
        for j in rng.permutation(len(qs)).tolist():
            q, paragraph = qs[j], paragraphs[qs[j]["doc_id"]]
            kind, swapped = "relation", relation_swap(q["question"], paragraph, rng)
            if swapped is None:
                kind, swapped = "entity", entity_swap(docs[j], paragraph, pool, rng)
            if swapped is not None:
                rows.append({**q, "id": f"{q['id']}-{kind}", "question": swapped, "answers": [], "unanswerable": True,
                             "swap": kind, "asked": q["question"]})
            if len(rows) == n:
                break
        write_jsonl(out[half], rows)
    return out


def selective(predictions: Path, questions: Path) -> dict:
    """Answerable / unanswerable questions answered and the EM of the answers given."""
    rows = {r["id"]: r for r in read_jsonl(predictions)}
    marks = {q["id"]: q.get("unanswerable", False) for q in read_jsonl(questions)}
    un = [r for i, r in rows.items() if marks[i]]
    an = [r for i, r in rows.items() if not marks[i]]
    given = [r for r in rows.values() if not r["no_answer"]]
    return {"unanswerable_answered": round(float(np.mean([not r["no_answer"] for r in un])), 4) if un else None,
            "answerable_answered": round(float(np.mean([not r["no_answer"] for r in an])), 4) if an else None,
            "answered_em": round(float(np.mean([r["em"] for r in given])), 4) if given else None,
            "em_answerable": round(float(np.mean([r["em"] for r in an])), 4) if an else None}


def swaps_answered(predictions: Path, questions: Path) -> dict:
    """Share of the constructed near misses answered, by kind of swap."""
    answered = {r["id"]: not r["no_answer"] for r in read_jsonl(predictions)}
    by: dict[str, list[bool]] = {}
    for q in read_jsonl(questions):
        by.setdefault(q["swap"], []).append(answered[q["id"]])
    return {kind: {"questions": len(v), "answered": round(float(np.mean(v)), 4)} for kind, v in sorted(by.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", type=Path, required=True, help="the default index of squad_corpus + the official dev articles")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--reader", default=None, help="reader checkpoint or run (default: the package's)")
    ap.add_argument("--kinds", default="hybrid,dense,bm25")
    ap.add_argument("--max-unanswerable", type=float, default=None, help="the threshold rule's share (default: ralm's)")
    ap.add_argument("--coverage", type=float, default=None, help="instead: the threshold answering this share of the calibration "
                    "half's answerable questions (`ralm eval qa --calibrate --coverage`: a reader judged at the coverage of the "
                    "one it replaces)")
    ap.add_argument("--swaps", type=int, default=0, help="constructed near misses per half (0: none)")
    ap.add_argument("--no-heldout", action="store_true", help="calibrate only")
    args = ap.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    squad_index, halves, removed = squad_sets(args.index, work)
    generated = generated_sets(squad_index, work)
    also = [f"--also={index}={questions}" for index, questions in generated.values()]
    swaps = swap_sets(halves, work, args.swaps) if args.swaps else {}
    if swaps:
        also.append(f"--also={squad_index}={swaps['calibration']}")
    rule = ([] if args.max_unanswerable is None else ["--max-unanswerable", str(args.max_unanswerable)]) + (
        [] if args.coverage is None else ["--coverage", str(args.coverage)])
    report = {"removed_articles": sorted(removed), "sets": {s: str(q) for s, (_, q) in generated.items()}, "kinds": {}}
    reader = args.reader
    for kind in args.kinds.split(","):
        out = work / f"reader-{kind}"
        side = [] if kind == "hybrid" else ["--side", kind]
        if not (out / "config.json").is_file():
            shutil.rmtree(out, ignore_errors=True)
            fit = ralm("eval", "qa", "--index", squad_index, "--questions", halves["calibration"], *also, *side, *rule,
                       "--calibrate", "--out", out, "--predictions", work / f"calibration-{kind}.predictions.jsonl",
                       *(["--model", reader] if reader else []), log=work / f"calibrate-{kind}.log")
            (work / f"calibrate-{kind}.json").write_text(json.dumps(fit, indent=2))
        fit = json.loads((work / f"calibrate-{kind}.json").read_text())
        report["kinds"][kind] = {"threshold": fit["threshold"], "fit": fit["calibration_fit"]}
        reader = str(out)  # the next kind's map joins this one's
        if not args.no_heldout:
            pred = work / f"heldout-{kind}.predictions.jsonl"
            if not pred.is_file():
                result = ralm("eval", "qa", "--index", squad_index, "--questions", halves["heldout"], *side, "--model", out,
                              "--predictions", pred)
                (work / f"heldout-{kind}.json").write_text(json.dumps(result, indent=2))
            result = json.loads((work / f"heldout-{kind}.json").read_text())
            report["kinds"][kind]["heldout"] = {"em": result["em"], "f1": result["f1"], "auroc": result.get("auroc"),
                                                "aurc": result.get("aurc"), **selective(pred, halves["heldout"])}
            if swaps:
                pred = work / f"heldout-swaps-{kind}.predictions.jsonl"
                if not pred.is_file():
                    ralm("eval", "qa", "--index", squad_index, "--questions", swaps["heldout"], *side, "--model", out,
                         "--predictions", pred)
                report["kinds"][kind]["heldout_swaps"] = swaps_answered(pred, swaps["heldout"])
        print(json.dumps({kind: report["kinds"][kind]}), flush=True)
    shutil.rmtree(work / "reader", ignore_errors=True)
    shutil.copytree(reader, work / "reader")
    report["seconds"] = round(time.perf_counter() - start, 1)
    (work / "report.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
