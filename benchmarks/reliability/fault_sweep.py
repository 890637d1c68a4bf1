"""Fault sweep: bad inputs and killed processes against the real `ralm` command.

    python benchmarks/reliability/fault_sweep.py [--http] [--keep DIR] [--timeout 180] [--classes 69.1,...] [--baseline-src OLD/src]

Builds tiny data in a temporary folder (a random 2-layer BERT with the bundled wordpieces, a
six-document corpus, dense and BM25 indexes, a RETRO chunk DB), then
  - runs every bad CLI input as its own process. Handled: exit code 2, one line on stderr,
    no traceback, and that line names the fault. Inputs that are accepted with a warning
    (empty documents, an index of another corpus) count when they exit 0 with a `warning:` line,
    and inputs with a correct result (a sound index checked) when they exit 0 with it;
  - kills index builds and training runs with SIGKILL mid-way and runs them again. Recovered:
    the rerun succeeds (a training run resumes from its checkpoint) and leaves no temp folder;
  - with --http, sends bad requests to `ralm serve` on 127.0.0.1. Handled: a 4xx with a JSON
    {"error"} body, and the server still answers /health afterwards; then races DELETEs,
    stalls headers and bodies, loads /docs' assets, and reads the server's log.
  - issue 69's classes (69.1 writes from another origin's page, Host forms and security headers,
    on a server of its own; 69.2 a checksum for every file; 69.3 a build over live updates;
    69.4 parsers in linear time, each page within 45 s; 69.5 library exceptions; 69.6 outputs
    never overwrite inputs, the inputs compared byte for byte; 69.7 input limits, CLI and HTTP;
    69.7q item 7's questionable cases as decided) judged by the same standard;
  - in the kill class, also `ralm serve` SIGKILLed 3 times under a writer: acknowledged writes lost.
The summary counts the cases of each class of issue 33 (1 verified index files, 2 error
boundary, 3 corpus and text, 4 server) and issue 69 beside those of the earlier sweeps.
`--baseline-src OLD/src` runs every command with another checkout's code (the tiny data too).
Prints one JSON summary on stdout; progress goes to stderr. 20 minutes on 2 busy CPU cores (issue
69's classes without kill: about 4).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import ROOT, SRC, free_port, ralm_env, run_ralm  # noqa: E402
from common import start_server as serve  # noqa: E402

sys.path[:0] = [str(SRC), str(ROOT / "tests")]
from conftest import DOCS, make_tiny_bert  # noqa: E402  (the tests' tiny model and corpus)

ENV = ralm_env(SRC, OMP_NUM_THREADS="2")
LR = r"--lr|learning rate|\blr\b"  # trainer configs name their field (lr), as library errors do


@dataclass
class Case:
    name: str
    args: list
    needle: str = ""  # a regex the error line must match (the fault it names)
    warn: bool = False  # accepted with a `warning:` line instead of refused
    timeout: float | None = None  # seconds, when shorter than --timeout (a server that wrongly starts)
    cls: str = "earlier sweeps"  # the class of fault (issue 33's items 1-4) the summary counts it under
    ok: bool = False  # a correct result: exit 0, and stdout matches `needle`
    gone: Path | None = None  # a folder the failed command must not leave behind
    stdin: Path | None = None  # a file given as the command's standard input
    intact: tuple = ()  # files the command must leave byte for byte as they were (its inputs, an index's files)
    failed: str | None = None  # why the case could not even be set up (an older code's index lacks the file to damage)


def ralm(*args, timeout: float = 120, stdin: Path | None = None) -> subprocess.CompletedProcess:
    """One case's command (an argument may be bytes, one that is not UTF-8), whatever its exit code."""
    return run_ralm(*args, env=ENV, cwd=ROOT, timeout=timeout, stdin=stdin)


def check(case: Case, timeout: float) -> str | None:
    """None when the case was handled, else why not."""
    if case.failed:
        return case.failed
    before = {p: p.read_bytes() if p.is_file() else None for p in case.intact}
    try:
        proc = ralm(*case.args, timeout=min(timeout, case.timeout or timeout), stdin=case.stdin)
    except subprocess.TimeoutExpired:
        return f"still running after {min(timeout, case.timeout or timeout)} s"
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    if "Traceback" in proc.stderr:
        return f"traceback (exit {proc.returncode}): {lines[-1] if lines else ''}"
    if case.gone is not None and case.gone.exists():
        return f"left {case.gone} behind"
    changed = [p.name for p, data in before.items() if (p.read_bytes() if p.is_file() else None) != data]
    if changed:
        return f"overwrote {', '.join(changed)}"
    if case.ok:
        if proc.returncode != 0 or not re.search(case.needle, proc.stdout) or "NaN" in proc.stdout:
            return f"exit {proc.returncode}, not the expected result: {(proc.stdout or ' | '.join(lines))[:300]}"
        return None
    if case.warn:
        found = [line for line in lines if line.startswith("warning:")]
        if proc.returncode != 0 or not found or not re.search(case.needle, found[0]):
            return f"exit {proc.returncode}, no matching warning: {lines[-1] if lines else ''}"
        return None
    if proc.returncode != 2:
        return f"exit {proc.returncode}: {lines[-1] if lines else ''}"
    if len(lines) != 1 or not lines[0].startswith("error:") or not re.search(case.needle, lines[0]):
        return f"not one matching error line: {' | '.join(lines)[:300]}"
    return None


# -- tiny data -----------------------------------------------------------------------------

def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def big_corpus(path: Path, n: int) -> Path:
    """n documents of a few sentences each: builds that take long enough to be killed mid-way."""
    return write_jsonl(path, ({"id": f"d{i}", "title": f"{d['title']} {i}", "text": f"{d['text']} Number {i} follows {i - 1}."}
                              for i, d in ((i, DOCS[i % len(DOCS)]) for i in range(n))))


def make_data(tmp: Path) -> dict:
    import transformers

    transformers.logging.disable_progress_bar()
    bert, other = make_tiny_bert(tmp / "bert"), make_tiny_bert(tmp / "bert2", seed=1)
    corpus = write_jsonl(tmp / "corpus.jsonl", DOCS)
    questions = write_jsonl(tmp / "q.jsonl", [{"id": "q1", "question": "Who created Python?", "answers": ["Guido van Rossum"]},
                                              {"id": "q2", "question": "Where is the Nile?", "answers": ["Africa"]}])
    for args in (["index", "build", corpus, "--out", tmp / "dense", "--model", bert, "--dim", 16],
                 ["index", "build", corpus, "--out", tmp / "dense-other", "--model", other, "--dim", 16],
                 ["index", "build", corpus, "--out", tmp / "bm25", "--kind", "bm25"],
                 ["index", "build", corpus, "--out", tmp / "dense-faiss", "--model", bert, "--dim", 16, "--faiss", "Flat"],
                 ["retro", "build-db", corpus, "--out", tmp / "db", "--model", bert, "--chunk-len", 16]):
        proc = ralm(*args)
        if proc.returncode:
            sys.exit(f"setup failed: ralm {' '.join(map(str, args))}\n{proc.stderr}")
    (tmp / "a_file").write_text("not a directory\n")
    other_retriever = next((tmp / "dense-other" / "retriever").iterdir())
    taken = socket.create_server(("127.0.0.1", 0))  # held for the whole sweep: `serve` must refuse its port
    updates_dir = tmp / "bm25-updates-dir"
    shutil.copytree(tmp / "bm25", updates_dir)
    (updates_dir / "updates.jsonl").mkdir()
    return {"bert": bert, "other_retriever": other_retriever, "corpus": corpus, "questions": questions, "taken": taken,
            "taken_port": taken.getsockname()[1], "updates_dir_index": updates_dir}


def damaged(tmp: Path, name: str, src: str, damage) -> Path:
    """A copy of index `src` with one file damaged by `damage(version dir, block store dir, root)`."""
    dst = tmp / "damaged" / name
    shutil.copytree(tmp / src, dst)
    damage(next((dst / "versions").glob("v*")), next((dst / "blocks").iterdir()), dst)
    return dst


def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


