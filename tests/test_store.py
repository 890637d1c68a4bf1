import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time

from pathlib import Path

import numpy as np
import pytest

from ralm.atomic import atomic_path, remove_stale_temps, temp_dir, write_json
from ralm.errors import RalmError
from ralm.retrieval.index.store import IndexDir


def _write_version(value: float, n: int = 1000):
    def write(tmp):
        np.save(tmp / "embeddings.npy", np.full((n, 4), value, np.float32))
        return {"sides": ["dense"], "count": n, "blocks": "k", "dim": 4, "retriever": "retriever/fp", "doc_fingerprint": "fp",
                "value": value}
    return write


def test_versions_are_numbered_and_latest_moves(tmp_path):
    index = IndexDir.create(tmp_path / "idx", "dense")
    assert index.publish(_write_version(1.0)) == "v000001"
    assert index.publish(_write_version(2.0)) == "v000002"
    assert index.latest() == "v000002"
    assert index.version_manifest("v000001")["value"] == 1.0


FIXTURES = Path(__file__).parent / "fixtures"


def test_a_manifest_of_ralm_04_is_read_into_the_sides_sections():
    """versions/v000001/manifest.json of a real hybrid build by ralm 0.4 (benchmarks/refactor/same_behaviour.py's
    index, before sections): the dense side's fields at the top level, BM25's nowhere."""
    from ralm.retrieval.index.bm25_side import BM25Section
    from ralm.retrieval.index.dense_side import DenseSection
    from ralm.retrieval.index.store import VersionManifest

    raw = json.loads((FIXTURES / "version_manifest_0.4_hybrid.json").read_text())
    m = VersionManifest.from_json(raw, "fixture")
    assert m.sides == ("dense", "bm25") and m.kind == "hybrid" and m.count == raw["count"] == 326
    assert m.sections == {"dense": DenseSection(dim=384, retriever="retriever/a754b78b8705d4c4",
                                                doc_fingerprint="a754b78b8705d4c4", dtype="fp32"),
                          "bm25": BM25Section()}
    assert set(m.extra) == {"kind", "build_seconds"} and m.files == raw["files"]  # nothing of a side left untyped
    new = m.to_json()
    assert new["sections"]["dense"] == {k: raw[k] for k in ("dim", "retriever", "doc_fingerprint", "dtype")}
    assert not {"dim", "retriever", "doc_fingerprint", "dtype"} & set(new) and VersionManifest.from_json(new, "again") == m
    with pytest.raises(RalmError, match="fixture: 'sections.dense.doc_fingerprint' must be present"):
        VersionManifest.from_json({k: v for k, v in raw.items() if k != "doc_fingerprint"}, "fixture")


def test_an_index_of_ralm_04_opens_searches_and_checks_as_before(tiny_hybrid_index, tmp_path, ralm):
    """A hybrid index whose manifests are laid out as ralm 0.4 wrote them (the fixtures' keys)
    searches as the index it came from, and `ralm index check` verifies it."""
    import shutil

    from conftest import lay_out_as_ralm_04
    from ralm.retrieval.search.searcher import Searcher

    old = tmp_path / "old"
    shutil.copytree(tiny_hybrid_index, old)
    lay_out_as_ralm_04(old)
    assert IndexDir(old).version("v000001") == IndexDir(tiny_hybrid_index).version("v000001")
    queries = ["capital of France", "highest mountain"]
    a, b = Searcher.open(old).search(queries, 3), Searcher.open(tiny_hybrid_index).search(queries, 3)
    assert [[(h.id, h.score, h.found_by) for h in q] for q in a] == [[(h.id, h.score, h.found_by) for h in q] for q in b]
    rc, out, err = ralm("index", "check", old, "--json")
    assert rc == 0 and json.loads(out)["sound"] and json.loads(out)["versions"][0]["verified"], err


def test_old_versions_are_pruned_but_latest_kept(tmp_path):
    index = IndexDir.create(tmp_path / "idx", "dense")
    for v in range(5):
        index.publish(_write_version(float(v)), keep=2)
    assert index.versions() == ["v000004", "v000005"]


