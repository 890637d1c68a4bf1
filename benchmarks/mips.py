"""Exact MIPS throughput: ralm's ExactIndex (in fp32 and in bf16) vs faiss.IndexFlatIP on the
same vectors, in one run, with a check that each returns the same ids as faiss.

  python benchmarks/mips.py                          # CPU: 1M x 128, 1,024 queries, top-8
  python benchmarks/mips.py --n 13000000 --device cuda   # GPU: 13M x 128 in bf16

On CPU the bf16 index shortlists in bf16 and rescores in fp32 (ralm.retrieval.exact), so its ids
should equal faiss's; on CUDA the matrix is bf16 and ids may differ only within bf16 ties.
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
    ap.add_argument("--dtypes", default="fp32,bf16", help="ExactIndex compute dtypes to time (bf16 needs a bf16 CPU or CUDA)")
    args = ap.parse_args()

    from ralm.retrieval.exact import ExactIndex
    from ralm.runtime import resolve_device

    device = resolve_device(args.device)
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((args.n, args.dim), dtype=np.float32)
    q = rng.standard_normal((args.queries, args.dim), dtype=np.float32)

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

    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "n": args.n, "dim": args.dim, "queries": args.queries, "k": args.k,
    }
    ours = {}
    for dtype in args.dtypes.split(","):
        index = ExactIndex(emb, device, dtype=dtype)
        (s_ours, i_ours), t_batch = best(lambda: index.search(q, args.k), args.repeat)
        _, t_one = best(lambda: index.search(q[:1], args.k), max(args.repeat, 10))
        ours[dtype] = (s_ours, i_ours, t_batch)
        result.update({f"ours_{dtype}_batch_ms": round(1000 * t_batch, 2), f"ours_{dtype}_qps": round(args.queries / t_batch, 1),
                       f"ours_{dtype}_single_query_ms": round(1000 * t_one, 3)})
        del index
    if not args.no_faiss:
        import faiss

        flat = faiss.IndexFlatIP(args.dim)
        flat.add(emb)
        (s_f, i_f), t_f = best(lambda: flat.search(q, args.k), args.repeat)
        _, t_f1 = best(lambda: flat.search(q[:1], args.k), max(args.repeat, 10))
        result.update({
            "faiss_threads": faiss.omp_get_max_threads(),
            "faiss_batch_ms": round(1000 * t_f, 2),
            "faiss_qps": round(args.queries / t_f, 1),
            "faiss_single_query_ms": round(1000 * t_f1, 3),
        })
        for dtype, (s_ours, i_ours, t_batch) in ours.items():
            # Equal ids, except where two scores tie within the ours-vs-fp32 rounding.
            tol = 1e-2 if device.type == "cuda" else 1e-4
            result.update({
                f"ratio_qps_ours_{dtype}_over_faiss": round(t_f / t_batch, 3),
                f"ids_equal_fraction_{dtype}": round(float((i_ours == i_f).mean()), 5),
                f"mismatches_beyond_ties_{dtype}": int(((i_ours != i_f) & (np.abs(s_ours - s_f) > tol * np.abs(s_f).max())).sum()),
            })
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
