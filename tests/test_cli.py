"""The command line: JSON outputs are the public interface; bad input is one line, exit 2."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import DOCS
from ralm.defaults import MAX_QUESTION_CHARS


def test_index_build_search_and_eval_retrieval(ralm, tiny_bert, corpus_file, tmp_path):
    rc, out, err = ralm("index", "build", corpus_file, "--out", tmp_path / "idx", "--model", tiny_bert, "--dim", 16, "--json")
    assert rc == 0, err
    summary = json.loads(out)
    assert summary["blocks"] == len(DOCS) and summary["version"] == "v000001" and summary["dim"] == 16

    rc, out, err = ralm("search", tmp_path / "idx", "capital of Japan", "-k", 2, "--json")
    assert rc == 0, err
    hits = json.loads(out)
    assert len(hits) == 2 and set(hits[0]) == {"id", "title", "score", "text", "found_by"}

    # each answer is in one block, ranked where `ralm search` ranks it (a random model); the Mona Lisa's in none
    asked = {"Who created Python?": ("Guido van Rossum", "python:0"), "When was the Eiffel Tower finished?": ("1889", "paris:0"),
             "Where does the Nile flow?": ("the Mediterranean Sea", "nile:0"), "Who painted the Mona Lisa?": ("Leonardo", None)}
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"id": f"q{i}", "question": q, "answers": [a]}) + "\n"
                                 for i, (q, (a, _)) in enumerate(asked.items())))
    ranks = {}
    for q, (_, block) in asked.items():
        rc, out, _ = ralm("search", tmp_path / "idx", q, "-k", len(DOCS), "--json")
        ranks[q] = [h["id"] for h in json.loads(out)].index(block) + 1 if block else None
    # recall@k by hand at each answer's rank and one above it, where a k off by one would show
    ks = sorted({k for r in ranks.values() if r for k in (r - 1, r) if k >= 1})
    rc, out, err = ralm("eval", "retrieval", "--index", tmp_path / "idx", "--questions", questions, "--ks", ",".join(map(str, ks)),
                        "--predictions", tmp_path / "pred.jsonl", "--json")
    assert rc == 0, err
    result = json.loads(out)
    assert result["questions"] == 4
    assert {k: result[f"recall@{k}"] for k in ks} == {k: 100 * sum(r is not None and r <= k for r in ranks.values()) / 4 for k in ks}
    rows = [json.loads(line) for line in (tmp_path / "pred.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["q0", "q1", "q2", "q3"]
    assert [[h["has_answer"] for h in r["retrieved"]].index(True) + 1 if r["id"] != "q3" else None for r in rows] == list(ranks.values())


def _one_line_error(rc, err, needle):
    assert rc == 2
    assert "Traceback" not in err
    assert needle in err
    assert len([line for line in err.strip().splitlines() if line.strip()]) <= 2  # one message (may wrap once)


def test_bad_inputs_get_one_clear_line_and_exit_code_2(ralm, tiny_bert, tmp_path, tiny_dense_index):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "text": "ok"}\n{"id": "b", "text" "oops"}\n')
    _one_line_error(*ralm("index", "build", bad, "--out", tmp_path / "x", "--model", tiny_bert, "--dim", 16)[::2], "bad.jsonl:2")
    _one_line_error(*ralm("index", "build", bad, "--out", tmp_path / "y", "--model", tmp_path / "nomodel")[::2], "no such directory")
    _one_line_error(*ralm("search", tiny_dense_index, "paris", "-k", 0)[::2], "-k must be a positive integer")
    _one_line_error(*ralm("search", tmp_path, "paris")[::2], "not an index directory")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    _one_line_error(*ralm("index", "build", empty, "--out", tmp_path / "z", "--model", tiny_bert, "--dim", 16)[::2], "the corpus is empty")
    q = tmp_path / "q.jsonl"
    q.write_text('{"question": "x"}\n')
    _one_line_error(*ralm("eval", "retrieval", "--index", tiny_dense_index, "--questions", q)[::2], "q.jsonl:1: missing field 'answers'")


@pytest.mark.slow
def test_demo_runs_offline_and_prints_evidence(ralm, tmp_path, monkeypatch):
    """The README's first command: the bundled corpus and model, no network, cached index."""
    monkeypatch.setenv("RALM_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, out, err = ralm("demo", "--json", "-k", "2")
    assert rc == 0, err
    results = json.loads(out)
    assert len(results) >= 5
    for r in results:
        assert r["question"] and len(r["evidence"]) == 2
        assert {"id", "title", "score", "text"} <= set(r["evidence"][0])
    rc, _, err = ralm("demo", "-k", "1")
    assert rc == 0 and "reusing cached demo index" in err


def test_an_answer_prints_the_top_blocks_and_its_own_not_all_ten():
    from ralm.console import SHOWN, out, print_answer
    from ralm.pipeline import Answer, Evidence

    evidence = [Evidence(j, f"doc{j}", f"Title {j}", f"text of block {j}", 1.0, 0.1, "", 0.0, None) for j in range(10)]
    answer = Answer("q?", "text", 0.5, 0.9, evidence, 6, list(range(10)), [e.text for e in evidence])
    with out.capture() as cap:
        print_answer(answer)
    printed = [j for j in range(10) if f"(doc{j})" in cap.get()]
    assert printed == [*range(SHOWN), 6] and f"{10 - SHOWN - 1} more blocks read" in cap.get()
    assert "p(answer) = 0.500" in cap.get()  # what the probability beside the confidence is of


def test_a_real_process_exits_2_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ralm", "search", str(tmp_path), "anything"], capture_output=True, text=True,
                          env={**os.environ, "RALM_NO_PROGRESS": "1"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "not an index directory" in proc.stderr


def _truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


# The six damaged-index cases of issue #19 (item 7): each names its file in one line.
DAMAGES = {
    "embeddings.npy truncated": (lambda v, b, r: _truncate(v / "embeddings.npy", 200), "embeddings.npy is damaged"),
    "token file truncated": (lambda v, b, r: _truncate(b / "tokens" / "values.bin", 10), "values.bin is damaged"),
    "version manifest garbage": (lambda v, b, r: (v / "manifest.json").write_text("{garbage"), "v000001/manifest.json is damaged"),
    "index manifest garbage": (lambda v, b, r: (r / "manifest.json").write_text("not json"), "manifest.json is damaged"),
    "blocks.jsonl garbage": (lambda v, b, r: (b / "blocks.jsonl").write_text("garbage\n"), "blocks.jsonl is damaged"),
    "LATEST names a missing version": (lambda v, b, r: (r / "LATEST").write_text("v000042\n"), "LATEST names 'v000042'"),
}


@pytest.mark.parametrize("name", DAMAGES)
def test_a_damaged_index_is_one_line_naming_the_file(ralm, tiny_dense_index, tmp_path, name):
    damage, needle = DAMAGES[name]
    root = tmp_path / "idx"
    shutil.copytree(tiny_dense_index, root)
    damage(root / "versions" / "v000001", next((root / "blocks").iterdir()), root)
    _one_line_error(*ralm("search", root, "paris", "-k", 2)[::2], needle)


def test_out_pointing_at_a_file_is_one_line(ralm, tiny_bert, corpus_file, tmp_path):
    afile = tmp_path / "a_file"
    afile.write_text("x")
    _one_line_error(*ralm("index", "build", corpus_file, "--out", afile, "--retriever", "bm25")[::2], "a_file is a file")
    _one_line_error(*ralm("ict", "--corpus", corpus_file, "--out", afile, "--model", tiny_bert, "--dim", 16, "--steps", 1,
                          "--batch-size", 2)[::2], "a_file is a file")


def test_a_wrong_shaped_update_log_line_stops_serve_with_one_line(ralm, tiny_bert, corpus_file, tmp_path):
    rc, _, err = ralm("index", "build", corpus_file, "--out", tmp_path / "idx", "--retriever", "bm25")
    assert rc == 0, err
    (tmp_path / "idx" / "updates.jsonl").write_text('{"op": "add", "id": "a", "title": "", "text": "fine"}\n[1, 2]\n')
    _one_line_error(*ralm("serve", "--index", tmp_path / "idx")[::2], "updates.jsonl:2: not an update record")


def test_empty_documents_and_an_index_of_another_corpus_are_one_warning_line(ralm, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in [*DOCS, {"id": "stub", "title": "Stub", "text": ""}]))
    rc, out, err = ralm("index", "build", corpus, "--out", tmp_path / "idx", "--retriever", "bm25", "--json")
    assert rc == 0 and json.loads(out)["blocks"] == len(DOCS)
    assert err.strip() == f"warning: {corpus}: skipped 1 document with empty text (the first at {corpus}:{len(DOCS) + 1})"

    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"id": f"o{i}", "title": "Soup", "text": f"Stir the soup {i} times."}) + "\n" for i in range(4)))
    assert ralm("index", "build", other, "--out", tmp_path / "other-idx", "--retriever", "bm25")[0] == 0
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question": "Who created Python?", "answers": ["Guido van Rossum"]}) + "\n")
    rc, out, err = ralm("eval", "retrieval", "--index", tmp_path / "other-idx", "--questions", questions, "--ks", "1,5", "--json")
    assert rc == 0 and json.loads(out)["recall@5"] == 0.0
    assert err.startswith("warning: no question has an answer in its top-4 passages") and str(other) in err
    assert len(err.strip().splitlines()) == 1


