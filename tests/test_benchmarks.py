"""benchmarks/: the map from documents to scripts holds (every benchmark path a document names
exists, every script is in benchmarks/README.md's table), the shared runner (benchmarks/common.py)
reports a command's exit code, output and failure, and every script starts (`--help`)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))
import common  # noqa: E402

SCRIPTS = sorted(p for p in BENCH.glob("*/*") if p.suffix in (".py", ".sh"))
PATH = re.compile(r"benchmarks/[\w./-]+?\.(?:py|sh)\b")
HEAVY = {"torch", "ralm", "transformers", "matplotlib", "faiss"}  # imports that take seconds


def documents() -> list[Path]:
    return [ROOT / "README.md", BENCH / "RESULTS.md", BENCH / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "recipes").iterdir())]


def test_every_benchmark_script_a_document_names_exists():
    missing = [f"{doc.relative_to(ROOT)}: {path}" for doc in documents() for path in PATH.findall(doc.read_text(encoding="utf-8"))
               if not (ROOT / path).is_file()]
    assert not missing


def test_the_readme_maps_every_script_and_links_only_files_that_exist():
    readme = (BENCH / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#]+)\)", readme)
    assert [link for link in links if not (BENCH / link).exists()] == []
    assert [str(p.relative_to(BENCH)) for p in SCRIPTS if f"({p.relative_to(BENCH)})" not in readme] == []


def test_run_ralm_returns_the_exit_code_and_output_and_ralm_stops_on_a_failure(tmp_path):
    done = common.run_ralm("--help")
    assert done.returncode == 0 and "index" in done.stdout
    missing = tmp_path / "no-index"
    failed = common.run_ralm("index", "check", missing)
    assert failed.returncode == 2 and str(missing) in failed.stderr and "Traceback" not in failed.stderr
    with pytest.raises(SystemExit, match=r"ralm index check .*no-index failed \(2\): .*no-index"):
        common.ralm("index", "check", missing)


def test_start_server_names_why_a_server_did_not_start(tmp_path):
    with pytest.raises(RuntimeError, match=r"the server exited with 2: .*no-index"):
        common.start_server(tmp_path / "no-index", common.free_port(), timeout=60)


def test_jsonl_round_trips(tmp_path):
    rows = [{"id": "a", "text": "é"}, {"id": "b", "n": 2}]
    assert common.read_jsonl(common.write_jsonl(tmp_path / "x.jsonl", rows)) == rows


def _heavy(script: Path) -> bool:
    tree = ast.parse(script.read_text(encoding="utf-8"))
    names = {a.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for a in node.names}
    names |= {node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}
    return bool(names & HEAVY)


PY = [p for p in SCRIPTS if p.suffix == ".py"]


@pytest.mark.parametrize("script", [pytest.param(p, id=str(p.relative_to(BENCH)),
                                                 marks=[pytest.mark.slow] if _heavy(p) else []) for p in PY])
def test_every_script_starts_from_the_repository_root(script):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, script.relative_to(ROOT), "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-1000:]
    assert "usage" in done.stdout
