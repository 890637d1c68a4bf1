"""Recall@k of the default dense index (built in each --dtype) next to the same encoder used
as sentence-transformers users use it (mean pooling, L2-normalised, cosine, 256 wordpieces,
fp32), on the same blocks and questions, in one run, with a paired count at each k <= 20: the
questions only the default finds an answer for against those only plain does, and the two-sided
sign test of that split. --model swaps the encoder (default: the bundled MiniLM), e.g. for a local
all-mpnet-base-v2.

  python benchmarks/retrieval/squad_retrieval.py --work runs/sqret \\
      --corpus ../shared/data/squad_corpus.jsonl ../shared/data/squad_dev_official_corpus.jsonl \\
      --questions ../shared/data/squad_dev_official.jsonl ../shared/data/squad_dev.jsonl

Several --corpus files are concatenated (ids must stay unique). Indexes and the plain
embeddings are kept in --work, so a rerun (or a resume after a kill) only evaluates.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch


def combined_corpus(paths: list[str], work: Path) -> Path:
    if len(paths) == 1:
        return Path(paths[0])
    out = work / "corpus.jsonl"
    if not out.is_file():
        from ralm.atomic import atomic_path

        with atomic_path(out) as tmp:
            tmp.write_text("".join(Path(p).read_text(encoding="utf-8") for p in paths), encoding="utf-8")
    return out


def plain_encoder(path: str):
    """texts -> [N, H] unit vectors from the plain HF model: mean pooling, normalised, 256 wordpieces."""
    from transformers import AutoModel, AutoTokenizer

    from ralm.retrieval.towers.encoders import pool

    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()

    @torch.inference_mode()
    def encode(texts: list[str]) -> torch.Tensor:
        enc = tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        return torch.nn.functional.normalize(pool(model(**enc).last_hidden_state, enc["attention_mask"], "mean"), dim=-1)

    return encode


def plain_embeddings(searcher, work: Path, encode, batch_size: int = 64) -> np.ndarray:
    """Every block as "title text", encoded by the plain model (`plain_encoder`)."""
    from ralm.atomic import atomic_path
    from ralm.progress import track
    from ralm.retrieval.index.bm25_side import block_texts

    out = work / "plain.npy"
    if out.is_file():
        return np.load(out, allow_pickle=False)
    texts = block_texts(searcher.current.blocks, show_progress=False)
    vecs = [encode(texts[i : i + batch_size]).numpy()
            for i in track(range(0, len(texts), batch_size), -(-len(texts) // batch_size), "plain encoder (fp32)")]
    emb = np.concatenate(vecs).astype(np.float32)
    with atomic_path(out) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, emb)
    return emb


def plain_hits(emb: np.ndarray, searcher, questions, ks, encode) -> list[list[bool]]:
    """Per question: does each of the plain model's top max(ks) blocks hold an answer."""
    from ralm.data.qa import has_answer

    matrix = torch.from_numpy(emb)
    blocks = searcher.current.blocks
    hits = []
    for i in range(0, len(questions), 256):
        batch = questions[i : i + 256]
        top = torch.topk(encode([q.question for q in batch]) @ matrix.T, max(ks), dim=1).indices.numpy()
        hits.extend([has_answer(blocks.record(int(r))["text"], qq.answers) for r in row] for qq, row in zip(batch, top))
    return hits


def paired(default: list[list[bool]], plain: list[list[bool]], k: int) -> dict:
    """Questions answered within the top k by one system only, and the two-sided sign test."""
    a = sum(any(d[:k]) and not any(p[:k]) for d, p in zip(default, plain))
    b = sum(any(p[:k]) and not any(d[:k]) for d, p in zip(default, plain))
    n, tail = a + b, min(a, b)
    p_value = min(1.0, 2 * sum(math.comb(n, i) for i in range(tail + 1)) / 2**n) if n else 1.0
    return {"default_only": a, "plain_only": b, "sign_test_p": round(p_value, 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--corpus", nargs="+", required=True)
    ap.add_argument("--questions", nargs="+", required=True)
    ap.add_argument("--dtypes", default="fp32,bf16", help="one default index per compute dtype")
    ap.add_argument("--ks", default="1,5,20,100")
    ap.add_argument("--model", default=None, help="encoder: HF model directory (default: the bundled MiniLM)")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain sentence-transformers-style baseline")
    args = ap.parse_args()

    from ralm.data.qa import read_questions
    from ralm.encoders.loading import default_model_path
    from ralm.eval.metrics import recall_at_k
    from ralm.eval.retrieval import evaluate_retrieval
    from ralm.retrieval.index.build import build_index
    from ralm.retrieval.search.searcher import Searcher

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    corpus = combined_corpus(args.corpus, work)
    ks = [int(k) for k in args.ks.split(",")]
    question_sets = {Path(q).name: read_questions(q) for q in args.questions}
    model = args.model or default_model_path()
    result: dict = {"corpus": [str(c) for c in args.corpus], "model": model, "threads": torch.get_num_threads(), "torch": torch.__version__}
    searcher = None
    for dtype in args.dtypes.split(","):
        index = work / f"dense-{dtype}"
        if not (index / "LATEST").is_file():
            t = time.perf_counter()
            build_index(corpus, index, model=model, dtype=dtype)
            result[f"build_seconds_{dtype}"] = round(time.perf_counter() - t, 1)
        searcher = Searcher.open(index, dtype=dtype)
        result["blocks"] = len(searcher)
        for name, qs in question_sets.items():
            r = evaluate_retrieval(searcher, qs, ks=ks, show_progress=True, predictions=work / f"default_{dtype}-{name}")
            result[f"default_{dtype}/{name}"] = {k: v for k, v in r.items() if k.startswith("recall") or k in ("questions", "seconds")}
            print(json.dumps({f"default_{dtype}/{name}": result[f"default_{dtype}/{name}"]}), flush=True)
    if not args.no_plain and searcher is not None:
        t = time.perf_counter()
        encode = plain_encoder(model)  # loaded once, for the blocks and every question set
        emb = plain_embeddings(searcher, work, encode)
        result["plain_embed_seconds"] = round(time.perf_counter() - t, 1)
        for name, qs in question_sets.items():
            hits = plain_hits(emb, searcher, qs, ks, encode)
            result[f"plain/{name}"] = recall_at_k(hits, ks)
            for dtype in args.dtypes.split(","):  # the default's top 20 per question, from its predictions
                rows = [json.loads(line) for line in (work / f"default_{dtype}-{name}").read_text(encoding="utf-8").splitlines()]
                default = [[r["has_answer"] for r in row["retrieved"]] for row in rows]
                result[f"paired_{dtype}/{name}"] = {f"@{k}": paired(default, hits, k) for k in ks if k <= 20}
            print(json.dumps({key: v for key, v in result.items() if key.endswith(f"/{name}") and not key.startswith("default")}), flush=True)
    (work / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