# -- the cases -----------------------------------------------------------------------------

def cli_cases(tmp: Path, d: dict) -> list[Case]:
    bert, corpus, q = d["bert"], d["corpus"], d["questions"]
    bad = tmp / "bad"
    bad.mkdir()
    (bad / "malformed.jsonl").write_text('{"id": "a", "text": "ok"}\n{"id": "b", "text" "oops"}\n')
    write_jsonl(bad / "no_text.jsonl", [{"id": "a", "title": "A"}])
    (bad / "latin1.jsonl").write_bytes('{"id": "a", "text": "caf\xe9"}\n'.encode("latin-1"))
    (bad / "empty.jsonl").write_text("")
    (bad / "corpus.csv").write_text("id,text\na,b\n")
    (bad / "no_text_col.tsv").write_text("id\ttitle\na\tA\n")
    (bad / "ragged.tsv").write_text("id\ttitle\ttext\na\tA\n")
    write_jsonl(bad / "dup_ids.jsonl", [DOCS[0], DOCS[0]])
    write_jsonl(bad / "empty_text.jsonl", [*DOCS, {"id": "blank", "title": "Blank", "text": "  "}])
    write_jsonl(bad / "other_corpus.jsonl", [{"id": f"o{i}", "title": "Cooking", "text": f"Stir the soup {i} times."} for i in range(6)])
    (bad / "q_malformed.jsonl").write_text('{"question": "x", "answers": ["y"]\n')
    write_jsonl(bad / "q_no_answers.jsonl", [{"question": "x"}])
    write_jsonl(bad / "q_empty.jsonl", [{"question": " ", "answers": ["y"]}])
    write_jsonl(bad / "q_answers_int.jsonl", [{"question": "x", "answers": 3}])
    proc = ralm("index", "build", bad / "other_corpus.jsonl", "--out", tmp / "other_bm25", "--kind", "bm25")
    assert proc.returncode == 0, proc.stderr

    dense, bm25, db = tmp / "dense", tmp / "bm25", tmp / "db"
    afile, missing = tmp / "a_file", tmp / "does-not-exist"
    run = lambda name: tmp / "runs" / name  # noqa: E731
    tiny_lm = ["--dim", 32, "--layers", 1, "--heads", 2, "--seq-len", 32]
    tiny_ict = ["--model", bert, "--dim", 16, "--batch-size", 2, "--steps", 2]
    cases = [
        Case("corpus: malformed JSON line", ["index", "build", bad / "malformed.jsonl", "--out", run("i1"), "--kind", "bm25"], r"malformed\.jsonl:2"),
        Case("corpus: missing field", ["index", "build", bad / "no_text.jsonl", "--out", run("i2"), "--kind", "bm25"], r"no_text\.jsonl:1.*'text'"),
        Case("corpus: not UTF-8", ["index", "build", bad / "latin1.jsonl", "--out", run("i3"), "--kind", "bm25"], r"latin1\.jsonl:1.*UTF-8"),
        Case("corpus: empty", ["index", "build", bad / "empty.jsonl", "--out", run("i4"), "--kind", "bm25"], "empty"),
        Case("corpus: missing file", ["index", "build", missing, "--out", run("i5"), "--kind", "bm25"], "not found"),
        Case("corpus: unknown format", ["index", "build", bad / "corpus.csv", "--out", run("i6"), "--kind", "bm25"], "unknown corpus format"),
        Case("corpus: TSV without text column", ["index", "build", bad / "no_text_col.tsv", "--out", run("i7"), "--kind", "bm25"], r"no_text_col\.tsv:1"),
        Case("corpus: TSV ragged row", ["index", "build", bad / "ragged.tsv", "--out", run("i8"), "--kind", "bm25"], r"ragged\.tsv:2"),
        Case("corpus: duplicate ids", ["index", "build", bad / "dup_ids.jsonl", "--out", run("i9"), "--kind", "bm25"], "more than once"),
        Case("corpus: a document with empty text", ["index", "build", bad / "empty_text.jsonl", "--out", run("i10"), "--kind", "bm25"],
             r"empty_text\.jsonl:7", warn=True),
        Case("index build: missing model", ["index", "build", corpus, "--out", run("i11"), "--model", missing], "not found|no such directory"),
        Case("index build: --out is a file", ["index", "build", corpus, "--out", afile, "--kind", "bm25"], "a_file"),
        Case("index build: --out another kind", ["index", "build", corpus, "--out", bm25, "--model", bert, "--dim", 16], "bm25"),
        Case("index build: unknown kind", ["index", "build", corpus, "--out", run("i12"), "--kind", "tfidf"], "unknown index kind"),
        Case("index build: --batch-size 0", ["index", "build", corpus, "--out", run("i13"), "--batch-size", 0], "--batch-size"),
        Case("index build: --dim -4", ["index", "build", corpus, "--out", run("i14"), "--model", bert, "--dim", -4], "dim"),
        Case("search: -k 0", ["search", bm25, "capital", "-k", 0], "-k"),
        Case("search: -k -3", ["search", bm25, "capital", "-k", -3], "-k"),
        Case("search: empty query", ["search", bm25, " "], "empty"),
        Case("search: not an index", ["search", tmp, "capital"], "not an index"),
        Case("search: a model of another index", ["search", dense, "capital", "--model", d["other_retriever"]], "another model"),
        Case("eval retrieval: --ks 0", ["eval", "retrieval", "--index", bm25, "--questions", q, "--ks", "0,5"], "--ks"),
        Case("eval retrieval: --ks not numbers", ["eval", "retrieval", "--index", bm25, "--questions", q, "--ks", "a,b"], "--ks"),
        Case("questions: malformed JSON", ["eval", "retrieval", "--index", bm25, "--questions", bad / "q_malformed.jsonl"], r"q_malformed\.jsonl:1"),
        Case("questions: missing answers", ["eval", "retrieval", "--index", bm25, "--questions", bad / "q_no_answers.jsonl"], r":1.*answers"),
        Case("questions: empty question", ["eval", "retrieval", "--index", bm25, "--questions", bad / "q_empty.jsonl"], r":1.*question"),
        Case("questions: answers not a list", ["eval", "retrieval", "--index", bm25, "--questions", bad / "q_answers_int.jsonl"], r":1.*answers"),
        Case("questions: missing file", ["eval", "retrieval", "--index", bm25, "--questions", missing], "not found"),
        Case("eval retrieval: index of another corpus", ["eval", "retrieval", "--index", tmp / "other_bm25", "--questions", q],
             "no question", warn=True),
        Case("ask: empty question", ["ask", " ", "--model", bert, "--index", bm25], "empty"),
        Case("serve: --port 70000", ["serve", "--index", bm25, "--port", 70000], "--port"),
        Case("knnlm eval: --lmbda 2", ["knnlm", "eval", "--model", missing, "--store", missing, "--text", corpus, "--lmbda", 2], "lmbda"),
        Case("retro generate: --top-p 0", ["retro", "generate", "hi", "--model", missing, "--db", db, "--top-p", 0], "--top-p|top_p"),
        # item 8 of issue #19: every trainer refuses nonsensical numbers before any work
        Case("ict: --lr -1e-3", ["ict", "--corpus", corpus, "--out", run("t1"), *tiny_ict, "--lr", -1e-3], LR),
        Case("ict: --steps 0", ["ict", "--corpus", corpus, "--out", run("t2"), *tiny_ict[:-2], "--steps", 0], "steps"),
        Case("pretrain: --lr -1e-3", ["pretrain", "--corpus", corpus, "--out", run("t3"), "--model", bert, "--index", dense, "--steps", 2,
                                      "--refresh", "none", "--masking", "random", "-k", 2, "--lr", -1e-3], LR),
        Case("pretrain: --retriever-lr -1", ["pretrain", "--corpus", corpus, "--out", run("t4"), "--model", bert, "--index", dense, "--steps", 2,
                                             "--refresh", "none", "--masking", "random", "-k", 2, "--retriever-lr", -1], "retriever.lr|learning rate"),
        Case("finetune: --lr -1e-3", ["finetune", "--questions", q, "--index", bm25, "--out", run("t5"), "--init", bert, "--steps", 2,
                                      "--batch-size", 2, "-k", 2, "--lr", -1e-3], LR),
        Case("finetune: --retriever-lr -1", ["finetune", "--questions", q, "--index", bm25, "--out", run("t6"), "--init", bert, "--steps", 2,
                                             "--batch-size", 2, "-k", 2, "--retriever-lr", -1], "retriever.lr|learning rate"),
        Case("dpr: --lr -1e-3", ["dpr", "--questions", q, "--corpus", corpus, "--out", run("t7"), "--model", bert, "--dim", 16, "--steps", 2,
                                 "--batch-size", 2, "--lr", -1e-3], LR),
        Case("lm train: --lr -1e-3", ["lm", "train", "--text", corpus, "--out", run("t8"), *tiny_lm, "--steps", 2, "--lr", -1e-3], LR),
        Case("retro train: --lr -1e-3", ["retro", "train", "--db", db, "--text", corpus, "--out", run("t9"), *tiny_lm, "--cca-start", 0,
                                         "--steps", 2, "--lr", -1e-3], LR),
        Case("lm train: --batch-size 0", ["lm", "train", "--text", corpus, "--out", run("t10"), *tiny_lm, "--steps", 2, "--batch-size", 0], "batch"),
        Case("ict: --out is a file", ["ict", "--corpus", corpus, "--out", afile, *tiny_ict], "a_file"),
        Case("lm train: --out is a file", ["lm", "train", "--text", corpus, "--out", afile, *tiny_lm, "--steps", 2], "a_file"),
        Case("retro build-db: --out is a file", ["retro", "build-db", corpus, "--out", afile, "--model", bert, "--chunk-len", 16], "a_file"),
        Case("convert hf-realm: missing source", ["convert", "hf-realm", missing, "--out", run("c1")], "not found|does-not-exist"),
    ]
    # A damaged index: one line naming the damaged file, never a traceback.
    damages = {
        "embeddings.npy truncated": ("dense", lambda v, b, r: truncate(v / "embeddings.npy", 200), "embeddings.npy"),
        "embeddings.npy empty": ("dense", lambda v, b, r: truncate(v / "embeddings.npy", 0), "embeddings.npy"),
        "token file truncated": ("dense", lambda v, b, r: truncate(b / "tokens" / "values.bin", 10), "values.bin"),
        "token offsets truncated": ("dense", lambda v, b, r: truncate(b / "tokens" / "offsets.npy", 40), "offsets.npy"),
        "index manifest garbage": ("dense", lambda v, b, r: (r / "manifest.json").write_text("{garbage"), "manifest.json"),
        "version manifest garbage": ("dense", lambda v, b, r: (v / "manifest.json").write_text("{garbage"), "manifest.json"),
        "version manifest wrong shape": ("dense", lambda v, b, r: (v / "manifest.json").write_text("[1, 2]\n"), "manifest.json"),
        "block store manifest garbage": ("bm25", lambda v, b, r: (b / "manifest.json").write_text("\x00\xff garbage"), "manifest.json"),
        "blocks.jsonl garbage": ("bm25", lambda v, b, r: (b / "blocks.jsonl").write_text("garbage\n" * 100), "blocks.jsonl"),
        "blocks.jsonl truncated": ("bm25", lambda v, b, r: truncate(b / "blocks.jsonl", 50), "blocks.jsonl"),
        "LATEST names a missing version": ("dense", lambda v, b, r: (r / "LATEST").write_text("v000042\n"), "v000042"),
    }
    for name, (src, damage, needle) in damages.items():
        path = damaged(tmp, name.replace(" ", "_"), src, damage)
        cases.append(Case(f"damaged index: {name}", ["search", path, "capital", "-k", 2], re.escape(needle)))
    # A wrong-shaped line in the update log stops `ralm serve` with one line, not a traceback.
    for name, line in (("a list", "[1, 2]"), ("no id", '{"op": "add", "text": "x"}'), ("unknown op", '{"op": "merge", "id": "x"}')):
        path = damaged(tmp, f"updates_{name.replace(' ', '_')}", "bm25", lambda v, b, r, line=line: (r / "updates.jsonl").write_text(
            json.dumps({"op": "add", "id": "ok", "title": "", "text": "fine"}) + "\n" + line + "\n"))
        cases.append(Case(f"updates.jsonl: {name}", ["serve", "--index", path, "--port", free_port()], r"updates\.jsonl:2", timeout=60))
    return cases + verify_cases(tmp) + boundary_cases(tmp, d) + text_cases(tmp, d) + issue69_cases(tmp, d)