def test_version(ralm):
    code, out, _ = ralm("--version")
    assert code == 0 and out.strip() == f"ralm {ralm_version()}"


def ralm_version() -> str:
    import ralm

    return ralm.__version__


def test_mistakes_are_named_before_torch_is_imported(tiny_hybrid_index, tmp_path):
    """A bad option or path is one line and exit code 2 before the heavy imports (about a second,
    benchmarks/RESULTS.md), and `eval qa --calibrate` counts its questions before answering them."""
    (tmp_path / "office").mkdir()
    (tmp_path / "office" / "report.docx").write_text("x")
    twenty = tmp_path / "twenty.jsonl"
    twenty.write_text("".join(json.dumps({"id": str(i), "question": f"q{i}", "answers": ["a"]}) + "\n" for i in range(20)))
    long = tmp_path / "long.jsonl"
    long.write_text("".join(json.dumps({"question": q, "answers": ["a"]}) + "\n" for q in ("q", "x" * (MAX_QUESTION_CHARS + 1))))
    index = str(tiny_hybrid_index)
    cases = {("ask", "q", "--index", str(tmp_path / "none")): "not an index directory",
             ("search", index, "q", "-k", "0"): "-k must be a positive integer",
             ("index", "build", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "a")): "corpus not found",
             ("index", "build", str(tmp_path / "office"), "--out", str(tmp_path / "b")): "skipped 1 file of unknown format (report.docx)",
             ("index", "add", index, str(tmp_path / "office"), "--include", "*.md"): "1 file left out by the include/exclude patterns",
             ("eval", "qa", "--index", index, "--questions", str(twenty), "--calibrate", "--out", str(tmp_path / "c")):
                 "calibration needs at least 50 held-back questions, got 20",
             ("ask", "q", "--index", index, "--device", "gpu"): "--device must be auto, cpu, cuda or cuda:N",
             ("ask", "q", "--index", index, "--dtype", "fp16"): "--dtype must be one of auto, fp32, bf16",
             ("serve", "--index", index, "--max-body-mb", "0"): "--max-body-mb must be a positive integer",
             ("eval", "qa", "--index", index, "--questions", str(twenty), "--predictions", str(twenty)):
                 f"--predictions {twenty} is what --questions reads",
             ("export", index, "--format", "hf", "--out", str(tiny_hybrid_index / "exported")): "an index directory, which ralm never writes into",
             ("ask", "x" * (MAX_QUESTION_CHARS + 1), "--index", index): f"the question holds {MAX_QUESTION_CHARS + 1:,} characters",
             ("search", index, "x" * (MAX_QUESTION_CHARS + 1)): f"the query holds {MAX_QUESTION_CHARS + 1:,} characters",
             ("eval", "qa", "--index", index, "--questions", str(long)): f"{long}:2: field 'question' holds {MAX_QUESTION_CHARS + 1:,} characters"}
    code = ("import sys\nfrom ralm.cli import main\nsys.argv = ['ralm', *sys.argv[1:]]\ntry:\n    main()\n"
            "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    for argv, message in cases.items():
        proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env)
        assert proc.stdout.split() == ["2", "False"] and message in proc.stderr, (argv, proc.stdout, proc.stderr)


