"""Exact MIPS throughput: ralm's ExactIndex (in fp32 and in bf16) vs faiss.IndexFlatIP on the
same vectors, with a check that each returns the same ids as faiss.

  python benchmarks/speed/mips.py                          # CPU: 1M x 128, 1,024 queries, top-8
  python benchmarks/speed/mips.py --n 13000000 --device cuda   # GPU: 13M x 128 in bf16

Each engine runs in its own process on the same seeded vectors: numpy's OpenBLAS, faiss's and
torch's thread pools each keep their threads busy-waiting after a call, so on a small CPU the
engine timed after another one runs up to 1.5x slower (measured here, either order).

On CPU the bf16 index shortlists in bf16 and rescores in fp32 (ralm.retrieval.backends.exact), so its ids
should equal faiss's; on CUDA the matrix is bf16 and ids may differ only within bf16 ties.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def vectors(args) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((args.n, args.dim), dtype=np.float32), rng.standard_normal((args.queries, args.dim), dtype=np.float32)


def time_engine(args) -> None:
    """Child process: time one engine, save its scores/ids, print its figures as JSON."""
    import torch

    emb, q = vectors(args)
    if args.engine == "faiss":
        import faiss

        index = faiss.IndexFlatIP(args.dim)
        index.add(emb)
        search, sync = index.search, (lambda: None)
    else:
        from ralm.retrieval.backends.exact import ExactIndex
        from ralm.runtime import resolve_device

        device = resolve_device(args.device)
        search = ExactIndex(emb, device=device, dtype=args.engine).search
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def best(queries, repeat):
        search(queries, args.k)  # warm-up
        times = []
        for _ in range(repeat):
            sync()
            t = time.perf_counter()
            out = search(queries, args.k)
            sync()
            times.append(time.perf_counter() - t)
        return out, min(times)

    (scores, ids), t_batch = best(q, args.repeat)
    _, t_one = best(q[:1], max(args.repeat, 10))
    np.savez(args.save, scores=scores, ids=ids)
    print(json.dumps({"batch_s": t_batch, "single_s": t_one,
                      "threads": faiss.omp_get_max_threads() if args.engine == "faiss" else torch.get_num_threads()}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--queries", type=int, default=1024)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-faiss", action="store_true")
    ap.add_argument("--dtypes", default="fp32,bf16", help="ExactIndex compute dtypes to time (bf16 needs a bf16 CPU or CUDA)")
    ap.add_argument("--engine", help=argparse.SUPPRESS)  # internal: the child process's engine
    ap.add_argument("--save", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        return time_engine(args)

    import torch

    result = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu ({torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "n": args.n, "dim": args.dim, "queries": args.queries, "k": args.k,
    }
    engines = args.dtypes.split(",") + ([] if args.no_faiss else ["faiss"])
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for engine in engines:
            save = Path(tmp) / f"{engine}.npz"
            cmd = [sys.executable, __file__, "--engine", engine, "--save", str(save)] + [
                f"--{name}={getattr(args, name)}" for name in ("n", "dim", "queries", "k", "repeat", "device")]
            figures = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            with np.load(save) as found:
                out[engine] = (found["scores"], found["ids"], figures["batch_s"])
            name = "faiss" if engine == "faiss" else f"ours_{engine}"
            result.update({f"{name}_batch_ms": round(1000 * figures["batch_s"], 2), f"{name}_qps": round(args.queries / figures["batch_s"], 1),
                           f"{name}_single_query_ms": round(1000 * figures["single_s"], 3), f"{name}_threads": figures["threads"]})
    if "faiss" in out:
        s_f, i_f, t_f = out.pop("faiss")
        for dtype, (s_ours, i_ours, t_batch) in out.items():
            # Equal ids, except where two scores tie within the ours-vs-fp32 rounding.
            tol = 1e-2 if args.device.startswith("cuda") else 1e-4
            result.update({
                f"ratio_qps_ours_{dtype}_over_faiss": round(t_f / t_batch, 3),
                f"ids_equal_fraction_{dtype}": round(float((i_ours == i_f).mean()), 5),
                f"mismatches_beyond_ties_{dtype}": int(((i_ours != i_f) & (np.abs(s_ours - s_f) > tol * np.abs(s_f).max())).sum()),
            })
    elif "fp32" in out:  # no faiss (a GPU machine without it): check against ours in fp32
        s_r, i_r, _ = out["fp32"]
        for dtype, (s_ours, i_ours, _) in out.items():
            if dtype != "fp32":
                tol = 1e-2 if args.device.startswith("cuda") else 1e-4
                result.update({f"ids_equal_fp32_fraction_{dtype}": round(float((i_ours == i_r).mean()), 5),
                               f"mismatches_beyond_ties_vs_fp32_{dtype}": int(((i_ours != i_r) & (np.abs(s_ours - s_r) > tol * np.abs(s_r).max())).sum())})
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
