"""REALM learns to retrieve from the masked-LM signal alone, on a task where retrieval is the
only way (data/knowledge.py): made-up entities, each with a fact document, and sentences from
other documents that mention an entity and one of its facts, the fact masked.

Everything starts from a tiny randomly initialised BERT with the bundled vocabulary: towers
and encoder know nothing. One MLM warm-up (train.mlm) is shared by every arm: it teaches the
encoder to read a masked fact from evidence, on a second generated task with so many entities
(`--warm-entities`) that memorising their facts does not pay. Each of its entities is one
document, the fact statement then the notes (`write_corpus(joined=True)`), and every sentence
is read with its own block, kept in it half the time (`--warm-keep`): kept, it is the plainest
copying lesson, which a random BERT learns in a few hundred steps; cut out, the fact must be
read from the statement's other wording ("founded in Oslo by Clara" for "arrive from [MASK]"),
which teaches the encoder which of the statement's two values each wording asks for. Without
that half (sentence always kept, entities' documents apart) the encoder read the founder for
"Travellers to E often arrive from [MASK]": the right fact document then hurt that sentence,
REALM learned to avoid it, and that one template held recall@1 at 0.85-0.89 (1,000-2,000 steps).
(Warmed up with the sentence always cut out of notes-only blocks it stayed at the class prior, log 30 =
3.4 nats, for 600 steps; warmed up on the training corpus itself it memorised the facts and REALM
then put all of p(z|x) on the null document.) The towers start
from `--ict-steps` ICT steps, the weak start of the cold-start problem (0: random towers,
whose mean-pooled vectors already rank by shared words; from them REALM learned 40 training
entities but not 160, and the 40 did not carry over to held-out names). Then each arm runs the real
pre-training path (train.pretrain: marginal likelihood over retrieved blocks and the null
document, index refreshes) on the same budget:

  full        REALM as shipped, asynchronous index refresh every `--refresh-every` steps
  frozen      the towers never train (retriever_warmup = steps): the encoder alone
  no_null     no null document among the candidates
  random_mask random wordpieces masked instead of the facts
  fresh_index the index refreshed in-process before every step (no staleness)

After training the held-out entities' fact documents are indexed with the trained document
tower (eval/knowledge.py) and their held-out sentences scored: recall@1 of the fact document,
masked-token accuracy of the marginal, p(null|x). `start_recall@1` is the same recall with the
towers at step 0. Curves: benchmarks/figures/realm_knowledge_*.png. The last stdout line is
JSON: {"full": {"recall@1", "mlm_accuracy", "start_recall@1", ...}, "frozen": {...}, ...}.

    python benchmarks/realm/realm_knowledge.py            # 37 minutes on a shared 2-core CPU (4.5-11 per arm)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ralm.data.knowledge import KnowledgeConfig, KnowledgeTask, generate_task, save_spacy_pipeline
from ralm.encoders.loading import save_random_encoder
from ralm.eval.knowledge import score_checkpoint
from ralm.train.ict import IctConfig, train_ict
from ralm.train.mlm import MlmConfig, warm_up_encoder
from ralm.train.pretrain import PretrainConfig, pretrain

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import FIGURES  # noqa: E402
CURVES = ("span_in_top", "loss", "p_null", "retrieval_utility")


def arms(steps: int) -> dict[str, dict]:
    """Each ablation as overrides of the full run's config."""
    return {"full": {},
            "frozen": {"retriever_warmup": steps},
            "no_null": {"null_doc": False},
            "random_mask": {"masking": "random"},
            "fresh_index": {"refresh": "sync", "refresh_every": 1}}


