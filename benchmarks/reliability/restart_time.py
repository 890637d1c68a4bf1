"""Restart time of `ralm serve` against the number of updates its index's log holds.

    python benchmarks/reliability/restart_time.py --baseline-src OLD/src [--counts 1000,10000,100000] [--work DIR]

The index: the demo corpus (bundled MiniLM, hybrid). The log: N updates of one-sentence notes
(each a SQuAD paragraph's first sentence and a unique word), every tenth the replacement of an
earlier note and every twentieth the deletion of one. For each N the server is started in a
fresh process and timed until /health answers (Python start, imports, model loads and the
index's open included), on copies of the index holding:
  before     the log as ralm <= 0.4 wrote it (records only), served by --baseline-src's code,
             which embeds every logged document again at each start;
  after      the same updates written through LiveSearcher.add (each side's state stored with
             the log), served by this tree's code (--compact-after 0: the log stays as it is);
  compacted  after `ralm index compact` folded that log into a new version.
`empty` is the same server on the index with no log, for reference. One JSON line per start.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import DATA, SRC, free_port, ralm, ralm_env, start_server  # noqa: E402


def restart_seconds(index: Path, src: Path, *extra: str, timeout: float = 3600) -> float:
    """Seconds from starting `ralm serve` (the code in `src`) to its first /health answer."""
    port = free_port()
    start = time.perf_counter()
    try:
        proc = start_server(index, port, *extra, env=ralm_env(src), timeout=timeout, poll=0.1)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
    took = time.perf_counter() - start
    proc.kill()
    proc.wait()
    return took


def updates(n: int, seed: int = 0, batch: int = 1000) -> list[tuple[str, dict]]:
    """N update records: one-sentence notes, with replacements and deletions of notes of
    earlier batches (an id twice in one batch would be one update)."""
    rng = random.Random(seed)
    sentences = []
    with open(DATA / "squad_corpus.jsonl", encoding="utf-8") as f:
        for line in f:
            p = json.loads(line)
            sentences.append((p["title"], p["text"].split(". ")[0].strip() + "."))
    ops, live, settled, touched = [], [], 0, set()
    for i in range(n):
        if i % batch == 0:
            settled, touched = len(live), set()
        title, text = sentences[i % len(sentences)]
        pick = rng.randrange(settled) if settled else None
        if pick is not None and live[pick] not in touched and i % 20 == 19:
            doc_id = live.pop(pick)
            settled -= 1
            ops.append(("delete", {"op": "delete", "id": doc_id}))
            continue
        if pick is not None and live[pick] not in touched and i % 10 == 9:
            doc_id = live[pick]
        else:
            doc_id = f"note{i}"
            live.append(doc_id)
        touched.add(doc_id)
        ops.append(("add", {"op": "add", "id": doc_id, "title": title, "text": f"{text} zq{i:x}"}))
    return ops


def write_through_library(index: Path, ops: list[tuple[str, dict]], batch: int = 1000) -> None:
    """The updates appended as `ralm index add/delete` and the server append them, a batch at a time."""
    from ralm.data.corpus import Document
    from ralm.retrieval.search.live import LiveSearcher

    live = LiveSearcher.open(index)
    for at in range(0, len(ops), batch):
        chunk = ops[at:at + batch]
        adds = [Document(r["id"], r["title"], r["text"]) for op, r in chunk if op == "add"]
        deletes = [r["id"] for op, r in chunk if op == "delete"]
        if adds:
            live.add(adds)
        if deletes:
            live.delete(deletes)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline-src", type=Path, required=True, help="src/ of the code before (ralm <= 0.4)")
    ap.add_argument("--counts", default="1000,10000,100000")
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    from ralm.retrieval.index.build import build_index

    work = args.work or Path(tempfile.mkdtemp(prefix="ralm-restart-"))
    work.mkdir(parents=True, exist_ok=True)
    base = work / "base"
    if not (base / "LATEST").is_file():
        build_index(SRC / "ralm" / "data" / "demo" / "corpus.jsonl", base, show_progress=False)
    src = SRC
    print(json.dumps({"log": "empty", "updates": 0, "code": "after", "seconds": round(restart_seconds(base, src, "--compact-after", "0"), 1)}),
          flush=True)
    for n in (int(c) for c in args.counts.split(",")):
        ops = updates(n)
        before, after = work / f"before-{n}", work / f"after-{n}"
        for path in (before, after):
            shutil.rmtree(path, ignore_errors=True)
            shutil.copytree(base, path)
        (before / "updates.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for _, r in ops), encoding="utf-8")
        start = time.perf_counter()
        write_through_library(after, ops)
        written = time.perf_counter() - start
        for label, index, code, extra in (("before", before, args.baseline_src, ()), ("after", after, src, ("--compact-after", "0"))):
            print(json.dumps({"log": label, "updates": n, "code": "before" if code != src else "after",
                              "log_mb": round(sum(p.stat().st_size for p in index.glob("updates*")) / 1e6, 1),
                              "seconds": round(restart_seconds(index, code, *extra), 1),
                              **({"written_seconds": round(written, 1)} if label == "after" else {})}), flush=True)
        start = time.perf_counter()
        done = ralm("index", "compact", after, env=ralm_env(src))
        print(json.dumps({"log": "compacted", "updates": n, "code": "after", "compact_seconds": round(time.perf_counter() - start, 1),
                          "blocks": done["blocks"], "seconds": round(restart_seconds(after, src, "--compact-after", "0"), 1)}), flush=True)
        shutil.rmtree(before, ignore_errors=True)
        shutil.rmtree(after, ignore_errors=True)


if __name__ == "__main__":
    main()
