"""Index versions that verify themselves (retrieval/index/verify.py, `ralm index check`): every
kind of damage is one line naming the file and exit code 2, never a traceback or a NaN."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from ralm.errors import RalmError
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


def _flip_byte(path, offset=-5, mask=0xFF):
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def _flip_in(path, after: bytes, mask=0x01):
    """Flip the byte just after `after`'s first occurrence, staying ASCII (mask 1): the file
    still parses, so only a checksum can tell."""
    _flip_byte(path, path.read_bytes().index(after) + len(after), mask)


def _shift_offsets(b):
    """A bit flipped high in every offset but the last of blocks.idx.npy (same size, shape, dtype):
    each read of a record would ask for exabytes."""
    path = b / "blocks.idx.npy"
    n = len(np.load(path))
    data = bytearray(path.read_bytes())
    header = len(data) - 8 * n
    for i in range(1, n - 1):
        data[header + 8 * i + 7] ^= 0x40
    path.write_bytes(bytes(data))


NEW_DOC = {"id": "zanzibar", "title": "Zanzibar", "text": "Zanzibar is an archipelago off Tanzania, known for its cloves."}


def _logged(r):
    """One live add in the index's update log (its record and, in updates-<id>.bin, its states)."""
    from ralm.data.corpus import Document
    from ralm.retrieval.search.live import LiveSearcher

    LiveSearcher.open(r).add([Document(**NEW_DOC)])
    return r / "updates.jsonl", next(r.glob("updates-*.bin"))


def _edit_logged_text(r):
    log, _ = _logged(r)
    log.write_bytes(log.read_bytes().replace(b"cloves", b"nutmeg"))  # valid JSON, a text edited by hand


def _old_log(r):
    """What ralm <= 0.5 wrote: a header without "checksums", records without "crc"."""
    (r / "updates.jsonl").write_text(json.dumps({"op": "log", "id": "0123456789abcdef"}) + "\n"
                                     + json.dumps({"op": "add", **NEW_DOC}) + "\n")


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
    # a flipped byte in each kind of file (#69): caught by `check`, and where the file is read at open, by opening
    "version manifest, a digit flipped": ("bm25", lambda v, b, r: _flip_in(v / "manifest.json", b'"created": 1'),
                                          "v000001/manifest.json", False),
    "block record offsets flipped high": ("bm25", lambda v, b, r: _shift_offsets(b), "blocks.idx.npy", True),
    "block records flipped byte": ("bm25", lambda v, b, r: _flip_byte(b / "blocks.jsonl", 40), "blocks.jsonl", False),
    "bm25 params flipped byte": ("bm25", lambda v, b, r: _flip_byte(v / "bm25" / "params.index.json", 20), "params.index.json", True),
    "bm25 vocab flipped byte": ("bm25", lambda v, b, r: _flip_byte(v / "bm25" / "vocab.index.json", 40), "vocab.index.json", True),
    "tokenizer.json flipped byte": ("dense", lambda v, b, r: _flip_byte(next((r / "retriever").glob("*/tokenizer.json")), 5000),
                                    "tokenizer.json", True),
    "tokenizer config flipped byte": ("dense", lambda v, b, r: _flip_byte(next((r / "retriever").glob("*/tokenizer_config.json")), 30),
                                      "tokenizer_config.json", True),
    "model config flipped byte": ("dense", lambda v, b, r: _flip_byte(next((r / "retriever").glob("*/config.json")), 30),
                                  "config.json", True),
    "safetensors header, a key edited": ("dense", lambda v, b, r: _flip_in(next((r / "retriever").glob("*/model.safetensors")),
                                                                             b'"dtyp'), "model.safetensors", True),
    "live state flipped byte": ("dense", lambda v, b, r: _flip_byte(_logged(r)[1], 30), "updates-", True),
    "update log record edited by hand": ("bm25", lambda v, b, r: _edit_logged_text(r), "updates.jsonl:2", True),
    "update log record flipped byte": ("bm25", lambda v, b, r: _flip_byte(_logged(r)[0], -30), "updates.jsonl:2", True),
    "update log header, its id flipped": ("bm25", lambda v, b, r: _flip_in(_logged(r)[0], b'"id": "'), "updates.jsonl:1", True),
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


def test_a_latest_naming_an_older_version_is_named(ralm, tmp_path):
    """A flipped digit in LATEST can name another complete version: the index would serve old data."""
    from conftest import DOCS
    from ralm.retrieval.index.build import build_index

    root = tmp_path / "bm25"
    for docs in (DOCS[:3], DOCS):  # two versions
        build_index(docs, root, kind="bm25", show_progress=False)
    assert ralm("index", "check", root)[0] == 0
    (root / "LATEST").write_text("v000001\n")
    _one_line_error(*ralm("index", "check", root, "--json")[::2], "LATEST names v000001, but v000002 is newer")


def test_an_index_manifests_kind_and_its_copy_must_agree(ralm, indexes, tmp_path):
    root, _, _ = _copy(indexes, tmp_path, "bm25")
    manifest = root / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"retriever": "bm25"', '"retriever": "bm26"'))
    _one_line_error(*ralm("index", "check", root, "--json")[::2], "differs from \"kind\"")


