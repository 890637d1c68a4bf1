"""Kill test of live writes to a hybrid index: `ralm serve` is killed (SIGKILL) at random moments
while clients add and delete documents; after each kill it must start again, and every
acknowledged write must be seen by both sides (BM25 finds each added document by its unique
word; the dense side lists it; a deleted one is gone from both).

    python benchmarks/reliability/kill_writes.py [--kills 10] [--seed 0] [--work DIR]

Builds a small hybrid index (the demo corpus's first 40 documents, bundled MiniLM), serves it on
127.0.0.1 only, and prints a JSON summary: kills, restarts that failed, acknowledged writes,
and writes missing from a side. Bounded: each phase stops after a few seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import SRC, free_port, start_server  # noqa: E402


def writer(port: int, rng: random.Random, acked: dict, stop: threading.Event) -> None:
    """Adds documents (each with a unique word) and deletes some; records what was acknowledged
    (True: added, False: deleted, None: a delete the kill cut off, which may or may not have applied)."""
    n = 0
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
        while not stop.is_set():
            n += 1
            doc_id = f"w{rng.randrange(1 << 30):x}"
            word = f"zq{doc_id}"
            try:
                if acked and rng.random() < 0.25:
                    victim = rng.choice([d for d, live in acked.items() if live] or [None])
                    if victim:
                        acked[victim] = None  # in flight: a kill now may or may not have applied it
                        if c.delete(f"/documents/{victim}").status_code == 200:
                            acked[victim] = False
                    continue
                r = c.post("/documents", json={"documents": [{"id": doc_id, "title": "Note", "text": f"A note that mentions {word} once."}]})
                if r.status_code == 200:
                    acked[doc_id] = True
            except httpx.HTTPError:
                return  # the server was killed


def check(port: int, index: Path, acked: dict) -> list[str]:
    """The acknowledged writes missing from a side (or deleted documents still found): BM25 over
    HTTP (each added document is the top hit for its unique word); the dense side as the server
    holds it after replaying the log (each live block's embedding equals a fresh encoding)."""
    import numpy as np

    from ralm.data.corpus import Document
    from ralm.retrieval.index.dense_side import dense_of
    from ralm.retrieval.search.live import LiveSearcher

    bad = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
        for doc_id, live in acked.items():
            if live is None:
                continue
            top = c.post("/search", json={"query": f"zq{doc_id}", "k": 1, "retriever": "bm25"}).json()
            if live != (bool(top) and top[0]["id"] == f"{doc_id}:0"):
                bad.append(f"{doc_id}: acknowledged {'add' if live else 'delete'} wrong on the bm25 side")
    snap = LiveSearcher.open(index).current
    retriever = dense_of(snap).retriever
    for doc_id, live in acked.items():
        if live is None:
            continue
        row = snap.delta.row_of.get(f"{doc_id}:0")
        if live != (row is not None):
            bad.append(f"{doc_id}: acknowledged {'add' if live else 'delete'} wrong on the dense side")
        elif live:
            rec = snap.delta.records[row]
            fresh = retriever.encode_documents([Document(doc_id, rec["title"], rec["text"])])[0]
            if not np.allclose(snap.delta.state["dense"][row], fresh, atol=1e-2):
                bad.append(f"{doc_id}: dense embedding does not match its text")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    from ralm.retrieval.index.build import build_index

    rng = random.Random(args.seed)
    work = args.work or Path(tempfile.mkdtemp(prefix="ralm-kill-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus.jsonl"
    demo = (SRC / "ralm" / "data" / "demo" / "corpus.jsonl").read_text().splitlines(keepends=True)
    corpus.write_text("".join(demo[:40]))
    index = work / "index"
    if not (index / "LATEST").is_file():
        build_index(corpus, index, show_progress=False)
    acked: dict[str, bool] = {}
    failed_restarts, missing, started = 0, [], time.perf_counter()
    port = free_port()
    for _ in range(args.kills):
        try:
            proc = start_server(index, port)
        except RuntimeError as e:
            failed_restarts += 1
            print(f"restart failed: {e}", file=sys.stderr)
            continue
        missing = check(port, index, acked)  # what survived the last kill
        if missing:
            break
        stop = threading.Event()
        threads = [threading.Thread(target=writer, args=(port, random.Random(rng.random()), acked, stop)) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(rng.uniform(0.2, 3.0))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        stop.set()
        for t in threads:
            t.join(15)
    proc = start_server(index, port)
    missing = missing or check(port, index, acked)
    os.killpg(proc.pid, signal.SIGKILL)
    print(json.dumps({"kills": args.kills, "failed_restarts": failed_restarts, "acknowledged_adds": sum(v is True for v in acked.values()),
                      "acknowledged_deletes": sum(v is False for v in acked.values()),
                      "deletes_cut_off": sum(v is None for v in acked.values()), "missing_or_wrong": len(missing),
                      "examples": missing[:5], "seconds": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
