"""RETRO and kNN-LM on the generated knowledge task (data/knowledge.py): the perplexity of the
fact wordpieces of held-out sentences, retrieval on vs off.

The LM and RETRO train on the pre-training corpus (the training entities' fact and notes
documents). Retrieval reads the *stating documents*, the entities' fact documents ("Hidden
River was founded in Milan by Grace."): RETRO trains with the training entities' ones in its
chunk DB and is evaluated with the held-out entities' added (as a user adds documents); the
kNN-LM datastore holds the LM's states over all of them. A held-out sentence ("Every summer
Hidden River holds a fair in honour of Milan.") is about a held-out entity and in no corpus: its
fact (one of 30 cities or 30 founders) is stated only in the entity's fact document.

Where retrieval can supply the fact at all. Each sentence is scored on its own from a chunk
boundary. RETRO retrieves with complete chunks, and a token reads the neighbours of earlier
chunks only, so the fact can come from retrieval when a chunk that ends before the fact holds
the entity's whole name ("reachable"); the chunk length 5 makes that so for every stated
sentence and for the held-out sentences that name the entity in their first words. The others
name the fact first ("A statue of Grace stands in ... Hidden River."), which no causal model
can get; both sets are reported. `retrieved` is the share of reachable facts for which a
neighbour of that chunk holds the entity's name and the fact.

There are more training entities (8,000) than the small models can memorise the facts of.
RETRO trains as `ralm retro train` does by default and as the paper does: a training chunk never
reads neighbours from its own document, so a training fact document cannot retrieve itself and
the facts reach the model only through the notes sentences that retrieve another document.
Two RETRO runs of the same steps are reported against the base LM: "retro" (the defaults) and
"retro_copy", whose first `--copy-warmup` steps are a copy warm-up (`ralm retro train
--copy-warmup`: windows of the chunk DB's own text, each chunk its own first neighbour; the
steps after it exclude same-document neighbours like the defaults).

A control, "stated": the held-out fact documents themselves, which the DB and datastore hold
verbatim, each scored on its own. The datastore's keys are the LM's states over its stream, so
they carry the previous documents as context and a document scored on its own matches none of
them; "stated_context" queries the kNN-LM with those very keys, the context the datastore holds.
The held-out entities are split in two halves: kNN-LM's lambda and temperature are chosen on the
first ("tune"), every figure is reported on the second.

    python benchmarks/lm/lm_knowledge.py            # about 60 minutes on 2 idle CPU cores

The last stdout line is JSON: {"lm": {...}, "knnlm": {...}, "retro": {...}, "retro_off": {...},
"retro_copy": {...}, "retro_copy_off": {...}, "lm_stated": {...}, "knnlm_stated_context": {...},
...}, each with "fact_ppl" (all facts) and "fact_ppl_reachable".
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ralm.atomic import write_text
from ralm.data.blocks import wordpiece_tokenizer
from ralm.data.chunks import TokenStream, tokenize_text
from ralm.data.corpus import Document, jsonl_lines
from ralm.data.knowledge import (
    FactSentence,
    KnowledgeConfig,
    KnowledgeTask,
    generate_task,
)
from ralm.models.knnlm import build_datastore, interpolate, knn_target_prob
from ralm.models.lm import LMConfig, load_lm
from ralm.models.retro import load_retro, neighbour_batch, training_config
from ralm.retrieval.lm.chunkdb import ChunkDB, build_chunk_db
from ralm.retrieval.lm.datastore import Datastore
from ralm.train.lm import LMTrainConfig, RetroTrainConfig, train_lm, train_retro


@dataclass
class Scored:
    """Sentences as one batch, each from position 0 of its row (right-padded), and its facts."""
    ids: torch.Tensor  # [S, L], L a multiple of the chunk length
    rows: np.ndarray  # [F] the sentence of each fact wordpiece
    positions: np.ndarray  # [F] its position (predicted from position - 1)
    reachable: np.ndarray  # [F] a chunk ending before it holds the entity's whole name
    split: np.ndarray  # [F] "tune" or "report"


def write_jsonl(path: Path, docs: list[Document]) -> Path:
    write_text(path, jsonl_lines(docs))
    return path


def stated_sentences(task: KnowledgeTask) -> list[FactSentence]:
    """The held-out fact documents as sentences, one per fact (the control)."""
    out = []
    for e, doc in zip([e for e in task.entities if e.held_out], task.eval_docs):
        for relation, value in (("city", e.city), ("founder", e.founder)):
            start = doc.text.index(f" {value}") + 1
            out.append(FactSentence(doc.text, (start, start + len(value)), relation, e.name, e.source))
    return out


def score_batch(sentences: list[FactSentence], tune: set[str], hf_tokenizer, chunk_len: int) -> Scored:
    tok = wordpiece_tokenizer(hf_tokenizer)
    encoded = tok.encode_batch([s.text for s in sentences], add_special_tokens=False)
    length = -(-max(len(e.ids) for e in encoded) // chunk_len) * chunk_len
    ids = torch.full((len(sentences), length), hf_tokenizer.pad_token_id or 0, dtype=torch.long)
    rows, positions, reachable, split = [], [], [], []
    for i, (s, enc) in enumerate(zip(sentences, encoded)):
        ids[i, : len(enc.ids)] = torch.tensor(enc.ids)
        name = tok.encode(s.entity, add_special_tokens=False).ids
        for p, (a, b) in enumerate(enc.offsets):
            if a < s.span[1] and b > s.span[0]:
                complete = range(p // chunk_len)  # chunks ending at or before position p - 1
                rows.append(i)
                positions.append(p)
                reachable.append(any(set(name) <= set(enc.ids[u * chunk_len : (u + 1) * chunk_len]) for u in complete))
                split.append("tune" if s.source in tune else "report")
    return Scored(ids, np.array(rows), np.array(positions), np.array(reachable), np.array(split))


def fact_report(nll: np.ndarray, s: Scored, split: str = "report") -> dict:
    """Fact-token perplexity of one split, all facts and reachable ones."""
    part = s.split == split
    picked, reach = nll[part], s.reachable[part]
    return {"fact_nll": round(float(picked.mean()), 4), "fact_ppl": round(math.exp(picked.mean()), 3),
            "fact_ppl_reachable": round(math.exp(picked[reach].mean()), 3), "fact_tokens": int(part.sum()),
            "reachable_tokens": int(reach.sum())}


def datastore_keys(s: Scored, sentences: list[FactSentence], hf_tokenizer, stream: TokenStream,
                   store: Datastore) -> torch.Tensor:
    """The datastore's own key for each fact wordpiece of documents it holds [F, D]: the LM state
    over the datastore's stream (the previous documents as context), where a sentence scored on
    its own starts from nothing."""
    starts = {tuple(stream.tokens[a : b - 1].tolist()): a  # a document's wordpieces, its [SEP] dropped
              for a, b in zip(stream.doc_starts[:-1], stream.doc_starts[1:])}
    tok = wordpiece_tokenizer(hf_tokenizer)
    first = [starts[tuple(e.ids)] for e in tok.encode_batch([x.text for x in sentences], add_special_tokens=False)]
    at = np.array([first[r] + p - 1 for r, p in zip(s.rows, s.positions)])  # the key at p - 1 predicts the token at p
    if not (store.values[at] == s.ids[torch.from_numpy(s.rows), torch.from_numpy(s.positions)].numpy()).all():
        raise SystemExit("datastore keys and fact wordpieces are misaligned")
    return torch.from_numpy(np.asarray(store.keys[at], dtype=np.float32))


@torch.inference_mode()
def own_key_distances(lm, s: Scored, own: torch.Tensor, store: Datastore) -> dict:
    """How far the states of documents scored on their own lie from their own datastore keys
    (`own` [F, D]), against the nearest key, in median squared L2; and how often the own key
    is the nearest."""
    alone = lm.features(s.ids)[torch.from_numpy(s.rows), torch.from_numpy(s.positions) - 1].float()  # [F, D]
    to_own = ((alone - own) ** 2).sum(-1).numpy()
    nearest, _ = store.search(alone.numpy(), 1)
    return {"own_key_sq_dist": round(float(np.median(to_own)), 4), "nearest_sq_dist": round(float(np.median(nearest[:, 0])), 4),
            "own_key_nearest": round(float((to_own <= nearest[:, 0] + 1e-4).mean()), 4)}


@torch.inference_mode()
def lm_scores(lm, s: Scored, store: Datastore, *, k: int, temperatures,
              hidden: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per fact wordpiece: log p_LM [F] and p_kNN [len(temperatures), F]; the LM states are the
    sentences' own unless `hidden` [F, D] gives others."""
    rows, positions = torch.from_numpy(s.rows), torch.from_numpy(s.positions)
    if hidden is None:
        hidden = lm.features(s.ids)[rows, positions - 1]  # [F, D]
    targets = s.ids[rows, positions]  # [F]
    logp = torch.log_softmax(lm.head(hidden), -1)[torch.arange(len(rows)), targets]
    dist, values = store.search(hidden.float().numpy(), k)
    p_knn = [knn_target_prob(torch.from_numpy(dist), torch.from_numpy(values), targets, t).double().numpy()
             for t in temperatures]
    return logp.double().numpy(), np.stack(p_knn)