def plot(runs: dict[str, Path], out_prefix: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = []
    for metric in CURVES:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for name, run in runs.items():
            rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            ax.plot([r["step"] for r in rows], [r.get(metric, float("nan")) for r in rows], label=name)
        ax.set_xlabel("REALM step")
        ax.set_ylabel(metric)
        ax.set_title(f"knowledge task: {metric} (training batches)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_prefix.with_name(f"{out_prefix.name}_{metric}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        drawn.append(path)
    return drawn


def knowledge_setup(args: argparse.Namespace) -> tuple[Path, KnowledgeTask]:
    """One torch thread, a fresh work directory `args.out`, and the task of `args` (shared
    with lm_knowledge.py)."""
    # one thread: on a shared 2-core machine two threads spin-wait on each other (8x slower)
    torch.set_num_threads(1)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    return out, generate_task(KnowledgeConfig(args.train_entities, args.eval_entities, seed=args.seed))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/realm_knowledge", help="work directory (replaced)")
    ap.add_argument("--arms", default="full,frozen,no_null,random_mask,fresh_index")
    ap.add_argument("--train-entities", type=int, default=400)
    ap.add_argument("--eval-entities", type=int, default=40)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--warm-entities", type=int, default=800, help="entities of the warm-up task (too many to memorise)")
    ap.add_argument("--mlm-steps", type=int, default=500)
    ap.add_argument("--warm-keep", type=float, default=0.5, help="share of warm-up blocks that keep the masked sentence")
    ap.add_argument("--mlm-lr", type=float, default=1e-3)
    ap.add_argument("--ict-steps", type=int, default=20, help="ICT steps for the towers' start (0: random towers)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("-k", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-5, help="the encoder's REALM learning rate")
    ap.add_argument("--retriever-lr", type=float, default=3e-4)
    ap.add_argument("--refresh-every", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--figures", default=str(FIGURES / "realm_knowledge"), help="PNG prefix ('' for none)")
    args = ap.parse_args()
    started = time.perf_counter()
    out, task = knowledge_setup(args)
    cpu = torch.device("cpu")
    corpus = task.write_corpus(out / "corpus.jsonl")
    warm_task = generate_task(KnowledgeConfig(args.warm_entities, 1, seed=args.seed + 1))
    warm_corpus = warm_task.write_corpus(out / "warm-up.jsonl", joined=True)
    spacy_dir = save_spacy_pipeline(out / "spacy")
    bert = save_random_encoder(out / "random-bert", hidden_size=args.hidden, layers=args.layers,
                               heads=max(1, args.hidden // 32), seed=args.seed, pooling="mean")
    lengths = dict(max_query_len=32, block_len=48, max_len=80)
    fp32 = dict(dtype="fp32")  # a tiny model gains nothing from bf16 autocast on CPU

    mlm = MlmConfig(str(warm_corpus), model=str(bert), steps=args.mlm_steps, head_steps=0, batch_size=32,
                    lr=args.mlm_lr, warmup=20, spacy_model=str(spacy_dir), save_every=args.mlm_steps, log_every=20,
                    evidence=1.0, keep_sentence=args.warm_keep, seed=args.seed, **lengths, **fp32)
    warm = warm_up_encoder(mlm, out / "mlm", cpu, show_progress=False)
    print(f"MLM warm-up: {warm.steps} steps in {warm.seconds} s", flush=True)
    init = None
    if args.ict_steps:
        ict = IctConfig(str(corpus), model=str(bert), dim=args.dim, steps=args.ict_steps, batch_size=16, lr=1e-3, warmup=5,
                        keep_sentence=0.0, block_len=lengths["block_len"], max_query_len=lengths["max_query_len"],
                        save_every=args.ict_steps, log_every=10, seed=args.seed, **fp32)
        init = train_ict(ict, out / "ict", cpu, show_progress=False).run

    # every arm starts from these towers (random ones search with their mean-pooled vectors)
    start_retriever = Path(init) / "final" / "retriever" if init else bert
    base = dict(model=str(bert), init=init, encoder=warm.run, mlm_warmup=0, dim=args.dim, steps=args.steps,
                batch_size=args.batch_size, k=args.k, lr=args.lr, warmup=20, retriever_warmup=0,
                retriever_lr=args.retriever_lr, spacy_model=str(spacy_dir), refresh="async",
                refresh_every=args.refresh_every, save_every=args.steps, log_every=10, seed=args.seed, **lengths, **fp32)
    results, runs = {}, {}
    for name in args.arms.split(","):
        overrides = arms(args.steps)[name]
        cfg = PretrainConfig(str(corpus), **{**base, **overrides})
        run = out / name
        done = pretrain(cfg, run, cpu, show_progress=False, notify=lambda m: None)
        runs[name] = run
        score = lambda retriever, encoder, where: score_checkpoint(  # noqa: E731
            task, retriever, encoder, out / "eval" / where, k=args.k, null_doc=cfg.null_doc, **lengths)
        start = score(start_retriever, warm.encoder, f"{name}-start")
        end = score(done.retriever, done.encoder, name)
        results[name] = {"recall@1": round(end.recall_at_1, 4), "mlm_accuracy": round(end.mlm_accuracy, 4),
                         "p_null": round(end.p_null, 4), "recall@k": round(end.recall_at_k, 4),
                         "start_recall@1": round(start.recall_at_1, 4), "start_mlm_accuracy": round(start.mlm_accuracy, 4),
                         "train_s": done.seconds, "overrides": overrides}
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    if args.figures:
        for path in plot(runs, Path(args.figures)):
            print(f"wrote {path}", flush=True)
    print(f"task: {asdict(task.cfg)}; {len(task.train_docs)} training documents, {len(task.eval_sentences)} held-out "
          f"sentences; wall {time.perf_counter() - started:.0f} s", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