def _before_torch(argv) -> tuple[int, bool, str]:
    """(exit code, whether torch was imported, stderr) of `ralm ARGV...` in a fresh process."""
    code = ("import sys\nfrom ralm.cli import main\nsys.argv = ['ralm', *sys.argv[1:]]\ntry:\n    main()\n"
            "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, env=env)
    rc, torch_imported = proc.stdout.decode().split()
    return int(rc), torch_imported == "True", proc.stderr.decode("utf-8", "replace")


def test_late_mistakes_are_one_line_before_torch_is_imported(tiny_hybrid_index, tiny_bert, corpus_file, tmp_path):
    """Issue #64 item 3 and #69 item 5: each mistake below used to surface only after torch and the
    models loaded (5-23 s), or as a crash; each is one line and exit code 2 before torch."""
    import socket

    import numpy as np
    import torch

    afile = tmp_path / "afile"
    afile.write_text("x")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps({"model_type": "bert"}))
    torch.save({"w": torch.zeros(1)}, pickled / "pytorch_model.bin")
    np.savez(tmp_path / "emb.npz", a=np.zeros((len(DOCS), 32), dtype=np.float32))
    (tmp_path / "names").mkdir()
    (tmp_path / "names" / "ok.txt").write_text("Readable text.")
    with open(os.fsencode(tmp_path / "names") + b"/caf\xe9.txt", "wb") as f:  # a Latin-1 file name
        f.write(b"text")
    (tmp_path / "pdfs").mkdir()
    (tmp_path / "pdfs" / "scan.pdf").write_bytes(b"\x00garbage, no header" * 50)
    index, bert, corpus = str(tiny_hybrid_index), str(tiny_bert), str(corpus_file)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        busy = str(taken.getsockname()[1])
        cases = [(("index", "build", corpus, "--out", str(afile)), "--out " + str(afile) + " is a file"),
                 (("ict", "--corpus", corpus, "--out", str(afile), "--model", bert), "is a file"),
                 (("export", bert, "--format", "hf", "--out", str(afile)), "is a file"),
                 (("ask", "q", "--index", index, "--model", "nosuch"), "--model: no such directory: nosuch"),
                 (("search", index, "q", "--model", "nosuch"), "--model nosuch: no such directory, nor (offline"),
                 (("index", "build", corpus, "--out", str(tmp_path / "a"), "--model", str(afile)), "is a file; name a model directory"),
                 (("index", "build", corpus, "--out", str(tmp_path / "b"), "--model", str(pickled)), "ralm loads safetensors only"),
                 (("serve", "--index", index, "--port", busy), f"cannot listen on 127.0.0.1:{busy}: Address already in use"),
                 (("index", "build", str(tmp_path / "pdfs"), "--out", str(tmp_path / "c")), "scan.pdf: not a readable PDF"),
                 (("index", "build", str(tmp_path / "names"), "--out", str(tmp_path / "d")), "the file name 'caf\\xe9.txt' is not UTF-8"),
                 (("ask", b"caf\xe9?", "--index", index), "the question is not UTF-8 text (byte 0xe9 at character 3)"),
                 (("search", index, b"caf\xe9"), "the query is not UTF-8 text (byte 0xe9 at character 3)"),
                 (("index", "build", corpus, "--out", str(tmp_path / "e"), "--model", bert, "--embeddings", str(tmp_path / "emb.npz")),
                  "is a .npz archive"),
                 (("index", "build", corpus, "--out", str(tmp_path / "f"), "--model", bert, "--faiss", "HNSW0"), "HNSW0 is too small"),
                 (("eval", "qa", "--index", index, "--questions", corpus, "--coverage", "0.6"), "add --calibrate or drop --coverage"),
                 (("ict", "--corpus", corpus, "--out", str(tmp_path / "g"), "--model", "nosuch"), "--model nosuch: no such directory"),
                 (("train-reader", "--questions", corpus, "--init", str(afile), "--out", str(tmp_path / "g")), "--init " + str(afile) + " is a file"),
                 (("pretrain", "--corpus", corpus, "--encoder=nosuch", "--out", str(tmp_path / "g")), "--encoder nosuch: no such directory"),
                 (("dpr", "--questions", corpus, "--corpus", corpus, "--model", str(pickled), "--out", str(tmp_path / "g")),
                  "ralm loads safetensors only")]
        for argv, message in cases:
            rc, torch_imported, err = _before_torch(argv)
            assert (rc, torch_imported) == (2, False) and message in err, (argv, err)
            assert len(err.strip().splitlines()) == 1 and "weights_only" not in err, err
    assert not any((tmp_path / d).exists() for d in "abcdefg")  # nothing half-built


