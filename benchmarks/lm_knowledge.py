"""RETRO and kNN-LM on the generated knowledge task (data/knowledge.py): the perplexity of the
fact wordpieces in held-out sentences, retrieval on vs off.

The LMs train on the training entities' documents. The chunk database (RETRO) and the
datastore (kNN-LM) hold those documents plus the held-out entities' fact documents: the only
place a held-out fact is stated. Each held-out sentence (about a held-out entity, in no
corpus) is then scored; the fact is unpredictable without retrieval (one of 30 cities or 30
founders), so retrieval should cut its perplexity sharply. A causal LM can only use what comes
before the fact, so sentences where the entity comes first are also reported alone.

A control, "stated": the held-out fact documents themselves ("Hidden River was founded in
Milan by Grace."), which the database/datastore hold verbatim. Retrieval that works at all
finds them; a gain there and none on the held-out sentences means the retrieval matches
contexts, not entities.

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
from ralm.data.knowledge import FactSentence, KnowledgeTask
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


def stated_sentences(task: KnowledgeTask) -> list[FactSentence]:
    """The held-out fact documents as sentences, one per fact (the control)."""
    out = []
    for e, doc in zip([e for e in task.entities if e.held_out], task.eval_docs):
        for relation, value in (("city", e.city), ("founder", e.founder)):
            start = doc.text.index(f" {value}") + 1
            out.append(FactSentence(doc.text, (start, start + len(value)), relation, e.name, e.source))
    return out


def fact_report(nll: np.ndarray, where: np.ndarray, entity_first: np.ndarray) -> dict:
    picked = nll[where]
    return {"fact_nll": round(float(picked.mean()), 4), "fact_ppl": round(math.exp(picked.mean()), 3),
            "fact_ppl_entity_first": round(math.exp(picked[entity_first].mean()), 3), "fact_tokens": int(len(picked))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/lm_knowledge", help="work directory (replaced)")
    ap.add_argument("--train-entities", type=int, default=160)
    ap.add_argument("--eval-entities", type=int, default=40)
    ap.add_argument("--steps", type=int, default=300)
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
    sets = {"held_out": task.eval_sentences, "stated": stated_sentences(task)}
    texts = {name: write_jsonl(out / f"{name}.jsonl", [{"id": f"s{i}", "title": f"s{i}", "text": s.text}
                                                       for i, s in enumerate(sentences)])
             for name, sentences in sets.items()}
    sizes = dict(dim=128, layers=2, heads=2, max_len=32)
    optim = dict(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=30, save_every=args.steps,
                 log_every=50, seed=args.seed, dtype="fp32")
    results = {}

    lm_run = train_lm(LMTrainConfig(text=str(train), model=LMConfig(**sizes), **optim), out / "lm", cpu, show_progress=False)
    lm, tokenizer = load_lm(out / "lm")
    streams = {name: tokenize_text(path, tokenizer, show_progress=False) for name, path in texts.items()}
    positions = {name: fact_positions(streams[name], sets[name], tokenizer) for name in sets}
    store = Datastore(build_datastore(lm, out / "lm", tokenize_text(stating, tokenizer, show_progress=False),
                                      out / "datastore", device=cpu, show_progress=False))
    temperatures, lambdas = (1.0, 3.0, 10.0), (0.25, 0.5, 0.75)
    for name, stream in streams.items():
        suffix = "" if name == "held_out" else f"_{name}"
        p_lm, p_knn = knnlm_log_probs(lm, store, stream, k=args.k, temperatures=temperatures, device=cpu, show_progress=False)
        results["lm" + suffix] = {**fact_report(-p_lm, *positions[name]), "train_loss": lm_run.loss, "train_s": lm_run.seconds}
        grid = []
        for i, t in enumerate(temperatures):
            for lmbda in lambdas:
                logp = interpolate(torch.from_numpy(p_lm), torch.from_numpy(p_knn[i]), lmbda).double().numpy()
                grid.append({"lmbda": lmbda, "temperature": t, **fact_report(-logp, *positions[name])})
        results["knnlm" + suffix] = {**min(grid, key=lambda g: g["fact_nll"]), "k": args.k, "grid": grid}
        print(f"LM{suffix}: {json.dumps(results['lm' + suffix])}\nkNN-LM{suffix} (best of the grid): "
              f"{json.dumps({k: v for k, v in results['knnlm' + suffix].items() if k != 'grid'})}", flush=True)

    db_path = build_chunk_db(stating, out / "chunkdb", chunk_len=args.chunk_len, device=cpu, show_progress=False)
    cfg = training_config(db_path, **sizes, neighbours=2, cca_start=0, cca_every=1, encoder_layers=1)
    retro_run = train_retro(RetroTrainConfig(text=str(train), db=str(db_path), model=cfg, **optim), out / "retro", cpu,
                            show_progress=False)
    retro, _ = load_retro(out / "retro")
    db = ChunkDB(db_path, cpu)
    stride = max(cfg.chunk_len, cfg.max_len // 2 // cfg.chunk_len * cfg.chunk_len)
    for name, stream in streams.items():
        suffix = "" if name == "held_out" else f"_{name}"
        neighbours = text_neighbours(db, stream, k=cfg.neighbours, exclude_same_doc=False, show_progress=False)
        for arm, nb in (("retro", neighbours), ("retro_off", None)):
            nll = retro_nll(retro, db, stream, neighbours=nb, stride=stride, device=cpu, show_progress=False)
            results[arm + suffix] = {**fact_report(nll, *positions[name]), "train_loss": retro_run.loss,
                                     "train_s": retro_run.seconds}
            print(f"{arm}{suffix}: {json.dumps(results[arm + suffix])}", flush=True)
    print(f"task: {asdict(task.cfg)}; {len(task.eval_sentences)} held-out sentences; wall {time.perf_counter() - started:.0f} s",
          flush=True)
    print(json.dumps({k: {x: y for x, y in v.items() if x != "grid"} for k, v in results.items()}))


if __name__ == "__main__":
    main()