# -- issue 33: whole classes of faults -------------------------------------------------------

def _nan_embeddings(v: Path) -> None:
    import numpy as np

    emb = np.load(v / "embeddings.npy")
    emb[:] = np.nan
    np.save(v / "embeddings.npy", emb)  # same size, shape and dtype


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))


def _drop_key(path: Path, *keys: str) -> None:
    m = json.loads(path.read_text())
    for key in keys:
        m.pop(key)
    path.write_text(json.dumps(m))


def verify_cases(tmp: Path) -> list[Case]:
    """Item 1: damaged files of every index kind, found when a version opens (sizes, shapes,
    dtypes) or by `ralm index check` (checksums, NaN/inf)."""
    c = "1 verified index files"
    damages = {  # name: (index, damage(version, blocks, root), the file named, found on open)
        "bm25 array truncated": ("bm25", lambda v, b, r: truncate(sorted((v / "bm25").glob("*.npy"))[0], 100), r"bm25/", True),
        "bm25 array one byte flipped": ("bm25", lambda v, b, r: _flip_byte(sorted((v / "bm25").glob("*.npy"))[-1]), r"bm25/", False),
        "bm25 vocabulary json truncated": ("bm25", lambda v, b, r: truncate(next((v / "bm25").glob("vocab*.json")), 5), r"vocab", True),
        "model.safetensors truncated": ("dense", lambda v, b, r: truncate(next(r.glob("retriever/*/model.safetensors")), 300),
                                        "model.safetensors", True),
        "model.safetensors one byte flipped": ("dense", lambda v, b, r: _flip_byte(next(r.glob("retriever/*/model.safetensors"))),
                                               "model.safetensors", False),
        # ('retriever' alone is the old name of 'kind', kept for older ralm: dropping it harms nothing)
        "index manifest without 'kind'": ("dense", lambda v, b, r: _drop_key(r / "manifest.json", "kind", "retriever"), "kind", True),
        "NaN embeddings": ("dense", lambda v, b, r: _nan_embeddings(v), "embeddings.npy", False),
        "token values one byte flipped": ("dense", lambda v, b, r: _flip_byte(b / "tokens" / "values.bin"), "values.bin", False),
        "faiss index truncated": ("dense-faiss", lambda v, b, r: truncate(v / "faiss.index", 64), "faiss.index", True),
    }
    cases = []
    for name, (src, damage, needle, on_open) in damages.items():
        path = damaged(tmp, "v_" + re.sub(r"\W+", "_", name), src, damage)
        cases.append(Case(f"index check: {name}", ["index", "check", path, "--json"], re.escape(needle), cls=c))
        if on_open:
            cases.append(Case(f"search: {name}", ["search", path, "capital", "-k", 2, "--json"], re.escape(needle), cls=c))
    nan = damaged(tmp, "v_nan_search", "dense", lambda v, b, r: _nan_embeddings(v))
    cases.append(Case("search --json over NaN embeddings: no bare NaN", ["search", nan, "capital", "-k", 2, "--json"], "index check", cls=c))
    for kind in ("dense", "bm25", "dense-faiss"):
        cases.append(Case(f"index check: a sound {kind} index", ["index", "check", tmp / kind, "--json"], r'"sound": true', cls=c, ok=True))
    return cases