def test_one_shot_search_and_ask_import_no_transformers(served, tmp_path):
    """`search` and `ask` read tokenizers and BERT weights themselves on every kind of index,
    also where a logged document is split anew (a log of ralm <= 0.4 stores no blocks):
    importing transformers would cost a one-shot command more than torch does."""
    runs = []
    for kind in ("index", "dense", "bm25"):  # hybrid, dense, BM25
        index = shutil.copytree(served / kind, tmp_path / kind)
        (index / "updates.jsonl").write_text(json.dumps({"op": "add", "id": "rome", "title": "Rome", "text": "Rome is the capital of Italy."}) + "\n")
        runs += [["search", str(index), "capital of Italy", "--json"],
                 ["ask", "capital of Italy", "--index", str(index), "--model", str(served / "reader"), "--json"]]
    code = ("import json, sys\nfrom ralm.cli import main\nseen = []\nfor argv in json.loads(sys.argv[1]):\n"
            "    sys.argv, rc = ['ralm', *argv], 0\n    try:\n        main()\n    except SystemExit as e:\n        rc = e.code\n"
            "    seen.append([rc, 'transformers' in sys.modules])\nprint(json.dumps(seen), file=sys.stderr)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(runs)], capture_output=True, text=True, env=env)
    assert json.loads(proc.stderr.splitlines()[-1]) == [[0, False]] * len(runs), proc.stderr
    assert proc.stdout.count('"rome:0"') == len(runs), proc.stdout  # each command read the logged document


def test_lines_sent_to_a_file_are_not_wrapped(tmp_path):
    code = "from ralm.console import err, out\nout.print('ralm index upgrade ' + 'x' * 150)\nerr.print('resume with: ' + 'y' * 150)"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"), "COLUMNS": "80"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert proc.stdout == "ralm index upgrade " + "x" * 150 + "\n" and proc.stderr == "resume with: " + "y" * 150 + "\n"


def test_export_of_a_run_holding_a_retriever_and_a_reader_asks_which(ralm, tiny_bert, tmp_path):
    from ralm.models.reader import Reader
    from ralm.retrieval.towers.encoders import Retriever

    run = tmp_path / "run"
    Retriever.from_pretrained(str(tiny_bert)).save_pretrained(run / "final" / "retriever")
    Reader.from_encoder(tiny_bert).save_pretrained(run / "final" / "reader")
    code, _, err = ralm("export", run, "--format", "hf", "--out", tmp_path / "e")
    assert code == 2 and "holds a retriever and a reader: name the one to export with --part" in err
    assert not (tmp_path / "e").exists()
    for part in ("reader", "retriever"):
        code, out, err = ralm("export", run, "--format", "hf", "--part", part, "--out", tmp_path / part, "--json")
        assert code == 0 and json.loads(out)["kind"] == part, err


def test_index_build_with_precomputed_embeddings_checks_its_options_first(ralm, tiny_bert, corpus_file, tmp_path):
    import numpy as np

    emb = tmp_path / "emb.npy"
    np.save(emb, np.random.default_rng(0).standard_normal((len(DOCS), 32)).astype(np.float32))
    build = ("index", "build", corpus_file, "--model", tiny_bert, "--embeddings")
    _one_line_error(*ralm(*build, emb, "--out", tmp_path / "a", "--dim", 8)[::2], "--dim adds an untrained projection")
    _one_line_error(*ralm(*build, emb, "--out", tmp_path / "a", "--retriever", "bm25")[::2], "a bm25 index has no dense side")
    _one_line_error(*ralm(*build, tmp_path / "none.npy", "--out", tmp_path / "a")[::2], "none.npy: no such file")
    assert not (tmp_path / "a").exists()
    rc, out, err = ralm(*build, emb, "--out", tmp_path / "b", "--faiss", "exact", "--json")
    assert rc == 0, err
    assert json.loads(out)["faiss"] is None and np.array_equal(
        np.load(next((tmp_path / "b" / "versions").iterdir()) / "embeddings.npy"), np.load(emb))


def test_an_output_never_overwrites_an_input_or_a_file_of_an_index(ralm, corpus_file, tmp_path):
    """`--predictions` naming the questions file (or a link to it) would overwrite it; naming
    INDEX/manifest.json would leave an index that no longer opens. Both are one line, and
    nothing is written."""
    assert ralm("index", "build", corpus_file, "--out", tmp_path / "idx", "--kind", "bm25")[0] == 0
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question": "Who created Python?", "answers": ["Guido van Rossum"]}) + "\n")
    (tmp_path / "link.jsonl").symlink_to(questions)
    manifest = tmp_path / "idx" / "manifest.json"
    before = questions.read_bytes(), manifest.read_bytes()
    qa = ("eval", "qa", "--index", tmp_path / "idx", "--questions", questions, "--predictions")
    _one_line_error(*ralm(*qa, questions)[::2], f"--predictions {questions} is what --questions reads")
    _one_line_error(*ralm(*qa, tmp_path / "link.jsonl")[::2], "is what --questions reads")
    _one_line_error(*ralm(*qa, manifest)[::2], f"lies inside {tmp_path / 'idx'}, an index directory")
    retrieval = ("eval", "retrieval", "--index", tmp_path / "idx", "--questions", questions, "--predictions")
    _one_line_error(*ralm(*retrieval, questions)[::2], "is what --questions reads")
    _one_line_error(*ralm(*retrieval, tmp_path / "idx" / "versions" / "v000001" / "p.jsonl")[::2], "an index directory")
    _one_line_error(*ralm("index", "build", corpus_file, "--out", corpus_file, "--kind", "bm25")[::2], "is what --corpus reads")
    assert (questions.read_bytes(), manifest.read_bytes()) == before
    rc, out, err = ralm("search", tmp_path / "idx", "Who created Python?", "--json")
    assert rc == 0 and json.loads(out)[0]["id"] == "python:0", err  # the index still opens
    rc, _, err = ralm("eval", "retrieval", "--index", tmp_path / "idx", "--questions", questions, "--predictions", tmp_path / "p.jsonl")
    assert rc == 0 and (tmp_path / "p.jsonl").is_file(), err  # an output beside them is written


def test_an_endless_stdin_line_is_refused_after_a_bounded_read(tiny_hybrid_index, tmp_path):
    """`ralm ask < /dev/zero` read one endless line into memory (MemoryError): a line is read
    at most MAX_QUESTION_CHARS characters' worth at a time, so 10 MB without a newline is one
    line naming stdin:1 and the limit, in about a second, having read a few kilobytes of it."""
    endless = tmp_path / "endless.txt"
    endless.write_bytes(b"a" * 10_000_000)  # no newline
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    with open(endless, "rb") as stdin:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "ralm", "ask", "--index", str(tiny_hybrid_index)], stdin=stdin,
                              capture_output=True, text=True, env=env, timeout=60)
        seconds = time.perf_counter() - start
        read = os.lseek(stdin.fileno(), 0, os.SEEK_CUR)  # the child shared this file offset: how far it read
    _one_line_error(proc.returncode, proc.stderr, f"stdin:1: the line holds more than {MAX_QUESTION_CHARS:,} characters")
    assert seconds < 10, seconds
    assert read < 100_000, read


