"""Two processes on CPU with gloo, as `torchrun --nproc_per_node 2` would start them."""

import json
import os
import socket

import numpy as np
import pytest
import torch.multiprocessing as mp

from ralm.distributed import shard_range
from ralm.retrieval.index.dense_side import dense_of

from conftest import DOCS

MORE = DOCS + [{"id": f"extra{i}", "title": f"Extra {i}", "text": f"Extra document number {i} about topic {i % 3}."} for i in range(7)]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), RALM_NO_PROGRESS="1")
    import torch

    torch.set_num_threads(1)
    fn(rank, *args)
    import torch.distributed as dist

    dist.barrier()  # no rank tears the group down while another still has gloo work in flight
    dist.destroy_process_group()
    # Skip the interpreter's teardown: gloo's threads can abort it ("terminate called without an
    # active exception", SIGABRT) after the work is done and the results are written.
    os._exit(0)


def run_ranks(fn, *args, world=2):
    mp.start_processes(_worker, args=(world, _port(), fn, args), nprocs=world, start_method="spawn")


def test_shard_ranges_cover_every_row_once():
    for n in (0, 1, 5, 13, 100):
        for world in (1, 2, 3, 8):
            rows = [r for rank in range(world) for r in range(*shard_range(n, rank, world))]
            assert rows == list(range(n))


def _build_and_search(rank, corpus, index_dir, model, out_file):
    from ralm.retrieval.index.build import build_index
    from ralm.retrieval.search.searcher import Searcher

    build_index(corpus, index_dir, model=model, dim=16, show_progress=False, piece_rows=3, dtype="fp32")
    searcher = Searcher.open(index_dir, dtype="fp32")
    assert type(dense_of(searcher.current).index).__name__ == "ShardedExactIndex"
    scores, rows = searcher.search_rows(["capital city", "river in Africa", "Moon landing"], 5)
    if rank == 0:
        np.savez(out_file, scores=scores, rows=rows)


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in MORE))
    return path


def test_sharded_build_equals_one_process_and_sharded_search_equals_exact(tmp_path, corpus, tiny_bert):
    from ralm.retrieval.index.build import build_index
    from ralm.retrieval.search.searcher import Searcher
    from ralm.retrieval.index.store import IndexDir

    # one process first; its retriever (PCA projection) is then used by both builds
    # fp32: bf16 rounding depends on how rows are batched, which differs between the layouts
    single, _ = build_index(corpus, tmp_path / "one", model=str(tiny_bert), dim=16, show_progress=False, dtype="fp32")
    model = str(single.root / single.version_manifest("v000001")["sections"]["dense"]["retriever"])
    build_index(corpus, tmp_path / "one", model=model, show_progress=False, dtype="fp32")  # v000002 through the pieces path
    run_ranks(_build_and_search, corpus, tmp_path / "two", model, tmp_path / "sharded.npz")
    two = IndexDir(tmp_path / "two")
    a = np.load(single.version_path("v000002") / "embeddings.npy")
    b = np.load(two.version_path(two.latest()) / "embeddings.npy")
    np.testing.assert_allclose(a, b, atol=1e-5)
    assert not [p for p in (tmp_path / "two" / "versions").iterdir() if p.name.startswith(".pieces")]

    sharded = np.load(tmp_path / "sharded.npz")
    scores, rows = Searcher.open(tmp_path / "two", dtype="fp32").search_rows(["capital city", "river in Africa", "Moon landing"], 5)
    np.testing.assert_array_equal(sharded["rows"], rows)
    np.testing.assert_allclose(sharded["scores"], scores, rtol=1e-5)


def test_a_restarted_build_encodes_only_missing_pieces(tmp_path, corpus, tiny_bert, monkeypatch):
    from ralm.retrieval.backends import sharded
    from ralm.retrieval.index.build import build_index
    from ralm.retrieval.towers.encoders import Retriever

    r = Retriever.from_pretrained(tiny_bert, dim=16)
    r.cfg.projection_ready = True
    r.save_pretrained(tmp_path / "model")
    calls = []
    real = sharded.encode_rows

    def counting(*args, **kwargs):
        calls.append(kwargs["out"].shape[0])
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed while encoding the second piece
        return real(*args, **kwargs)

    monkeypatch.setattr(sharded, "encode_rows", counting)
    with pytest.raises(KeyboardInterrupt):
        build_index(corpus, tmp_path / "idx", model=str(tmp_path / "model"), show_progress=False, piece_rows=5)
    staging = [p for p in (tmp_path / "idx" / "versions").iterdir() if p.name.startswith(".pieces")]
    assert len(staging) == 1 and len(list(staging[0].glob("rows-*.npy"))) == 1  # the finished piece only
    calls.clear()
    monkeypatch.setattr(sharded, "encode_rows", lambda *a, **k: (calls.append(k["out"].shape[0]), real(*a, **k))[1])
    _, name = build_index(corpus, tmp_path / "idx", model=str(tmp_path / "model"), show_progress=False, piece_rows=5)
    assert name == "v000001" and calls == [5, 3]  # 13 rows: pieces 0-5 kept; 5-10 and 10-13 encoded