def boundary_cases(tmp: Path, d: dict) -> list[Case]:
    """Item 2: the filesystem and options checked before slow work."""
    c = "2 error boundary"
    bert, corpus, q = d["bert"], d["corpus"], d["questions"]
    afile, fifo = tmp / "a_file", tmp / "fifo.jsonl"
    if not fifo.exists():
        os.mkfifo(fifo)
    stop = write_jsonl(tmp / "bad" / "stop_words.jsonl", [{"id": "a", "title": "", "text": "the a of it is"}, {"id": "b", "text": "x y z"}])
    run = lambda name: tmp / "runs" / name  # noqa: E731
    tiny_ict = ["ict", "--corpus", corpus, "--model", bert, "--dim", 16, "--batch-size", 2, "--steps", 2]
    pre = ["pretrain", "--corpus", corpus, "--model", bert, "--steps", 2, "--refresh", "none", "--masking", "random", "-k", 2]
    return [
        Case("--out below a file", ["index", "build", corpus, "--out", afile / "sub", "--kind", "bm25"], "a_file", cls=c),
        Case("--out in /proc", ["index", "build", corpus, "--out", "/proc/ralm-sweep/x", "--kind", "bm25"], "/proc/ralm-sweep", cls=c),
        Case("--predictions is a folder", ["eval", "retrieval", "--index", tmp / "bm25", "--questions", q, "--predictions", tmp / "bad"],
             "bad", cls=c),
        Case("a FIFO as the corpus", ["index", "build", fifo, "--out", run("b1"), "--kind", "bm25"], "not a regular file", cls=c,
             timeout=60),
        Case("a FIFO as the questions", ["eval", "retrieval", "--index", tmp / "bm25", "--questions", fifo], "not a regular file", cls=c,
             timeout=60),
        Case("a failed build removes its --out", ["index", "build", stop, "--out", run("b2"), "--kind", "bm25"], "stop word",
             cls=c, gone=run("b2")),
        Case("--device cuda without CUDA", ["index", "build", corpus, "--out", run("b3"), "--device", "cuda"], "CUDA", cls=c),
        Case("--device unknown", ["search", tmp / "bm25", "capital", "--device", "tpu7"], "--device", cls=c),
        Case("--faiss unparsable", ["index", "build", corpus, "--out", run("b4"), "--model", bert, "--dim", 16, "--faiss", "IVFxx,Flat"],
             "IVFxx", cls=c),
        Case("--faiss IVF1024 on 6 blocks: fitted", ["index", "build", corpus, "--out", run("b5"), "--model", bert, "--dim", 16,
                                                      "--faiss", "IVF1024,Flat"], "IVF1024", warn=True, cls=c),
        Case("ict --lr inf", [*tiny_ict, "--out", run("b6"), "--lr", "inf"], "--lr", cls=c),
        Case("ict --lr nan", [*tiny_ict, "--out", run("b7"), "--lr", "nan"], "--lr", cls=c),
        Case("ict --keep-sentence nan", [*tiny_ict, "--out", run("b8"), "--keep-sentence", "nan"], "--keep-sentence", cls=c),
        Case("ict --block-len 100000", [*tiny_ict, "--out", run("b9"), "--block-len", 100000], "block.len", cls=c),
        Case("pretrain --retriever-lr inf", [*pre, "--index", tmp / "dense", "--out", run("b10"), "--retriever-lr", "inf"],
             "--retriever-lr", cls=c),
        Case("pretrain --index of a BM25 index", [*pre, "--index", tmp / "bm25", "--out", run("b11")], "dense", cls=c),
        Case("knnlm eval --lmbda nan", ["knnlm", "eval", "--model", tmp / "missing", "--store", tmp / "missing", "--text", corpus,
                                        "--lmbda", "nan"], "lmbda", cls=c),
        Case("serve on a port already taken", ["serve", "--index", tmp / "bm25", "--port", d["taken_port"]], "cannot listen", cls=c,
             timeout=60),
        Case("serve with updates.jsonl a folder", ["serve", "--index", d["updates_dir_index"], "--port", free_port()],
             "not a regular file", cls=c, timeout=60),
    ]


def text_cases(tmp: Path, d: dict) -> list[Case]:
    """Item 3: corpus and text edge cases."""
    c = "3 corpus and text"
    bad = tmp / "bad"
    lines = {
        "a lone surrogate in the text": '{"id": "s", "text": "x \\ud800 y"}',
        "a lone surrogate in the title": '{"id": "s", "title": "\\udfff", "text": "x"}',
        "an id with a newline": json.dumps({"id": "a\nb", "text": "x"}),
        "an id with NUL": json.dumps({"id": "a\u0000b", "text": "x"}),
        "an id of zero-width spaces": json.dumps({"id": "\u200b\u200b", "text": "x"}),
        "an id '..'": json.dumps({"id": "..", "text": "x"}),
        "JSON nested 100000 deep": "[" * 100_000 + "]" * 100_000,
        "an integer of 5000 digits": '{"id": ' + "7" * 5000 + ', "text": "x"}',
    }
    cases = []
    for i, (name, line) in enumerate(lines.items()):
        path = bad / f"text_{i}.jsonl"
        path.write_text(json.dumps(DOCS[0]) + "\n" + line + "\n")
        cases.append(Case(f"corpus: {name}", ["index", "build", path, "--out", tmp / "runs" / f"x{i}", "--kind", "bm25"],
                          rf"text_{i}\.jsonl:2", cls=c, gone=tmp / "runs" / f"x{i}"))
    zw = write_jsonl(bad / "zero_width.jsonl", [{"id": "z", "text": "\u200b\u200b \ufeff"}])
    single = write_jsonl(bad / "single_letters.jsonl", [{"id": "s", "text": "a b c d e f g"}])
    qs = bad / "q_surrogate.jsonl"
    qs.write_text('{"question": "who \\ud800?", "answers": ["x"]}\n')
    cases += [
        Case("corpus: text of only zero-width spaces", ["index", "build", zw, "--out", tmp / "runs" / "z1", "--kind", "bm25"],
             "empty", cls=c),
        Case("bm25 corpus: single letters only", ["index", "build", single, "--out", tmp / "runs" / "z2", "--kind", "bm25"],
             "single character", cls=c, gone=tmp / "runs" / "z2"),
        Case("questions: a lone surrogate", ["eval", "retrieval", "--index", tmp / "bm25", "--questions", qs], r"q_surrogate\.jsonl:1",
             cls=c),
        Case("search: a query of zero-width spaces", ["search", tmp / "bm25", "\u200b\u200b", "--json"], r"^\[", ok=True, cls=c),
    ]
    return cases


# -- issue 69: reliability in a hostile world ---------------------------------------------

I69 = {"69.1": "69.1 cross-origin writes and headers", "69.2": "69.2 a checksum for every file",
       "69.3": "69.3 a build keeps live updates", "69.4": "69.4 parsers in linear time",
       "69.5": "69.5 library exceptions", "69.6": "69.6 outputs never overwrite inputs",
       "69.7": "69.7 input limits", "69.7q": "69.7q the questionable cases, decided"}


def _live(tmp: Path, name: str, *, compacted: bool = False) -> Path:
    """A copy of the BM25 index with one document added through its update log (folded into a
    new version by `ralm index compact` when `compacted`)."""
    index = tmp / "live" / name
    shutil.copytree(tmp / "bm25", index)
    added = write_jsonl(tmp / "live" / f"{name}.jsonl", [{"id": "zanzibar", "title": "Zanzibar", "text": "Zanzibar grows cloves."}])
    for args in (["index", "add", index, added], *([["index", "compact", index]] if compacted else [])):
        proc = ralm(*args)
        if proc.returncode:  # (an older code may lack the command: its cases then fail, counted)
            print(f"setup: ralm {' '.join(map(str, args))}: exit {proc.returncode}", file=sys.stderr)
    return index


def _edit_log_text(root: Path) -> None:
    """One letter of a logged document changed: the line is still valid JSON, only its checksum knows."""
    log = root / "updates.jsonl"
    log.write_bytes(log.read_bytes().replace(b"Zanzibar grows", b"Zanzibar grew", 1))


def _edit_manifest_date(v: Path) -> None:
    """The version manifest's `created` changed by a second: a well-formed manifest whose files all
    match it, that only the manifest's own checksum knows was edited."""
    m = json.loads((v / "manifest.json").read_text())
    m["created"] += 1
    (v / "manifest.json").write_text(json.dumps(m, indent=2))