def test_a_version_manifest_is_typed_validated_and_an_older_one_still_loads(tmp_path):
    from ralm.retrieval.index.dense_side import DenseSection
    from ralm.retrieval.index.store import VersionManifest

    index = IndexDir.create(tmp_path / "idx", "dense")
    index.publish(_write_version(1.0, n=3))  # the dense fields at the top level, as ralm 0.4 wrote them
    m = index.version("v000001")
    assert (m.version, m.sides, m.count, m.blocks, m.kind) == ("v000001", ("dense",), 3, "k", "dense")
    assert m.sections == {"dense": DenseSection(dim=4, retriever="retriever/fp", doc_fingerprint="fp")}
    assert m.extra["value"] == 1.0 and set(m.files) == {"embeddings.npy"}  # a field no one types, the inventory
    assert VersionManifest.from_json(m.to_json(), "here") == m
    path = index.version_path("v000001") / "manifest.json"
    written = json.loads(path.read_text())
    assert written["sections"] == {"dense": {"dim": 4, "retriever": "retriever/fp", "doc_fingerprint": "fp"}}
    assert "dim" not in written  # published in the new layout
    old = {k: v for k, v in written.items() if k != "sides"}  # from before "sides"
    path.write_text(json.dumps({**old, "kind": "dense"}))
    assert index.version("v000001").sides == ("dense",)
    dense = written["sections"]["dense"]
    for broken, message in (({"count": -1}, "'count' must be positive, got -1"), ({"count": "3"}, "'count' must be int"),
                            ({"sections": {"dense": {**dense, "dim": None}}}, "'sections.dense.dim' must be present"),
                            ({"sections": {"dense": {**dense, "dim": 0}}}, "'sections.dense.dim' must be positive"),
                            ({"sections": {"dense": {**dense, "faiss": 3}}}, "'sections.dense.faiss' must be str"),
                            ({"sections": {"dense": {**dense, "nprobe": 3}}}, "'sections.dense.nprobe' is no field of the dense side"),
                            ({"sections": {"dense": dense, "bm25": {}}}, "'sections' must be an object of the sides it holds"),
                            ({"version": "latest"}, "'version' must be a version name")):
        path.write_text(json.dumps({**old, **broken}))
        with pytest.raises(RalmError, match=f"manifest.json: {message}.*rebuild"):
            index.version("v000001")
    with pytest.raises(RalmError, match="'blocks' must be present"):  # a build that forgets a field publishes nothing
        index.publish(lambda tmp: {"sides": ["bm25"], "count": 3})
    assert index.versions() == ["v000001"]


def test_a_failing_write_leaves_the_old_version_intact(tmp_path):
    index = IndexDir.create(tmp_path / "idx", "dense")
    index.publish(_write_version(1.0))

    def broken(tmp):
        np.save(tmp / "embeddings.npy", np.zeros((10, 4), np.float32))
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        index.publish(broken)
    assert index.latest() == "v000001" and index.versions() == ["v000001"]
    assert not [p for p in (tmp_path / "idx" / "versions").iterdir() if p.name.startswith(".")]


def _publish_forever(root):
    index = IndexDir(root)

    def slow(tmp):
        np.save(tmp / "embeddings.npy", np.zeros((100, 4), np.float32))
        time.sleep(60)  # killed here, half-way through a version
        return {"kind": "dense"}

    index.publish(slow)


def test_killing_the_writer_leaves_the_old_index_intact(tmp_path):
    index = IndexDir.create(tmp_path / "idx", "dense")
    index.publish(_write_version(1.0))
    proc = mp.get_context("spawn").Process(target=_publish_forever, args=(str(tmp_path / "idx"),))
    proc.start()
    deadline = time.time() + 60
    while not any(p.name.startswith(".building") for p in (tmp_path / "idx" / "versions").iterdir()):
        assert time.time() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    again = IndexDir(tmp_path / "idx")
    assert again.latest() == "v000001" and again.versions() == ["v000001"]
    assert np.load(again.version_path("v000001") / "embeddings.npy")[0, 0] == 1.0
    assert again.publish(_write_version(3.0)) == "v000002"  # the debris does not block the next version
    assert not [p for p in (tmp_path / "idx" / "versions").iterdir() if p.name.startswith(".")]  # and is removed


