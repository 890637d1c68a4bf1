"""How ralm's costs grow with the corpus: N = 10k, 100k, 1M blocks of a hybrid index built from
precomputed embeddings, and the dense and BM25 search structures alone at larger N.

  python benchmarks/scale/scale.py --work runs/scale                       # every stage, every size
  python benchmarks/scale/scale.py --work runs/scale --sizes 10000 --only data,build,open,search
  python benchmarks/scale/scale.py --work runs/scale --report              # table + log-log figure

The corpora are made, deterministically, from the SQuAD paragraphs: each document is 2-6 of
their sentences (mostly consecutive ones of one article, so a document keeps a topic), short
enough to be one block, under a title drawn from a large vocabulary ("<article> <word> <word>").
Its vector is the normalised mean of its sentences' real MiniLM block embeddings (each sentence
encoded once, as a block under its article's title) plus Gaussian noise, so a million-block dense
side keeps the neighbourhoods real text has and needs no hours of CPU encoding; the vectors go in
through `ralm index build --embeddings` (one row per block). The corpus of N documents is the
first N documents of every larger one, so sizes differ only in N.

Stages (`--only`, comma-separated; each writes WORK/results/<stage>-<N>.json and is skipped when
that file exists, so an interrupted run resumes; --force reruns):
  data      corpus-N.jsonl + emb-N.npy (and, once, the sentences and their embeddings)
  build     `ralm index build --embeddings` (hybrid; approximate dense search chosen from N):
            wall, peak RSS, disk per part, seconds per side (the version manifest's build_seconds)
  open      LiveSearcher.open in a fresh process, then its first search, and the restart: launch to
            first answer (and a one-shot `ralm search` wall)
  search    in process: hybrid, dense and BM25 latency p50/p99 over SQuAD questions; the dense
            side's recall@10 against exact search over the same vectors
  serve     `ralm serve`: /search latency p50/p99 at concurrency 1 and 8, the server's peak RSS
  check     `ralm index check`
  add       `ralm index add` of 10,000 new documents (on a copy of the index's log)
  replay    opening the index after 100,000 updates logged as `ralm index add/delete` log them,
            then its first search (which builds the live documents' scorers) and the restart as in open,
            in --restarts fresh processes: medians, and the range (timed out at --update-timeout)
  dense     the dense search structure alone (IVF-SQ8 + fp32 rescoring, vectors generated in
            chunks, never one fp32 matrix): build, memory per block, latency, recall; any N
  bm25      the BM25 structure alone (bm25s, as the index's BM25 side builds it from its texts):
            build, peak RSS, disk, then latency and RSS opened memory-mapped in a fresh process
            (--bm25-sizes). The build holds every block's terms in memory: N above --bm25-whole
            is simulated, the structure of a --bm25-tile-base build tiled N/base times (each
            block repeated: every posting keeps its weight up to the idf of the new counts)
  sharded   exact dense search over 2 gloo processes (torchrun, loopback) against one
Machine-dependent: run with `nice -n 10` on a shared box, and compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import DATA, FIGURES, SRC  # noqa: E402

CHUNK = 10_000  # documents drawn from one seeded generator: every corpus is a prefix of the larger ones
BODY_BUDGET = 220  # wordpieces of a document's text: with a title of <= 32, one 288-wordpiece block
NOISE = 0.35  # norm of the Gaussian noise added to a document's mean sentence vector (unit vectors)
SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[A-Z0-9\"'(])")


# -- the corpus generator --------------------------------------------------------------------------

def sentences(args) -> dict:
    """The SQuAD sentences of 4-80 words of every --stride-th paragraph (of all 442 articles),
    each once: text, article, wordpiece count, and its block embedding (title = its article) by
    the retriever --model (default: the bundled MiniLM), cached in WORK/sentences.{jsonl,npy}."""
    work, model, stride = Path(args.work), args.model, args.stride
    meta, emb_file = work / "sentences.jsonl", work / "sentences.npy"
    if not emb_file.is_file():
        import torch

        from ralm.data.corpus import Document
        from ralm.retrieval.towers.encoders import Retriever

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
        rows, seen = [], set()
        with open(DATA / "squad_corpus.jsonl", encoding="utf-8") as f:
            paragraphs = [json.loads(line) for p, line in enumerate(f) if p % stride == 0]
        for para in paragraphs:
            for s in SENTENCE_END.split(para["text"].strip()):
                s = " ".join(s.split())
                if 4 <= len(s.split()) <= 80 and s not in seen:
                    seen.add(s)
                    rows.append({"title": para["title"], "text": s})
        retriever = Retriever.from_pretrained(model).eval()
        tok = retriever.tokenizer
        for r, ids in zip(rows, tok([r["text"] for r in rows], add_special_tokens=False)["input_ids"]):
            r["pieces"] = len(ids)
        rows = [r for r in rows if r["pieces"] <= BODY_BUDGET // 2]
        order = np.argsort([r["pieces"] for r in rows], kind="stable")  # length-sorted batches: little padding
        emb = np.zeros((len(rows), retriever.dim), np.float32)
        step = 2048
        for i in range(0, len(order), step):
            idx = order[i : i + step]
            emb[idx] = retriever.encode_documents([Document("s", rows[j]["title"], rows[j]["text"]) for j in idx], batch_size=128)
            print(f"sentences: {min(i + step, len(order))}/{len(order)}", file=sys.stderr, flush=True)
        with open(meta.with_suffix(".tmp"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        np.save(emb_file.with_suffix(".tmp.npy"), emb)
        os.replace(meta.with_suffix(".tmp"), meta)
        os.replace(emb_file.with_suffix(".tmp.npy"), emb_file)
    with open(meta, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    titles = sorted({r["title"] for r in rows})
    words = sorted({w for r in rows for w in re.findall(r"[a-z]{4,12}", r["text"].lower())})
    return {"text": [r["text"] for r in rows], "pieces": np.array([r["pieces"] for r in rows]),
            "article": np.array([titles.index(r["title"]) for r in rows]), "titles": titles, "words": words,
            "emb": np.load(emb_file, mmap_mode="r")}


def draw_chunk(s: dict, c: int, *, seed: int, dim_only: bool = False) -> tuple[list[dict] | None, np.ndarray]:
    """Documents c*CHUNK ... (c+1)*CHUNK-1: ({"id", "title", "text"} or None, vectors [CHUNK, D]).
    A document is a random sentence, then up to 5 more, each the next sentence of the same
    article with probability 3/4 (else any sentence), while they fit BODY_BUDGET wordpieces."""
    rng = np.random.default_rng([seed, c])
    emb, pieces, article = s["emb"], s["pieces"], s["article"]
    n_sent = len(pieces)
    first = rng.integers(n_sent, size=CHUNK)
    extra = rng.integers(1, 6, size=CHUNK)
    picked = np.full((CHUNK, 6), -1)
    picked[:, 0] = first
    budget = BODY_BUDGET - pieces[first]
    total = np.array(emb[first], dtype=np.float32)  # [CHUNK, D]
    count = np.ones(CHUNK, np.float32)
    active = np.ones(CHUNK, bool)
    for t in range(1, 6):
        nxt = picked[:, t - 1] + 1
        same = (rng.random(CHUNK) < 0.75) & (nxt < n_sent)
        same &= article[np.minimum(nxt, n_sent - 1)] == article[first]
        cand = np.where(same, nxt, rng.integers(n_sent, size=CHUNK))
        active &= (t <= extra) & (pieces[cand] <= budget)
        picked[active, t] = cand[active]
        budget = budget - np.where(active, pieces[cand], 0)
        total += np.asarray(emb[cand], dtype=np.float32) * active[:, None]
        count += active
    noise = rng.standard_normal(total.shape, dtype=np.float32) * (NOISE / np.sqrt(total.shape[1]))
    vecs = total / count[:, None] + noise
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    words = rng.integers(len(s["words"]), size=(CHUNK, 2))
    if dim_only:
        return None, vecs
    docs = []
    for j in range(CHUNK):
        title = f"{s['titles'][article[first[j]]]} {s['words'][words[j, 0]]} {s['words'][words[j, 1]]}"
        docs.append({"id": f"d{c * CHUNK + j:08d}", "title": title, "text": " ".join(s["text"][p] for p in picked[j] if p >= 0)})
    return docs, vecs


def make_corpus(args, n: int) -> tuple[Path, Path]:
    """WORK/data/corpus-N.jsonl and emb-N.npy [N, D] (row i: document i's one block)."""
    data, seed = Path(args.work) / "data", args.seed
    data.mkdir(parents=True, exist_ok=True)
    corpus, emb_path = data / f"corpus-{n}.jsonl", data / f"emb-{n}.npy"
    if corpus.is_file() and emb_path.is_file():
        return corpus, emb_path
    s = sentences(args)
    tmp_c, tmp_e = corpus.with_suffix(".tmp"), emb_path.with_suffix(".tmp.npy")
    emb = np.lib.format.open_memmap(tmp_e, mode="w+", dtype=np.float32, shape=(n, s["emb"].shape[1]))
    with open(tmp_c, "w", encoding="utf-8") as f:
        for c in range(-(-n // CHUNK)):
            docs, vecs = draw_chunk(s, c, seed=seed)
            m = min(CHUNK, n - c * CHUNK)
            f.writelines(json.dumps(d, ensure_ascii=False) + "\n" for d in docs[:m])
            emb[c * CHUNK : c * CHUNK + m] = vecs[:m]
            if c % 10 == 9:
                print(f"corpus-{n}: {c * CHUNK + m} documents", file=sys.stderr, flush=True)
    emb.flush()
    del emb
    os.replace(tmp_c, corpus)
    os.replace(tmp_e, emb_path)
    return corpus, emb_path


def update_docs(s: dict, n: int, *, seed: int, start: int) -> tuple[list[dict], np.ndarray]:
    """n new documents (ids u<number>) and their vectors [n, D], drawn from chunks no corpus uses."""
    docs, vecs = [], []
    for c in range(-(-n // CHUNK)):
        chunk, v = draw_chunk(s, 1_000_000 + start // CHUNK + c, seed=seed)
        docs += [{**d, "id": f"u{start + c * CHUNK + j:08d}"} for j, d in enumerate(chunk)]
        vecs.append(v)
    return docs[:n], np.concatenate(vecs)[:n]


def questions(n: int, seed: int) -> list[str]:
    """n SQuAD questions (their answers sit in the sentences the corpora recombine)."""
    with open(DATA / "squad_train.jsonl", encoding="utf-8") as f:
        qs = [json.loads(line)["question"] for line in f]
    return [qs[i] for i in np.random.default_rng(seed).choice(len(qs), n, replace=False)]


# -- running and measuring a child process ---------------------------------------------------------

def child_env(args) -> dict:
    return {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "RALM_NO_PROGRESS": "1",
            "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}


def run(cmd: list[str], args, *, log: Path, timeout: float | None = None) -> dict:
    """Run `cmd` -> {rc, seconds, peak_rss_mb, timed_out, out (stdout)}. The peak RSS is GNU
    time's (a child forked from this process would count this process's pages as its own)."""
    import signal
    import threading

    log.parent.mkdir(parents=True, exist_ok=True)
    rss_file = log.with_suffix(".rss")
    start = time.perf_counter()
    with open(log, "ab") as err:
        err.write(f"\n$ {' '.join(map(str, cmd))}\n".encode())
        err.flush()
        p = subprocess.Popen(["/usr/bin/time", "-f", "%M %U %S", "-o", str(rss_file), *map(str, cmd)], stdout=subprocess.PIPE, stderr=err,
                             env=child_env(args), start_new_session=True)
        killed = []
        timer = threading.Timer(timeout, lambda: (killed.append(1), os.killpg(p.pid, signal.SIGKILL))) if timeout else None
        if timer:
            timer.start()
        out = p.stdout.read().decode()
        p.wait()
        if timer:
            timer.cancel()
    usage = re.findall(r"^(\d+) ([\d.]+) ([\d.]+)$", rss_file.read_text(), re.MULTILINE) if rss_file.is_file() else []
    rss, user, system = usage[-1] if usage else (None, None, None)
    return {"rc": p.returncode, "seconds": round(time.perf_counter() - start, 2), "peak_rss_mb": round(int(rss) / 1024) if rss else None,
            "cpu_seconds": round(float(user) + float(system), 1) if rss else None, "timed_out": bool(killed), "out": out}


def last_json(out: str) -> dict:
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def ralm(*argv) -> list[str]:
    return [sys.executable, "-m", "ralm", *map(str, argv)]


def me(args, *argv) -> list[str]:
    return [sys.executable, __file__, "--work", args.work, "--seed", args.seed, "--queries", args.queries,
            "--model", args.model or "", "--stride", args.stride, *argv]


def du(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def latest_version(idx: Path) -> Path:
    return idx / "versions" / (idx / "LATEST").read_text().strip()


def pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(np.array(values) * 1000, q)), 1)


# -- stages ----------------------------------------------------------------------------------------

def stage_data(args, n: int) -> dict:
    start = time.perf_counter()
    corpus, emb = make_corpus(args, n)
    return {"corpus_mb": round(du(corpus) / 2**20, 1), "embeddings_mb": round(du(emb) / 2**20, 1),
            "seconds": round(time.perf_counter() - start, 1)}


def index_of(args, n: int) -> Path:
    return Path(args.work) / f"idx-{n}"


def stage_build(args, n: int) -> dict:
    corpus, emb = make_corpus(args, n)
    idx = index_of(args, n)
    shutil.rmtree(idx, ignore_errors=True)
    cmd = ralm("index", "build", corpus, "--out", idx, "--embeddings", emb, "--json", *(["--model", args.model] if args.model else []))
    r = run(cmd, args, log=Path(args.work) / "logs" / f"build-{n}.log")
    if r["rc"]:
        raise SystemExit(f"build {n} failed: see {Path(args.work) / 'logs'}")
    version = latest_version(idx)
    manifest = json.loads((version / "manifest.json").read_text())
    dense = manifest.get("sections", {}).get("dense", manifest)  # ralm <= 0.4 kept its fields at the top level
    disk = {"blocks": du(idx / "blocks"), "embeddings": du(version / "embeddings.npy"), "faiss": du(version / "faiss.index"),
            "bm25": du(version / "bm25"), "retriever": du(idx / "retriever"), "total": du(idx)}
    return {"seconds": r["seconds"], "cpu_seconds": r["cpu_seconds"], "peak_rss_mb": r["peak_rss_mb"],
            "build_seconds": manifest.get("build_seconds"),
            "faiss": dense.get("faiss"), "faiss_params": dense.get("faiss_params"),
            "disk_mb": {k: round(v / 2**20, 1) for k, v in disk.items()}, "blocks": manifest["count"]}


def stage_open(args, n: int) -> dict:
    idx = index_of(args, n)
    log = Path(args.work) / "logs" / f"open-{n}.log"
    child = run(me(args, "--child", "open", "--index", idx, "--started", time.time()), args, log=log)
    cli = run(ralm("search", idx, "who designed the eiffel tower", "-k", "10", "--json"), args, log=log)
    return {**last_json(child["out"]), "peak_rss_mb": child["peak_rss_mb"], "cli_search_seconds": cli["seconds"],
            "cli_search_rss_mb": cli["peak_rss_mb"]}


def stage_search(args, n: int) -> dict:
    r = run(me(args, "--child", "search", "--index", index_of(args, n)), args, log=Path(args.work) / "logs" / f"search-{n}.log")
    return {**last_json(r["out"]), "peak_rss_mb": r["peak_rss_mb"]}


def stage_serve(args, n: int) -> dict:
    """`ralm serve` in its own process: /search at concurrency 1 and 8, then its peak RSS."""
    import socket

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = Path(args.work) / "logs" / f"serve-{n}.log"
    start = time.perf_counter()
    with open(log, "ab") as err:
        p = subprocess.Popen([str(c) for c in ralm("serve", "--index", index_of(args, n), "--port", port)], stdout=err, stderr=err,
                             env=child_env(args), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if p.poll() is not None or time.perf_counter() - start > 900:
                raise SystemExit(f"serve {n} did not start: see {log}")
            time.sleep(0.5)
        ready = time.perf_counter() - start
        qs = questions(args.queries, args.seed + 1)
        out = {"ready_seconds": round(ready, 1)}
        for conc in (1, 8):
            out[f"c{conc}"] = load(url, qs * (1 if conc == 1 else 2), conc)
            if conc == 1:  # the server's own timing of the same requests (without the client's queueing)
                out["c1"]["server_ms"] = httpx.get(f"{url}/stats", timeout=30).json()["latency_ms"]["search"]
        status = Path(f"/proc/{p.pid}/status").read_text()
        out["peak_rss_mb"] = round(int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024)
        out["rss_mb"] = round(int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024)
        return out
    finally:
        p.terminate()
        p.wait(30)


def load(url: str, queries: list[str], concurrency: int) -> dict:
    """POST /search for every query, `concurrency` clients at a time -> latency p50/p99."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    lat: list[float] = []
    errors: list[int] = []
    lock, todo = threading.Lock(), iter(queries)

    def worker():
        with httpx.Client(base_url=url, timeout=120) as client:
            client.post("/search", json={"query": "warm up", "k": 10})
            while True:
                with lock:
                    q = next(todo, None)
                if q is None:
                    return
                t = time.perf_counter()
                r = client.post("/search", json={"query": q, "k": 10})
                lat.append(time.perf_counter() - t)
                if r.status_code != 200:
                    errors.append(r.status_code)

    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()
    wall = time.perf_counter() - t
    return {"requests": len(lat), "errors": len(errors), "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99),
            "requests_per_s": round(len(lat) / wall, 1)}


def stage_check(args, n: int) -> dict:
    r = run(ralm("index", "check", index_of(args, n), "--json"), args, log=Path(args.work) / "logs" / f"check-{n}.log")
    return {"seconds": r["seconds"], "cpu_seconds": r["cpu_seconds"], "peak_rss_mb": r["peak_rss_mb"],
            "sound": last_json(r["out"]).get("sound", False)}


def copy_index(args, n: int, name: str) -> Path:
    """A copy of the index that updates may change: hard links (published files are never
    modified in place), without the original's update log."""
    src, dst = index_of(args, n), Path(args.work) / f"{name}-{n}"
    shutil.rmtree(dst, ignore_errors=True)
    subprocess.run(["cp", "-al", str(src), str(dst)], check=True)
    for log in dst.glob("updates*"):
        log.unlink()
    return dst


def stage_add(args, n: int) -> dict:
    """`ralm index add` of --add-docs new documents on a copy of the index."""
    work = Path(args.work)
    docs = work / "data" / f"add-{args.add_docs}.jsonl"
    if not docs.is_file():
        with open(docs.with_suffix(".tmp"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(d, ensure_ascii=False) + "\n" for d in update_docs(sentences(args), args.add_docs, seed=args.seed, start=0)[0])
        os.replace(docs.with_suffix(".tmp"), docs)
    idx = copy_index(args, n, "idx-add")
    try:
        r = run(ralm("index", "add", idx, docs, "--json"), args, log=work / "logs" / f"add-{n}.log", timeout=args.update_timeout)
    finally:
        shutil.rmtree(idx, ignore_errors=True)
    return {"documents": args.add_docs, "seconds": r["seconds"], "cpu_seconds": r["cpu_seconds"], "timed_out": r["timed_out"], "rc": r["rc"],
            "peak_rss_mb": r["peak_rss_mb"], "docs_per_s": round(args.add_docs / r["seconds"], 1) if not r["rc"] else None}


def stage_replay(args, n: int) -> dict:
    """Open a copy of the index whose update log holds --updates updates, written as `ralm
    index add/delete` write them (each side's state of a logged block stored with the log):
    60% new documents, the rest replacements of new ones and deletions of corpus documents
    (20% of the updates, at most half the corpus). A fresh process times the open; the log
    is not compacted (the worst case a server restart meets)."""
    work = Path(args.work)
    idx = copy_index(args, n, "idx-replay")
    try:
        w = run(me(args, "--child", "writelog", "--index", idx, "--n", n, "--updates", args.updates, "--add-docs", args.add_docs),
                args, log=work / "logs" / f"writelog-{n}.log")
        if w["rc"]:
            raise SystemExit(f"replay {n}: writing the log failed: see {work / 'logs'}")
        runs = []
        for _ in range(args.restarts):  # a restart is seconds on a shared box: its median, and the range
            r = run(me(args, "--child", "open", "--index", idx, "--started", time.time()), args, log=work / "logs" / f"replay-{n}.log",
                    timeout=args.update_timeout)
            if r["timed_out"] or r["rc"]:
                return {**last_json(w["out"]), "timed_out": r["timed_out"], "rc": r["rc"], "seconds": r["seconds"]}
            runs.append({k: r[k] for k in ("seconds", "cpu_seconds", "peak_rss_mb")} | last_json(r["out"]))
        log_mb = round(sum(f.stat().st_size for f in idx.glob("updates*")) / 2**20, 1)
        medians = {k: round(float(np.median([x[k] for x in runs])), 2) for k in runs[0] if None not in [x[k] for x in runs]}
        return {**last_json(w["out"]), "log_mb": log_mb, "timed_out": False, "rc": 0, **medians,
                "restart_seconds_range": [min(x["restart_seconds"] for x in runs), max(x["restart_seconds"] for x in runs)],
                "runs": runs}
    finally:
        shutil.rmtree(idx, ignore_errors=True)


def stage_dense(args, n: int) -> dict:
    """The dense structure alone: built in one process, opened and searched in another."""
    work = Path(args.work)
    try:
        b = run(me(args, "--child", "dense", "--n", n), args, log=work / "logs" / f"dense-{n}.log")
        if b["rc"]:
            raise SystemExit(f"dense {n} failed: see {work / 'logs'}")
        r = run(me(args, "--child", "densesearch", "--n", n), args, log=work / "logs" / f"dense-{n}.log")
        if r["rc"]:
            raise SystemExit(f"dense {n}: searching failed: see {work / 'logs'}")
    finally:
        for f in dense_files(work, n).values():
            f.unlink(missing_ok=True)
    return {**last_json(b["out"]), "build_wall_seconds": b["seconds"], "build_peak_rss_mb": b["peak_rss_mb"],
            **last_json(r["out"]), "search_peak_rss_mb": r["peak_rss_mb"]}


def stage_bm25(args, n: int) -> dict:
    """The BM25 structure alone: built (or tiled from a smaller build) in one process, opened
    and searched in another."""
    work, log = Path(args.work), Path(args.work) / "logs" / f"bm25-{n}.log"
    source = bm25_dir(work, args.bm25_tile_base)  # what a tiled N is made from
    whole, base = n <= args.bm25_whole, args.bm25_tile_base
    if not whole and n % base:
        raise SystemExit(f"bm25 {n}: above --bm25-whole it is tiled from --bm25-tile-base {base}, which must divide it")
    built = n if whole else base
    try:
        b = run(me(args, "--child", "bm25", "--n", built), args, log=log)
        if b["rc"]:
            raise SystemExit(f"bm25 {built} failed (rc {b['rc']}, peak RSS {b['peak_rss_mb']} MB): see {log}")
        out = {**last_json(b["out"]), "build_wall_seconds": b["seconds"], "build_cpu_seconds": b["cpu_seconds"],
               "build_peak_rss_mb": b["peak_rss_mb"]}
        if not whole:
            t = run(me(args, "--child", "bm25tile", "--n", n, "--index", source), args, log=log)
            if t["rc"]:
                raise SystemExit(f"bm25 {n}: tiling failed: see {log}")
            out = {"n": n, "tiled_from": {**out, "disk_mb": round(du(source) / 2**20, 1)}, **last_json(t["out"])}
        r = run(me(args, "--child", "bm25search", "--n", n, *([] if whole else ["--index", source])), args, log=log)
        if r["rc"]:
            raise SystemExit(f"bm25 {n}: searching failed: see {log}")
        disk = round(du(bm25_dir(work, n)) / 2**20, 1)
    finally:
        for m in {n, built}:
            shutil.rmtree(bm25_dir(work, m), ignore_errors=True)
    return {**out, "disk_mb": disk, **last_json(r["out"]), "search_peak_rss_mb": r["peak_rss_mb"]}


def stage_sharded(args, n: int) -> dict:
    """Exact fp32 dense search of the index's vectors: one process against 2 torchrun ranks
    (gloo on loopback), each holding half the rows."""
    idx, log = index_of(args, n), Path(args.work) / "logs" / f"sharded-{n}.log"
    one = run(me(args, "--child", "sharded", "--index", idx), args, log=log)
    port = 29500 + os.getpid() % 1000
    two = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port, *me(args, "--child", "sharded",
                                                                                                               "--index", idx)[1:]],
              args, log=log)
    return {"one": {**last_json(one["out"]), "peak_rss_mb": one["peak_rss_mb"]}, "two": last_json(two["out"])}


STAGES = {"data": stage_data, "build": stage_build, "open": stage_open, "search": stage_search, "serve": stage_serve,
          "check": stage_check, "add": stage_add, "replay": stage_replay, "dense": stage_dense, "bm25": stage_bm25,
          "sharded": stage_sharded}
INDEX_STAGES = ("data", "build", "open", "search", "serve", "check", "add", "replay")


# -- child processes (one measurement each, so that peak RSS is theirs) ----------------------------

def rss_mb() -> int:
    return round(int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024)


def child_open(args) -> dict:
    """The open and the first search; with --started (the wall-clock time the process was
    launched), also the restart: launch to first answer, Python's start and the imports
    included, the benchmark's own question read not (nor the exit, which frees the heap)."""
    start = time.perf_counter()
    from ralm.retrieval.search.live import LiveSearcher

    imported = time.perf_counter()
    searcher = LiveSearcher.open(args.index)
    opened = time.perf_counter()
    rss, qs = rss_mb(), questions(21, args.seed + 1)
    searched = time.perf_counter()
    searcher.search(qs[:1], 10)  # builds the live documents' scorers: part of a restart
    answered = time.perf_counter()
    out = {"import_seconds": round(imported - start, 2), "open_seconds": round(opened - imported, 2),
           "first_search_seconds": round(answered - searched, 2), "rss_after_open_mb": rss}
    if args.started:
        out["restart_seconds"] = round(time.time() - args.started - (searched - opened), 2)
    out["then_search_p50_ms"] = pct(timed(lambda q: searcher.search([q], 10), qs[1:]), 50)  # after the restart is timed
    return out


def child_writelog(args) -> dict:
    """--updates updates through LiveSearcher.add/delete (the path of `ralm index add/delete`),
    in appends of 10,000; the dense side's state of a new block is its generated vector (the
    corpus's own import path, no encoder run, given to `add` as the dense side's states),
    everything else as the library computes it."""
    from ralm.data.corpus import Document
    from ralm.retrieval.search.live import LiveSearcher

    n_new, n_del = int(args.updates * 0.6), min(int(args.updates * 0.2), args.n // 2)
    docs, vecs = update_docs(sentences(args), n_new, seed=args.seed, start=args.add_docs)
    vec_of = {d["id"]: v for d, v in zip(docs, vecs)}
    imported = {"dense": lambda records: [vec_of[r["doc_id"]] for r in records]}  # each block: its document's vector
    rng = np.random.default_rng([args.seed, 7])
    replaced = [docs[int(i)] for i in rng.choice(n_new, args.updates - n_new - n_del)]
    batches = [("add", [Document(d["id"], d["title"], d["text"]) for d in docs]),
               ("add", [Document(d["id"], d["title"], d["text"][::-1]) for d in replaced]),
               ("delete", [f"d{int(i):08d}" for i in rng.choice(args.n, n_del, replace=False)])]
    searcher = LiveSearcher.open(args.index)
    start = time.perf_counter()
    for op, items in batches:
        for i in range(0, len(items), 10_000):
            if op == "add":
                searcher.add(items[i : i + 10_000], states=imported)
            else:
                searcher.delete(items[i : i + 10_000])
    return {"updates": args.updates, "live_documents": n_new, "replacements": len(replaced), "deletes": n_del,
            "write_seconds": round(time.perf_counter() - start, 1)}


def overlap(a: np.ndarray, b: np.ndarray) -> float:
    """Mean share of each row of b found in the same row of a (recall@k of a against b)."""
    return round(float(np.mean([len(set(x.tolist()) & set(y.tolist())) / len(y) for x, y in zip(a, b)])), 4)


def timed(fn, items, cpu: list | None = None) -> list[float]:
    """Wall seconds of fn(item) for each item (and, into `cpu`, this process's CPU seconds: on a
    shared box the wall time includes waiting for a core, the CPU time does not)."""
    out = []
    for item in items:
        t, c = time.perf_counter(), time.process_time()
        fn(item)
        out.append(time.perf_counter() - t)
        if cpu is not None:
            cpu.append(time.process_time() - c)
    return out


def child_search(args) -> dict:
    from ralm.retrieval.index.dense_side import dense_of
    from ralm.retrieval.search.live import LiveSearcher

    s = LiveSearcher.open(args.index)
    qs = questions(args.queries, args.seed + 1)
    s.search(qs[:3], 10)  # warm-up
    out = {}
    for side in ("hybrid", "dense", "bm25"):
        cpu: list[float] = []
        lat = timed(lambda q, side=side: s.search([q], 10, None if side == "hybrid" else side), qs, cpu)
        out[side] = {"p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "cpu_p50_ms": pct(cpu, 50)}
    out["load_average"] = os.getloadavg()[0]
    dense = dense_of(s.current)
    enc = dense.encode(qs)  # [Q, D]
    lat = timed(lambda i: dense.search(enc[i : i + 1], 10), range(len(qs)))
    out["dense_search"] = {"index": repr(dense.index), "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99)}
    exact = dense.exactly()
    lat = timed(lambda i: exact.search(enc[i : i + 1], 10), range(min(len(qs), 30)))
    out["exact_search"] = {"p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99)}
    truth = exact.search(enc, 10)[1]
    out["dense_recall@10"] = overlap(dense.search(enc, 10)[1], truth)
    snap = s.current  # the version (and its overlay) with its dense side searched exactly
    exactly = replace(snap, version=replace(snap.version, sides={**snap.sides, dense.name: exact}), scorers={})
    out["hybrid_recall@10"] = overlap(s.rank(qs, 10).rows, s.rank(qs, 10, exactly).rows)
    approximate = dense.index
    lists = getattr(approximate, "lists", None)  # a faiss IVF index; exact search has none
    if lists is not None:  # recall and latency against the number of lists probed
        default, sweep = approximate.search_params()["nprobe"], {}
        for nprobe in (8, 16, 32, 64, 128, 256):
            if nprobe <= lists:
                approximate.set_search_params(nprobe=nprobe)
                lat = timed(lambda i: approximate.search(enc[i : i + 1], 10), range(len(qs)))
                sweep[nprobe] = {"recall@10": overlap(approximate.search(enc, 10)[1], truth), "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99)}
        approximate.set_search_params(nprobe=default)
        out["nprobe"] = {"default": default, "lists": lists, "sweep": sweep}
    out["rss_mb"] = rss_mb()
    return out


def dense_files(work: Path, n: int) -> dict:
    return {k: work / f"dense-{n}.{k}" for k in ("faiss", "f16.npy", "queries.npy", "truth.npz")}


def child_dense(args) -> dict:
    """Build the dense search structure alone over n generated vectors (`auto_spec(n)`, or
    IVF-SQ8 below its threshold too), made chunk by chunk: written with the fp16 vectors it
    rescores from, the encoded queries and their exact top 10 of the fp32 vectors (kept
    as the vectors are made), for child_densesearch."""
    import torch

    from ralm.retrieval.backends import faiss_index as fi
    from ralm.retrieval.backends.exact import merge_topk
    from ralm.retrieval.towers.encoders import Retriever

    n, files = args.n, dense_files(Path(args.work), args.n)
    s = sentences(args)
    chunks = -(-n // CHUNK)

    def vectors(c):
        return draw_chunk(s, c, seed=args.seed, dim_only=True)[1][: min(CHUNK, n - c * CHUNK)]

    spec = fi.auto_spec(n) or f"IVF{fi.ivf_lists(n)},SQ8"
    faiss = fi.faiss_module()
    dim = s["emb"].shape[1]
    enc = Retriever.from_pretrained(args.model or None).eval().encode_queries(questions(args.queries, args.seed + 1)).numpy()
    np.save(files["queries.npy"], enc)  # [Q, D]
    index = faiss.index_factory(dim, spec, faiss.METRIC_INNER_PRODUCT)
    start = time.perf_counter()
    # as FaissIndex.build trains, on fi.training_count vectors (here the first: documents are drawn independently)
    size = fi.training_count(index)
    train = np.concatenate([vectors(c) for c in range(min(chunks, -(-size // CHUNK)))])[:size]
    fi.train(index, train, seed=args.seed)
    del train
    trained = time.perf_counter()
    header = np.lib.format.open_memmap(files["f16.npy"], mode="w+", dtype=np.float16, shape=(n, dim))  # the header; rows follow
    offset = header.offset
    del header
    best_s = torch.full((len(enc), 0), float("-inf"))
    best_i = torch.zeros((len(enc), 0), dtype=torch.long)
    exact_seconds = 0.0
    with open(files["f16.npy"], "r+b") as f16:  # written, not mapped: the pages never count as this process's memory
        f16.seek(offset)
        for c in range(chunks):
            v = vectors(c)
            index.add(v)
            f16.write(v.astype(np.float16).tobytes())
            t = time.perf_counter()  # not build time
            top_s, top_i = torch.topk(torch.from_numpy(enc @ v.T), min(10, len(v)), dim=1)
            best_s, best_i = merge_topk(torch.cat([best_s, top_s], 1), torch.cat([best_i, top_i + c * CHUNK], 1), 10)
            exact_seconds += time.perf_counter() - t
    built = time.perf_counter() - exact_seconds
    faiss.write_index(index, str(files["faiss"]))
    np.savez(files["truth.npz"], ids=best_i.numpy())
    return {"n": n, "spec": spec, "trained_on": min(size, n), "train_seconds": round(trained - start, 1),
            "add_seconds": round(built - trained, 1), "index_mb": round(files["faiss"].stat().st_size / 2**20, 1),
            "bytes_per_block": round(files["faiss"].stat().st_size / n, 1), "build_rss_mb": rss_mb()}


def child_densesearch(args) -> dict:
    """Open what child_dense wrote in a fresh process (its RSS is what a server holds) and
    search it: latency (wall and CPU) and recall@10 against exact at the default nprobe and a
    sweep; recall with a 100-candidate shortlist beside the default k + RESCORE tells ranks
    lost to SQ8 codes (near-duplicate vectors) from lists never probed."""
    import torch

    from ralm.retrieval.backends import faiss_index as fi
    from ralm.retrieval.backends.exact import rescore

    files = dense_files(Path(args.work), args.n)
    before = rss_mb()
    index = fi.faiss_module().read_index(str(files["faiss"]))
    ann = fi.FaissIndex(index, "", source=np.load(files["f16.npy"], mmap_mode="r"))
    ann.set_search_params(**ann.default_search_params())
    enc = np.load(files["queries.npy"])
    with np.load(files["truth.npz"]) as t:
        truth = t["ids"]  # [Q, 10]
    loaded = rss_mb()
    ann.search(enc[:2], 10)
    cpu: list[float] = []
    lat = timed(lambda i: ann.search(enc[i : i + 1], 10), range(len(enc)), cpu)

    def shortlisted(m):
        _, cand = index.search(enc, m)
        return rescore(ann.source, torch.from_numpy(enc), torch.from_numpy(cand.astype(np.int64)), 10)[1].numpy()

    sweep, default = {}, ann.search_params()["nprobe"]
    for nprobe in sorted({8, 16, 32, 64, 128, 256, default}):
        ann.set_search_params(nprobe=nprobe)
        sweep_cpu: list[float] = []
        sweep_lat = timed(lambda i: ann.search(enc[i : i + 1], 10), range(min(len(enc), 100)), sweep_cpu)
        sweep[nprobe] = {"recall@10": overlap(ann.search(enc, 10)[1], truth), "recall@10_shortlist_100": overlap(shortlisted(100), truth),
                         "p50_ms": pct(sweep_lat, 50), "p99_ms": pct(sweep_lat, 99), "cpu_p50_ms": pct(sweep_cpu, 50)}
    return {"nprobe": default, "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "cpu_p50_ms": pct(cpu, 50),
            "recall@10": sweep[default]["recall@10"], "nprobe_sweep": sweep,
            "rss_after_open_mb": loaded, "rss_before_open_mb": before, "rss_mb": rss_mb()}


def bm25_dir(work, n: int) -> Path:
    return Path(work) / f"bm25-{n}"


def child_bm25(args) -> dict:
    """BM25Index.build over the `title text` of n generated documents (what the index's BM25
    side indexes of one-block documents), saved for child_bm25search."""
    from ralm.retrieval.backends.bm25 import BM25Index
    from ralm.retrieval.index.bm25_side import indexed_text

    s = sentences(args)
    texts = []
    for c in range(-(-args.n // CHUNK)):
        docs = draw_chunk(s, c, seed=args.seed)[0][: min(CHUNK, args.n - c * CHUNK)]
        texts += [indexed_text(d) for d in docs]
    made = rss_mb()
    start = time.perf_counter()
    index = BM25Index.build(texts, show_progress=False)
    built = time.perf_counter() - start
    index.save(bm25_dir(args.work, args.n))
    return {"n": args.n, "build_seconds": round(built, 1), "rss_texts_mb": made, "avgdl": round(index.avgdl, 1)}


def child_bm25tile(args) -> dict:
    """The BM25 structure of n blocks from the one in --index (B blocks): every block repeated
    n/B times (block i + r*B is block i), so a term's postings are its B-block postings n/B
    times and each weight is rescaled to the idf of the new counts (tf and length norms stay).
    Written term batch by term batch into memory-mapped arrays: a search structure at an N
    whose build would not fit in memory."""
    from ralm.atomic import read_json, write_json

    from ralm.retrieval.backends.bm25 import lucene_idf

    src, dst = Path(args.index), bm25_dir(args.work, args.n)
    params = read_json(src / "params.index.json")
    base, reps = params["num_docs"], args.n // params["num_docs"]
    indptr = np.load(src / "indptr.csc.index.npy")
    data, indices = (np.load(src / f"{k}.csc.index.npy", mmap_mode="r") for k in ("data", "indices"))
    df = np.diff(indptr).astype(np.float64)
    scale = (lucene_idf(args.n, reps * df) / lucene_idf(base, df)).astype(np.float32)
    start = time.perf_counter()
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("vocab.index.json", "ralm.json"):
        shutil.copyfile(src / name, dst / name)
    write_json(dst / "params.index.json", {**params, "num_docs": args.n})
    new_ptr = indptr.astype(np.int64) * reps
    np.save(dst / "indptr.csc.index.npy", new_ptr)
    out_d = np.lib.format.open_memmap(dst / "data.csc.index.npy", mode="w+", dtype=data.dtype, shape=(int(new_ptr[-1]),))
    out_i = np.lib.format.open_memmap(dst / "indices.csc.index.npy", mode="w+", dtype=np.int32, shape=(int(new_ptr[-1]),))
    step, t = 5_000_000, 0  # postings of the source read per batch
    while t < len(df):
        t_end = int(np.searchsorted(indptr, indptr[t] + step, side="right")) - 1
        t_end = max(t_end, t + 1)
        a, b = int(indptr[t]), int(indptr[t_end])
        term = np.repeat(np.arange(t, t_end), np.diff(indptr[t:t_end + 1]))  # [P] each posting's term
        at = np.arange(a, b) - indptr[term]  # [P] its place among its term's postings
        length = df[term].astype(np.int64)
        d, i = np.asarray(data[a:b]) * scale[term], np.asarray(indices[a:b], dtype=np.int64)
        for r in range(reps):
            dest = new_ptr[term] + r * length + at
            out_d[dest], out_i[dest] = d, i + r * base
        t = t_end
    out_d.flush()
    out_i.flush()
    return {"n": args.n, "repeats": reps, "tile_seconds": round(time.perf_counter() - start, 1), "postings": int(new_ptr[-1])}


def child_bm25search(args) -> dict:
    """Open what child_bm25 (or child_bm25tile) saved, memory-mapped, in a fresh process and
    time one query at a time; a tiled structure is compared with the build in --index: the
    share of queries whose best block is a copy of that build's best (not all: the idf of the
    repeated counts, `lucene_idf`, weighs rare terms a little more)."""
    from ralm.retrieval.backends.bm25 import BM25Index

    before = rss_mb()
    index = BM25Index.load(bm25_dir(args.work, args.n), args.n)
    loaded = rss_mb()
    qs = questions(args.queries, args.seed + 1)
    index.search(qs[:2], 10)
    cpu: list[float] = []
    lat = timed(lambda q: index.search([q], 10), qs, cpu)
    out = {"p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "cpu_p50_ms": pct(cpu, 50), "rss_before_open_mb": before,
           "rss_after_open_mb": loaded, "rss_mb": rss_mb()}
    if args.index:
        from ralm.atomic import read_json

        base = read_json(Path(args.index) / "params.index.json")["num_docs"]
        tiled_s, tiled = index.search(qs, 1)
        best = BM25Index.load(args.index, base).search(qs, 1)[1]
        hit = tiled_s[:, 0] > 0
        out["best_block_as_in_the_build"] = round(float(np.mean(tiled[hit, 0] % base == best[hit, 0])), 4)
    return out


def child_sharded(args) -> dict | None:
    import torch

    from ralm.distributed import dist_env
    from ralm.retrieval.backends.exact import ExactIndex
    from ralm.retrieval.backends.sharded import ShardedExactIndex
    from ralm.retrieval.towers.encoders import Retriever

    env = dist_env("gloo")
    emb = np.load(latest_version(Path(args.index)) / "embeddings.npy", mmap_mode="c")
    index = ShardedExactIndex(emb, env, dtype=torch.float32) if env.active else ExactIndex(emb, dtype="fp32")
    enc = Retriever.from_pretrained(str(next((Path(args.index) / "retriever").iterdir()))).eval().encode_queries(
        questions(64, args.seed + 1)).numpy()
    index.search(enc[:1], 10)
    lat1 = timed(lambda i: index.search(enc[i : i + 1], 10), range(30))
    lat64 = timed(lambda _: index.search(enc, 10), range(3))
    ids = index.search(enc, 10)[1]
    out = {"world": env.world, "p50_ms_1_query": pct(lat1, 50), "p99_ms_1_query": pct(lat1, 99),
           "ms_per_query_batch_64": round(min(lat64) * 1000 / 64, 2), "rss_mb_per_rank": rss_mb(),
           "ids_sha": __import__("hashlib").sha1(ids.tobytes()).hexdigest()[:12]}
    return out if env.is_main else None


CHILDREN = {"open": child_open, "writelog": child_writelog, "search": child_search, "dense": child_dense,
            "densesearch": child_densesearch, "bm25": child_bm25, "bm25tile": child_bm25tile,
            "bm25search": child_bm25search, "sharded": child_sharded}


# -- report ----------------------------------------------------------------------------------------

def load_results(work: Path) -> dict:
    out: dict = {}
    for f in sorted((work / "results").glob("*.json")):
        stage, n = f.stem.rsplit("-", 1)
        out.setdefault(stage, {})[int(n)] = json.loads(f.read_text())
    return out


def slope(points: dict) -> float | None:
    """The log-log slope of a cost between its two largest N (1: linear, 0: flat)."""
    ns = sorted(n for n, v in points.items() if v)
    if len(ns) < 2:
        return None
    a, b = ns[-2], ns[-1]
    return round(float(np.log(points[b] / points[a]) / np.log(b / a)), 2)


def report(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = load_results(Path(args.work))

    def get(stage, *keys):
        return {n: _dig(v, keys) for n, v in r.get(stage, {}).items() if _dig(v, keys)}

    series = {
        "build: block store (s)": get("build", "build_seconds", "blocks"),
        "build: dense side, import + IVF (s)": get("build", "build_seconds", "dense"),
        "build: BM25 side (s)": get("build", "build_seconds", "bm25"),
        "open (s)": get("open", "open_seconds"),
        "index check (s)": get("check", "seconds"),
        f"open after {args.updates:,} logged updates (s)": get(f"replay-{args.updates}-updates", "open_seconds"),
        f"restart to a first answer after {args.updates:,} updates (s)": get(f"replay-{args.updates}-updates", "restart_seconds"),
        "search hybrid p50 (ms)": get("search", "hybrid", "p50_ms"),
        "search dense p50 (ms)": get("search", "dense", "p50_ms"),
        "search BM25 p50 (ms)": get("search", "bm25", "p50_ms"),
        "exact dense scan p50 (ms)": get("search", "exact_search", "p50_ms"),
        "build peak RSS (MB)": get("build", "peak_rss_mb"),
        "serve peak RSS (MB)": get("serve", "peak_rss_mb"),
        "disk total (MB)": get("build", "disk_mb", "total"),
        "dense structure alone p50 (ms)": get("dense", "p50_ms"),
        "dense structure alone (MB)": get("dense", "index_mb"),
        "BM25 structure alone p50, above 2M tiled (ms)": get("bm25", "p50_ms"),
        "BM25 structure alone, build peak RSS (MB)": get("bm25", "build_peak_rss_mb"),
    }
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    panels = {0: ("time (s)", "(s)"), 1: ("latency (ms)", "(ms)"), 2: ("memory and disk (MB)", "(MB)")}
    for i, (title, unit) in panels.items():
        ax = axes[i]
        for name, pts in series.items():
            if name.endswith(unit) and pts:
                ns = sorted(pts)
                ax.plot(ns, [pts[n] for n in ns], "o-", label=name.replace(f" {unit}", ""))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("blocks (N)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("ralm cost against corpus size (benchmarks/scale/scale.py on a 2-core CPU box; RESULTS.md says which ran idle)")
    fig.tight_layout()
    fig.savefig(args.figure, dpi=110)
    slopes = {name: slope(pts) for name, pts in series.items() if len(pts) >= 2}
    growing = [(v, k) for k, v in slopes.items() if v is not None and "structure alone" not in k]
    print(json.dumps({"figure": str(args.figure), "series": series, "log_log_slope_between_two_largest_N": slopes,
                      "fastest": max(growing) if growing else None}, indent=1, default=str))


def _dig(v, keys):
    for k in keys:
        if not isinstance(v, dict):
            return None
        v = v.get(k)
    return v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="runs/scale", help="generated corpora, indexes, logs and results (resumable)")
    ap.add_argument("--sizes", default="10000,100000,1000000", help="N of the index stages")
    ap.add_argument("--dense-sizes", default="1000000,3000000,10000000", help="N of the dense-structure stage")
    ap.add_argument("--bm25-sizes", default="1000000,2000000,10000000", help="N of the BM25-structure stage")
    ap.add_argument("--bm25-whole", type=int, default=2_000_000, help="largest N the BM25 stage builds whole (its memory)")
    ap.add_argument("--bm25-tile-base", type=int, default=1_000_000, help="the build a larger N's BM25 structure is tiled from")
    ap.add_argument("--only", default=",".join(INDEX_STAGES), help=f"stages: {', '.join(STAGES)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--queries", type=int, default=200, help="SQuAD questions timed per measurement")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument("--model", default="", help="the retriever that embeds the sentences (default: the bundled MiniLM)")
    ap.add_argument("--stride", type=int, default=3, help="sentences of every STRIDE-th SQuAD paragraph (30,845 at 3)")
    ap.add_argument("--add-docs", type=int, default=10_000, help="documents `ralm index add` adds (stage add)")
    ap.add_argument("--updates", type=int, default=100_000, help="logged updates replayed at open (stage replay)")
    ap.add_argument("--restarts", type=int, default=5, help="fresh processes that open the index after the updates (stage replay)")
    ap.add_argument("--update-timeout", type=float, default=1800, help="seconds before stages add and replay give up")
    ap.add_argument("--force", action="store_true", help="rerun stages that have results")
    ap.add_argument("--report", action="store_true", help="print the figures, their log-log slopes, and draw --figure")
    ap.add_argument("--figure", default=FIGURES / "scale.png")
    ap.add_argument("--child", choices=list(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--index", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--started", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.model = args.model or None
    sys.path.insert(0, str(SRC))
    if args.child:
        out = CHILDREN[args.child](args)
        if out is not None:
            print(json.dumps(out), flush=True)
        return
    if args.report:
        report(args)
        return
    work = Path(args.work)
    (work / "results").mkdir(parents=True, exist_ok=True)
    stages = [st for st in args.only.split(",") if st]
    unknown = [st for st in stages if st not in STAGES]
    if unknown:
        ap.error(f"unknown stage(s) {unknown}; choose from {', '.join(STAGES)}")
    for stage in stages:
        sizes = {"dense": args.dense_sizes, "bm25": args.bm25_sizes}.get(stage, args.sizes)
        for n in (int(x) for x in sizes.split(",")):
            # results of several document and update counts
            name = {"add": f"add-{args.add_docs}-docs", "replay": f"replay-{args.updates}-updates"}.get(stage, stage)
            target = work / "results" / f"{name}-{n}.json"
            if target.is_file() and not args.force:
                continue
            print(f"[{time.strftime('%H:%M:%S')}] {stage} N={n}", file=sys.stderr, flush=True)
            start = time.perf_counter()
            result = {**STAGES[stage](args, n), "stage_wall_seconds": round(time.perf_counter() - start, 1),
                      "date": time.strftime("%Y-%m-%d %H:%M")}
            target.write_text(json.dumps(result, indent=1) + "\n")
            print(json.dumps({"stage": stage, "n": n, **result}), flush=True)


if __name__ == "__main__":
    main()
