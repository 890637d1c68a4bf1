"""Several processes sharing one index, killed at random: no acknowledged update may be lost,
and an update logged by another process must be live in the server within a second.

    python benchmarks/reliability/shared_index.py [--seconds 240] [--compact-after 500] [--seed 0] [--work DIR]

On a small hybrid index (the demo corpus's first 40 documents; a small random encoder, hidden 64, so
that the processes spend their time on the index, not on a model) it runs at once:
  server    `ralm serve --compact-after N` (it follows the log and compacts it as it grows),
            written to over HTTP by a thread here (POST /documents, DELETE /documents/ID);
  writers   two processes adding documents and deleting some of their own, each a document or
            a delete per append, through the library path of `ralm index add/delete`;
  cli       a real `ralm index add` (then `ralm index delete` of the one before), back to back;
  reader    a process opening the index in a loop, checking at each open that every update
            acknowledged before it began, and not updated again until it ended, is there (an
            acknowledged delete: gone).
Every 2-8 s one of server, writers and reader is killed (SIGKILL) and started again; then, for
--calm-seconds, the server and one writer (an update every 0.5 s, a `ralm index add` every 5 s)
run alone, unkilled. Each
update is recorded before it is sent and when it is acknowledged; an update cut off by a kill
may or may not have applied. At the end a fresh server and a fresh open check every
acknowledged update. Visibility: from each `ralm index add`'s exit, and from one in four writer
acknowledgements (every one in the calm phase), until GET /documents/ID answers 200 (timed only
while the server was up throughout). Prints a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import SRC, ralm, ralm_env, run_ralm  # noqa: E402

ENV = ralm_env(SRC, OMP_NUM_THREADS="1")


def note(doc_id: str) -> dict:
    return {"id": doc_id, "title": "Note", "text": f"A note that mentions zq{doc_id} once."}


class Acks:
    """An append-only record of one writer's updates: {"op", "id", "phase", "t"}, the phase "start",
    then "done" once acknowledged (or "refused": the server was down, nothing was sent).
    A killed process's writes are in the page cache already: flushing is enough."""

    def __init__(self, path: Path):
        self.path = path

    def __call__(self, op: str, doc_id: str, phase: str) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"op": op, "id": doc_id, "phase": phase, "t": time.time()}) + "\n")


def expected(work: Path, until: float | None = None) -> dict[str, bool | None]:
    """id -> True (an acknowledged add, not deleted since), False (an acknowledged delete), or
    None (an update a kill cut off: either), from every writer's acknowledgements up to `until`."""
    state: dict[str, bool | None] = {}
    for path in work.glob("acks-*.jsonl"):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                a = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill of its writer
            if until is not None and a["t"] > until:
                continue
            if a["phase"] == "refused":  # never reached the server: as before it began
                state[a["id"]] = True if a["op"] == "delete" else state.pop(a["id"], None)
                continue
            state[a["id"]] = None if a["phase"] == "start" else a["op"] == "add"
    return state


# -- the roles that run as processes ----------------------------------------------------------------

def run_writer(index: Path, work: Path, name: str, seed: int, pause: float) -> None:
    from ralm.data.corpus import Document
    from ralm.retrieval.search.live import LiveSearcher

    rng = random.Random(f"{seed}-{os.getpid()}")  # a restarted writer draws new ids
    ack = Acks(work / f"acks-{name}.jsonl")
    mine = [d for d, live in expected(work).items() if live and d.startswith(name)]
    live = LiveSearcher.open(index)
    while True:
        if mine and rng.random() < 0.2:
            doc_id = mine.pop(rng.randrange(len(mine)))
            ack("delete", doc_id, "start")
            live.delete([doc_id])
            ack("delete", doc_id, "done")
        else:
            doc_id = f"{name}{rng.randrange(1 << 40):x}"
            ack("add", doc_id, "start")
            live.add([Document(**note(doc_id))])
            ack("add", doc_id, "done")
            mine.append(doc_id)
        time.sleep(pause)


def run_reader(index: Path, work: Path) -> None:
    from ralm.retrieval.search.live import LiveSearcher

    while True:
        began = time.time()
        want = expected(work, until=began)
        live = LiveSearcher.open(index)
        after = expected(work)  # an update begun while it opened may or may not be seen
        wrong = [d for d, present in want.items() if present is not None and after.get(d) == present and live.exists(d) != present]
        with open(work / "reader.jsonl", "a", encoding="utf-8") as out:
            out.write(json.dumps({"t": began, "checked": sum(v is not None for v in want.values()), "wrong": wrong[:5],
                                  "wrong_count": len(wrong)}) + "\n")


# -- the conductor ------------------------------------------------------------------------------------

