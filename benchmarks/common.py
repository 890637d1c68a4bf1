"""What the benchmark scripts share: where the data and this checkout's code are, running the
product's own commands (`python -m ralm ...`) and servers, and reading and writing the JSONL
files they take. Benchmarks are users of the product: they make data and call commands, never a
second training or calibration loop.

A script in a sub-folder imports it after putting this folder on its path, once:

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
    from common import DATA, ralm  # noqa: E402
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository
SRC = ROOT / "src"
DATA = ROOT.parent / "shared" / "data"
FIGURES = ROOT / "benchmarks" / "figures"


def ralm_env(src: Path | None = None, **extra: str) -> dict:
    """The environment of a child `ralm`: no progress bars, no Hub downloads; with `src`, the
    code of that src/ directory (another checkout's, for a before/after figure)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RALM_NO_PROGRESS": "1", **extra}
    if src is not None:
        env["PYTHONPATH"] = str(src)
    return env


def run_ralm(*args, env: dict | None = None, cwd: Path | None = None, timeout: float | None = None,
             stdin: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m ralm ARGS` in a child process, whatever its exit code: returncode, stdout and
    stderr (decoded, undecodable bytes replaced). An argument may be bytes (one that is not
    UTF-8); stdin is the file `stdin` or empty; past `timeout` s, subprocess.TimeoutExpired."""
    argv = [a if isinstance(a, bytes) else str(a) for a in args]
    with open(stdin or os.devnull, "rb") as f:
        proc = subprocess.run([sys.executable, "-m", "ralm", *argv], capture_output=True, env=ralm_env() if env is None else env,
                              cwd=cwd, timeout=timeout, stdin=f, check=False)
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode("utf-8", "replace"),
                                       proc.stderr.decode("utf-8", "replace"))


def ralm(*args: str | os.PathLike, log: Path | None = None, env: dict | None = None) -> dict:
    """`ralm ARGS --json` in a child process: its JSON result (the last line of stdout). A
    failure stops the benchmark with the command's last words; `log` keeps its stderr."""
    out = run_ralm(*args, "--json", env=env)
    if log is not None:
        log.write_text(out.stderr)
    if out.returncode != 0:
        raise SystemExit(f"ralm {' '.join(map(str, args))} failed ({out.returncode}): {out.stderr.strip()[-800:]}")
    lines = out.stdout.strip().splitlines()
    if not lines:
        raise SystemExit(f"ralm {' '.join(map(str, args))} printed no JSON result")
    return json.loads(lines[-1])


def run(cmd: list[str], log: Path, *, append: bool = False) -> float:
    """Run `cmd` (any program), its stdout and stderr into `log` (appended after a `$ cmd` line
    with `append`); its wall time in seconds. A failure raises CalledProcessError."""
    start = time.perf_counter()
    with open(log, "a" if append else "w") as f:
        if append:
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT)
    return round(time.perf_counter() - start, 1)


# -- servers ------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int) -> bool:
    """Whether a server on 127.0.0.1:`port` answers GET /health with 200."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return r.status == 200
    except OSError:  # refused, reset, timed out, or an HTTP error status
        return False


def start_server(index: Path, port: int, *extra, env: dict | None = None, cwd: Path | None = None,
                 timeout: float = 120, poll: float = 0.2) -> subprocess.Popen:
    """`ralm serve --index INDEX --port PORT EXTRA...` in its own process group (to be killed
    whole), returned once /health answers. RuntimeError, with the server's last words, when it
    exits first or does not answer within `timeout` s (then it is killed)."""
    server = subprocess.Popen([sys.executable, "-m", "ralm", "serve", "--index", str(index), "--port", str(port), *map(str, extra)],
                              env=ralm_env() if env is None else env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              start_new_session=True)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if healthy(port):
            return server
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}: {server.stderr.read().decode()[-500:]}")
        time.sleep(poll)
    os.killpg(server.pid, signal.SIGKILL)  # the group this call started
    server.wait()
    raise RuntimeError("the server did not answer /health in time")


# -- files --------------------------------------------------------------------------------------

def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def calibrated_predictions(path: Path) -> list[dict]:
    """The rows of `ralm eval qa --predictions` by a calibrated reader (each with "confidence"
    and "em"); a file without confidences stops the script with what to do."""
    rows = read_jsonl(path)
    if not rows or "confidence" not in rows[0]:
        raise SystemExit(f"{path}: no 'confidence' in the predictions (evaluate a calibrated reader)")
    return rows


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


def article_interval(diff, units: list[str], *, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean of `diff` (one value per question),
    resampling whole units (articles, pages: one unit's questions are not independent)."""
    import numpy as np

    diff = np.asarray(diff, dtype=np.float64)
    names = sorted(set(units))
    index = {u: i for i, u in enumerate(names)}
    unit = np.array([index[u] for u in units])
    sums = np.bincount(unit, weights=diff, minlength=len(names))
    counts = np.bincount(unit, minlength=len(names))
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(names), size=(draws, len(names)))
    means = sums[picks].sum(1) / counts[picks].sum(1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))