def _huge_offsets(b: Path) -> None:
    import numpy as np

    idx = np.load(b / "blocks.idx.npy")
    idx[...] = 1 << 40  # a record a terabyte into blocks.jsonl
    np.save(b / "blocks.idx.npy", idx)


def issue69_cases(tmp: Path, d: dict) -> list[Case]:
    """Issue 69's classes that the command line shows (item 1 and the HTTP side of item 7 are
    in http69_faults): each a few cases, judged as the others are."""
    import numpy as np
    import torch

    bert, corpus, q, bm25 = d["bert"], d["corpus"], d["questions"], tmp / "bm25"
    bad, run = tmp / "bad69", lambda name: tmp / "runs69" / name  # noqa: E731
    bad.mkdir()
    cases = []

    # item 2: every file verified by `index check`, and on read
    c = I69["69.2"]
    logged = _live(tmp, "logged")
    damages = {  # name: (index copied, damage(version, blocks, root), the file named, command)
        "an update-log line's text edited": (logged, lambda v, b, r: _edit_log_text(r), r"updates\.jsonl:2", "check"),
        "an update-log line's text edited, opened": (logged, lambda v, b, r: _edit_log_text(r), r"updates\.jsonl:2", "search"),
        "a logged document's live state flipped": (logged, lambda v, b, r: _flip_byte(next(r.glob("updates-*.bin"))), r"updates-", "check"),
        "blocks.idx.npy one byte flipped": (bm25, lambda v, b, r: _flip_byte(b / "blocks.idx.npy"), r"blocks\.idx\.npy", "check"),
        "blocks.idx.npy offsets past blocks.jsonl, opened": (bm25, lambda v, b, r: _huge_offsets(b), r"blocks\.idx\.npy|blocks\.jsonl",
                                                               "search"),
        "the version manifest's date edited": (bm25, lambda v, b, r: _edit_manifest_date(v), r"manifest\.json", "check"),
        "doc_hash.npy one byte flipped": (bm25, lambda v, b, r: _flip_byte(b / "doc_hash.npy"), r"doc_hash\.npy", "check"),
        "tokenizer.json damaged, opened": (tmp / "dense", lambda v, b, r: truncate(next(r.glob("retriever/*/tokenizer.json")), 100),
                                           r"tokenizer\.json", "search"),
    }
    for name, (src, damage, needle, command) in damages.items():
        dst = tmp / "damaged69" / re.sub(r"\W+", "_", name)
        shutil.copytree(src, dst)
        try:
            damage(next((dst / "versions").glob("v*")), next((dst / "blocks").iterdir()), dst)
            failed = None
        except (StopIteration, AttributeError, OSError) as e:  # the file, or the field, is not in this code's index
            failed = f"nothing to damage in this code's index ({type(e).__name__})"
        args = ["index", "check", dst, "--json"] if command == "check" else ["search", dst, "capital", "-k", 2, "--json"]
        cases.append(Case(f"{command}: {name}", args, needle, cls=c, failed=failed))

    # item 3: a build over a live index is refused unless --replace
    c = I69["69.3"]
    compacted = _live(tmp, "compacted", compacted=True)
    replaced = _live(tmp, "replaced")
    cases += [
        Case("build over an index holding a logged add", ["index", "build", corpus, "--out", _live(tmp, "rebuilt"), "--kind", "bm25"],
             r"--replace", cls=c),
        Case("build over an index whose add a compaction folded", ["index", "build", corpus, "--out", compacted, "--kind", "bm25"],
             r"--replace", cls=c),
        Case("build --replace drops them, as asked", ["index", "build", corpus, "--out", replaced, "--kind", "bm25", "--replace"],
             r"built", ok=True, cls=c),
    ]

    # item 4: parsers in linear time (sizes the code before took minutes on, or hours)
    c = I69["69.4"]
    pages = {"20,000 identical Markdown headings": ("headings.md", "# Care\n\ntext\n\n" * 20_000, True),
             "20,000 identical HTML headings": ("headings.html", "<main>" + "<h2>Care</h2><p>t</p>" * 20_000 + "</main>", True),
             "20,000 reopened formatting tags": ("reopened.html", "".join(f"<p><b id={k}>w</p>" for k in range(20_000)), True),
             "100,000 nested divs (refused)": ("deep.html", "<div>" * 100_000 + "x", False)}
    for i, (name, (file, text, read)) in enumerate(pages.items()):
        folder = bad / f"pages{i}"
        folder.mkdir()
        (folder / file).write_text(text)
        cases.append(Case(f"a page of {name}", ["index", "build", folder, "--out", run(f"p{i}"), "--kind", "bm25"],
                          r"built" if read else r"deeper than 512", ok=read, timeout=45, cls=c))

    # item 5: a library's exception is one line naming the input
    c = I69["69.5"]
    (bad / "pdfs").mkdir()
    (bad / "pdfs" / "scan.pdf").write_bytes(b"\x00garbage, no header" * 50)
    (bad / "bomb").mkdir()
    # the tests' deflate bomb: 100 MB of zeros in 97 kB
    from test_formats_hostile import HOSTILE_PDFS

    (bad / "bomb" / "bomb.pdf").write_bytes(HOSTILE_PDFS["bomb"][0])
    (bad / "names").mkdir()
    (bad / "names" / "ok.txt").write_text("Readable text.")
    with open(os.fsencode(bad / "names") + b"/caf\xe9.txt", "wb") as f:  # a Latin-1 file name
        f.write(b"text")
    pickled = bad / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps({"model_type": "bert"}))
    torch.save({"w": torch.zeros(1)}, pickled / "pytorch_model.bin")
    np.savez(bad / "emb.npz", a=np.zeros((len(DOCS), 32), dtype=np.float32))
    cases += [
        Case("a .pdf without %PDF-", ["index", "build", bad / "pdfs", "--out", run("l1"), "--kind", "bm25"], r"scan\.pdf", cls=c),
        Case("a PDF deflate bomb", ["index", "build", bad / "bomb", "--out", run("l2"), "--kind", "bm25"], r"bomb\.pdf", cls=c,
             timeout=60),
        Case("a file name that is not UTF-8", ["index", "build", bad / "names", "--out", run("l3"), "--kind", "bm25"], r"caf\\xe9",
             cls=c),
        Case("a query that is not UTF-8", ["search", bm25, b"caf\xe9"], r"not UTF-8", cls=c),
        Case("--embeddings an .npz archive", ["index", "build", corpus, "--out", run("l4"), "--model", bert, "--embeddings",
                                              bad / "emb.npz"], r"\.npz", cls=c),
        Case("--model of pickled weights only", ["index", "build", corpus, "--out", run("l5"), "--model", pickled], r"safetensors",
             cls=c),
        Case("--faiss HNSW0", ["index", "build", corpus, "--out", run("l6"), "--model", bert, "--dim", 16, "--faiss", "HNSW0"],
             r"HNSW0", cls=c, timeout=60),
    ]

    # item 6: an output never overwrites an input or a file of an index
    c = I69["69.6"]
    qcopy = bad / "q69.jsonl"
    shutil.copyfile(q, qcopy)
    (bad / "q69-link.jsonl").symlink_to(qcopy)
    ccopy = bad / "corpus69.jsonl"
    shutil.copyfile(corpus, ccopy)
    target = tmp / "bm25-outputs"  # a copy: the code before wrote into it
    shutil.copytree(bm25, target)
    manifest = target / "manifest.json"
    retrieval = ["eval", "retrieval", "--index", target, "--questions", qcopy, "--predictions"]
    cases += [
        Case("--predictions the questions file", [*retrieval, qcopy], r"--questions", cls=c, intact=(qcopy,)),
        Case("--predictions a link to the questions file", [*retrieval, bad / "q69-link.jsonl"], r"--questions", cls=c, intact=(qcopy,)),
        Case("--predictions an index's manifest.json", [*retrieval, manifest], r"index", cls=c, intact=(manifest,)),
        Case("--out the corpus file", ["index", "build", ccopy, "--out", ccopy, "--kind", "bm25"], r"corpus69", cls=c, intact=(ccopy,)),
        Case("ict --out inside an index", ["ict", "--corpus", corpus, "--out", target / "versions" / "run", "--model", bert, "--dim", 16,
                                           "--batch-size", 2, "--steps", 2], r"index", cls=c, gone=target / "versions" / "run"),
    ]

    # item 7: questions capped at 2,000 characters everywhere
    c = I69["69.7"]
    long_q = "x" * 2001
    write_jsonl(bad / "q_long.jsonl", [{"question": "q", "answers": ["a"]}, {"question": long_q, "answers": ["a"]}])
    (bad / "endless.txt").write_bytes(b"a" * 10_000_000)  # no newline
    cases += [
        Case("search: a query of 2,001 characters", ["search", bm25, long_q], r"2,000|2000", cls=c),
        Case("ask: a question of 2,001 characters", ["ask", long_q, "--index", bm25], r"2,000|2000", cls=c, timeout=90),
        Case("questions file: a question of 2,001 characters", ["eval", "retrieval", "--index", bm25, "--questions", bad / "q_long.jsonl"],
             r"q_long\.jsonl:2", cls=c),
        Case("ask on stdin: 10 MB without a newline", ["ask", "--index", bm25], r"stdin:1", cls=c, timeout=60, stdin=bad / "endless.txt"),
    ]

    # item 7's questionable cases, decided: refused in one line naming the fault
    c = I69["69.7q"]
    bidi = write_jsonl(bad / "bidi.jsonl", [DOCS[0], {"id": "report\u202eexe.txt", "text": "x"}])
    zw = write_jsonl(bad / "zw_id.jsonl", [DOCS[0], {"id": "guide\u200b.md", "text": "x"}])
    (bad / "binary").mkdir()
    (bad / "binary" / "ok.txt").write_text("Readable text.")
    (bad / "binary" / "page.htm").write_bytes(b"<p>" + bytes(range(256)) * 16)
    (bad / "binary_md").mkdir()
    (bad / "binary_md" / "notes.md").write_bytes(b"# Notes\n" + bytes(range(128)) * 16)  # binary, yet valid UTF-8
    zeros = np.ones((len(DOCS), 32), dtype=np.float32)
    zeros[3] = 0
    np.save(bad / "zero_row.npy", zeros)
    cases += [
        Case("an id with a bidi override (U+202E)", ["index", "build", bidi, "--out", run("q1"), "--kind", "bm25"], r"U\+202E", cls=c),
        Case("an id with a zero-width space inside", ["index", "build", zw, "--out", run("q2"), "--kind", "bm25"], r"U\+200B", cls=c),
        Case("a binary .htm", ["index", "build", bad / "binary", "--out", run("q3"), "--kind", "bm25"], r"page\.htm.*binary", cls=c),
        Case("a binary .md of valid UTF-8", ["index", "build", bad / "binary_md", "--out", run("q4"), "--kind", "bm25"], r"notes\.md.*binary", cls=c),
        Case("--embeddings with an all-zero row", ["index", "build", corpus, "--out", run("q5"), "--model", bert, "--embeddings",
                                                   bad / "zero_row.npy"], r"row 3 is all zeros", cls=c),
    ]
    return cases


