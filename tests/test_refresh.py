"""The index builder: snapshots in, published versions out; a concurrent reader never sees a
partial version, and killing the builder mid-write leaves the index readable."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from ralm.retrieval.index.dense_side import embed_blocks
from ralm.retrieval.towers.encoders import Retriever
from ralm.retrieval.index.refresh import Snapshots, publish_embeddings
from ralm.retrieval.search.searcher import Searcher
from ralm.retrieval.index.store import IndexDir
from ralm.retrieval.index.dense_side import dense_of
from ralm.runtime import Runtime

CPU = Runtime.resolve("cpu")  # the automatic dtype, as the trainer's refresh computes on a CPU


@pytest.fixture
def index(tiny_dense_index, tmp_path) -> IndexDir:
    shutil.copytree(tiny_dense_index, tmp_path / "index")
    return IndexDir(tmp_path / "index")


def _retriever(index: IndexDir) -> Retriever:
    return Retriever.from_pretrained(index.root / index.version_manifest(index.latest())["sections"]["dense"]["retriever"]).eval()


def _expected(retriever: Retriever, index: IndexDir, tmp_path) -> np.ndarray:
    key = index.version_manifest(index.latest())["blocks"]
    return np.array(embed_blocks(retriever, index.blocks(key), tmp_path / "expected.npy", CPU, show_progress=False))


QUERIES = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)


def _assert_embeddings(version, expected: np.ndarray) -> None:
    """The version answers every query over all rows exactly as the expected matrix does."""
    scores, rows = dense_of(version).index.search(QUERIES, len(expected))
    want = QUERIES @ expected.T  # [3, N]
    np.testing.assert_allclose(scores, np.take_along_axis(want, rows, 1), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.sort(scores, 1), np.sort(want, 1), rtol=1e-4, atol=1e-5)


def test_builder_process_publishes_the_newest_snapshot(index, tmp_path):
    retriever = _retriever(index)
    with torch.no_grad():
        retriever.doc.proj.weight.mul_(-2.0)  # a "trained" document tower
    snaps = Snapshots(tmp_path / "snaps")
    snaps.write(retriever, 3)
    snaps.write(retriever, 7)
    assert snaps.latest()[0] == 7 and len(list(snaps.root.glob("step-*"))) == 2
    searcher = Searcher(index, None, check_model=False)
    before = searcher.current.name
    proc = subprocess.run([sys.executable, "-m", "ralm.retrieval.index.refresh", "--index", str(index.root), "--snapshots",
                           str(snaps.root), "--max-versions", "1", "--poll", "0.1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert searcher.refresh() and searcher.current.name != before
    manifest = searcher.current.manifest
    assert manifest.step == 7 and manifest.seconds > 0
    assert manifest.sections["dense"].doc_fingerprint == retriever.doc_fingerprint()
    _assert_embeddings(searcher.current, _expected(retriever, index, tmp_path))
    # the published version is searchable on its own, with the retriever saved beside it
    hits = Searcher.open(index.root).search(["capital of Japan"], 2)[0]
    assert len(hits) == 2


WRITER = textwrap.dedent("""
    import sys, time
    import ralm.retrieval.index.dense_side as build
    from ralm.runtime import Runtime
    from ralm.retrieval.towers.encoders import Retriever
    from ralm.retrieval.index.refresh import publish_embeddings
    from ralm.retrieval.index.store import IndexDir

    real = build.encode_rows
    def slow(encode, rows, lengths, **kwargs):  # one block at a time with a pause
        def sleepy(ids, mask):
            time.sleep(float(sys.argv[3]))
            return encode(ids, mask)
        return real(sleepy, rows, lengths, **{**kwargs, "batch_size": 1})
    build.encode_rows = slow
    index = IndexDir(sys.argv[1])
    manifest = index.version_manifest(index.latest())
    retriever = Retriever.from_pretrained(index.root / manifest["sections"]["dense"]["retriever"])
    print("ready", flush=True)
    for step in range(1, int(sys.argv[2]) + 1):
        publish_embeddings(index, retriever, blocks_key=manifest["blocks"], blocks=index.blocks(manifest["blocks"]), step=step,
                           runtime=Runtime.resolve("cpu"), keep=100)
""")


def _writer(index: IndexDir, versions: int, pause: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(index.root), str(versions), str(pause)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "RALM_NO_PROGRESS": "1"})
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_concurrent_reader_never_sees_a_partial_version(index, tmp_path):
    expected = _expected(_retriever(index), index, tmp_path)
    searcher = Searcher(index, None, check_model=False)
    writer = _writer(index, versions=6, pause=0.03)
    seen, checks = set(), 0
    while True:
        done = writer.poll() is not None
        searcher.refresh()  # what the trainer does between steps
        _assert_embeddings(searcher.current, expected)  # a half-written file has rows of zeros
        seen.add(searcher.current.manifest.step)
        checks += 1
        if done:
            break
        time.sleep(0.005)
    assert writer.returncode == 0, writer.stdout.read()
    assert {1, 6} <= seen and checks > 10
    assert index.latest() == index.versions()[-1]


def test_killing_the_builder_mid_write_leaves_the_index_readable(index):
    before = index.latest()
    writer = _writer(index, versions=1, pause=2.0)
    deadline = time.time() + 60
    while not list((index.root / "versions").glob(".building-*")):
        assert time.time() < deadline, "the writer never started a version"
        time.sleep(0.05)
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    assert index.latest() == before and index.versions() == [before]
    searcher = Searcher(index, None, check_model=False)
    assert searcher.current.name == before
    assert dense_of(searcher.current).index.search(QUERIES, 2)[1].shape == (3, 2)


def test_sync_publish_records_step_and_prunes_old_retrievers(index, tmp_path):
    retriever = _retriever(index).train()
    key = index.version_manifest(index.latest())["blocks"]
    for step in (1, 2, 3, 4):
        with torch.no_grad():
            retriever.doc.proj.bias.add_(0.01)  # a new document tower each time
        publish_embeddings(index, retriever, blocks_key=key, blocks=index.blocks(key), step=step, runtime=CPU,
                           keep=2)
    assert [index.version_manifest(v)["step"] for v in index.versions()] == [3, 4]
    saved = {p.name for p in (index.root / "retriever").iterdir()}
    assert saved == {index.version_manifest(v)["sections"]["dense"]["retriever"].split("/")[-1] for v in index.versions()}
    assert retriever.training  # embedding ran in eval mode, then training mode came back