class Role:
    def __init__(self, name: str, cmd: list[str], log: Path):
        self.name, self.cmd, self.log, self.proc, self.kills, self.started = name, cmd, log, None, 0, 0.0

    def start(self) -> None:
        with open(self.log, "ab") as log:  # the server logs its swaps, compactions and refusals here
            self.proc = subprocess.Popen(self.cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        self.started = time.time()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def serving(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def visible_after(port: int, doc_id: str, since: float, server: Role, timeout: float = 10) -> float | None:
    """Seconds from `since` until the server holds `doc_id`; None when the server restarted meanwhile."""
    while time.time() - since < timeout:
        if server.started > since:
            return None
        try:
            if httpx.get(f"http://127.0.0.1:{port}/documents/{doc_id}", timeout=2).status_code == 200:
                return None if server.started > since else time.time() - since
        except httpx.HTTPError:
            return None
        time.sleep(0.02)
    return timeout


def http_writer(port: int, work: Path, stop: threading.Event, rng: random.Random) -> None:
    """The server's own writes: adds, and deletes of documents it added."""
    ack = Acks(work / "acks-http.jsonl")
    mine = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
        while not stop.is_set():
            delete = bool(mine) and rng.random() < 0.2
            doc_id = mine.pop(rng.randrange(len(mine))) if delete else f"h{rng.randrange(1 << 40):x}"
            op = "delete" if delete else "add"
            ack(op, doc_id, "start")
            try:
                r = c.delete(f"/documents/{doc_id}") if delete else c.post("/documents", json={"documents": [note(doc_id)]})
                if r.status_code == 200:
                    ack(op, doc_id, "done")
                    if not delete:
                        mine.append(doc_id)
            except httpx.ConnectError:  # the server is down: nothing was sent
                ack(op, doc_id, "refused")
                if delete:
                    mine.append(doc_id)
                time.sleep(0.5)
            except httpx.HTTPError:  # cut off by a kill: may or may not have applied
                time.sleep(0.5)
            time.sleep(0.05)


def cli_writer(port: int, work: Path, stop: threading.Event, index: Path, server: Role, seen: list, rng: random.Random,
               pause: float = 1) -> None:
    """A real `ralm index add` (and a delete of the one before) every `pause` s, timed until the server holds it."""
    ack = Acks(work / "acks-cli.jsonl")
    previous = None
    while not stop.wait(pause):
        doc_id = f"c{rng.randrange(1 << 40):x}"
        (work / "cli.jsonl").write_text(json.dumps(note(doc_id)) + "\n")
        ack("add", doc_id, "start")
        ralm("index", "add", index, work / "cli.jsonl", env=ENV)
        ack("add", doc_id, "done")
        took = visible_after(port, doc_id, time.time(), server)
        if took is not None:
            seen.append(took)
        if previous is not None:
            ack("delete", previous, "start")
            ralm("index", "delete", index, previous, env=ENV)
            ack("delete", previous, "done")
        previous = doc_id


def sample_writers(port: int, work: Path, stop: threading.Event, server: Role, seen: list, rng: random.Random,
                   rate: float = 0.25) -> None:
    """A share `rate` of the writers' acknowledgements, taken as they come (within 0.2 s), timed until the server holds it."""
    tailed: dict[str, int] = {}
    while not stop.wait(0.02):
        for name in ("a", "b"):
            with open(work / f"acks-{name}.jsonl", "rb") as f:
                f.seek(tailed.get(name, 0))
                data = f.read()
            whole = data[:data.rfind(b"\n") + 1]
            tailed[name] = tailed.get(name, 0) + len(whole)
            for line in whole.decode().splitlines():
                a = json.loads(line)
                fresh = time.time() - a["t"] < 0.2 and server.started < a["t"]
                if a["op"] == "add" and a["phase"] == "done" and fresh and rng.random() < rate:
                    took = visible_after(port, a["id"], a["t"], server)
                    if took is not None:
                        seen.append(took)


def percentile(values: list[float], q: float) -> float | None:
    return round(sorted(values)[min(len(values) - 1, int(q * len(values)))], 3) if values else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=240)
    ap.add_argument("--compact-after", type=int, default=500)
    ap.add_argument("--calm-seconds", type=float, default=90, help="then the server and one writer alone, unkilled")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--role", choices=["writer", "reader"], help=argparse.SUPPRESS)
    ap.add_argument("--name", default="", help=argparse.SUPPRESS)
    ap.add_argument("--pause", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="ralm-shared-"))
    index = work / "index"
    if args.role == "writer":
        return run_writer(index, work, args.name, args.seed, args.pause)
    if args.role == "reader":
        return run_reader(index, work)

    from ralm.encoders.loading import save_random_encoder
    from ralm.retrieval.index.build import build_index

    rng = random.Random(args.seed)
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus.jsonl"
    corpus.write_text("".join((SRC / "ralm" / "data" / "demo" / "corpus.jsonl").read_text().splitlines(keepends=True)[:40]))
    encoder = save_random_encoder(work / "encoder", hidden_size=64, layers=2, pooling="mean")
    build_index(corpus, index, model=str(encoder), show_progress=False)
    for name in ("a", "b", "http", "cli"):
        (work / f"acks-{name}.jsonl").touch()
    port = 20000 + rng.randrange(20000)
    me = [sys.executable, str(Path(__file__).resolve()), "--work", str(work)]
    server = Role("server", [sys.executable, "-m", "ralm", "serve", "--index", str(index), "--port", str(port),
                             "--compact-after", str(args.compact_after)], work / "server.log")
    roles = [server, *(Role(f"writer {n}", [*me, "--role", "writer", "--name", n, "--seed", str(rng.randrange(1 << 30))],
                            work / f"writer-{n}.log") for n in ("a", "b")), Role("reader", [*me, "--role", "reader"], work / "reader.log")]
    for r in roles:
        r.start()
    while not serving(port):
        time.sleep(0.2)
    stop = threading.Event()
    cli_seen, writer_seen = [], []
    threads = [threading.Thread(target=target, args=(port, work, stop, *extra)) for target, extra in (
        (http_writer, (random.Random(rng.random()),)), (cli_writer, (index, server, cli_seen, random.Random(rng.random()))),
        (sample_writers, (server, writer_seen, random.Random(rng.random()))))]
    for t in threads:
        t.start()
    started = time.time()
    while time.time() - started < args.seconds:
        time.sleep(rng.uniform(2, 8))
        victim = rng.choice(roles)
        victim.kill()
        victim.kills += 1
        victim.start()
    stop.set()
    for t in threads:
        t.join()
    for r in roles:
        r.kill()

    # a calm phase: the server and one writer (an update every 0.5 s), no kills, every acknowledgement timed
    calm_cli, calm_writer, stop = [], [], threading.Event()
    roles[1].cmd += ["--pause", "0.5"]
    for r in roles[:2]:
        r.start()
    while not serving(port):
        time.sleep(0.2)
    threads = [threading.Thread(target=cli_writer, args=(port, work, stop, index, server, calm_cli, random.Random(rng.random()), 5)),
               threading.Thread(target=sample_writers, args=(port, work, stop, server, calm_writer, random.Random(rng.random()), 1.0))]
    for t in threads:
        t.start()
    time.sleep(args.calm_seconds)
    stop.set()
    for t in threads:
        t.join()
    for r in roles:
        r.kill()

    # the end: a fresh server and a fresh open hold every acknowledged update
    want = expected(work)
    server.start()
    while not serving(port):
        time.sleep(0.2)
    lost = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
        for doc_id, present in want.items():
            if present is not None and (c.get(f"/documents/{doc_id}").status_code == 200) != present:
                lost.append(f"{doc_id}: acknowledged {'add' if present else 'delete'}, not so in the server")
        sample = [d for d, present in want.items() if present][:: max(1, sum(bool(v) for v in want.values()) // 50)]
        for doc_id in sample:  # BM25 finds each by its word, on the server's snapshot
            top = c.post("/search", json={"query": f"zq{doc_id}", "k": 1, "retriever": "bm25"}).json()
            if not top or top[0]["id"] != f"{doc_id}:0":
                lost.append(f"{doc_id}: not found by its word")
        version = c.get("/health").json()["index_version"]
    server.kill()
    from ralm.retrieval.search.live import LiveSearcher

    final = LiveSearcher.open(index)
    lost += [f"{d}: acknowledged {'add' if p else 'delete'}, not so on open" for d, p in want.items()
             if p is not None and final.exists(d) != p]
    check = run_ralm("index", "check", index, "--json", env=ENV)
    reads = [json.loads(line) for line in (work / "reader.jsonl").read_text().splitlines() if line.endswith("}")]
    acks = [json.loads(line) for p in work.glob("acks-*.jsonl") for line in p.read_text().splitlines() if line.endswith("}")]
    done = [a for a in acks if a["phase"] == "done"]
    print(json.dumps({
        "seconds": args.seconds, "compact_after": args.compact_after,
        "acknowledged": {"adds": sum(a["op"] == "add" for a in done), "deletes": sum(a["op"] == "delete" for a in done),
                         "by": {p.stem[5:]: sum(1 for line in p.read_text().splitlines() if '"done"' in line) for p in work.glob("acks-*.jsonl")}},
        "cut_off_by_kills": sum(v is None for v in want.values()),
        "kills": {r.name: r.kills for r in roles},
        "compactions": int(version[1:]) - 1,
        "reader_opens": len(reads), "reader_opens_missing_an_acknowledged_update": sum(r["wrong_count"] > 0 for r in reads),
        "lost_acknowledged_updates": len(lost), "examples": lost[:5],
        "visible_in_server_s": {phase: {name: {"n": len(v), "p50": percentile(v, 0.5), "p95": percentile(v, 0.95),
                                               "max": percentile(v, 1.0)} for name, v in (("cli", cli), ("writers", writers))}
                                for phase, cli, writers in (("under kills", cli_seen, writer_seen), ("calm", calm_cli, calm_writer))},
        "index_check": "sound" if check.returncode == 0 else check.stderr.strip()[-300:],
        "wall_seconds": round(time.time() - started, 1),
    }))


if __name__ == "__main__":
    main()