# -- kill -9 -------------------------------------------------------------------------------

def debris(root: Path) -> list[str]:
    """Hidden temp folders a killed writer left (resumable `.pieces-*` staging excluded)."""
    return [str(p.relative_to(root)) for p in root.rglob(".*") if p.is_dir() and (p.name.endswith(".tmp") or p.name.startswith(".building"))]


def kill_when(args: list, ready, timeout: float) -> bool:
    """Start `ralm ARGS`, SIGKILL it once `ready()` holds; False if it finished first."""
    proc = subprocess.Popen([sys.executable, "-m", "ralm", *map(str, args)], env=ENV, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        if ready():
            os.killpg(proc.pid, signal.SIGKILL)  # the process group: an index builder child dies too
            proc.wait()
            return True
        time.sleep(0.01)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return True
    return False


def kill_faults(tmp: Path, d: dict, timeout: float) -> list[tuple[str, str | None]]:
    """(name, None if recovered else why not) for each killed-and-rerun job."""
    big = big_corpus(tmp / "big.jsonl", 6000)
    bert = d["bert"]
    results = []

    def index_job(name: str, out: Path, args: list, ready):
        build = ["index", "build", big, "--out", out, *args]
        if not kill_when(build, ready, timeout):
            return results.append((name, "finished before it could be killed"))
        proc = ralm(*build, timeout=timeout)
        if proc.returncode:
            return results.append((name, f"rerun exit {proc.returncode}: {proc.stderr.strip()[-300:]}"))
        left = debris(out)
        hits = ralm("search", out, "capital", "-k", 1, "--json", timeout=timeout)
        results.append((name, f"temp folders left: {left}" if left else None if hits.returncode == 0 else f"search after rerun: {hits.stderr[-300:]}"))

    dense, dense2, bm25 = tmp / "kill-dense", tmp / "kill-dense2", tmp / "kill-bm25"
    index_job("dense build killed while writing its block store", dense, ["--model", bert, "--dim", 16],
              lambda: (dense / "blocks").is_dir() and any((dense / "blocks").iterdir()))
    index_job("dense build killed while embedding", dense2, ["--model", bert, "--dim", 16],
              lambda: (dense2 / "versions").is_dir() and any((dense2 / "versions").iterdir()))
    index_job("bm25 build killed while publishing its version", bm25, ["--kind", "bm25"],
              lambda: (bm25 / "versions").is_dir() and any((bm25 / "versions").iterdir()))

    def train_job(name: str, out: Path, args: list, steps: int):
        ckpts = out / "checkpoints"
        # --save-every 1: checkpoints are written all the time, so the kill often lands in one
        cmd = [*args, "--out", out, "--steps", steps, "--save-every", 1, "--log-every", 1]
        if not kill_when(cmd, lambda: (ckpts / "LATEST").is_file() and len(list(ckpts.glob("step-*"))) >= 2, timeout):
            return results.append((name, "finished before it could be killed"))
        proc = ralm(*cmd, "--json", timeout=timeout)
        if proc.returncode:
            return results.append((name, f"rerun exit {proc.returncode}: {proc.stderr.strip()[-300:]}"))
        logged = [int(m.group(1)) for m in re.finditer(r"^step (\d+)", proc.stderr, re.M)]
        finished = (ckpts / "LATEST").read_text().strip() == f"step-{steps:06d}"
        left = debris(out)
        # --log-every 1: a resumed run's first logged step is past 1
        results.append((name, f"temp folders left: {left}" if left else None if finished and logged and logged[0] > 1
                        else f"did not resume and finish: first logged step {logged[:1]}, LATEST {(ckpts / 'LATEST').read_text().strip()}"))

    train_job("ict run killed mid-training", tmp / "kill-ict", ["ict", "--corpus", d["corpus"], "--model", bert, "--dim", 16,
                                                                "--batch-size", 2], 20)
    train_job("lm run killed mid-training", tmp / "kill-lm", ["lm", "train", "--text", d["corpus"], "--dim", 32, "--layers", 1,
                                                              "--heads", 2, "--seq-len", 32, "--batch-size", 2], 40)
    return results


# -- HTTP ----------------------------------------------------------------------------------

def request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, bytes]:
    """(status, body) of one request (`answer` with the headers too)."""
    status, _, raw = answer(port, method, path, body, headers)
    return status, raw


