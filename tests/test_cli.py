"""The command line: JSON outputs are the public interface; bad input is one line, exit 2."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import DOCS


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
    _one_line_error(*ralm("index", "build", bad, "--out", tmp_path / "y", "--model", tmp_path / "nomodel")[::2], "model directory not found")
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
    assert err.strip() == f"warning: {corpus}: skipped 1 document(s) with empty text (the first at {corpus}:{len(DOCS) + 1})"

    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"id": f"o{i}", "title": "Soup", "text": f"Stir the soup {i} times."}) + "\n" for i in range(4)))
    assert ralm("index", "build", other, "--out", tmp_path / "other-idx", "--retriever", "bm25")[0] == 0
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question": "Who created Python?", "answers": ["Guido van Rossum"]}) + "\n")
    rc, out, err = ralm("eval", "retrieval", "--index", tmp_path / "other-idx", "--questions", questions, "--ks", "1,5", "--json")
    assert rc == 0 and json.loads(out)["recall@5"] == 0.0
    assert err.startswith("warning: no question has an answer in its top-4 passages") and str(other) in err
    assert len(err.strip().splitlines()) == 1


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
