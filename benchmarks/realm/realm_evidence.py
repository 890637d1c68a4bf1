"""REALM's evidence gain on real text: `ralm pretrain` with its defaults (its own MLM warm-up,
k 8, 288-wordpiece blocks, the asynchronous index builder) on a CPU-sized share of the SQuAD
corpus, measured at several points of the run on held-out articles
(squad_dev_official_corpus.jsonl, never pre-trained on) with `ralm.eval.evidence`.

    python benchmarks/realm/realm_evidence.py --work runs/evidence

Resumable: each stage skips what WORK already holds.
  corpus   WORK/corpus.jsonl: every `--every`-th paragraph of squad_corpus.jsonl (all articles)
  train    `ralm pretrain` up to each point of `--points` in turn (the same run, resumed with a
           larger --steps); after each, RUN/final is copied to WORK/points/step-N; `--checkpoints`
           adds points from the run's last two checkpoints. The start (step 0) is the warm-up
           encoder (RUN/mlm/final/encoder) with the starting towers (the retriever of the run's
           first index version). A run stopped early (SIGTERM: it checkpoints and exports at
           step N) is measured by copying RUN/final to WORK/points/step-N and `--stage eval
           --points N`; the eval stage may also run beside training
  eval     per point and `--indexed` setting: a dense index built with the point's document
           tower (shared by points whose towers are equal) over WORK/corpus.jsonl ("corpus": no
           block holds the held-out articles' knowledge) or over it plus the held-out paragraphs
           ("heldout": as a user adds documents; each sentence's own paragraph is excluded, as
           pre-training excludes trivial retrievals, so the evidence is the article's other
           paragraphs), then the evidence gain on `--sentences` held-out masked sentences, with its
           95% bootstrap interval over articles (WORK/points/step-N/evidence.json,
           evidence-heldout.json); every point measured is reported
  report   benchmarks/figures/realm_evidence_gain.png (the held-out gain at each point; the
           warm-up's own-block evidence gain and REALM's retrieval utility per logged window) and
           realm_evidence_retrieval_utility.png (the run's own curve, drawn when a segment ends
           unstopped); the last stdout line is JSON

Only corpus, out, steps, save-every and device are given to `ralm pretrain`; everything else is its
default. On a GPU (`--device cuda`; auto picks it) a step takes about 0.25 s instead of 14 s:

    python benchmarks/realm/realm_evidence.py --work runs/evidence-gpu --points 100,1000 --save-every 250
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

from ralm.atomic import read_json
from ralm.retrieval.index.store import KEEP_VERSIONS
from ralm.train.pretrain import PretrainConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import DATA, FIGURES, run  # noqa: E402


def copy_dir(src: Path, dst: Path) -> None:
    """Copy a directory so that `dst` exists only once complete."""
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    tmp.rename(dst)


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.rename(path)


def make_corpus(work: Path, source: Path, every: int) -> Path:
    corpus = work / "corpus.jsonl"
    if not corpus.is_file():
        lines = source.read_text().splitlines()[::every]
        tmp = corpus.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.rename(corpus)
    return corpus


def start_point(run_dir: Path, dst: Path) -> None:
    """WORK/points/step-0: the warm-up encoder and the towers that built the first index version."""
    from ralm.retrieval.index.store import IndexDir

    if dst.is_dir():
        return
    index = IndexDir(run_dir / "index")
    first = index.version(index.versions()[0])
    if first.step != 0:
        raise SystemExit(f"{run_dir}/index no longer holds its step-0 version; cannot record the start")
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copytree(index.root / first.retriever, tmp / "retriever")
    shutil.copytree(run_dir / "mlm" / "final" / "encoder", tmp / "encoder")
    tmp.rename(dst)


def checkpoint_point(run_dir: Path, step: int, dst: Path) -> None:
    """WORK/points/step-N from the run's checkpoint of step N (the run keeps its last two):
    between two segment ends at no extra training cost."""
    from ralm.models.realm import KnowledgeAugmentedEncoder, Realm, RealmConfig
    from ralm.retrieval.towers.encoders import Retriever
    from ralm.train.checkpoints import load_checkpoint

    if dst.is_dir():
        return
    ckpt = run_dir / "checkpoints" / f"step-{step:06d}"
    if not ckpt.is_dir():
        raise SystemExit(f"{ckpt}: not kept (a run keeps its last two checkpoints); choose --save-every to keep it")
    model = Realm(Retriever.from_pretrained(run_dir / "final" / "retriever"),
                  KnowledgeAugmentedEncoder.from_pretrained(run_dir / "final" / "encoder"), RealmConfig())
    load_checkpoint(ckpt, model)
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.retriever.save_pretrained(tmp / "retriever")
    model.encoder.save_pretrained(tmp / "encoder")
    tmp.rename(dst)


def train(args, corpus: Path, work: Path, ralm: list[str]) -> dict:
    """Train up to each point; returns {point: wall seconds of its segment}."""
    run_dir, points = work / "run", work / "points"
    points.mkdir(parents=True, exist_ok=True)
    # The start's towers are read from the run index's step-0 version, which the KEEP_VERSIONS-th
    # refresh prunes: refuse, before any training, a first segment past it.
    refresh = read_json(run_dir / "config.json")["refresh_every"] if (run_dir / "config.json").is_file() \
        else PretrainConfig.refresh_every
    if not (points / "step-0").is_dir() and args.points[0] >= (last := KEEP_VERSIONS * refresh):
        raise SystemExit(f"--points: the first point ({args.points[0]}) must come before step {last}, where the "
                         "run's index drops the starting towers that step 0 is measured with")
    walls = json.loads((work / "train_wall.json").read_text()) if (work / "train_wall.json").is_file() else {}
    for step in args.points:
        dst = points / f"step-{step}"
        if not dst.is_dir():
            walls[str(step)] = run([*ralm, "pretrain", "--corpus", str(corpus), "--out", str(run_dir), "--steps", str(step),
                                    "--save-every", str(args.save_every), "--device", args.device, *args.pretrain_args.split()],
                                   work / "train.log", append=True)
            write_json(work / "train_wall.json", walls)
            copy_dir(run_dir / "final", dst)
        start_point(run_dir, points / "step-0")
    for step in args.checkpoints:
        checkpoint_point(run_dir, step, points / f"step-{step}")
    return walls


def weights_key(retriever: Path) -> str:
    """A digest of a retriever directory's weights: points with equal towers share one index."""
    h = hashlib.sha1()
    for f in sorted(retriever.rglob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def eval_corpus(work: Path, corpus: Path, heldout: str, setting: str) -> Path:
    """What the evaluation index holds: the pre-training corpus, or with the held-out paragraphs
    added (as a user adds documents; each sentence's own paragraph is then excluded)."""
    if setting == "corpus":
        return corpus
    if setting != "heldout":
        raise SystemExit(f"--indexed: 'corpus' or 'heldout', got {setting!r}")
    out = work / "corpus+heldout.jsonl"
    if not out.is_file():
        tmp = out.with_suffix(".tmp")
        tmp.write_text(corpus.read_text() + Path(heldout).read_text())
        tmp.rename(out)
    return out


def evaluate(args, corpus: Path, work: Path, ralm: list[str]) -> dict[str, dict[int, dict]]:
    """{setting: {point: scores}} for each index setting of `--indexed`."""
    from ralm.eval.evidence import EvidenceConfig, evidence_gain
    from ralm.runtime import Runtime

    rt = Runtime.resolve(args.device, "auto", show_progress=False)  # the compute dtype pre-training used
    if (work / "run" / "index" / "LATEST").is_file():  # the eval stage may run beside training, from its start
        start_point(work / "run", work / "points" / "step-0")

    results = {}
    for setting in args.indexed:
        indexed, suffix = eval_corpus(work, corpus, args.heldout, setting), "" if setting == "corpus" else f"-{setting}"
        results[setting] = {}
        for step in sorted({0, *args.points, *args.checkpoints}):
            point = work / "points" / f"step-{step}"
            out = point / f"evidence{suffix}.json"
            if not point.is_dir():
                continue
            measured = json.loads(out.read_text()) if out.is_file() else {}
            if measured.get("limit") != args.sentences:  # not yet measured, or with another sentence count
                index = work / "indexes" / f"{weights_key(point / 'retriever')}{suffix}"
                if not (index / "LATEST").is_file():
                    run([*ralm, "index", "build", str(indexed), "--out", str(index), "--kind", "dense",
                         "--model", str(point / "retriever"), "--device", args.device], work / "eval.log", append=True)
                start = time.perf_counter()
                cfg = EvidenceConfig(str(point / "retriever"), str(point / "encoder"), str(index), args.heldout, k=args.k,
                                     limit=args.sentences, cache=str(work / "heldout"))
                scores = evidence_gain(cfg, rt)
                measured = {"step": step, "limit": args.sentences, **scores.to_json(),
                            "eval_s": round(time.perf_counter() - start, 1)}
                write_json(out, measured)
            results[setting][step] = measured
    return results


def report(args, work: Path, settings: dict[str, dict[int, dict]], walls: dict) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = Path(args.figures)
    figures.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    mlm_rows = [json.loads(line) for line in (work / "run" / "mlm" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    fig, (gain, warm, utility) = plt.subplots(1, 3, figsize=(14, 3.6))
    for setting, results in settings.items():
        steps = sorted(results)
        values = [results[s]["evidence_gain"] for s in steps]
        bars = [[v - results[s]["gain_ci95"][0] for s, v in zip(steps, values)],
                [results[s]["gain_ci95"][1] - v for s, v in zip(steps, values)]]
        gain.errorbar(steps, values, yerr=bars, fmt="o-", capsize=3, label=f"evidence gain (95% interval), index: {setting}")
        gain.plot(steps, [results[s]["helped_share"] - 0.5 for s in steps], "s--", alpha=0.6,
                  label=f"share helped - 0.5, index: {setting}")
    gain.set_xlabel("REALM step (0: after the MLM warm-up)")
    gain.set_ylabel("nats / masked wordpiece")
    gain.set_title(f"held-out sentences, top-{args.k} + null vs null only", fontsize=9)
    gain.legend(fontsize=8)
    warm.plot([r["step"] for r in mlm_rows], [r["evidence_gain"] for r in mlm_rows], ".-")
    warm.set_xlabel("MLM warm-up step")
    warm.set_ylabel("nats / masked wordpiece")
    warm.set_title("warm-up batches: own block vs no block", fontsize=9)
    utility.plot([r["step"] for r in rows], [r["retrieval_utility"] for r in rows], "o-")
    utility.set_xlabel("REALM step")
    utility.set_ylabel("nats / sentence")
    utility.set_title("REALM batches: retrieval utility (top block vs null)", fontsize=9)
    for ax in (gain, warm, utility):
        ax.axhline(0, color="grey", lw=0.8)
    fig.tight_layout()
    fig.savefig(figures / "realm_evidence_gain.png", dpi=120)
    if (work / "run" / "retrieval_utility.png").is_file():  # drawn when a segment ends
        shutil.copyfile(work / "run" / "retrieval_utility.png", figures / "realm_evidence_retrieval_utility.png")
    rates = [r["steps_per_s"] for r in rows if r.get("steps_per_s")]
    keys = ("evidence_gain", "gain_ci95", "loss_retrieved", "loss_null", "helped_share", "sentences", "articles",
            "wordpieces", "own_document_indexed")
    return {"points": {setting: {str(s): {k: r[k] for k in keys} for s, r in sorted(results.items())}
                       for setting, results in settings.items()},
            "train_wall_s": walls, "realm_steps_per_s": round(sum(rates) / len(rates), 4) if rates else None,
            "mlm_steps_per_s": round(sum(r["steps_per_s"] for r in mlm_rows) / len(mlm_rows), 4) if mlm_rows else None,
            "retrieval_utility_by_window": [(r["step"], r["retrieval_utility"]) for r in rows]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="runs/evidence")
    p.add_argument("--corpus", type=Path, default=DATA / "squad_corpus.jsonl")
    p.add_argument("--heldout", default=str(DATA / "squad_dev_official_corpus.jsonl"))
    p.add_argument("--every", type=int, default=9, help="keep every N-th paragraph of the corpus")
    p.add_argument("--points", type=lambda s: sorted(int(x) for x in s.split(",")), default=[50, 100, 150],
                   help="REALM steps at which to measure (the last is the run's length)")
    p.add_argument("--checkpoints", type=lambda s: sorted(int(x) for x in s.split(",") if x), default=[],
                   help="further points read from the run's last two checkpoints (multiples of --save-every)")
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--sentences", type=int, default=500, help="held-out masked sentences per measurement")
    p.add_argument("-k", type=int, default=8, help="retrieved blocks per sentence (pre-training's default)")
    p.add_argument("--pretrain-args", default="", help="extra `ralm pretrain` options, for smoke tests only "
                   "(e.g. '--mlm-warmup 4'); the measurement uses none")
    p.add_argument("--indexed", type=lambda s: s.split(","), default=["corpus", "heldout"],
                   help="what the evaluation index holds: 'corpus' (the pre-training corpus only: the held-out "
                        "articles' knowledge is in no block) and/or 'heldout' (the held-out paragraphs added, each "
                        "sentence's own paragraph excluded, as pre-training excludes trivial retrievals)")
    p.add_argument("--stage", choices=("all", "train", "eval"), default="all")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda: training, indexes and scoring")
    p.add_argument("--figures", default=str(FIGURES))
    args = p.parse_args()

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    corpus = make_corpus(work, args.corpus, args.every)
    ralm = [sys.executable, "-m", "ralm"]
    walls_file = work / "train_wall.json"
    walls = train(args, corpus, work, ralm) if args.stage in ("all", "train") else \
        json.loads(walls_file.read_text()) if walls_file.is_file() else {}
    if args.stage == "train":
        return
    summary = report(args, work, evaluate(args, corpus, work, ralm), walls)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