def http_faults(tmp: Path, timeout: float) -> list[tuple[str, str | None]]:
    index = tmp / "serve-bm25"
    shutil.copytree(tmp / "bm25", index)
    port = free_port()
    try:
        server = start_server(index, port, timeout, "--api-key", "secret")
    except RuntimeError as e:
        return [("server start", f"did not start: {e}")]
    try:
        key = {"X-API-Key": "secret"}
        j = lambda obj: json.dumps(obj).encode()  # noqa: E731
        cases = [
            ("search: malformed JSON", "POST", "/search", b'{"query": "x"', None),
            ("search: not UTF-8", "POST", "/search", b'{"query": "caf\xe9"}', None),
            ("search: missing query", "POST", "/search", j({}), None),
            ("search: empty query", "POST", "/search", j({"query": "  "}), None),
            ("search: query not a string", "POST", "/search", j({"query": 5}), None),
            ("search: k 0", "POST", "/search", j({"query": "capital", "k": 0}), None),
            ("search: k -1", "POST", "/search", j({"query": "capital", "k": -1}), None),
            ("search: k 100000", "POST", "/search", j({"query": "capital", "k": 100000}), None),
            ("search: k a string", "POST", "/search", j({"query": "capital", "k": "five"}), None),
            ("search: unknown side", "POST", "/search", j({"query": "capital", "side": "tfidf"}), None),
            ("search: dense on a BM25-only server", "POST", "/search", j({"query": "capital", "retriever": "dense"}), None),
            ("search: body a list", "POST", "/search", j(["capital"]), None),
            ("search: body declared too large", "POST", "/search", j({"query": "x"}), {"Content-Length": str(2 << 20)}),
            # (a server always has a reader now: without --model it loads the package's)
            ("ask: empty question", "POST", "/ask", j({"question": " "}), None),
            ("ask: k out of range", "POST", "/ask", j({"question": "Who created Python?", "k": 0}), None),
            ("documents: no API key", "POST", "/documents", j({"documents": [{"id": "a", "text": "b"}]}), None),
            ("documents: wrong API key", "POST", "/documents", j({"documents": [{"id": "a", "text": "b"}]}), {"X-API-Key": "nope"}),
            ("documents: empty list", "POST", "/documents", j({"documents": []}), key),
            ("documents: missing text", "POST", "/documents", j({"documents": [{"id": "a"}]}), key),
            ("documents: empty text", "POST", "/documents", j({"documents": [{"id": "a", "text": " "}]}), key),
            ("documents: empty id", "POST", "/documents", j({"documents": [{"id": "", "text": "b"}]}), key),
            ("documents: delete unknown id", "DELETE", "/documents/no-such-doc", None, key),
            # issue 33, item 4
            (f"{C4}: documents: a non-ASCII API key", "POST", "/documents", j({"documents": [{"id": "a", "text": "b"}]}),
             {"X-API-Key": "s\u00e9cret".encode()}),
            (f"{C4}: documents: an id with a newline", "POST", "/documents", j({"documents": [{"id": "a\nb", "text": "b"}]}), key),
            (f"{C4}: documents: an id with NUL", "POST", "/documents", j({"documents": [{"id": "a\u0000b", "text": "b"}]}), key),
            (f"{C4}: documents: a lone surrogate", "POST", "/documents", b'{"documents": [{"id": "a", "text": "\\ud800"}]}', key),
            (f"{C4}: search: JSON nested 100000 deep", "POST", "/search", b"[" * 100_000 + b"]" * 100_000, None),
            (f"{C4}: search: k of 5000 digits", "POST", "/search", b'{"query": "x", "k": ' + b"9" * 5000 + b"}", None),
            ("unknown path", "GET", "/no-such-page", None, None),
            ("wrong method", "GET", "/search", None, None),
        ]
        results = []
        for name, method, path, body, headers in cases:
            try:
                status, raw = request(port, method, path, body, headers)
            except OSError as e:
                results.append((name, f"no answer: {e}"))
                continue
            results.append((name, refused(status, raw)))
        results += [(f"{C4}: {name}", why) for name, why in server_faults(port, key)]
        alive = server.poll() is None and request(port, "GET", "/health")[0] == 200
        results.append(("server alive after the bad requests", None if alive else "the server stopped answering"))
        server.terminate()
        logged = server.communicate(timeout=30)[1].decode(errors="replace")
        results.append((f"{C4}: deletions are logged", None if "deleted document" in logged else f"not in the log: {logged[-300:]}"))
        return results
    finally:
        stop_server(server)  # only the server this sweep started


C4 = "4 server"


def start_server(index: Path, port: int, timeout: float, *extra) -> subprocess.Popen:
    """`ralm serve` on 127.0.0.1:`port`, once /health answers (its own process group, to be killed whole)."""
    return serve(index, port, "--host", "127.0.0.1", *extra, env=ENV, cwd=ROOT, timeout=timeout, poll=0.3)