def test_concurrent_reader_never_sees_a_partial_version(tmp_path):
    index = IndexDir.create(tmp_path / "idx", "dense")
    index.publish(_write_version(0.0))
    seen, errors, stop = [], [], threading.Event()

    def read():
        reader = IndexDir(tmp_path / "idx")
        while not stop.is_set():
            try:
                name = reader.latest()
                emb = np.load(reader.version_path(name) / "embeddings.npy")
                manifest = reader.version_manifest(name)
                assert emb.shape == (1000, 4) and float(emb[0, 0]) == manifest["value"]
                seen.append(name)
            except FileNotFoundError:
                continue  # a pruned old version: the reader simply retries with the new LATEST
            except Exception as e:  # pragma: no cover - the failure we test for
                errors.append(e)

    t = threading.Thread(target=read)
    t.start()
    for v in range(1, 8):
        index.publish(_write_version(float(v)), keep=2)
    stop.set()
    t.join()
    assert not errors and len(set(seen)) >= 2


def test_create_refuses_a_foreign_directory_and_a_kind_change(tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file.txt").write_text("x")
    with pytest.raises(RalmError, match="not an index directory"):
        IndexDir.create(tmp_path / "busy", "dense")
    IndexDir.create(tmp_path / "idx", "bm25")
    with pytest.raises(RalmError, match="holds a bm25 index"):
        IndexDir.create(tmp_path / "idx", "dense")
    with pytest.raises(RalmError, match="no manifest.json"):
        IndexDir(tmp_path / "nothing")


def test_atomic_file_write_keeps_old_content_on_error(tmp_path):
    target = tmp_path / "a.json"
    write_json(target, {"v": 1})
    with pytest.raises(ValueError):
        with atomic_path(target) as tmp:
            tmp.write_text("{half")
            raise ValueError("crash")
    assert json.loads(target.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_only_temp_folders_of_writers_that_are_gone_are_removed(tmp_path):
    """The rule: a temp folder names its writer (pid and machine); it is removed only when that
    writer ran on this machine and its pid no longer exists."""
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(exited.stdout)  # a process that has exited
    live = temp_dir(tmp_path, "step-000002")  # this process: a writer still at work
    dead = live.with_name(live.name.replace(f"-{os.getpid()}@", f"-{dead_pid}@"))
    dead.mkdir()
    elsewhere = dead.with_name(dead.name.replace("@", "@another-host.", 1))  # a pid on another machine means nothing here
    elsewhere.mkdir()
    foreign = tmp_path / ".not-ours.tmp"  # a name without a writer is never touched
    foreign.mkdir()
    assert remove_stale_temps(tmp_path) == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (live, elsewhere, foreign))


def test_an_atomic_write_removes_what_a_killed_writer_left_beside_it(tmp_path):
    code = ("import os, signal; from ralm.atomic import atomic_path\n"
            f"with atomic_path({str(tmp_path / 'big.bin')!r}) as tmp:\n"
            "    tmp.write_bytes(b'x' * 1000); os.kill(os.getpid(), signal.SIGKILL)")
    subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert [p.name.startswith(".big.bin-") for p in tmp_path.iterdir()] == [True]  # the killed writer's debris
    write_json(tmp_path / "other.json", {"v": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.json"]


@pytest.mark.parametrize("damage, message", [
    (lambda root: (root / "LATEST").write_text("v000042\n"), r"LATEST names 'v000042', which is not a version"),
    (lambda root: (root / "LATEST").write_bytes(b"\xff\x00"), r"LATEST names .*not a version"),
    (lambda root: (root / "manifest.json").write_text("{garbage"), r"idx/manifest.json is damaged \(not valid JSON"),
    (lambda root: (root / "versions" / "v000001" / "manifest.json").write_text("[1]"), r"v000001/manifest.json is damaged \(a JSON list"),
])
def test_a_damaged_index_directory_is_an_error_naming_the_file(tmp_path, damage, message):
    index = IndexDir.create(tmp_path / "idx", "dense")
    index.publish(_write_version(1.0))
    damage(tmp_path / "idx")
    with pytest.raises(RalmError, match=message):
        again = IndexDir(tmp_path / "idx")
        again.version_manifest(again.latest())


def test_out_pointing_at_a_file_is_an_error(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(RalmError, match="f is a file; an index is a directory"):
        IndexDir.create(tmp_path / "f", "dense")
