"""Corpus encoding throughput: ralm's encode path with default settings vs plain Hugging Face
AutoModel, same inputs and batch size, measured in one run, with an output check.

  python benchmarks/speed/encode.py                       # CPU: bundled MiniLM, 1,000 blocks
  python benchmarks/speed/encode.py --model bert-base --n 20000 --batch-size 256 --device cuda   # GPU

Printed ratios (time of the baseline / time of ours):
  ratio             vs HF in fp32, batches in corpus order: what a user gets without ralm
  ratio_vs_hf_bf16  vs the same HF loop under bf16 autocast (the fair mixed-precision baseline)
min_cosine_* compare each path's vectors with an fp32, one-block-at-a-time (unpadded) reference.

Blocks are random wordpieces with lengths uniform in [64, 288] (as in a real corpus) unless
--blocks points at a block store (e.g. INDEX/blocks/<key>).
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import numpy as np
import torch
import torch.nn.functional as F


def make_rows(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.concatenate([[101], rng.integers(1000, vocab, size=int(L) - 2), [102]]) for L in rng.integers(lo, hi + 1, size=n)]


def load_bert(name: str):
    from transformers import AutoModel, BertConfig, BertModel

    if name == "bert-base":  # BERT-base shape with random weights: speed does not depend on values
        torch.manual_seed(0)
        return BertModel(BertConfig(attn_implementation="sdpa"), add_pooling_layer=False), "cls"
    from ralm.encoders.loading import default_model_path
    from ralm.retrieval.towers.encoders import Retriever

    path = default_model_path() if name == "default" else name
    r = Retriever.from_pretrained(path, dim=None)
    return AutoModel.from_pretrained(path, attn_implementation="sdpa"), r.cfg.pooling


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default", help="'default' (bundled MiniLM), 'bert-base' (random BERT-base), or an HF dir")
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=288)
    ap.add_argument("--blocks", default=None, help="a block store folder to take real blocks from")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="ours: auto (default settings), fp32 or bf16")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args()

    from ralm.data.padding import pad_rows
    from ralm.retrieval.towers.encoders import RetrieverConfig, Tower, pool
    from ralm.retrieval.towers.encoding import encode_rows
    from ralm.runtime import autocast, dtype_name, resolve_device, resolve_dtype

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    half = torch.bfloat16 if device.type == "cuda" or dtype == torch.bfloat16 else None
    bert, pooling = load_bert(args.model)
    bert = bert.to(device).eval()
    if args.blocks:
        from ralm.data.blocks import BlockStore

        store = BlockStore(args.blocks)
        rows = [store.tokens[i] for i in range(min(args.n, len(store)))]
    else:
        rows = make_rows(args.n, args.min_len, args.max_len, bert.config.vocab_size)
    lengths = np.array([len(r) for r in rows])

    @torch.inference_mode()
    def baseline(mixed: torch.dtype | None) -> np.ndarray:
        """What users write: batches in corpus order, padded to the longest, optionally autocast."""
        out = []
        with autocast(device, mixed or torch.float32):
            for i in range(0, len(rows), args.batch_size):
                ids, mask = pad_rows(rows[i : i + args.batch_size])
                ids, mask = ids.to(device), mask.to(device)
                h = bert(input_ids=ids, attention_mask=mask).last_hidden_state
                out.append(pool(h, mask, pooling).float().cpu())
        return torch.cat(out).numpy()

    tower = Tower(bert, RetrieverConfig(dim=None, pooling=pooling)).eval()

    def ours() -> np.ndarray:
        out = np.zeros((len(rows), bert.config.hidden_size), np.float32)
        return encode_rows(tower, rows, lengths, out=out, batch_size=args.batch_size, device=device, show_progress=False,
                           dtype=dtype)

    def timed(fn):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return result, time.perf_counter() - t

    # Warm up every path on a slice (kernel selection, allocator), then time them one after another.
    head = rows
    rows = head[: min(len(head), 4 * args.batch_size)]
    lengths_full, lengths = lengths, lengths[: len(rows)]
    baseline(None), ours()
    if half is not None:
        baseline(half)
    rows, lengths = head, lengths_full
    (our_out, t_ours) = timed(ours)
    (base_out, t_base) = timed(lambda: baseline(None)) if device.type == "cpu" else (None, None)
    (half_out, t_half) = timed(lambda: baseline(half)) if half is not None else (None, None)

    # Reference: fp32, one block at a time, no padding at all.
    check = list(range(0, len(rows), max(1, len(rows) // 64)))
    with torch.inference_mode():
        ref = []
        for i in check:
            ids = torch.from_numpy(rows[i][None].astype(np.int64)).to(device)
            h = bert.float()(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
            ref.append(pool(h, torch.ones_like(ids), pooling).float().cpu())
        ref = torch.cat(ref)
    def min_cos(out: np.ndarray) -> float:
        return round(F.cosine_similarity(torch.from_numpy(out[check]), ref).min().item(), 5)

    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "model": args.model,
        "blocks": len(rows),
        "mean_len": float(lengths.mean()),
        "batch_size": args.batch_size,
        "dtype": dtype_name(dtype),
        "ours_blocks_per_s": round(len(rows) / t_ours, 1),
        "min_cosine_ours": min_cos(our_out),
    }
    if base_out is not None:  # on CUDA an fp32 baseline is no one's choice; bf16 is the baseline there
        result.update({"hf_fp32_blocks_per_s": round(len(rows) / t_base, 1), "ratio": round(t_base / t_ours, 3),
                       "min_cosine_hf_fp32": min_cos(base_out)})
    if half_out is not None:
        result.update({"hf_bf16_blocks_per_s": round(len(rows) / t_half, 1), "ratio_vs_hf_bf16": round(t_half / t_ours, 3),
                       "min_cosine_hf_bf16": min_cos(half_out)})
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
