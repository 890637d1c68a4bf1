"""The command line: JSON outputs are the public interface; bad input is one line, exit 2."""

import json
import os
import subprocess
import sys


from conftest import DOCS




def test_index_build_search_and_eval_retrieval(ralm, tiny_bert, corpus_file, tmp_path):
    rc, out, err = ralm("index", "build", corpus_file, "--out", tmp_path / "idx", "--model", tiny_bert, "--dim", 16, "--json")
    assert rc == 0, err
    summary = json.loads(out)
    assert summary["blocks"] == len(DOCS) and summary["version"] == "v000001" and summary["dim"] == 16

    rc, out, err = ralm("search", tmp_path / "idx", "capital of Japan", "-k", 2, "--json")
    assert rc == 0, err
    hits = json.loads(out)
    assert len(hits) == 2 and set(hits[0]) == {"id", "title", "score", "text"}

    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"id": "q1", "question": "Who created Python?", "answers": ["Guido van Rossum"]}) + "\n")
    rc, out, err = ralm("eval", "retrieval", "--index", tmp_path / "idx", "--questions", questions, "--ks", "1,6",
                        "--predictions", tmp_path / "pred.jsonl", "--json")
    assert rc == 0, err
    result = json.loads(out)
    assert result["recall@6"] == 100.0 and result["questions"] == 1
    assert json.loads((tmp_path / "pred.jsonl").read_text())["id"] == "q1"


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


def test_a_real_process_exits_2_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ralm", "search", str(tmp_path), "anything"], capture_output=True, text=True,
                          env={**os.environ, "RALM_NO_PROGRESS": "1"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "not an index directory" in proc.stderr