def test_index_and_corpus_are_options_and_the_older_positionals_still_work(ralm, corpus_file, tmp_path):
    """Issue #64 item 4: one argument style, --index DIR and --corpus PATH in every command; the
    older spellings (`ralm search DIR QUERY`, `ralm index build CORPUS`) are still read."""
    new, old = tmp_path / "new", tmp_path / "old"
    assert ralm("index", "build", "--corpus", corpus_file, "--out", new, "--kind", "bm25")[0] == 0
    assert ralm("index", "build", corpus_file, "--out", old, "--kind", "bm25")[0] == 0
    for search in (("search", "--index", new, "Who created Python?"), ("search", old, "Who created Python?"),
                   ("search", "Who created Python?", "--index", new)):
        rc, out, err = ralm(*search, "-k", 1, "--json")
        assert rc == 0 and json.loads(out)[0]["id"] == "python:0", (search, err)
    more = tmp_path / "more.jsonl"
    more.write_text(json.dumps({"id": "extra", "title": "Extra", "text": "Lisbon is the capital of Portugal."}) + "\n")
    for index, spelled in ((new, ("--index", new, "--corpus", more)), (old, (old, more))):
        rc, out, err = ralm("index", "add", *spelled, "--json")
        assert rc == 0 and json.loads(out)["added"] == 1, err
        rc, out, err = ralm("index", "delete", *(("--index", index) if index is new else (index,)), "extra", "--json")
        assert rc == 0 and json.loads(out)["deleted"] == 1, err
        for command in ("check", "compact"):
            assert ralm("index", command, *(("--index", index) if index is new else (index,)), "--json")[0] == 0


