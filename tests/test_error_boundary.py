"""The CLI's one error boundary (cli.main): bad input and the filesystem are one line and exit
code 2, checked before slow work; a failed build leaves nothing behind; bugs are one line and
exit code 1, with their traceback under RALM_DEBUG=1. And the corpus edge cases that used to
escape it."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
import torch

from conftest import DOCS
from ralm.data.corpus import Document, read_corpus
from ralm.errors import RalmError


def _one_line_error(rc, err, needle):
    assert rc == 2, err
    assert "Traceback" not in err
    assert needle in err, err
    assert len([line for line in err.strip().splitlines() if line.strip()]) <= 2  # one message (may wrap once)


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_filesystem_errors_are_one_line_naming_the_path(ralm, corpus_file, tmp_path):
    afile = tmp_path / "a_file"
    afile.write_text("x")
    _one_line_error(*ralm("index", "build", corpus_file, "--out", afile / "sub", "--retriever", "bm25")[::2], str(afile))
    rc, _, err = ralm("index", "build", corpus_file, "--out", tmp_path / "bm25", "--retriever", "bm25")
    assert rc == 0, err
    q = _jsonl(tmp_path / "q.jsonl", [{"question": "capital of France?", "answers": ["Paris"]}])
    # a folder where a file is expected
    _one_line_error(*ralm("eval", "retrieval", "--index", tmp_path / "bm25", "--questions", q, "--predictions", tmp_path)[::2],
                    str(tmp_path))


@pytest.mark.parametrize("node", ["device", "fifo"])
def test_an_output_never_replaces_a_device_or_fifo(ralm, corpus_file, tmp_path, node):
    target = tmp_path / "predictions"
    if node == "device":  # /dev/null's numbers, made here: a test must not touch the real one
        try:
            os.mknod(target, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("making a device node needs root (CAP_MKNOD)")
    else:
        os.mkfifo(target)
    assert ralm("index", "build", corpus_file, "--out", tmp_path / "bm25", "--retriever", "bm25")[0] == 0
    q = _jsonl(tmp_path / "q.jsonl", [{"question": "capital of France?", "answers": ["Paris"]}])
    rc, _, err = ralm("eval", "retrieval", "--index", tmp_path / "bm25", "--questions", q, "--predictions", target)
    _one_line_error(rc, err, "not a regular file")
    mode = os.lstat(target).st_mode
    assert stat.S_ISCHR(mode) if node == "device" else stat.S_ISFIFO(mode)  # still what it was


def test_weights_gone_non_finite_stop_a_run_and_an_export(ralm, tiny_bert, corpus_file, tmp_path):
    for lr in ("1e30", "1e38"):  # diverges in a step or two; overflows the first step's weights
        run = tmp_path / f"ict-{lr}"
        rc, _, err = ralm("ict", "--corpus", corpus_file, "--model", tiny_bert, "--dim", 16, "--steps", 3, "--batch-size", 4, "--preset", "cpu",
                          "--lr", lr, "--out", run)
        assert rc == 2 and "Traceback" not in err and "weights are NaN or inf (the training diverged" in " ".join(err.split()), err
        assert not (run / "final").exists() and not (run / "checkpoints").exists()
    _one_line_error(*ralm("ict", "--corpus", corpus_file, "--lr", "1e308", "--out", tmp_path / "ict")[::2], "lr must be at most 3.4e+38")
    from ralm.retrieval.towers.encoders import Retriever

    broken = Retriever.from_pretrained(str(tiny_bert), dim=16)
    with torch.no_grad():
        broken.doc.proj.weight[0, 0] = float("nan")
    broken.save_pretrained(tmp_path / "broken")
    rc, _, err = ralm("export", tmp_path / "broken", "--format", "hf", "--out", tmp_path / "exported")
    _one_line_error(rc, err, "1 of")
    assert not (tmp_path / "exported").exists()


def test_a_disk_filling_up_during_training_is_one_line_naming_the_file(tiny_bert, corpus_file, tmp_path):
    import resource
    import signal

    def small_disk():  # every file stops at 1 MB, as on a full disk (EFBIG, not the signal that would kill)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    proc = subprocess.run([sys.executable, "-m", "ralm", "ict", "--corpus", str(corpus_file), "--model", str(tiny_bert), "--dim", "16",
                           "--steps", "2", "--batch-size", "4", "--preset", "cpu", "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, preexec_fn=small_disk, check=False,
                          env={**os.environ, "RALM_NO_PROGRESS": "1", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2, proc.stderr
    last = " ".join(proc.stderr.split("error:")[-1].split())
    assert "File too large" in last and str(tmp_path / "run") in last and "Traceback" not in proc.stderr


def test_a_fifo_corpus_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "corpus.jsonl"
    os.mkfifo(fifo)
    proc = subprocess.run([sys.executable, "-m", "ralm", "index", "build", str(fifo), "--out", str(tmp_path / "x"), "--retriever",
                           "bm25"], capture_output=True, text=True, timeout=60, env={**os.environ, "RALM_NO_PROGRESS": "1"})
    _one_line_error(proc.returncode, proc.stderr, "not a regular file")


def test_a_failed_build_removes_the_folder_it_created(ralm, tmp_path):
    corpus = _jsonl(tmp_path / "stop.jsonl", [{"id": "a", "title": "", "text": "the a of it is"}, {"id": "b", "text": "x y z"}])
    _one_line_error(*ralm("index", "build", corpus, "--out", tmp_path / "idx", "--retriever", "bm25")[::2], "stop word")
    assert not (tmp_path / "idx").exists()


@pytest.mark.parametrize("args, needle", [
    (["ict", "--lr", "inf"], "--lr must be a finite number"),
    (["ict", "--lr", "nan"], "--lr must be a finite number"),
    (["ict", "--keep-sentence", "nan"], "--keep-sentence must be a finite number"),
    (["ict", "--block-len", "100000"], "--block-len must be at most 512"),
    (["ict", "--device", "tpu9"], "--device"),
    (["pretrain", "--retriever-lr", "inf"], "--retriever-lr must be a finite number"),
])
def test_options_are_checked_before_any_work(ralm, tiny_bert, corpus_file, tmp_path, args, needle):
    command, *options = args
    _one_line_error(*ralm(command, "--corpus", corpus_file, "--out", tmp_path / "run", "--model", tiny_bert, "--steps", 1,
                          "--batch-size", 2, *options)[::2], needle)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("args, needle", [
    (["knnlm", "eval", "--lmbda", "2"], "lmbda must be in [0, 1]"),
    (["knnlm", "eval", "--lmbda", "nan"], "lmbda must be in [0, 1]"),
    (["knnlm", "eval", "--temperature", "0"], "temperature must be a positive finite number"),
    (["retro", "generate", "hi", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["retro", "generate", "hi", "--temperature", "inf"], "--temperature must be a finite number"),
])
def test_sampling_and_interpolation_settings_are_checked_before_the_model_loads(ralm, corpus_file, tmp_path, args, needle):
    missing = tmp_path / "missing"  # were the model loaded first, the error would name it
    extra = ["--store", missing, "--text", corpus_file] if args[0] == "knnlm" else ["--db", missing]
    _one_line_error(*ralm(*args, "--model", missing, *extra)[::2], needle)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")
def test_cuda_without_cuda_is_one_line(ralm, corpus_file, tmp_path):
    _one_line_error(*ralm("index", "build", corpus_file, "--out", tmp_path / "x", "--device", "cuda")[::2], "CUDA is not available")


def test_pretrain_refuses_a_bm25_index_at_once(ralm, tiny_bert, corpus_file, tmp_path):
    assert ralm("index", "build", corpus_file, "--out", tmp_path / "bm25", "--retriever", "bm25")[0] == 0
    _one_line_error(*ralm("pretrain", "--corpus", corpus_file, "--out", tmp_path / "run", "--model", tiny_bert, "--index",
                          tmp_path / "bm25", "--steps", 1, "--refresh", "none", "--masking", "random", "-k", 2)[::2],
                    "needs a dense one")


def test_faiss_specs_are_parsed_first_and_ivf_fitted_to_the_corpus(ralm, tiny_bert, corpus_file, tmp_path, monkeypatch):
    import ralm.retrieval.index.build as build

    def no_encoding(*a, **k):
        raise AssertionError("encoded before the --faiss spec was checked")

    with monkeypatch.context() as m:
        m.setattr(build, "build_index", no_encoding)
        _one_line_error(*ralm("index", "build", corpus_file, "--out", tmp_path / "x", "--model", tiny_bert, "--dim", 16,
                              "--faiss", "IVFxx,Flat")[::2], "IVFxx")
    rc, out, err = ralm("index", "build", corpus_file, "--out", tmp_path / "ivf", "--model", tiny_bert, "--dim", 16,
                        "--faiss", "IVF1024,Flat", "--json")
    assert rc == 0, err
    assert "IVF1024" in err and json.loads(out)["faiss"] == "IVF1,Flat"
    rc, out, err = ralm("search", tmp_path / "ivf", "capital of France", "-k", 6, "--json")
    assert rc == 0 and len(json.loads(out)) == 6  # one cluster searched: every block found


def test_bugs_are_one_line_and_exit_1_with_the_traceback_under_ralm_debug(ralm, tmp_path, monkeypatch):
    from ralm.retrieval.search.searcher import Searcher

    (tmp_path / "idx").mkdir()  # an index the command line's own checks let through
    (tmp_path / "idx" / "manifest.json").write_text('{"format": "ralm.index/2", "retriever": "hybrid"}')

    def bug(*a, **k):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(Searcher, "open", bug)
    rc, _, err = ralm("search", tmp_path / "idx", "anything")
    assert rc == 1 and "internal error (ZeroDivisionError" in err and "RALM_DEBUG=1" in err and "Traceback" not in err
    monkeypatch.setenv("RALM_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        ralm("search", tmp_path / "idx", "anything")


# -- corpus and text edge cases ------------------------------------------------------------

@pytest.mark.parametrize("line, needle", [
    ('{"id": "a", "text": "x \\ud800 y"}', "lone surrogate"),
    ('{"id": "a", "title": "\\udfff", "text": "x"}', "field 'title' holds a lone surrogate"),
    (json.dumps({"id": "a\nb", "text": "x"}), "control character"),
    (json.dumps({"id": "a\u0000b", "text": "x"}), "control character"),
    (json.dumps({"id": "\u200b", "text": "x"}), "field 'id' is empty"),
    ("[" * 50_000 + "]" * 50_000, "nested too deeply"),
    ('{"id": ' + "9" * 5000 + ', "text": "x"}', "4300 digits"),
])
def test_hostile_corpus_lines_are_one_clear_error(tmp_path, line, needle):
    path = _jsonl(tmp_path / "c.jsonl", [DOCS[0], line])
    with pytest.raises(RalmError, match=needle) as e:
        list(read_corpus(path))
    assert "c.jsonl:2" in str(e.value)


def test_invisible_only_text_counts_as_empty_and_ids_keep_unicode(tmp_path):
    path = _jsonl(tmp_path / "c.jsonl", [DOCS[0], {"id": "zw", "text": "\u200b \u200b\ufeff"},
                                         {"id": "Zürich\u00a0\u4e1c", "text": "a city"}, {"id": 12345678901234567890, "text": "big"}])
    with pytest.warns(UserWarning, match="skipped 1 document"):
        docs = list(read_corpus(path))
    assert [d.id for d in docs] == ["paris", "Zürich\u00a0\u4e1c", "12345678901234567890"]
    assert docs[1] == Document("Zürich\u00a0\u4e1c", "", "a city")


def test_a_full_disk_names_the_file_being_written(tmp_path):
    import errno

    from ralm.atomic import atomic_path
    from ralm.commands.shared import os_error_line

    with pytest.raises(OSError) as e:
        with atomic_path(tmp_path / "out.json"):
            raise OSError(errno.ENOSPC, "No space left on device")  # what a write on a full disk raises: no file name
    assert os_error_line(e.value) == f"{tmp_path / 'out.json'}: No space left on device; free some space and run it again"
    assert list(tmp_path.iterdir()) == []  # nothing half-written left