def chunk_neighbours(db: ChunkDB, s: Scored, k: int) -> np.ndarray:
    """Neighbour chunk ids [S, n, k] of every chunk of every row (those holding padding read
    only positions past the sentence)."""
    m = db.chunk_len
    flat = s.ids.reshape(-1).numpy().astype(np.int32)
    return db.search(db.embed(flat, len(flat) // m), k).reshape(len(s.ids), -1, k)


def retrieved_share(db: ChunkDB, s: Scored, neighbours: np.ndarray, hf_tokenizer, sentences: list[FactSentence]) -> float:
    """Of the reachable report facts, the share whose last entity-naming chunk before the fact
    has a neighbour holding the entity's name and the fact."""
    tok, m, hits, total = wordpiece_tokenizer(hf_tokenizer), db.chunk_len, 0, 0
    for row, p, reach, split in zip(s.rows, s.positions, s.reachable, s.split):
        if not reach or split != "report":
            continue
        name = set(tok.encode(sentences[row].entity, add_special_tokens=False).ids)
        u = max(u for u in range(p // m) if name <= set(s.ids[row, u * m : (u + 1) * m].tolist()))
        values, mask = db.values(neighbours[row, u])
        hits += any(name | {int(s.ids[row, p])} <= set(v[mk].tolist()) for v, mk in zip(values, mask))
        total += 1
    return round(hits / max(total, 1), 3)


@torch.inference_mode()
def retro_fact_nll(model, db: ChunkDB, s: Scored, neighbours: np.ndarray | None, pad_id: int) -> np.ndarray:
    """NLL [F] of each fact wordpiece under RETRO, with `neighbours` [S, n, k] or retrieval off."""
    nb = mask = None
    if neighbours is not None:
        nb, mask = neighbour_batch(db, neighbours, torch.device("cpu"), pad_id)
    rows, positions = torch.from_numpy(s.rows), torch.from_numpy(s.positions)
    logp = torch.log_softmax(model(s.ids, nb, mask).float(), -1)  # [S, L, V]
    return -logp[rows, positions - 1, s.ids[rows, positions]].double().numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/lm_knowledge", help="work directory (replaced)")
    ap.add_argument("--train-entities", type=int, default=8000, help="training entities (beyond 900 the names come from longer word lists)")
    ap.add_argument("--eval-entities", type=int, default=100)
    ap.add_argument("--eval-mentions", type=int, default=2, help="held-out sentences per fact")
    ap.add_argument("--lm-steps", type=int, default=600)
    ap.add_argument("--steps", type=int, default=3000, help="RETRO steps (the copy warm-up's included)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3, help="the LM's peak learning rate")
    ap.add_argument("--retro-lr", type=float, default=5e-4,
                    help="RETRO's peak learning rate (at 2e-3 its copy warm-up learned no copying)")
    ap.add_argument("--chunk-len", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=30)
    ap.add_argument("--neighbours", type=int, default=2, help="RETRO neighbours per chunk")
    ap.add_argument("--k", type=int, default=32, help="kNN-LM neighbours")
    ap.add_argument("--copy-warmup", type=int, default=1500,
                    help="copy warm-up steps of the retro_copy run (of --steps; 0: no such run)")
    ap.add_argument("--retrofit", action="store_true", help="RETRO retro-fits the trained LM instead of training from scratch")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    started = time.perf_counter()
    torch.set_num_threads(1)  # on a shared 2-core machine two threads spin-wait on each other
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    task = generate_task(KnowledgeConfig(args.train_entities, args.eval_entities, eval_mentions=args.eval_mentions,
                                         seed=args.seed))
    cpu = torch.device("cpu")
    held_out = [e for e in task.entities if e.held_out]
    train = write_jsonl(out / "train.jsonl", task.train_docs)
    tune = {e.source for e in held_out[: len(held_out) // 2]}
    stating = {"train": write_jsonl(out / "stating-train.jsonl", [d for d in task.fact_docs if d.id not in {e.source for e in held_out}]),
               "all": write_jsonl(out / "stating.jsonl", task.fact_docs)}
    sets = {"": task.eval_sentences, "_stated": stated_sentences(task)}
    sizes = dict(dim=128, layers=2, heads=2, max_len=args.seq_len)
    optim = dict(batch_size=args.batch_size, lr=args.lr, warmup=30, log_every=50, seed=args.seed, dtype="fp32")
    results = {}

    lm_run = train_lm(LMTrainConfig(text=str(train), model=LMConfig(**sizes), steps=args.lm_steps, save_every=args.lm_steps,
                                    **optim), out / "lm", cpu, show_progress=False)
    lm, tokenizer = load_lm(out / "lm")
    lm.eval()
    scored = {name: score_batch(sentences, tune, tokenizer, args.chunk_len) for name, sentences in sets.items()}
    stream = tokenize_text(stating["all"], tokenizer, show_progress=False)
    store = Datastore(build_datastore(lm, out / "lm", stream, out / "datastore", device=cpu, show_progress=False))
    # Squared distances between states at the facts are 0.2-0.5 here: only a small temperature
    # lets the nearest key outweigh the other k - 1.
    temperatures, lambdas = (0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0), (0.1, 0.25, 0.5, 0.75, 0.9)
    # The kNN-LM's verbatim control: the stated facts queried with the datastore's own keys.
    own_keys = datastore_keys(scored["_stated"], sets["_stated"], tokenizer, stream, store)
    for name, s, hidden in [*((name, s, None) for name, s in scored.items()), ("_stated_context", scored["_stated"], own_keys)]:
        p_lm, p_knn = lm_scores(lm, s, store, k=args.k, temperatures=temperatures, hidden=hidden)
        results["lm" + name] = {**fact_report(-p_lm, s), "train_loss": lm_run.loss, "train_s": lm_run.seconds}
        grid = [(lmbda, t, -interpolate(torch.from_numpy(p_lm), torch.from_numpy(p_knn[i]), lmbda).double().numpy())
                for i, t in enumerate(temperatures) for lmbda in lambdas]
        lmbda, t, nll = min(grid, key=lambda g: fact_report(g[2], s, "tune")["fact_nll"])  # chosen on the tune half
        results["knnlm" + name] = {**fact_report(nll, s), "lmbda": lmbda, "temperature": t, "k": args.k}
        print(f"lm{name}: {json.dumps(results['lm' + name])}\nknnlm{name}: {json.dumps(results['knnlm' + name])}", flush=True)
    results["knnlm_stated"].update(own_key_distances(lm, scored["_stated"], own_keys, store))

    dbs = {split: build_chunk_db(path, out / f"chunkdb-{split}", chunk_len=args.chunk_len, device=cpu, show_progress=False)
           for split, path in stating.items()}
    retro_cfg = dict(neighbours=args.neighbours, cca_start=0, cca_every=1, encoder_layers=1)
    cfg = training_config(dbs["train"], retrofit=out / "lm" if args.retrofit else None,
                          **({"max_len": args.seq_len} if args.retrofit else sizes), **retro_cfg)
    db = ChunkDB(dbs["all"], cpu)  # the held-out entities' fact documents added after training
    pad = tokenizer.pad_token_id or 0
    neighbours = {name: chunk_neighbours(db, s, cfg.neighbours) for name, s in scored.items()}
    runs = {"retro": 0, **({"retro_copy": args.copy_warmup} if args.copy_warmup else {})}
    for run, copy_warmup in runs.items():
        retro_run = train_retro(RetroTrainConfig(text=str(train), db=str(dbs["train"]), model=cfg, steps=args.steps,
                                                 save_every=args.steps, retrofit=str(out / "lm") if args.retrofit else "",
                                                 copy_warmup=copy_warmup, **{**optim, "lr": args.retro_lr}),
                                out / run, cpu, show_progress=False)
        retro, _ = load_retro(out / run)
        retro.eval()
        for name, s in scored.items():
            for arm, nb in ((run, neighbours[name]), (run + "_off", None)):
                results[arm + name] = {**fact_report(retro_fact_nll(retro, db, s, nb, pad), s),
                                       "train_loss": retro_run.loss, "train_s": retro_run.seconds}
            results[run + name]["retrieved"] = retrieved_share(db, s, neighbours[name], tokenizer, sets[name])
            print(f"{run}{name}: {json.dumps(results[run + name])}\n"
                  f"{run}_off{name}: {json.dumps(results[run + '_off' + name])}", flush=True)
    print(f"task: {asdict(task.cfg)}; chunk {args.chunk_len}; report half: "
          f"{results['lm']['fact_tokens']} held-out and {results['lm_stated']['fact_tokens']} stated fact wordpieces; "
          f"wall {time.perf_counter() - started:.0f} s", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
