"""Bounded loopback load test of `ralm serve`: N requests at concurrency C, then stop.

  python benchmarks/serving/serve_load.py --index runs/dev --questions ../shared/data/squad_dev.jsonl \
      --requests 400 --concurrency 8 --endpoint search [--side dense]

Starts the server in this process on 127.0.0.1 (a free port), sends the questions of the file
in turn, and prints throughput, client-side p50/p99 latency and the error count as JSON.
Only loopback traffic; the run stops after --requests or --max-seconds, whichever comes first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--index", required=True)
    ap.add_argument("--model", default=None, help="a fine-tuning run or reader, for --endpoint ask (default: the package's reader)")
    ap.add_argument("--questions", required=True)
    ap.add_argument("--endpoint", choices=["search", "ask"], default="search")
    ap.add_argument("--side", "--retriever", default=None, help="the side searched (--retriever: its old name)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--max-seconds", type=float, default=600)
    args = ap.parse_args()

    import httpx

    from ralm.data.qa import read_questions
    from ralm.pipeline import resolve_reader
    from ralm.serve.app import serve_in_background
    from ralm.serve.service import ServeConfig, Service

    model = args.model or (str(resolve_reader(None)) if args.endpoint == "ask" else None)
    svc = Service(ServeConfig(index=args.index, model=model))
    questions = [q.question for q in read_questions(args.questions)]
    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + args.max_seconds

    async def run(url: str) -> float:
        counter = iter(range(args.requests))
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            async def worker():
                nonlocal errors
                for i in counter:
                    if time.perf_counter() > deadline:
                        return
                    q = questions[i % len(questions)]
                    body = {"k": args.k, "side": args.side}
                    body["query" if args.endpoint == "search" else "question"] = q
                    t = time.perf_counter()
                    try:
                        r = await client.post(f"/{args.endpoint}", json=body)
                        ok = r.status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    latencies.append(time.perf_counter() - t)
                    errors += not ok

            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            return time.perf_counter() - start

    with serve_in_background(svc) as url:
        wall = asyncio.run(run(url))
    lat = np.array(latencies) * 1000
    print(json.dumps({
        "endpoint": args.endpoint, "index": args.index, "side": args.side or svc.default_kind,
        "blocks": svc.stats()["corpus_blocks"],
        "requests": len(latencies), "concurrency": args.concurrency, "errors": errors,
        "seconds": round(wall, 2), "requests_per_s": round(len(latencies) / wall, 1),
        "client_p50_ms": round(float(np.percentile(lat, 50)), 1), "client_p99_ms": round(float(np.percentile(lat, 99)), 1),
        "server_stats_ms": svc.stats()["latency_ms"][args.endpoint],
    }, indent=2))


if __name__ == "__main__":
    main()