@pytest.mark.parametrize("argv, read, meant", [
    (("ask", "idx", "the question"), "read 'idx' as QUESTION and 'the question' as one too many",
     "did you mean `ralm ask --index idx 'the question'`?"),
    (("ask", "--index", "idx", "who", "made", "it"), "read 'who' as QUESTION and 'made', 'it' as 2 too many",
     "did you mean `ralm ask --index idx 'who made it'`?"),
    (("ask", "the question"), "missing option --index (read 'the question' as QUESTION)", "`ralm ask --index DIR QUESTION`"),
    (("search", "the query"), "missing option --index (read 'the query' as QUERY)", "`ralm search --index DIR QUERY`"),
    (("index", "build", "--corpus", "c.jsonl", "d.jsonl", "--out", "x"), "read 'd.jsonl' as one too many",
     "`ralm index build --corpus c.jsonl`"),
    (("index", "add", "more.jsonl"), "missing option --index (read 'more.jsonl' as --corpus)",
     "`ralm index add --index DIR --corpus CORPUS`"),
    # issue 64: these said click's "Missing option '--index'"
    (("serve", "runs/dev"), "read 'runs/dev' as one too many", "did you mean `ralm serve --index runs/dev`?"),
    (("eval", "qa", "runs/dev", "--questions", "q.jsonl"), "read 'runs/dev' as one too many",
     "did you mean `ralm eval qa --index runs/dev --questions q.jsonl`?"),
    (("eval", "retrieval", "runs/dev", "--questions", "q.jsonl"), "read 'runs/dev' as one too many",
     "did you mean `ralm eval retrieval --index runs/dev --questions q.jsonl`?"),
    (("eval", "qa", "--questions", "q.jsonl"), "missing option --index", "`ralm eval qa --index DIR --questions QUESTIONS`"),
])
def test_a_positional_too_many_or_an_index_missing_names_what_was_read(argv, read, meant):
    """`ralm ask idx "question"` said "Missing option '--index'", not that idx was read as the
    question: one line naming what each positional was read as and the spelling meant, before torch."""
    rc, torch_imported, err = _before_torch(argv)
    assert rc == 2 and not torch_imported and len(err.strip().splitlines()) == 1, err
    assert read in err and meant in err, err


def test_flags_print_no_value_in_help(ralm):
    """Item 7: an on/off flag takes no value, so help prints none beside it (typer printed `--json <bool>`
    and `--help <bool>`)."""
    for command in ((), ("search",), ("ask",), ("eval", "qa"), ("index",), ("index", "build"), ("retro", "eval"),
                    ("convert", "hf-realm"), ("pretrain",), ("lm", "train")):
        rc, out, _ = ralm(*command, "--help")
        flags = [line for line in out.splitlines() if "<bool>" in line]
        assert rc == 0 and not flags, (command, flags)


def test_the_command_list_starts_with_what_a_newcomer_runs():
    import typer

    from ralm.cli import app

    group = typer.main.get_command(app)
    listed = group.list_commands(typer.Context(group))
    assert listed[:7] == ["demo", "ask", "search", "index", "eval", "serve", "ict"], listed
