"""Same behaviour before and after a refactor: one ICT run, one fine-tuning run and one index
build, tiny and deterministic (CPU, fp32, fixed seed), whose loss curves, embeddings and exported
weights are compared with a recorded baseline.

    python benchmarks/refactor/same_behaviour.py --out runs/same-new --baseline runs/same-old

runs the three commands into --out (with the `python -m ralm` of this checkout's src/), then,
given --baseline (the same command's --out from the code before), prints one line per compared
file and exits 1 when any differs: metrics.jsonl (every logged metric but timings, to `--rtol`),
the index's embeddings.npy and the exported safetensors weights (bit for bit).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import DATA, SRC, ralm, ralm_env  # noqa: E402

TIMINGS = {"steps_per_s", "tokens_per_s", "refresh_s"}


def tiny_data(out: Path, data: Path, docs: int, questions: int) -> tuple[Path, Path]:
    """The first `docs` paragraphs of squad_corpus and the first `questions` training questions on them."""
    corpus, qfile = out / "corpus.jsonl", out / "questions.jsonl"
    lines = (data / "squad_corpus.jsonl").read_text().splitlines()[:docs]
    corpus.write_text("\n".join(lines) + "\n")
    ids = {json.loads(line)["id"] for line in lines}
    kept = []
    with open(data / "squad_train.jsonl") as f:
        for line in f:
            if json.loads(line)["doc_id"] in ids:
                kept.append(line.rstrip("\n"))
            if len(kept) == questions:
                break
    qfile.write_text("\n".join(kept) + "\n")
    return corpus, qfile


def commands(out: Path, corpus: Path, questions: Path) -> dict[str, list[str]]:
    cpu = ["--device", "cpu", "--dtype", "fp32"]
    loop = ["--seed", "0", "--log-every", "2", "--save-every", "10"]
    return {
        "index": ["index", "build", str(corpus), "--out", str(out / "index"), "--batch-size", "32", *cpu],
        "ict": ["ict", "--corpus", str(corpus), "--out", str(out / "ict"), "--steps", "20", "--batch-size", "8",
                "--warmup", "5", "--max-query-len", "32", "--block-len", "128", *loop, *cpu],
        "finetune": ["finetune", "--questions", str(questions), "--index", str(out / "index"), "--out", str(out / "finetune"),
                     "--steps", "20", "--batch-size", "2", "-k", "2", "--warmup", "5", "--max-len", "192",
                     "--trainable-layers", "1", *loop, *cpu],
    }


def run_all(out: Path, docs: int, questions: int) -> dict[str, float]:
    out.mkdir(parents=True, exist_ok=True)
    corpus, qfile = tiny_data(out, DATA, docs, questions)
    env = ralm_env(SRC)
    seconds = {}
    for name, args in commands(out, corpus, qfile).items():
        start = time.perf_counter()
        print("python -m ralm " + " ".join(args), flush=True)
        (out / f"{name}.json").write_text(json.dumps(ralm(*args, env=env)) + "\n")
        seconds[name] = round(time.perf_counter() - start, 1)
        print(f"  {seconds[name]} s", flush=True)
    return seconds


def curves(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS}
            for line in path.read_text().splitlines() if line.strip()]


def same_curves(a: list[dict], b: list[dict], rtol: float) -> tuple[bool, float]:
    """(equal to rtol, the largest relative difference)."""
    if len(a) != len(b) or any(set(x) != set(y) for x, y in zip(a, b)):
        return False, float("inf")
    worst = 0.0
    for x, y in zip(a, b):
        for k in x:
            if isinstance(x[k], (int, float)):
                diff = abs(x[k] - y[k]) / max(abs(x[k]), abs(y[k]), 1e-12)
                worst = max(worst, 0.0 if x[k] == y[k] else diff)
            elif x[k] != y[k]:
                return False, float("inf")
    return worst <= rtol, worst


def compared_files(root: Path) -> list[Path]:
    """metrics, embeddings and exported weights, relative to a --out folder."""
    found = [p.relative_to(root) for p in sorted(root.glob("*/metrics.jsonl"))]
    found += [p.relative_to(root) for p in sorted(root.glob("index/versions/*/embeddings.npy"))]
    found += [p.relative_to(root) for p in sorted(root.glob("*/final/*/*.safetensors"))]
    found += [p.relative_to(root) for p in sorted(root.glob("*/model/*.safetensors"))]
    return found


def compare(base: Path, new: Path, rtol: float) -> bool:
    ok = True
    wanted = compared_files(base)
    for rel in wanted:
        other = new / rel
        if not other.exists():
            # a run exported to RUN/model before and to RUN/final/model now compares with it
            other = new / rel.parent.parent / "final" / "model" / rel.name if rel.parent.name == "model" else other
        if not other.exists():
            print(f"MISSING  {rel}")
            ok = False
            continue
        if rel.suffix == ".jsonl":
            same, worst = same_curves(curves(base / rel), curves(other), rtol)
            print(f"{'same' if same else 'DIFFERS':8} {rel}: {len(curves(base / rel))} logged steps, "
                  f"largest relative difference {worst:.2e}")
        elif rel.suffix == ".npy":
            a, b = np.load(base / rel, allow_pickle=False), np.load(other, allow_pickle=False)
            same = a.shape == b.shape and np.array_equal(a, b)
            print(f"{'same' if same else 'DIFFERS':8} {rel}: {a.shape} {a.dtype}, identical: {same}")
        else:
            a, b = load_file(str(base / rel)), load_file(str(other))
            same = a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
            print(f"{'same' if same else 'DIFFERS':8} {rel}: {len(a)} tensors, identical: {same}")
        ok &= same
    if not wanted:
        print(f"nothing to compare in {base}")
        ok = False
    return ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for this code's runs (must not hold old runs)")
    p.add_argument("--baseline", type=Path, help="a previous --out to compare with")
    p.add_argument("--docs", type=int, default=300, help="paragraphs of squad_corpus")
    p.add_argument("--questions", type=int, default=200, help="training questions on them")
    p.add_argument("--rtol", type=float, default=1e-6, help="relative tolerance of the loss curves")
    p.add_argument("--compare-only", action="store_true", help="compare --out with --baseline without running")
    args = p.parse_args()
    if not args.compare_only:
        start = time.perf_counter()
        seconds = run_all(args.out, args.docs, args.questions)
        print(f"wall time {time.perf_counter() - start:.1f} s {seconds}")
    if args.baseline is not None:
        sys.exit(0 if compare(args.baseline, args.out, args.rtol) else 1)


if __name__ == "__main__":
    main()
