"""What a retriever returns for REALM's masked sentences: how long the top non-trivial block is
and how often it (or one of the top k) holds the masked salient span. Detects the collapse onto
near-empty blocks described in docs/pretraining.md.

    python benchmarks/realm_top_blocks.py --run RUN --corpus squad300.jsonl --retriever RUN/final/retriever
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from ralm.data.masking import MaskingConfig, corpus_sentences, masked_batch
from ralm.data.padding import pad_rows
from ralm.models.realm import RealmConfig, block_holds_span, select_candidates, trivial_margin
from ralm.retrieval.towers.encoders import Retriever
from ralm.retrieval.towers.encoding import encode_rows
from ralm.retrieval.index.store import IndexDir


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run", required=True, help="an ict/pretrain run directory (its blocks and spaCy sentences)")
    p.add_argument("--corpus", required=True)
    p.add_argument("--retriever", required=True)
    p.add_argument("--block-len", type=int, default=96)
    p.add_argument("--sentences", type=int, default=200)
    p.add_argument("-k", type=int, default=3)
    args = p.parse_args()

    retriever = Retriever.from_pretrained(args.retriever).eval()
    tok = retriever.tokenizer
    index = IndexDir(Path(args.run) / "index")
    _, blocks, table = corpus_sentences(index.blocks_dir, index.sentences_dir, args.corpus, hf_tokenizer=tok, block_len=args.block_len,
                                        show_progress=False)
    docs = np.zeros((len(blocks), retriever.dim), dtype=np.float32)
    encode_rows(retriever.doc, blocks.tokens, blocks.tokens.lengths(), out=docs, pad_id=tok.pad_token_id, show_progress=False)
    x_len = RealmConfig().max_query_len - 2  # as `ralm pretrain` masks and embeds x
    chosen = np.random.default_rng(1).choice(table.with_spans(x_len), args.sentences, replace=False)
    batch = masked_batch(table, blocks, chosen, cfg=MaskingConfig("salient", max_len=x_len), mask_id=tok.mask_token_id, seed=7,
                         step=0)
    with torch.inference_mode():
        queries = retriever.query(*pad_rows([[tok.cls_token_id, *e.ids, tok.sep_token_id] for e in batch], tok.pad_token_id))
        ranked = (queries @ torch.from_numpy(docs).T).topk(args.k + trivial_margin(blocks.doc_index)).indices.numpy()
    rows = select_candidates(ranked, blocks.doc_index, [e.doc for e in batch], args.k)  # [S, k]
    holds = np.array([[block_holds_span(e, blocks, int(r)) for r in rs] for e, rs in zip(batch, rows)])
    top_len = np.array([len(blocks.body(int(rs[0]))) for rs in rows])
    print(json.dumps({"retriever": args.retriever, "sentences": len(batch), "top_body_len_mean": round(float(top_len.mean()), 2),
                      "top_body_under_20": round(float((top_len < 20).mean()), 3), "span_in_top": round(float(holds[:, 0].mean()), 3),
                      f"span_in_top_{args.k}": round(float(holds.any(1).mean()), 3)}))


if __name__ == "__main__":
    main()
