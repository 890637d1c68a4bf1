"""What the benchmark scripts share: running the product's own commands (`ralm ... --json`) and
reading and writing the JSONL files they take. Benchmarks are users of the product: they make
data and call commands, never a second training or calibration loop."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def ralm(*args: str | os.PathLike, log: Path | None = None) -> dict:
    """`ralm ARGS --json` in a child process: its JSON result (the last line of stdout). A
    failure stops the benchmark with the command's last words; `log` keeps its stderr."""
    cmd = [sys.executable, "-m", "ralm", *map(str, args), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env={**os.environ, "RALM_NO_PROGRESS": "1"})
    if log is not None:
        log.write_text(out.stderr)
    if out.returncode != 0:
        raise SystemExit(f"ralm {' '.join(map(str, args))} failed ({out.returncode}): {out.stderr.strip()[-800:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def linked_copy(index: Path, out: Path) -> Path:
    """A copy of an index directory whose files are hard links (published files are never
    modified in place), without its update log: what live updates (`ralm index add/delete`) may
    then change without touching the original. Made once; an existing copy is reused."""
    if not out.exists():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(index, tmp, copy_function=os.link)
        for log in tmp.glob("updates*"):
            log.unlink()
        os.rename(tmp, out)
    return out