def test_a_saved_corpus_is_checked_against_the_checksum_it_is_named_by(ralm, indexes, tmp_path):
    root, _, _ = _copy(indexes, tmp_path, "bm25")  # built from documents in memory: saved in corpus/
    [saved] = (root / "corpus").glob("*.jsonl")
    assert ralm("index", "check", root)[0] == 0
    _flip_byte(saved, 20)
    _one_line_error(*ralm("index", "check", root, "--json")[::2], saved.name)


def test_a_sound_index_checks_clean_and_an_old_version_still_opens(ralm, indexes, tmp_path):
    for kind in ("dense", "bm25"):
        rc, out, err = ralm("index", "check", indexes / kind, "--json")
        assert rc == 0, err
        summary = json.loads(out)
        assert summary["sound"] and summary["versions"][0]["verified"] and summary["versions"][0]["files"] > 5
        assert summary["versions"][0]["manifest_checksum"] and summary["log_checksums"]
    root, version, _ = _copy(indexes, tmp_path, "bm25")
    m = json.loads((version / "manifest.json").read_text())
    del m["files"], m["checksum"]  # a version published before inventories (and manifest checksums) existed
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


def test_a_damaged_block_offset_is_named_by_every_read_of_a_document(ralm, indexes, tmp_path):
    """GET and DELETE of a document read its records by their offsets: one flipped high is the
    index file's damage, named, never a MemoryError from asking for exabytes."""
    from ralm.data.blocks import BlockStore

    root, _, blocks = _copy(indexes, tmp_path, "bm25")
    _shift_offsets(blocks)
    store = BlockStore(blocks)  # opens: only the last offset is read there
    with pytest.raises(RalmError, match="blocks.idx.npy is damaged"):
        store.record(1)
    with pytest.raises(RalmError, match="blocks.idx.npy is damaged"):
        store.check_line_offsets()
    _one_line_error(*ralm("index", "delete", root, "paris")[::2], "blocks.idx.npy")


def test_an_offset_inside_another_record_is_named(indexes, tmp_path):
    from ralm.data.blocks import BlockStore

    _, _, blocks = _copy(indexes, tmp_path, "bm25")
    offsets = np.load(blocks / "blocks.idx.npy")
    offsets[2] -= 3  # still inside blocks.jsonl, but not where a line starts
    np.save(blocks / "blocks.idx.npy", offsets)
    store = BlockStore(blocks)
    assert store.record(0)["id"]  # untouched
    with pytest.raises(RalmError, match=r"blocks.jsonl is damaged \(block 1 .*blocks.idx.npy"):
        store.record(1)


def test_a_log_from_before_checksums_still_replays_and_check_says_it_is_unverified(ralm, indexes, tmp_path):
    root, _, _ = _copy(indexes, tmp_path, "bm25")
    _old_log(root)
    rc, out, err = ralm("search", root, "archipelago cloves", "-k", 1, "--json")
    assert rc == 0 and json.loads(out)[0]["id"] == "zanzibar:0", err
    rc, out, err = ralm("index", "check", root)
    assert rc == 0 and "predates record checksums" in out, err
    assert json.loads(ralm("index", "check", root, "--json")[1])["log_checksums"] is False


def test_every_logged_line_and_state_carries_its_checksum(indexes, tmp_path):
    """The log as written: a header saying so, each line ending in its CRC, each add's state's CRC."""
    import zlib

    from ralm.retrieval.search.update_log import UpdateLog

    root, _, _ = _copy(indexes, tmp_path, "dense")
    log, states = _logged(root)
    header, record = (json.loads(line) for line in log.read_text().splitlines())
    assert header["checksums"] == "crc32" and "crc" in header and "crc" in record
    where = record["state"]
    assert where["crc32"] == zlib.crc32(states.read_bytes()[where["offset"]:where["offset"] + sum(where["sizes"].values())])
    read = UpdateLog(root).check()
    assert read.checksums and [r["id"] for r in read.records] == ["zanzibar"] and "crc" not in read.records[0]


def test_damaged_live_state_is_named_not_searched(ralm, indexes, tmp_path):
    """The issue's case: one flipped byte in updates-<id>.bin once made dense queries find another
    block first while `check` said sound; now both name the file."""
    root, _, _ = _copy(indexes, tmp_path, "dense")
    _, states = _logged(root)
    assert ralm("search", root, "archipelago cloves", "--json")[0] == 0
    _flip_byte(states, 3, 0x01)  # the smallest change: one bit of one float
    for args in (("index", "check", root), ("search", root, "archipelago cloves", "--json")):
        _one_line_error(*ralm(*args)[::2], states.name)
    states.unlink()  # what the error advises: the states are computed anew, then folded
    rc, _, err = ralm("index", "compact", root)
    assert rc == 0, err
    rc, out, err = ralm("search", root, "archipelago cloves", "-k", 1, "--json")
    assert rc == 0 and json.loads(out)[0]["id"] == "zanzibar:0", err
    assert ralm("index", "check", root)[0] == 0
