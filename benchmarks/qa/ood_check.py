"""Confidence off SQuAD: answerable and unanswerable questions over documents written for this
check (not Wikipedia), at three corpus sizes, through the default pipeline (`ralm eval qa`).

  handful   benchmarks/qa/ood/handbook.jsonl: 12 handbook pages of a made-up company; 25 questions
            they answer and 15 they do not (several ask what is stated for a neighbour: the
            Lisbon office's headcount where only Bergen's and its bicycle spaces are given)
  hundreds  the handbook plus 300 generated facility records of made-up towns (libraries,
            pools, clinics, ... each stating a random subset of its attributes); 100 facility
            questions beside the handbook's: half ask an attribute the record states, half one
            it does not (stated for other facilities), or about a facility that does not exist

Unanswerable questions are of two kinds, reported apart: `near_miss`, where a document read
states the attribute for a neighbour (SQuAD 2.0's hard case) and `absent`, where nothing in the
corpus is about it.
  tens of thousands
            the same documents added (`ralm index add`, live) to a copy of the default index of
            the SQuAD corpus (`--background`, about 20,800 Wikipedia blocks)

`--check second` runs the second check instead (benchmarks/qa/ood/second: 30 pages of a software
manual, a town's services guide and a company wiki as Markdown, HTML and text files, 90
answerable and 90 unanswerable questions, written after the reader's training data was fixed
and never trained or fitted on), `--check third` the third (benchmarks/qa/ood/third: 30 pages
of a university's guide, an e-bike maker's documentation and a railway's passenger guide,
written after the shipped reader and its maps were fixed): handful = the pages alone, hundreds
= the pages added to the first check's hundreds corpus, large = the pages added to the
background index.

For each size: the share of unanswerable questions answered at the reader's default threshold
(target: at most 10%), and the answerable questions' coverage and EM (of all, and of those
answered), apart for answers in tables, lists, definition lists and `key: value` lines and in
prose where the questions say so, with 95% intervals (the unanswerable answered resampling
questions, the best guess's EM resampling pages) and the AUROC of the confidence, answerable vs
unanswerable. A question counts as answered when its answer is not withheld.

    python benchmarks/qa/ood_check.py --work runs/ood --background runs/dev [--model READER] [--check second|third]

Writes WORK/report-TAG.json (TAG: the reader's path with / as -, or "shipped").
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import article_interval, linked_copy, ralm, read_jsonl, write_jsonl  # noqa: E402

HERE = Path(__file__).resolve().parent / "ood"
CHECKS = ("first", "second", "third")  # second, third: folders of pages and questions.jsonl in HERE

KINDS = {  # facility kind -> the attributes its records may state
    "public library": ("opened", "manager", "seats", "staff", "architect", "renovated", "hours"),
    "swimming pool": ("opened", "manager", "length", "staff", "architect", "renovated", "hours"),
    "health clinic": ("opened", "manager", "doctors", "staff", "architect", "renovated", "hours"),
    "ferry terminal": ("opened", "manager", "berths", "staff", "architect", "renovated", "hours"),
    "town museum": ("opened", "manager", "objects", "staff", "architect", "renovated", "hours"),
    "sports hall": ("opened", "manager", "seats", "staff", "architect", "renovated", "hours"),
}
SENTENCES = {
    "opened": ["The {f} opened in {v}.", "It first opened its doors in {v}.", "Since {v} the {f} has served the town."],
    "manager": ["It is managed by {v}.", "{v} has run the {f} for several years.", "The manager is {v}."],
    "seats": ["It has {v} seats.", "There is seating for {v} people."],
    "length": ["Its main pool is {v} metres long.", "The main basin measures {v} metres."],
    "doctors": ["{v} doctors work in its practice.", "The clinic employs {v} doctors."],
    "berths": ["The terminal has {v} berths.", "Ferries dock at {v} berths."],
    "objects": ["Its collection holds {v} objects.", "The museum keeps {v} objects."],
    "staff": ["It employs {v} people in all.", "A staff of {v} works there."],
    "architect": ["The building was designed by {v}.", "Its architect was {v}."],
    "renovated": ["It was renovated in {v}.", "A renovation was completed in {v}."],
    "hours": ["It is open from {v}.", "Opening hours are {v}."],
}
QUESTIONS = {
    "opened": "When did the {f} open?", "manager": "Who manages the {f}?", "seats": "How many seats does the {f} have?",
    "length": "How long is the main pool of the {f}?", "doctors": "How many doctors work at the {f}?",
    "berths": "How many berths does the {f} have?", "objects": "How many objects does the {f} hold?",
    "staff": "How many people work at the {f}?", "architect": "Who designed the {f}?",
    "renovated": "When was the {f} renovated?", "hours": "What are the opening hours of the {f}?",
}
FIRST = ["Astrid", "Bjorn", "Clara", "Dag", "Elin", "Frode", "Greta", "Henrik", "Ida", "Jonas", "Kari", "Lars", "Maren",
         "Nils", "Oda", "Per", "Ragna", "Sigurd", "Tone", "Vidar", "Aino", "Emil", "Liv", "Tor"]
LAST = ["Brekke", "Dahl", "Eide", "Fjeld", "Haugland", "Lunde", "Moen", "Nygard", "Rustad", "Sandvik", "Tangen", "Vik",
        "Aasen", "Bakke", "Hovland", "Kvam", "Myhre", "Strand", "Ulvik", "Vold"]
SYLLABLES = ["bra", "wa", "ter", "os", "kvik", "hol", "mar", "sund", "el", "fjor", "lund", "dal", "ness", "vin",
             "tor", "rud", "stad", "ham", "ber", "ga", "lo", "mo", "ra"]


def _town(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.choice((2, 3)))).capitalize()


def _value(attr: str, rng: random.Random) -> str:
    person = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    return {"opened": str(rng.randint(1890, 2020)), "renovated": str(rng.randint(1990, 2024)), "manager": person,
            "architect": person, "seats": str(rng.randint(40, 900)), "length": str(rng.choice((25, 33, 50))),
            "doctors": str(rng.randint(2, 14)), "berths": str(rng.randint(2, 9)), "objects": f"{rng.randint(2, 90) * 1000:,}",
            "staff": str(rng.randint(4, 160)),
            "hours": f"{rng.randint(6, 10):02d}:00 to {rng.randint(16, 22):02d}:00"}[attr]


def facilities(n: int = 300, questions: int = 100, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """n facility records and `questions` questions, half answerable (attribute stated), half
    not (an attribute stated for other facilities but not this one, or a facility that does not
    exist), deterministic in `seed`."""
    rng = random.Random(seed)
    docs, stated, names = [], [], set()
    while len(docs) < n:
        kind = rng.choice(sorted(KINDS))
        town = _town(rng)
        name = f"{town} {kind}"
        if name in names:
            continue
        names.add(name)
        attrs = rng.sample(KINDS[kind], rng.randint(3, 5))
        values = {a: _value(a, rng) for a in attrs}
        text = " ".join(rng.choice(SENTENCES[a]).format(f=kind, v=values[a]) for a in attrs)
        text = f"The {name} is in the town of {town}. " + text
        docs.append({"id": f"fac-{len(docs):03d}", "title": name.title(), "text": text})
        stated.append((name, kind, values))
    qs = []
    order = rng.sample(range(n), n)
    for i in order[: questions // 2]:  # answerable
        name, kind, values = stated[i]
        attr = rng.choice(sorted(values))
        qs.append({"id": f"fac-a{len(qs):03d}", "question": QUESTIONS[attr].format(f=name), "answers": [values[attr]]})
    for j, i in enumerate(order[questions // 2 : questions]):  # unanswerable
        name, kind, values = stated[i]
        missing = [a for a in KINDS[kind] if a not in values]
        if j % 4 == 3 or not missing:  # a facility that does not exist
            town = _town(rng)
            while f"{town} {kind}" in names:
                town = _town(rng)
            name, missing = f"{town} {kind}", list(KINDS[kind])
        attr = rng.choice(missing)
        qs.append({"id": f"fac-u{j:03d}", "question": QUESTIONS[attr].format(f=name), "answers": ["unanswerable"],
                   "unanswerable": True, "kind": "absent" if len(missing) == len(KINDS[kind]) else "near_miss"})
    return docs, qs


def interval(values: list[float], units: list[str]) -> list[float]:
    """95% bootstrap interval of a share, resampling whole units (percent)."""
    lo, hi = article_interval(values, units)
    return [round(100 * lo, 1), round(100 * hi, 1)]


def score(predictions: Path, questions: list[dict]) -> dict:
    """Unanswerable questions answered; answerable coverage, EM of all and of those answered; 95%
    intervals of the unanswerable answered (each question its own unit: they name no page) and
    of the answerable EM (resampling pages, or questions where none is named); the AUROC of the
    confidence, answerable vs unanswerable (how well it ranks them at any threshold)."""
    from ralm.eval.calibration import auroc

    rows = {json.loads(line)["id"]: json.loads(line) for line in predictions.read_text().splitlines()}
    un = [rows[q["id"]] for q in questions if q.get("unanswerable")]
    an = [rows[q["id"]] for q in questions if not q.get("unanswerable")]
    pages = {q["id"]: q.get("doc") or q["id"] for q in questions}
    answered = [r for r in an if not r["no_answer"]]
    kinds = {q["id"]: q.get("kind") for q in questions if q.get("unanswerable")}
    by_kind = {k: [r for r in un if kinds[r["id"]] == k] for k in ("near_miss", "absent")}
    structure = {q["id"]: q.get("structure") for q in questions if not q.get("unanswerable")}
    by_structure = {}
    for name, kinds in (("structured", ("table", "list", "definition", "key_value")), ("table", ("table",)),
                        ("prose", ("prose",))):
        rs = [r for r in an if structure.get(r["id"]) in kinds]
        given = [r for r in rs if not r["no_answer"]]
        if rs:
            by_structure[name] = {"questions": len(rs), "answered": round(len(given) / len(rs), 4),
                                  "em": round(sum(r["em"] for r in rs) / len(rs), 4),
                                  "answered_em": round(sum(r["em"] for r in given) / len(given), 4) if given else None}
    return {"unanswerable": len(un), "unanswerable_answered": round(sum(not r["no_answer"] for r in un) / max(len(un), 1), 4),
            **({"unanswerable_answered_ci95": interval([float(not r["no_answer"]) for r in un], [r["id"] for r in un])} if un else {}),
            **{f"{k}_answered": round(sum(not r["no_answer"] for r in rs) / len(rs), 4) for k, rs in by_kind.items() if rs},
            **{f"{k}_questions": len(rs) for k, rs in by_kind.items()},
            "answerable": len(an), "answerable_answered": round(len(answered) / max(len(an), 1), 4),
            "answerable_em": round(sum(r["em"] for r in an) / max(len(an), 1), 4),
            **({"answerable_em_ci95_by_page": interval([r["em"] for r in an], [pages[r["id"]] for r in an])} if an else {}),
            "answered_em": round(sum(r["em"] for r in answered) / max(len(answered), 1), 4) if answered else None,
            **({"auroc": round(auroc([r.get("confidence") or 0.0 for r in an + un], [True] * len(an) + [False] * len(un)), 3)}
               if an and un else {}),
            **({"by_structure": by_structure} if by_structure else {}),
            "wrongly_answered": [{"question": r["question"], "answer": r["prediction"], "confidence": r.get("confidence")}
                                 for r in un if not r["no_answer"]][:10]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--background", type=Path, default=None, help="the default index of the SQuAD corpus (the large size)")
    ap.add_argument("--model", default=None, help="reader (default: the package's)")
    ap.add_argument("--sizes", default="handful,hundreds,large")
    ap.add_argument("--check", choices=CHECKS, default="first")
    args = ap.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    handbook = read_jsonl(HERE / "handbook.jsonl")
    hb_questions = read_jsonl(HERE / "handbook_questions.jsonl")
    fac_docs, fac_questions = facilities()
    hundreds = handbook + fac_docs
    model = ["--model", args.model] if args.model else []
    tag = args.model.strip("/").replace("/", "-") if args.model else "shipped"  # runs/x/reader and runs/y/reader apart
    pages = None if args.check == "first" else HERE / args.check / "pages"
    if pages is not None:
        tag = f"{args.check}-{tag}"
        questions = read_jsonl(HERE / args.check / "questions.jsonl")
        corpora = {"handful": (None, questions), "hundreds": (hundreds, questions), "large": (None, questions)}
    else:
        corpora = {"handful": (handbook, hb_questions), "hundreds": (hundreds, hb_questions + fac_questions),
                   "large": (hundreds, hb_questions + fac_questions)}
    report = {}
    for size in args.sizes.split(","):
        docs, questions = corpora[size]
        index = work / (f"index-{size}" if pages is None else f"index-{args.check}-{size}")
        added = pages or write_jsonl(work / "added.jsonl", docs)
        if size == "large":
            if args.background is None:
                raise SystemExit("the large size needs --background INDEX")
            done = index.with_name(f"{index.name}.added")
            if not done.is_file():
                linked_copy(args.background, index)
                ralm("index", "add", index, added)
                done.write_text("added\n")
        elif not (index / "LATEST").is_file():
            ralm("index", "build", pages if docs is None else write_jsonl(work / f"corpus-{size}.jsonl", docs),
                 "--out", index)
            if pages is not None and docs is not None:
                ralm("index", "add", index, pages)
        qfile = write_jsonl(work / f"questions-{tag}-{size}.jsonl", questions)
        pred = work / f"predictions-{size}-{tag}.jsonl"
        result = ralm("eval", "qa", "--index", index, "--questions", qfile, "--predictions", pred, *model)
        report[size] = {"threshold": result.get("threshold"), **score(pred, questions), "seconds": result.get("seconds")}
        print(json.dumps({size: report[size]}), flush=True)
    (work / f"report-{tag}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
