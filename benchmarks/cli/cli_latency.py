"""One-shot latency of `ralm search` and `ralm ask` over the demo index, as ratios to the wall
time of `python -c "import torch"` measured in the same rounds (so a loaded machine scales both).

Each round runs, in fresh processes: `import torch`, `ralm search`, `ralm ask` (and the same two
with `--baseline-src`'s code, interleaved, when given), then one process that times the phases
of a one-shot answer through the library (start + import torch, ralm's imports, opening the
index with its retriever, encoding + search, reading the hits, loading the reader, reading the
blocks). Medians over the rounds; the last line is JSON {"search_ratio", "ask_ratio", ...}.

`--errors` times mistakes instead: the seconds from start to the one-line error (exit code 2) of
a missing index, `-k 0`, a missing corpus, a folder of no readable file, and `eval qa
--calibrate` on 20 questions (it needs 50), in this checkout and `--baseline-src`'s.

  python benchmarks/cli/cli_latency.py --rounds 7
  python benchmarks/cli/cli_latency.py --rounds 7 --baseline-src /path/to/old/checkout/src
  python benchmarks/cli/cli_latency.py --errors --rounds 3 --baseline-src /path/to/old/checkout/src
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import SRC  # noqa: E402

QUESTION = "who invented the telephone"

PHASES = r'''
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from ralm.models.reader import Reader
from ralm.pipeline import OpenQA, open_searcher
t2 = time.perf_counter()
searcher = open_searcher(sys.argv[1])
t3 = time.perf_counter()
scores, rows = searcher.search_rows([sys.argv[2]], 5)
t4 = time.perf_counter()
records = [searcher.current.blocks.record(int(r)) for r in rows[0]]
t5 = time.perf_counter()
reader = Reader.from_pretrained(None)
t6 = time.perf_counter()
OpenQA(reader, searcher).answer([sys.argv[2]])
t7 = time.perf_counter()
print(json.dumps({"import torch": t1 - t0, "import ralm": t2 - t1, "open index + retriever": t3 - t2,
                  "encode + search": t4 - t3, "read hits": t5 - t4, "load reader": t6 - t5, "answer (search + read)": t7 - t6}))
'''


def timed(cmd: list[str], env: dict, expect: int = 0) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    took = time.perf_counter() - start
    if proc.returncode != expect:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}, not {expect}:\n{proc.stderr[-2000:]}")
    return took


def mistakes(index: str, tmp: Path) -> dict[str, list[str]]:
    """Commands that are each one mistake away from working (all exit with code 2)."""
    (tmp / "office").mkdir()
    (tmp / "office" / "report.docx").write_bytes(b"PK")
    questions = tmp / "twenty.jsonl"
    questions.write_text("".join(json.dumps({"id": str(i), "question": f"who invented thing {i}", "answers": ["Bell"]}) + "\n"
                                 for i in range(20)))
    return {"ask: missing index": ["ask", QUESTION, "--index", str(tmp / "no-index")],
            "search: -k 0": ["search", index, QUESTION, "-k", "0"],
            "index build: missing corpus": ["index", "build", str(tmp / "missing.jsonl"), "--out", str(tmp / "a")],
            "index build: no readable file": ["index", "build", str(tmp / "office"), "--out", str(tmp / "b")],
            "eval qa --calibrate: 20 questions": ["eval", "qa", "--index", index, "--questions", str(questions), "--calibrate",
                                                  "--out", str(tmp / "c")]}


def error_latency(args, codes: dict[str, dict], index: str) -> None:
    times: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cases = mistakes(index, Path(tmp))
        for _ in range(args.rounds):
            for case, argv in cases.items():
                for name, code_env in codes.items():
                    times.setdefault((case, name), []).append(timed([sys.executable, "-m", "ralm", *argv], code_env, expect=2))
    median = {key: statistics.median(v) for key, v in times.items()}
    print(f"{args.rounds} rounds, medians: seconds to the error")
    for case in cases:
        print(f"  {case:<36}" + "".join(f"  {name} {median[case, name]:6.2f} s" for name in codes))
    print(json.dumps({f"{case} ({name})": round(median[case, name], 2) for case in cases for name in codes}))


def environment(src: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1", "RALM_NO_PROGRESS": "1"}


def demo_index(env: dict) -> str:
    code = ("from ralm.demo import demo_index; from ralm.runtime import Runtime; "
            "print(demo_index(Runtime.resolve('cpu', show_progress=False))[0])")
    return subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--index", help="index directory (default: the demo index, built once in the cache)")
    ap.add_argument("--question", default=QUESTION)
    ap.add_argument("--baseline-src", type=Path, help="another checkout's src/ to time in the same rounds")
    ap.add_argument("--errors", action="store_true", help="time mistakes (bad options and paths) instead of answers")
    args = ap.parse_args()
    env = environment(SRC)
    index = args.index or demo_index(env)
    codes = {"new": env}
    if args.baseline_src:
        codes["baseline"] = environment(args.baseline_src.resolve())
    if args.errors:
        error_latency(args, codes, index)
        return
    times: dict[str, list[float]] = {"torch": []}
    phases: list[dict] = []
    for _ in range(args.rounds):
        times["torch"].append(timed([sys.executable, "-c", "import torch"], env))
        for name, code_env in codes.items():
            cli = [sys.executable, "-m", "ralm"]
            times.setdefault(f"{name} search", []).append(timed(cli + ["search", index, args.question, "--json"], code_env))
            times.setdefault(f"{name} ask", []).append(timed(cli + ["ask", args.question, "--index", index, "--json"], code_env))
        out = subprocess.run([sys.executable, "-c", PHASES, index, args.question], env=env, check=True, capture_output=True, text=True)
        phases.append(json.loads(out.stdout.strip().splitlines()[-1]))
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.rounds} rounds, medians; index {index}")
    for key, value in median.items():
        print(f"  {key:<16} {value:6.2f} s  {value / median['torch']:5.2f}x import torch")
    print("phases of a one-shot answer (library calls, this checkout):")
    for key in phases[0]:
        print(f"  {key:<24} {statistics.median(p[key] for p in phases):6.3f} s")
    result = {"search_ratio": round(median["new search"] / median["torch"], 2),
              "ask_ratio": round(median["new ask"] / median["torch"], 2), "torch_s": round(median["torch"], 3)}
    if args.baseline_src:
        result.update(baseline_search_ratio=round(median["baseline search"] / median["torch"], 2),
                      baseline_ask_ratio=round(median["baseline ask"] / median["torch"], 2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
