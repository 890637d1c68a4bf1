"""Training speed in bf16 vs fp32: `ralm finetune` and `ralm pretrain` with the same settings,
one run per dtype on the same machine, on the first N SQuAD paragraphs. Prints steps/s and the
loss curves' agreement as JSON and draws both curves per trainer into benchmarks/figures/.

    python benchmarks/speed/train_dtype.py --work runs/train-dtype
    python benchmarks/speed/train_dtype.py --work runs/train-dtype-default --only pretrain --pretrain-settings default --pretrain-steps 8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import DATA, FIGURES, run  # noqa: E402


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def steps_per_s(rows: list[dict]) -> float:
    """The mean of the logged windows' steps/s, the first skipped (start-up)."""
    return float(np.mean([r["steps_per_s"] for r in rows[1:] or rows]))


def plot(name: str, curves: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for dtype, rows in curves.items():
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], marker="o", ms=3, label=dtype)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"ralm {name}: bf16 vs fp32")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


# The REALM step alone (--mlm-warmup 0: the warm-up is another trainer, timed in its own right).
PRETRAIN_SETTINGS = {
    "small": ["--batch-size", "4", "-k", "4", "--block-len", "96", "--max-len", "160", "--warmup", "5", "--log-every", "5"],
    "default": ["--warmup", "2", "--log-every", "2"],
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", required=True)
    p.add_argument("--paragraphs", type=int, default=300)
    p.add_argument("--finetune-steps", type=int, default=60)
    p.add_argument("--pretrain-steps", type=int, default=40)
    p.add_argument("--pretrain-settings", choices=("small", "default"), default="small",
                   help="small: 4 sentences x k 4, blocks of 96 (the optimizer's share of a step is large); "
                        "default: ralm pretrain's own (8 x k 8, blocks of 288, max-len 352)")
    p.add_argument("--only", choices=("finetune", "pretrain"), help="time one trainer only")
    p.add_argument("--figures", default=str(FIGURES))
    args = p.parse_args()

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    corpus, questions = work / "corpus.jsonl", work / "questions.jsonl"
    if not corpus.is_file():
        lines = (DATA / "squad_corpus.jsonl").read_text().splitlines()[: args.paragraphs]
        corpus.write_text("".join(line + "\n" for line in lines))
        ids = {json.loads(line)["id"] for line in lines}
        qs = [line for line in (DATA / "squad_train.jsonl").read_text().splitlines() if json.loads(line)["doc_id"] in ids]
        questions.write_text("".join(line + "\n" for line in qs))
    ralm = [sys.executable, "-m", "ralm"]
    if not (work / "bm25" / "LATEST").is_file():
        run([*ralm, "index", "build", str(corpus), "--out", str(work / "bm25"), "--kind", "bm25"], work / "bm25.log")

    jobs = {
        "finetune": lambda out, dt: [*ralm, "finetune", "--questions", str(questions), "--index", str(work / "bm25"),
                                     "--out", str(out), "--steps", str(args.finetune_steps), "--batch-size", "4", "-k", "4",
                                     "--max-len", "256", "--log-every", "5", "--save-every", "1000", "--dtype", dt, "--device", "cpu"],
        "pretrain": lambda out, dt: [*ralm, "pretrain", "--corpus", str(corpus), "--out", str(out),
                                     "--steps", str(args.pretrain_steps), *PRETRAIN_SETTINGS[args.pretrain_settings],
                                     "--refresh", "none", "--mlm-warmup", "0", "--save-every", "1000", "--dtype", dt, "--device", "cpu"],
    }
    result = {}
    for name, cmd in jobs.items():
        if args.only and name != args.only:
            continue
        curves = {}
        for dtype in ("fp32", "bf16"):
            out = work / f"{name}-{dtype}"
            if not (out / "final").is_dir():
                result[f"{name}_{dtype}_wall_s"] = run(cmd(out, dtype), work / f"{name}-{dtype}.log")
            curves[dtype] = metrics(out)
        sps = {d: steps_per_s(rows) for d, rows in curves.items()}
        loss = {d: np.array([r["loss"] for r in rows]) for d, rows in curves.items()}
        result[name] = {
            "steps_per_s_fp32": round(sps["fp32"], 4), "steps_per_s_bf16": round(sps["bf16"], 4),
            "speedup": round(sps["bf16"] / sps["fp32"], 3),
            "loss_fp32": [round(x, 4) for x in loss["fp32"]], "loss_bf16": [round(x, 4) for x in loss["bf16"]],
            "max_abs_loss_gap": round(float(np.abs(loss["fp32"] - loss["bf16"]).max()), 4),
        }
        plot(name, curves, Path(args.figures) / f"dtype_{name}_loss.png")
        print(json.dumps({name: result[name]}), flush=True)
    (work / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
