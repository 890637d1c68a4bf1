"""Index versions that verify themselves (retrieval/index/verify.py, `ralm index check`): every
kind of damage is one line naming the file and exit code 2, never a traceback or a NaN."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from ralm.retrieval.index.verify import check_full, check_open, inventory


def _one_line_error(rc, err, needle):
    assert rc == 2, err
    assert "Traceback" not in err
    assert needle in err, err
    assert len([line for line in err.strip().splitlines() if line.strip()]) <= 2  # one message (may wrap once)


@pytest.fixture(scope="module")
def indexes(tmp_path_factory, tiny_bert):
    from conftest import DOCS
    from ralm.retrieval.index.build import build_index

    root = tmp_path_factory.mktemp("verify")
    build_index(DOCS, root / "dense", model=str(tiny_bert), dim=16, show_progress=False)
    build_index(DOCS, root / "bm25", kind="bm25", show_progress=False)
    return root


def _copy(indexes, tmp_path, kind):
    root = tmp_path / kind
    shutil.copytree(indexes / kind, root)
    return root, root / "versions" / "v000001", next((root / "blocks").iterdir())


def _flip_byte(path, offset=-5):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_the_inventory_records_every_file_the_version_uses(indexes):
    version = indexes / "dense" / "versions" / "v000001"
    files = json.loads((version / "manifest.json").read_text())["files"]
    emb = np.load(version / "embeddings.npy")
    assert files["embeddings.npy"]["shape"] == list(emb.shape) and files["embeddings.npy"]["dtype"] == "<f4"
    assert any(k.endswith("tokens/values.bin") for k in files) and any(k.endswith("model.safetensors") for k in files)
    assert all((version / k).stat().st_size == e["size"] for k, e in files.items())
    assert inventory(version, []) == {k: e for k, e in files.items() if not k.startswith("..")}
    check_full(version, files)


def _nan_embeddings(v, b, r):
    emb = np.load(v / "embeddings.npy")
    emb[1, 3] = np.nan
    np.save(v / "embeddings.npy", emb)  # same size, shape and dtype: only the checksum and the scan see it


def _drop_kind(v, b, r):
    """Neither "kind" nor "retriever", its older name, in the index's own manifest."""
    m = json.loads((r / "manifest.json").read_text())
    del m["kind"], m["retriever"]
    (r / "manifest.json").write_text(json.dumps(m))


def _sides(r, sides):
    path = r / "versions" / "v000001" / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "sides": sides}))


def _side_gone(v):
    """The BM25 side's files removed, and the inventory with them: the manifest still names the side."""
    shutil.rmtree(v / "bm25")
    m = json.loads((v / "manifest.json").read_text())
    (v / "manifest.json").write_text(json.dumps({**m, "files": {k: e for k, e in m["files"].items() if not k.startswith("bm25/")}}))


def _log_linked_elsewhere(r):
    (r.parent / "elsewhere.jsonl").write_text("")
    (r / "updates.jsonl").symlink_to(r.parent / "elsewhere.jsonl")


# (kind, damage, what the error names, caught when the version opens or only by `index check`)
DAMAGES = {
    "a NUL line in the update log": ("bm25", lambda v, b, r: (r / "updates.jsonl").write_bytes(b"\0" * 40 + b"\n"),
                                     "updates.jsonl:1", True),
    "an update log linked elsewhere": ("bm25", lambda v, b, r: _log_linked_elsewhere(r), "updates.jsonl is not a regular file", True),
    "a side whose files are gone": ("dense", lambda v, b, r: _side_gone(v), "bm25", True),
    "an unknown side": ("dense", lambda v, b, r: _sides(r, ["dense", "colbert"]), "colbert", True),
    "bm25 array truncated": ("bm25", lambda v, b, r: _truncate(next((v / "bm25").glob("*.npy")), 100), "bm25/", True),
    "bm25 array flipped byte": ("bm25", lambda v, b, r: _flip_byte(next((v / "bm25").glob("*.npy"))), "bm25/", False),
    "model.safetensors truncated": ("dense", lambda v, b, r: _truncate(next((r / "retriever").glob("*/model.safetensors")), 300),
                                    "model.safetensors", True),
    "index manifest without kind": ("dense", _drop_kind, "kind", True),
    "NaN embeddings": ("dense", _nan_embeddings, "embeddings.npy", False),
    "token values flipped byte": ("dense", lambda v, b, r: _flip_byte(b / "tokens" / "values.bin"), "values.bin", False),
    "block offsets reshaped": ("bm25", lambda v, b, r: np.save(b / "tokens" / "offsets.npy", np.zeros((2, 7), np.int64)),
                               "offsets.npy", True),
}


def _truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


@pytest.mark.parametrize("name", DAMAGES)
def test_index_check_names_the_damaged_file(ralm, indexes, tmp_path, name):
    kind, damage, needle, on_open = DAMAGES[name]
    root, version, blocks = _copy(indexes, tmp_path, kind)
    damage(version, blocks, root)
    _one_line_error(*ralm("index", "check", root, "--json")[::2], needle)
    if on_open:  # the cheap checks when a version opens catch it too
        _one_line_error(*ralm("search", root, "capital", "-k", 2, "--json")[::2], needle)


def test_a_sound_index_checks_clean_and_an_old_version_still_opens(ralm, indexes, tmp_path):
    for kind in ("dense", "bm25"):
        rc, out, err = ralm("index", "check", indexes / kind, "--json")
        assert rc == 0, err
        summary = json.loads(out)
        assert summary["sound"] and summary["versions"][0]["verified"] and summary["versions"][0]["files"] > 5
    root, version, _ = _copy(indexes, tmp_path, "bm25")
    m = json.loads((version / "manifest.json").read_text())
    del m["files"]  # a version published before inventories existed
    (version / "manifest.json").write_text(json.dumps(m))
    rc, out, err = ralm("search", root, "capital", "-k", 2, "--json")
    assert rc == 0 and json.loads(out)[0]["id"] in ("paris:0", "tokyo:0")
    rc, out, err = ralm("index", "check", root)
    assert rc == 0 and "predate file inventories" in out


def test_check_open_reads_headers_only(indexes, tmp_path):
    root, version, _ = _copy(indexes, tmp_path, "dense")
    files = json.loads((version / "manifest.json").read_text())["files"]
    check_open(version, files)
    _nan_embeddings(version, None, root)
    check_open(version, files)  # same size, shape, dtype
    with pytest.raises(Exception, match="NaN"):
        check_full(version, files)


def test_non_finite_scores_never_print_a_bare_nan(ralm, indexes, tmp_path):
    root, version, blocks = _copy(indexes, tmp_path, "dense")
    emb = np.load(version / "embeddings.npy")
    emb[:] = np.nan
    np.save(version / "embeddings.npy", emb)
    rc, out, err = ralm("search", root, "capital", "-k", 2, "--json")
    assert "NaN" not in out
    _one_line_error(rc, err, "index check")
    for args in ((), ("--retriever", "hybrid"), ("--retriever", "dense")):  # a table, not only JSON, and fused with BM25
        rc, out, err = ralm("search", root, "capital", "-k", 2, *args)
        assert "nan" not in out.lower()
        _one_line_error(rc, err, f"ralm index check {root}")