def stop_server(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)  # only the server this sweep started
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def answer(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one request; a Host in `headers` replaces the connection's own."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def refused(status: int, raw: bytes) -> str | None:
    """None for a 4xx with a JSON {"error"}, else what came instead."""
    try:
        has_error = "error" in json.loads(raw)
    except ValueError:
        has_error = False
    return None if 400 <= status < 500 and has_error else f"status {status}: {raw[:160]!r}"


def http69_faults(tmp: Path, timeout: float, classes: set) -> list[tuple[str, str, str | None]]:
    """(class, name, None if handled else why not): item 1 (writes from another origin's page,
    Host forms of DNS rebinding, the security headers) and item 7's HTTP limit."""
    index = tmp / "serve69-bm25"
    shutil.copytree(tmp / "bm25", index)
    port = free_port()
    try:
        server = start_server(index, port, timeout, "--api-key", "secret")
    except RuntimeError as e:
        return [(I69["69.1"], "server start", str(e))]
    key, own = {"X-API-Key": "secret"}, f"http://127.0.0.1:{port}"
    doc = lambda i: json.dumps({"documents": [{"id": i, "text": "Zanzibar is famous for cloves."}]}).encode()  # noqa: E731
    results = []
    try:
        if "69.1" in classes:
            c = I69["69.1"]

            def write_refused(method, path, body, headers, doc_id, present):
                status, _, raw = answer(port, method, path, body, {**key, **headers})
                why = refused(status, raw)
                there = answer(port, "GET", f"/documents/{doc_id}")[0] == 200
                return why or (None if there == present else f"refused ({status}) but {doc_id} {'gone' if present else 'written'}")

            evil = {"Origin": "http://evil.example"}
            results += [
                (c, "a write with the key from another origin's page",
                 write_refused("POST", "/documents", doc("csrf1"), evil, "csrf1", False)),
                (c, "a file upload from a sandboxed frame (Origin: null)",
                 write_refused("POST", "/documents/file?name=csrf.txt", b"cloves", {"Content-Type": "text/plain", "Origin": "null"},
                               "csrf.txt", False)),
                (c, "a delete with only another origin's Referer",
                 write_refused("DELETE", "/documents/paris", None, {"Referer": "http://evil.example/page.html"}, "paris", True)),
                (c, "a write the browser marks cross-site",
                 write_refused("POST", "/documents", doc("csrf2"), {"Origin": own, "Sec-Fetch-Site": "cross-site"}, "csrf2", False)),
                (c, "another port of this machine is another origin",
                 write_refused("POST", "/documents", doc("csrf3"), {"Origin": f"http://127.0.0.1:{port + 1}"}, "csrf3", False)),
            ]
            for host in ("evil.example", "localhost:80@evil.example", "[::1]evil.example"):
                status, _, raw = answer(port, "GET", "/health", None, {"Host": host})
                results.append((c, f"Host: {host} (DNS rebinding)", refused(status, raw)))
            status, _, raw = answer(port, "POST", "/documents", doc("own"), {**key, "Origin": own})
            results.append((c, "a write from the server's own page is accepted",
                            None if status == 200 else f"status {status}: {raw[:160]!r}"))
            for path in ("/", "/health"):
                _, headers, _ = answer(port, "GET", path)
                headers = {k.lower(): v for k, v in headers.items()}
                missing = [h for h, want in (("x-frame-options", "DENY"), ("x-content-type-options", "nosniff"),
                                             ("content-security-policy", "frame-ancestors 'none'"),
                                             ("referrer-policy", "same-origin")) if want not in headers.get(h, "")]
                results.append((c, f"security headers on GET {path}", f"missing {missing}" if missing else None))
        if "69.7" in classes:
            c = I69["69.7"]
            for path, field in (("/search", "query"), ("/ask", "question")):
                status, _, raw = answer(port, "POST", path, json.dumps({field: "x" * 2001}).encode())
                results.append((c, f"POST {path}: a {field} of 2,001 characters", refused(status, raw)))
        return results
    finally:
        stop_server(server)


def writer_kills(tmp: Path, timeout: float, *, kills: int = 3, seed: int = 0) -> tuple[list[tuple[str, str | None]], dict]:
    """`ralm serve` SIGKILLed `kills` times while a client adds documents (and deletes every fifth
    one added before); restarted each time. Every write the server acknowledged must be there
    after the last restart: each acknowledged add found by GET /documents/ID, each delete gone."""
    import random
    import threading

    rng = random.Random(seed)
    index = tmp / "kill-writes-bm25"
    shutil.copytree(tmp / "bm25", index)
    key = {"X-API-Key": "secret"}
    state: dict[str, bool] = {}  # id -> True (add acknowledged), False (delete acknowledged)
    unsure: set[str] = set()  # a write the kill cut off: applied or not, either is right
    n = 0
    results = []
    for k in range(kills):
        port = free_port()
        try:
            server = start_server(index, port, timeout, "--api-key", "secret")
        except RuntimeError as e:
            return [(f"restart {k}", str(e))], {"acknowledged": len(state), "lost": None}
        stop = threading.Event()

        def write(port=port, stop=stop):
            nonlocal n
            while not stop.is_set():
                n += 1
                doc_id = f"w{n}"
                op = ("DELETE", f"/documents/w{n - 3}", None, f"w{n - 3}") if n % 5 == 0 and state.get(f"w{n - 3}") else \
                     ("POST", "/documents", json.dumps({"documents": [{"id": doc_id, "text": f"Write {n} of the kill test."}]}).encode(),
                      doc_id)
                method, path, body, target = op
                try:
                    status = request(port, method, path, body, key)[0]
                except OSError:
                    unsure.add(target)
                    return
                if status == 200:
                    state[target] = method == "POST"
                else:
                    unsure.add(target)

        thread = threading.Thread(target=write)
        thread.start()
        time.sleep(rng.uniform(1.0, 3.0))
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        stop.set()
        thread.join()
    port = free_port()
    try:
        server = start_server(index, port, timeout, "--api-key", "secret")
    except RuntimeError as e:
        return [("restart after the last kill", str(e))], {"acknowledged": len(state), "lost": None}
    try:
        lost = [i for i, added in state.items() if i not in unsure and (request(port, "GET", f"/documents/{i}")[0] == 200) != added]
    finally:
        stop_server(server)
    check = ralm("index", "check", index, "--json", timeout=timeout)
    results.append((f"serve killed {kills} times under a writer: acknowledged writes lost",
                    f"{len(lost)} lost ({lost[:5]})" if lost else None))
    results.append(("index check after the kills", None if check.returncode == 0 else check.stderr.strip()[-300:]))
    return results, {"acknowledged": len(state) - len(unsure & set(state)), "cut_off": len(unsure), "lost": len(lost)}


def server_faults(port: int, key: dict) -> list[tuple[str, str | None]]:
    """Item 4's cases that are not one request: a race, stalled clients, offline /docs."""
    import concurrent.futures

    results = []
    status, _ = request(port, "POST", "/documents", json.dumps({"documents": [{"id": "race", "text": "a race"}]}).encode(), key)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        statuses = sorted(pool.map(lambda _: request(port, "DELETE", "/documents/race", None, key)[0], range(8)))
    results.append(("8 concurrent DELETEs of one id", None if status == 200 and statuses == [200] + [404] * 7 else f"statuses {statuses}"))

    def silent_after(data: bytes, limit: float) -> str | None:
        with socket.create_connection(("127.0.0.1", port), timeout=limit) as s:
            s.sendall(data)
            try:
                answer = s.recv(4096)
            except socket.timeout:
                return f"still open after {limit} s"
        return None if answer in (b"",) or b" 408 " in answer.split(b"\r\n")[0] else f"answered {answer[:60]!r}"

    results.append(("half-sent headers are cut off", silent_after(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n", 40)))
    results.append(("a half-sent body times out (408)", silent_after(
        b"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"query\"", 60)))
    status, page = request(port, "GET", "/docs")
    assets = re.findall(rb'(?:src|href)="([^"]+\.(?:js|css))"', page)
    offline = status == 200 and assets and all(a.startswith(b"/") and request(port, "GET", a.decode())[0] == 200 for a in assets)
    results.append(("/docs works offline", None if offline else f"status {status}, assets {assets}"))
    return results


# -- main ----------------------------------------------------------------------------------

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--http", action="store_true", help="also send bad HTTP requests to `ralm serve` on 127.0.0.1")
    p.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temporary folder, removed)")
    p.add_argument("--timeout", type=float, default=180, help="seconds one command may take")
    p.add_argument("--classes", default="earlier,1,2,3,4,69.1,69.2,69.3,69.4,69.5,69.6,69.7,69.7q,kill",
                   help="comma-separated classes to run: earlier (the earlier sweeps' inputs), 1-4 (issue 33's items), 69.1-69.7 "
                   "(issue 69's items; 69.1 and 69.7's HTTP cases start their own server), 69.7q (item 7's questionable cases, "
                   "decided), kill (kill -9 and rerun, and a server killed under a writer); default: all")
    p.add_argument("--baseline-src", type=Path, help="run the cases against another checkout's src/ (the code before a fix): "
                   "cases it cannot handle count as not handled")
    args = p.parse_args()
    if args.baseline_src:
        ENV["PYTHONPATH"] = str(args.baseline_src.resolve())
    tmp = Path(tempfile.mkdtemp(prefix="ralm-fault-sweep-")) if args.keep is None else args.keep
    tmp.mkdir(parents=True, exist_ok=True)
    start = time.time()
    failures = []
    try:
        print(f"tiny data in {tmp}", file=sys.stderr)
        data = make_data(tmp)
        classes = set(args.classes.split(","))
        cases = [c for c in cli_cases(tmp, data) if c.cls.split()[0] in classes]
        handled = 0
        for case in cases:
            why = check(case, args.timeout)
            handled += why is None
            print(f"{'ok  ' if why is None else 'FAIL'} {case.name}{'' if why is None else ': ' + why}", file=sys.stderr)
            if why:
                failures.append({"kind": "cli", "case": case.name, "why": why})
        kills = kill_faults(tmp, data, args.timeout) if "kill" in classes else []
        writes = {}
        if "kill" in classes:
            killed, writes = writer_kills(tmp, args.timeout)
            kills += killed
        http = http_faults(tmp, args.timeout) if args.http else []
        http69 = http69_faults(tmp, args.timeout, classes) if classes & {"69.1", "69.7"} else []
        http += [(name, why) for _, name, why in http69]
        for kind, results in (("kill", kills), ("http", http)):
            for name, why in results:
                print(f"{'ok  ' if why is None else 'FAIL'} {name}{'' if why is None else ': ' + why}", file=sys.stderr)
                if why:
                    failures.append({"kind": kind, "case": name, "why": why})
        by_class = {}
        for case in cases:
            tried, ok = by_class.get(case.cls, (0, 0))
            by_class[case.cls] = (tried + 1, ok + all(f["case"] != case.name for f in failures))
        server = [(n, why) for n, why in http if n.startswith(C4)]
        if server:
            by_class[C4] = (len(server), sum(why is None for _, why in server))
        for cls, _, why in http69:
            tried, ok = by_class.get(cls, (0, 0))
            by_class[cls] = (tried + 1, ok + (why is None))
        summary = {"cli_inputs_tried": len(cases), "cli_handled": handled,
                   "by_class": {name: {"tried": t, "handled": h} for name, (t, h) in sorted(by_class.items())},
                   "kills": len(kills), "kills_recovered": sum(why is None for _, why in kills),
                   "writes_under_kills": writes, "code": str(args.baseline_src or SRC),
                   "http_tried": len(http), "http_handled": sum(why is None for _, why in http),
                   "seconds": round(time.time() - start), "failures": failures}
        print(json.dumps(summary, indent=1))
    finally:
        if args.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
