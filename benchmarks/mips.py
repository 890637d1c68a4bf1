"""Exact MIPS throughput: ralm's ExactIndex vs faiss.IndexFlatIP on the same vectors, in one
run, with a check that both return the same ids.

  python benchmarks/mips.py                          # CPU: 1M x 128, 1,024 queries, top-8
  python benchmarks/mips.py --n 13000000 --device cuda   # GPU: 13M x 128 in bf16
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--queries", type=int, default=1024)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-faiss", action="store_true")
    args = ap.parse_args()

    from ralm.retrieval.exact import ExactIndex
    from ralm.runtime import resolve_device

    device = resolve_device(args.device)
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((args.n, args.dim), dtype=np.float32)
    q = rng.standard_normal((args.queries, args.dim), dtype=np.float32)
    ours = ExactIndex(emb, device)

    def best(fn, repeat):
        fn()  # warm-up
        times = []
        for _ in range(repeat):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return out, min(times)

    (s_ours, i_ours), t_batch = best(lambda: ours.search(q, args.k), args.repeat)
    _, t_one = best(lambda: ours.search(q[:1], args.k), max(args.repeat, 10))
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "n": args.n, "dim": args.dim, "queries": args.queries, "k": args.k,
        "ours_batch_ms": round(1000 * t_batch, 2),
        "ours_qps": round(args.queries / t_batch, 1),
        "ours_single_query_ms": round(1000 * t_one, 3),
    }
    if not args.no_faiss:
        import faiss

        flat = faiss.IndexFlatIP(args.dim)
        flat.add(emb)
        (s_f, i_f), t_f = best(lambda: flat.search(q, args.k), args.repeat)
        _, t_f1 = best(lambda: flat.search(q[:1], args.k), max(args.repeat, 10))
        # Equal ids, except where two scores tie within the ours-vs-fp32 rounding.
        same = (i_ours == i_f).mean()
        tol = 1e-2 if device.type == "cuda" else 1e-4
        mismatched_not_tied = int(((i_ours != i_f) & (np.abs(s_ours - s_f) > tol * np.abs(s_f).max())).sum())
        result.update({
            "faiss_threads": faiss.omp_get_max_threads(),
            "faiss_batch_ms": round(1000 * t_f, 2),
            "faiss_qps": round(args.queries / t_f, 1),
            "faiss_single_query_ms": round(1000 * t_f1, 3),
            "ratio_qps_ours_over_faiss": round(t_f / t_batch, 3),
            "ids_equal_fraction": round(float(same), 5),
            "mismatches_beyond_ties": mismatched_not_tied,
        })
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
