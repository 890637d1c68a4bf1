"""benchmarks/scale/scale.py at its smallest size (10,000 documents) with the tiny BERT: every stage runs
on the real SQuAD sentences and reports what its figures must satisfy. The benchmark's figures
themselves (1M blocks, the bundled MiniLM) are in benchmarks/RESULTS.md."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"


@pytest.mark.slow
def test_scale_benchmark_runs_its_smallest_size(tiny_bert, tmp_path):
    if not (DATA / "squad_corpus.jsonl").is_file():
        pytest.skip(f"needs the SQuAD data in {DATA}")
    stages = "data,build,open,search,serve,check,add,replay,dense,bm25"
    subprocess.run([sys.executable, ROOT / "benchmarks" / "scale" / "scale.py", "--work", tmp_path, "--model", tiny_bert, "--stride", "20",
                    "--sizes", "10000", "--dense-sizes", "20000", "--bm25-sizes", "20000,40000", "--bm25-whole", "20000",
                    "--bm25-tile-base", "20000", "--only", stages, "--queries", "20", "--add-docs", "100",
                    "--updates", "300", "--restarts", "2", "--threads", "1"], check=True, timeout=1200)
    r = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "results").glob("*.json")}
    build = r["build-10000"]
    assert build["blocks"] == 10_000 and build["faiss"] is None  # one block per document; exact search at this size
    assert set(build["build_seconds"]) == {"blocks", "dense", "bm25"} and build["disk_mb"]["embeddings"] > 0
    search = r["search-10000"]
    assert search["dense_recall@10"] == search["hybrid_recall@10"] == 1.0
    assert 0 < search["hybrid"]["p50_ms"] <= search["hybrid"]["p99_ms"]
    assert r["open-10000"]["open_seconds"] > 0 and r["check-10000"]["sound"]
    assert r["serve-10000"]["c1"]["errors"] == r["serve-10000"]["c8"]["errors"] == 0 and r["serve-10000"]["peak_rss_mb"] > 0
    add, replay = r["add-100-docs-10000"], r["replay-300-updates-10000"]
    assert add["rc"] == 0 and replay["rc"] == 0 and replay["updates"] == 300 and replay["live_documents"] > 0
    assert len(replay["runs"]) == 2 and replay["restart_seconds_range"][0] <= replay["restart_seconds"] <= replay["restart_seconds_range"][1]
    for one in replay["runs"]:  # launch to first answer: the imports, the open and the first search, within the process's whole life
        assert one["import_seconds"] + one["open_seconds"] + one["first_search_seconds"] <= one["restart_seconds"] <= one["seconds"]
    dense = r["dense-20000"]
    # a byte a dimension (+ an 8-byte id) instead of four; the tiny BERT's near-random vectors make IVF's recall low here
    assert dense["spec"].endswith(",SQ8") and dense["bytes_per_block"] < 2 * 32 and 0 < dense["recall@10"] <= 1
    # searched in a second process, which opened what the first wrote; the stage leaves no files behind
    assert dense["rss_after_open_mb"] > 0 and 0 < dense["nprobe_sweep"][str(dense["nprobe"])]["recall@10_shortlist_100"] <= 1
    assert not list(tmp_path.glob("dense-20000.*"))
    bm25 = r["bm25-20000"]  # built, then searched memory-mapped in a fresh process; nothing left behind
    assert bm25["n"] == 20_000 and bm25["disk_mb"] > 0 and 0 < bm25["p50_ms"] <= bm25["p99_ms"] and bm25["build_peak_rss_mb"] > 0
    tiled = r["bm25-40000"]  # above --bm25-whole: the 20,000-block build tiled twice, most queries' best a copy of its best
    assert tiled["repeats"] == 2 and tiled["tiled_from"]["n"] == 20_000 and tiled["disk_mb"] > bm25["disk_mb"]
    assert tiled["best_block_as_in_the_build"] >= 0.8  # the rest move with the idf of the repeated counts
    assert not list(tmp_path.glob("bm25-*/"))
    report = subprocess.run([sys.executable, ROOT / "benchmarks" / "scale" / "scale.py", "--work", tmp_path, "--report", "--figure",
                             tmp_path / "scale.png"], check=True, capture_output=True, text=True).stdout
    assert (tmp_path / "scale.png").is_file() and json.loads(report)["series"]["open (s)"]
