"""RETRO and kNN-LM on the generated knowledge task (data/knowledge.py): the perplexity of the
fact wordpieces in held-out sentences, retrieval on vs off.

The LMs train on the training entities' documents. The chunk database (RETRO) and the
datastore (kNN-LM) hold those documents plus the held-out entities' fact documents: the only
place a held-out fact is stated. Each held-out sentence (about a held-out entity, in no
corpus) is then scored; the fact is unpredictable without retrieval (one of 30 cities or 30
founders), so retrieval should cut its perplexity sharply. A causal LM can only use what comes
before the fact, so sentences where the entity comes first are also reported alone.

    python benchmarks/lm_knowledge.py            # a few minutes on 2 CPU cores

The last stdout line is JSON: {"lm": {...}, "knnlm": {...}, "retro": {...}, "retro_off": {...}}
with "fact_ppl" (all held-out facts) and "fact_ppl_entity_first".
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from ralm.data.blocks import wordpiece_tokenizer
from ralm.data.chunks import tokenize_text
from ralm.eval.perplexity import knnlm_log_probs, retro_nll
from ralm.models.knnlm import build_datastore, interpolate
from ralm.models.lm import LMConfig, load_lm
from ralm.models.retro import load_retro, training_config
from ralm.retrieval.lm.chunkdb import ChunkDB, build_chunk_db, text_neighbours
from ralm.retrieval.lm.datastore import Datastore
from ralm.train.lm import LMTrainConfig, RetroTrainConfig, train_lm, train_retro
from realm_knowledge import knowledge_setup  # this folder


def write_jsonl(path: Path, docs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def fact_positions(stream, sentences, hf_tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Indices into the stream's next-token NLL array [T - 1] of every fact wordpiece (the NLL
    at p scores token p + 1), and whether its sentence names the entity before the fact."""
    tok = wordpiece_tokenizer(hf_tokenizer)
    where, entity_first = [], []
    for i, (s, enc) in enumerate(zip(sentences, tok.encode_batch([s.text for s in sentences], add_special_tokens=False))):
        start = int(stream.doc_starts[i])
        assert list(stream.tokens[start:start + len(enc.ids)]) == enc.ids, "held-out stream out of step"
        for j, (a, b) in enumerate(enc.offsets):
            if a < s.span[1] and b > s.span[0]:
                where.append(start + j - 1)
                entity_first.append(s.text.index(s.entity) < s.span[0])
    return np.array(where), np.array(entity_first)


def fact_report(nll: np.ndarray, where: np.ndarray, entity_first: np.ndarray) -> dict:
    picked = nll[where]
    return {"fact_nll": round(float(picked.mean()), 4), "fact_ppl": round(math.exp(picked.mean()), 3),
            "fact_ppl_entity_first": round(math.exp(picked[entity_first].mean()), 3), "fact_tokens": int(len(picked))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/lm_knowledge", help="work directory (replaced)")
    ap.add_argument("--train-entities", type=int, default=160)
    ap.add_argument("--eval-entities", type=int, default=40)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--chunk-len", type=int, default=8)
    ap.add_argument("--k", type=int, default=32, help="kNN-LM neighbours")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    started = time.perf_counter()
    out, task = knowledge_setup(args)
    cpu = torch.device("cpu")
    train = task.write_corpus(out / "train.jsonl")
    stating = task.write_corpus(out / "stating.jsonl", with_eval=True)  # + the held-out fact documents
    held_out = write_jsonl(out / "held_out.jsonl", [{"id": f"s{i}", "title": f"s{i}", "text": s.text}
                                                    for i, s in enumerate(task.eval_sentences)])
    sizes = dict(dim=128, layers=2, heads=2, max_len=64)
    optim = dict(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=30, save_every=args.steps,
                 log_every=50, seed=args.seed, dtype="fp32")
    results = {}

    lm_run = train_lm(LMTrainConfig(text=str(train), model=LMConfig(**sizes), **optim), out / "lm", cpu, show_progress=False)
    lm, tokenizer = load_lm(out / "lm" / "model")
    stream = tokenize_text(held_out, tokenizer, show_progress=False)
    where, entity_first = fact_positions(stream, task.eval_sentences, tokenizer)
    store = build_datastore(lm, out / "lm" / "model", tokenize_text(stating, tokenizer, show_progress=False),
                            out / "datastore", device=cpu, show_progress=False)
    temperatures, lambdas = (1.0, 3.0, 10.0), (0.25, 0.5, 0.75)
    p_lm, p_knn = knnlm_log_probs(lm, Datastore(store), stream, args.k, temperatures, device=cpu, show_progress=False)
    results["lm"] = {**fact_report(-p_lm, where, entity_first), "train_loss": lm_run.loss, "train_s": lm_run.seconds}
    grid = []
    for i, t in enumerate(temperatures):
        for lmbda in lambdas:
            logp = interpolate(torch.from_numpy(p_lm), torch.from_numpy(p_knn[i]), lmbda).double().numpy()
            grid.append({"lmbda": lmbda, "temperature": t, **fact_report(-logp, where, entity_first)})
    results["knnlm"] = {**min(grid, key=lambda g: g["fact_nll"]), "k": args.k, "grid": grid}
    print(f"LM: {json.dumps(results['lm'])}\nkNN-LM (best of the grid): {json.dumps(results['knnlm'])}", flush=True)

    db_path = build_chunk_db(stating, out / "chunkdb", chunk_len=args.chunk_len, device=cpu, show_progress=False)
    cfg = training_config(db_path, **sizes, neighbours=2, cca_start=0, cca_every=1, encoder_layers=1)
    retro_run = train_retro(RetroTrainConfig(text=str(train), db=str(db_path), model=cfg, **optim), out / "retro", cpu,
                            show_progress=False)
    retro, _ = load_retro(out / "retro" / "model")
    db = ChunkDB(db_path, cpu)
    neighbours = text_neighbours(db, stream, cfg.neighbours, exclude_same_doc=False, show_progress=False)
    stride = max(cfg.chunk_len, cfg.max_len // 2 // cfg.chunk_len * cfg.chunk_len)
    for name, nb in (("retro", neighbours), ("retro_off", None)):
        nll = retro_nll(retro, db, stream, nb, stride, cpu, show_progress=False)
        results[name] = {**fact_report(nll, where, entity_first), "train_loss": retro_run.loss, "train_s": retro_run.seconds}
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    print(f"task: {asdict(task.cfg)}; {len(task.eval_sentences)} held-out sentences; wall {time.perf_counter() - started:.0f} s",
          flush=True)
    print(json.dumps({k: {x: y for x, y in v.items() if x != "grid"} for k, v in results.items()}))


if __name__ == "__main__":
    main()
