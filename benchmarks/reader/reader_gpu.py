"""The shipped reader's GPU stage: a larger teacher fine-tuned, then the MiniLM reader trained on
all of SQuAD train with the answer rule's labels, the null span and the teacher's soft targets,
in one prepared run on one GPU; every part but the run itself happens on the CPU.

  prepare  (CPU) the run's data: SQuAD train questions with their gold paragraph and the top
           BM25 blocks of other documents (a squad_corpus-only index, as `ralm train-reader`
           retrieves distractors), the calibration half of official dev with its top-10 blocks
           of the default hybrid index (to choose among the candidates on the GPU; the held-out
           half is never read there), and the teacher encoder packed as int8 rows (a 64 MiB limit
           per transfer; per-row int8 moves each weight by at most 0.4% of its row's largest)
  train    (GPU) featurise every (question, text) pair once on all cores; fine-tune the teacher
           (e.g. all-mpnet-base-v2, the same wordpieces as MiniLM) with the shared-softmax
           objective, null span and no-answer share of `ralm train-reader`; then train two
           students from the shipped reader on the same batches, one on the labels alone and one
           with the teacher's KL term (`distill_kl`, the teacher reading the same windows); then
           EM on the calibration half (open, the pipeline's own `pick_answer` over the top 10,
           and closed, on the gold paragraph) of every candidate. Every phase has a time budget
           (steps are set from the speed of its first steps) so the run ends inside the lease.
           Writes to OUT: log.jsonl, each student as int8 per-row deltas from its start (more
           precise than fp16 weights), the teacher's top spans over the first pass of the data.
  unpack   (CPU) a student reader directory from the shipped reader and its deltas.

    python benchmarks/reader/reader_gpu.py prepare --work runs/gpu --dev-index runs/dev --teacher-dir /path/all-mpnet-base-v2 --out .gpu
    python benchmarks/reader/reader_gpu.py train --data .gpu/data --teacher /tmp/w/teacher --student .gpu/student --out $OUT --budget 540
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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import DATA, ralm  # noqa: E402

PART_BYTES = 56_000_000  # a teacher part: what travels in one call beside the working tree
NEAR = -1  # the text number of a question's near miss (its paragraph without the answer's sentences)


# -- prepare (CPU) ----------------------------------------------------------------------------

def _write_xz(path: Path, rows) -> None:
    with lzma.open(path, "wt", encoding="utf-8", preset=6) as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _read_xz(path: Path) -> list:
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def prepare(args) -> None:
    """Writes OUT/data (each file once: a rerun skips what exists) and, with --teacher-dir, the
    teacher's parts OUT/t1, OUT/t2, ..."""
    from ralm.data.qa import read_questions
    from ralm.pipeline import open_searcher
    from ralm.retrieval.search.searcher import Searcher

    work, out = Path(args.work), Path(args.out)
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    docs = [json.loads(line) for line in (DATA / "squad_corpus.jsonl").read_text(encoding="utf-8").splitlines()]
    ordinal = {d["id"]: i for i, d in enumerate(docs)}
    if not (data / "questions.jsonl.xz").is_file():
        bm25 = work / "squad-bm25"
        if not (bm25 / "LATEST").is_file():
            ralm("index", "build", DATA / "squad_corpus.jsonl", "--out", bm25, "--kind", "bm25")
        _write_xz(data / "docs.jsonl.xz", ({"id": d["id"], "text": d["text"]} for d in docs))
        searcher = Searcher.open(bm25)
        records = searcher.current.blocks.records(range(len(searcher.current.blocks)))
        _write_xz(data / "blocks.jsonl.xz", ({"d": ordinal[r["doc_id"]], "text": r["text"]} for r in records))
        doc_of_block = np.array([ordinal[r["doc_id"]] for r in records])
        questions = read_questions(DATA / "squad_train.jsonl")[: args.limit]
        rows_out = []
        for i in range(0, len(questions), 512):
            chunk = questions[i : i + 512]
            _, rows = searcher.search_rows([q.question for q in chunk], args.distractors + 6)
            for q, qrows in zip(chunk, rows):
                own = ordinal[q.extra["doc_id"]]
                rows_out.append({"q": q.question, "a": list(q.answers), "d": own,
                                 "x": [int(r) for r in qrows if r >= 0 and doc_of_block[r] != own][: args.distractors]})
        _write_xz(data / "questions.jsonl.xz", rows_out)
    if args.dev_index and not (data / "eval.jsonl.xz").is_file():
        # the calibration half (odd lines) over the default index, read as the pipeline reads it
        lines = (DATA / "squad_dev_official.jsonl").read_text(encoding="utf-8").splitlines()[0::2]
        cal = [json.loads(line) for line in lines]
        dev = open_searcher(args.dev_index)
        dev_docs = {json.loads(line)["id"]: json.loads(line)["text"]
                    for line in (DATA / "squad_dev_official_corpus.jsonl").read_text(encoding="utf-8").splitlines()}
        snap = dev.current
        ranked = dev.rank([q["question"] for q in cal], 10, snap, None)
        _write_xz(data / "eval.jsonl.xz", (
            {"id": q["id"], "q": q["question"], "a": q["answers"], "gold": dev_docs[q["doc_id"]],
             "texts": [snap.blocks.record(int(r))["text"] for r in rows], "scores": [float(s) for s in scores]}
            for q, rows, scores in zip(cal, ranked.rows, ranked.scores)))
    if args.teacher_dir:
        pack_encoder(Path(args.teacher_dir), out)
    print(json.dumps({"bytes": {p.name: p.stat().st_size for p in data.iterdir()}}))


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


def pack_encoder(src: Path, out: Path) -> None:
    """The encoder's 2-D weights as int8 rows (+ scales), the rest in fp16, in parts of at most
    PART_BYTES (out/t1, out/t2, ...), with its config and tokenizer in the first."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(src / "model.safetensors"))
    # the reader reads the last hidden states only: no pooler
    parts = _in_parts((_packed(key, state[key], "half") for key in sorted(state)
                       if not key.startswith("pooler.") and not key.endswith("position_ids")), PART_BYTES)
    for i, part in enumerate(parts, 1):
        folder = out / f"t{i}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in part.items()}, str(folder / f"part{i}.safetensors"))
        if i == 1:
            for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
                if (src / name).is_file():
                    shutil.copy(src / name, folder / name)
    print(json.dumps({"teacher_parts": [sum(f.stat().st_size for f in (out / f"t{i}").iterdir()) for i in range(1, len(parts) + 1)]}))


def unpack_encoder(parts: list[Path], out: Path) -> Path:
    """An HF model directory from `pack_encoder`'s parts (weights back in fp32)."""
    from safetensors.torch import load_file, save_file

    packed = {}
    for folder in parts:
        for f in folder.glob("part*.safetensors"):
            packed.update(load_file(str(f)))
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
            if (folder / name).is_file():
                out.mkdir(parents=True, exist_ok=True)
                shutil.copy(folder / name, out / name)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in _unpacked(packed).items()}, str(out / "model.safetensors"))
    return out


# -- featurisation (every core) -------------------------------------------------------------------

_READER = None


def _init_worker(student: str, max_len: int) -> None:
    global _READER
    import torch

    from ralm.models.reader import Reader

    torch.set_num_threads(1)
    _READER = Reader.from_pretrained(student, max_len=max_len)


def _featurize(job: tuple) -> list:
    """One question's texts as windows: [(text number, ids int32, evidence start, end, word_start
    bool, gold spans [(start, width)], text holds an answer)]. Text 0 is the gold paragraph, 1..
    the distractors, NEAR the gold paragraph without its answer's sentences (train/reader.py
    `without_answer`), when there is one."""
    from ralm.data.qa import has_answer
    from ralm.train.reader import without_answer

    question, answers, texts, stride = job
    near = without_answer(texts[0], answers)
    texts = [*texts, *([near] if near is not None else [])]
    batch, owner = _READER.featurizer.featurize_windows([question] * len(texts), texts, stride)
    match = _READER.featurizer.answer_match(batch, [answers] * len(owner))
    lengths = batch.attention_mask.sum(1).tolist()
    holds = [has_answer(t, answers) for t in texts]
    out = []
    for n, t in enumerate(owner):
        m = lengths[n]
        number = NEAR if near is not None and t == len(texts) - 1 else t
        out.append((number, batch.input_ids[n, :m].numpy().astype(np.int32), int(batch.evidence_start[n]),
                    int(batch.evidence_end[n]), batch.word_start[n, :m].numpy().copy(),
                    [tuple(x) for x in match[n].nonzero().tolist()], holds[t]))
    return out


def featurize_all(questions: list[dict], docs: list[dict], blocks: list[dict], *, student: str, max_len: int, stride: int,
                  distractors: int, workers: int) -> list[list]:
    from multiprocessing import get_context

    jobs = [(q["q"], q["a"], [docs[q["d"]]["text"], *(blocks[r]["text"] for r in q["x"][:distractors])], stride) for q in questions]
    if workers <= 1:
        _init_worker(student, max_len)
        return [_featurize(j) for j in jobs]
    with get_context("fork").Pool(workers, initializer=_init_worker, initargs=(student, max_len)) as pool:
        return pool.map(_featurize, jobs, chunksize=64)


# -- batches ---------------------------------------------------------------------------------

def make_batch(windows: list, width: int, device):
    """A ReaderBatch (no texts: training needs none) and the match tensor of `windows`."""
    import torch

    from ralm.data.reader_features import ReaderBatch

    n, length = len(windows), max(len(w[1]) for w in windows)
    ids = torch.zeros(n, length, dtype=torch.long)
    types = torch.zeros(n, length, dtype=torch.long)
    mask = torch.zeros(n, length, dtype=torch.long)
    begins = torch.ones(n, length, dtype=torch.bool)
    match = torch.zeros(n, length, width, dtype=torch.bool)
    for i, (_, row, ev_start, _, word_start, gold, _) in enumerate(windows):
        m = len(row)
        ids[i, :m] = torch.from_numpy(row.astype(np.int64))
        mask[i, :m] = 1
        types[i, ev_start:m] = 1
        begins[i, :m] = torch.from_numpy(word_start)
        for s, w in gold:
            match[i, s, w] = True
    starts = torch.tensor([w[2] for w in windows])
    ends = torch.tensor([w[3] for w in windows])
    batch = ReaderBatch(ids, mask, types, starts, ends, [[]] * n, [""] * n, begins)
    return batch.to(device), match.to(device)


def step_inputs(features: list, order: np.ndarray, drops: np.ndarray, *, distractors: int, near: np.ndarray | None = None):
    """The windows a step reads: each question's gold windows (unless dropped: then, where `near`,
    its near miss) and those of its first `distractors` distractors; (windows, question [N],
    no_answer [B]), as `ralm train-reader` reads them."""
    near = np.zeros(len(order), dtype=bool) if near is None else near
    windows, question, no_answer = [], [], []
    for b, (j, drop, miss) in enumerate(zip(order, drops, near)):
        mine = [w for w in features[j] if (0 < w[0] <= distractors) or (w[0] == 0 and not drop)
                or (w[0] == NEAR and drop and miss)]
        if not mine:  # a question whose texts all vanished (no distractor retrieved): read its gold
            mine, drop = [w for w in features[j] if w[0] == 0], False
        windows += mine
        question += [b] * len(mine)
        no_answer.append(bool(drop) and not any(w[6] for w in mine))
    return windows, question, no_answer


# -- train (GPU) -------------------------------------------------------------------------------

class Log:
    def __init__(self, out: Path):
        self.f = open(out / "log.jsonl", "a", buffering=1)
        self.t0 = time.perf_counter()

    def __call__(self, **record) -> None:
        record = {"t": round(time.perf_counter() - self.t0, 1), **record}
        self.f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)


def run_phase(name: str, models: list, *, features, teacher, cfg: dict, budget: float, log: Log, device,
              top_spans: dict | None = None) -> dict:
    """Train `models` (each with its own optimiser) on the same batches for about `budget`
    seconds: steps are fixed after the first `probe` steps from their speed (at most `epochs`
    passes). Each model: {"reader", "distill"}; a teacher (eval mode) gives soft targets."""
    import torch

    from ralm.data.reader_features import valid_spans
    from ralm.models.reader import distill_kl, shared_nll

    batch_size, distractors = cfg["batch_size"], cfg["distractors"]
    per_epoch = math.ceil(len(features) / batch_size)
    rng = np.random.default_rng(cfg["seed"])
    orders = [rng.permutation(len(features)) for _ in range(math.ceil(cfg["epochs"]))]
    total = int(per_epoch * cfg["epochs"])
    opts = []
    for m in models:
        m["reader"].train()
        params = [p for p in m["reader"].parameters() if p.requires_grad]
        opts.append(torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=0.01, fused=device.type == "cuda"))
    start = time.perf_counter()
    width = models[0]["reader"].cfg.max_span_width
    window_losses: dict[str, list] = {m["name"]: [] for m in models}
    step = 0
    while step < total:
        epoch, pos = divmod(step, per_epoch)
        order = orders[epoch][pos * batch_size : (pos + 1) * batch_size]
        drops = np.random.default_rng([cfg["seed"], step]).random(len(order)) < cfg["no_answer_share"]
        near = np.random.default_rng([cfg["seed"], step, 1]).random(len(order)) < cfg["near_miss_share"]
        windows, question, no_answer = step_inputs(features, order, drops, distractors=distractors, near=near)
        batch, match = make_batch(windows, width, device)
        question = torch.tensor(question, device=device)
        no_answer = torch.tensor(no_answer, device=device)
        warm = max(1, int(cfg["warmup"] * total))  # linear warm-up, then linear decay to 0 at `total`
        factor = (step + 1) / warm if step < warm else max(0.0, (total - step) / max(1, total - warm))
        t_scores = None
        if teacher is not None:
            with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                t_scores = teacher(batch).float()
            if top_spans is not None and step < per_epoch:
                keep_top_spans(top_spans, t_scores, batch, order[question.cpu().numpy()], windows, width)
        valid = valid_spans(batch, width)
        log_pz = torch.zeros(len(windows), device=device)
        for m, opt in zip(models, opts):
            reader = m["reader"]
            for g in opt.param_groups:
                g["lr"] = cfg["lr"] * factor
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                scores = reader(batch)
            scores = scores.float()
            null = reader.null_scores(scores)
            loss, labelled = shared_nll(scores, valid, match, log_pz=log_pz, question=question, questions=len(order), null=null,
                                        no_answer=no_answer)
            if m["distill"] > 0:
                kl = distill_kl(scores, t_scores, valid, log_pz=log_pz, question=question, questions=len(order), null=null,
                                teacher_null=teacher.null_scores(t_scores), temperature=cfg["temperature"])
                loss = (1 - m["distill"]) * loss + m["distill"] * kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(reader.parameters(), 1.0)
            opt.step()
            window_losses[m["name"]].append(loss.item())
        step += 1
        if step == 5:
            steady = time.perf_counter()  # the first steps warm caches and kernels up
        if step == cfg["probe"]:  # fix the run's length from its speed so far
            per_step = (time.perf_counter() - steady) / (step - 5)
            total = min(total, max(step + 1, step + int((budget - (time.perf_counter() - start)) / per_step)))
            log(phase=name, probe_s_per_step=round(per_step, 4), steps=total, epochs=round(total / per_epoch, 3))
        if step % cfg["log_every"] == 0 or step == total:
            log(phase=name, step=step, lr=round(cfg["lr"] * factor, 8),
                **{f"loss_{k}": round(float(np.mean(v)), 4) for k, v in window_losses.items()})
            window_losses = {k: [] for k in window_losses}
    for m in models:
        m["reader"].eval()
    return {"steps": step, "epochs": round(step / per_epoch, 3), "seconds": round(time.perf_counter() - start, 1)}


def keep_top_spans(store: dict, scores, batch, questions: np.ndarray, windows: list, width: int, top: int = 4) -> None:
    """The teacher's `top` span scores of each window of the first pass (its question, text
    number, span start and width, fp16 score) and its null score: what a distillation on a CPU
    could train from, without the teacher."""
    import torch

    from ralm.data.reader_features import valid_spans
    from ralm.models.reader import NEG

    flat = scores.masked_fill(~valid_spans(batch, width), NEG).flatten(1)  # [N, L*W]
    values, at = torch.topk(flat, top, dim=1)
    store.setdefault("question", []).append(questions.astype(np.int32))
    store.setdefault("text", []).append(np.array([w[0] for w in windows], dtype=np.int8))
    store.setdefault("start", []).append((at // width).to(torch.int16).cpu().numpy())
    store.setdefault("width", []).append((at % width).to(torch.int8).cpu().numpy())
    store.setdefault("score", []).append(values.to(torch.float16).cpu().numpy())
    store.setdefault("null", []).append(scores[:, 0, 0].to(torch.float16).cpu().numpy())


def evaluate(readers: dict, eval_rows: list, featurizer, *, device, log: Log, deadline: float) -> dict:
    """EM on the calibration half for each reader: open (the pipeline's pick_answer over the top
    10 blocks, p(z|x) the softmax of their fused scores) and closed (the gold paragraph alone);
    the inputs are featurised once, by the student's tokenizer, and read by every reader."""
    import torch

    from ralm.eval.metrics import exact_match
    from ralm.pipeline import pick_answer, read_batch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    chunks = []
    for i in range(0, len(eval_rows), 32):
        rows = eval_rows[i : i + 32]
        qs = [q["q"] for q in rows for _ in q["texts"]] + [q["q"] for q in rows]
        texts = [t for q in rows for t in q["texts"]] + [q["gold"] for q in rows]
        chunks.append((rows, featurizer.featurize(qs, texts, max_len=featurizer.max_read_len)))
    out = {}
    for name, reader in readers.items():
        if time.perf_counter() > deadline:
            log(phase="eval_skipped", model=name)
            continue
        open_em, closed_em, p_null = [], [], []
        with torch.inference_mode():
            for rows, batch in chunks:
                read = read_batch(reader, batch, device=device, dtype=dtype)
                at, gold = 0, read[-len(rows):]
                for q, g in zip(rows, gold):
                    k = len(q["texts"])
                    r = pick_answer(torch.log_softmax(torch.tensor(q["scores"], dtype=torch.float32), 0), read[at : at + k])
                    at += k
                    open_em.append(exact_match(r.answer, q["a"]))
                    closed_em.append(exact_match(pick_answer(torch.zeros(1), [g]).answer, q["a"]))
                    p_null.append(r.signals.get("p_null", 0.0))
        out[name] = {"open_em": round(100 * float(np.mean(open_em)), 2), "closed_em": round(100 * float(np.mean(closed_em)), 2),
                     "mean_p_null": round(float(np.mean(p_null)), 4), "questions": len(open_em), "per_question_open": open_em,
                     "per_question_closed": closed_em}
        log(phase="eval", model=name, **{k: v for k, v in out[name].items() if not k.startswith("per_question")})
    return out


def save_delta(reader, init_state: dict, out: Path, name: str) -> None:
    """The reader's weights as int8 per-row deltas from `init_state` (1-D tensors as fp32
    deltas), in files of at most 15 MB, plus its config."""
    from safetensors.torch import save_file

    state = {k: v.detach().float().cpu() for k, v in reader.state_dict().items() if reader._is_trained(k)}
    parts = _in_parts((_packed(key, state[key] - init_state[key].float(), "full") for key in sorted(state)), 15_000_000)
    meta = {"null_span": json.dumps(reader.cfg.null_span), "max_len": str(reader.cfg.max_len)}
    for i, part in enumerate(parts, 1):
        save_file({k: v.contiguous() for k, v in part.items()}, str(out / f"{name}.part{i}.safetensors"), metadata=meta)


def train(args) -> None:
    import torch

    from ralm.data.reader_features import wordpiece_map
    from ralm.models.reader import Reader

    deadline = time.perf_counter() + args.budget
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out)
    data = Path(args.data)
    questions = _read_xz(data / "questions.jsonl.xz")[: args.limit]
    docs, blocks = _read_xz(data / "docs.jsonl.xz"), _read_xz(data / "blocks.jsonl.xz")
    eval_rows = _read_xz(data / "eval.jsonl.xz")[: args.eval_limit]
    log(phase="start", cpus=os.cpu_count(), questions=len(questions))
    # featurise before CUDA starts in this process: the workers are forked from it
    features = featurize_all(questions, docs, blocks, student=args.student, max_len=args.max_len, stride=args.stride,
                             distractors=args.distractors, workers=args.workers)
    log(phase="featurised", questions=len(features), windows=sum(len(f) for f in features),
        with_gold_span=round(float(np.mean([any(w[5] for w in f if w[0] == 0) for f in features])), 4),
        with_near_miss=round(float(np.mean([any(w[0] == NEAR for w in f) for f in features])), 4))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "cuda": torch.version.cuda}
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    log(phase="device", **info)
    torch.backends.cuda.matmul.allow_tf32 = True

    common = {"distractors": args.distractors, "no_answer_share": args.no_answer_share, "near_miss_share": args.near_miss_share,
              "warmup": 0.05, "seed": args.seed,
              "probe": args.probe, "log_every": args.log_every, "temperature": args.temperature}
    teacher = to_teacher = None
    results = {}
    student0 = Reader.from_pretrained(args.student, max_len=args.max_len, calibration=None)
    if args.teacher:
        teacher_dir = Path(args.teacher)
        if not (teacher_dir / "model.safetensors").is_file():
            unpack_encoder(sorted(teacher_dir.parent.glob(teacher_dir.name + "-t*")), teacher_dir)
        teacher = Reader.from_encoder(str(teacher_dir), max_len=args.max_len, null_span=True).to(device)
        to_teacher = wordpiece_map(student0.tokenizer, teacher.tokenizer).to(device)
        budget = min(args.teacher_budget, deadline - time.perf_counter() - args.reserve)
        results["teacher"] = run_phase("teacher", [{"name": "teacher", "reader": _TeacherView(teacher, to_teacher),
                                                    "distill": 0.0}],
                                       features=features, teacher=None,
                                       cfg={**common, "batch_size": args.teacher_batch, "lr": args.teacher_lr,
                                            "epochs": args.teacher_epochs, "distractors": args.teacher_distractors},
                                       budget=budget, log=log, device=device)
        teacher.eval().requires_grad_(False)
        log(phase="teacher_done", **results["teacher"])
    init_state = {k: v.detach().clone() for k, v in student0.state_dict().items()}
    models = [{"name": "hard", "reader": student0.to(device), "distill": 0.0}]
    if teacher is not None:
        kd = Reader.from_pretrained(args.student, max_len=args.max_len, calibration=None).to(device)
        models.append({"name": "kd", "reader": kd, "distill": args.distill})
    for m in models:
        m["reader"].cfg.null_span = True
    budget = deadline - time.perf_counter() - args.reserve
    store: dict = {}
    results["students"] = run_phase("students", models, features=features,
                                    teacher=None if teacher is None else _TeacherView(teacher, to_teacher),
                                    cfg={**common, "batch_size": args.batch_size, "lr": args.lr, "epochs": args.epochs},
                                    budget=budget, log=log, device=device, top_spans=store)
    log(phase="students_done", **results["students"])
    for m in models:
        save_delta(m["reader"], init_state, out, f"student_{m['name']}")
    if store:
        np.savez_compressed(out / "teacher_top_spans.npz", **{k: np.concatenate(v) for k, v in store.items()})
    log(phase="saved", files=sorted(p.name for p in out.iterdir()))
    readers = {m["name"]: m["reader"] for m in models}
    readers["shipped"] = Reader.from_pretrained(args.student, max_len=args.max_len, calibration=None).to(device).eval()
    if teacher is not None:
        readers["teacher"] = _TeacherView(teacher, to_teacher)
    evals = evaluate(readers, eval_rows, readers["shipped"].featurizer, device=device, log=log, deadline=deadline - 5)
    (out / "eval_per_question.json").write_text(json.dumps(
        {k: {"open": v.pop("per_question_open"), "closed": v.pop("per_question_closed")} for k, v in evals.items()}))
    log(phase="done", results=results, evals=evals)


class _TeacherView:
    """The teacher reading the student's featurised inputs, their ids mapped to its vocabulary
    (`wordpiece_map`), so one set of features serves both."""

    def __init__(self, teacher, to_teacher):
        self.teacher, self.to_teacher = teacher, to_teacher

    def __getattr__(self, name):
        return getattr(self.teacher, name)

    def __call__(self, batch):
        from dataclasses import replace

        return self.teacher(replace(batch, input_ids=self.to_teacher[batch.input_ids.to(self.to_teacher.device)]))


# -- unpack (CPU) ------------------------------------------------------------------------------

def unpack(args) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    from ralm.models.reader import Reader

    reader = Reader.from_pretrained(args.init, calibration=None)
    delta = {}
    files = sorted(Path(args.delta).parent.glob(Path(args.delta).name + ".part*.safetensors"))
    for f in files:
        delta.update(load_file(str(f)))
    with safe_open(str(files[0]), "pt") as f:
        cfg = {"null_span": json.loads(f.metadata()["null_span"])}
    state = reader.state_dict()
    new = {name: state[name].float() + d for name, d in _unpacked(delta).items()}
    missing = [k for k in state if reader._is_trained(k) and k not in new]
    if missing:
        raise SystemExit(f"{args.delta}: deltas miss {missing[:3]}")
    reader.load_state_dict(new, strict=False)
    reader.cfg.null_span = cfg["null_span"]
    reader.save_pretrained(args.out)
    print(json.dumps({"out": args.out, "tensors": len(new), "null_span": reader.cfg.null_span}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dev-index", default=None, help="the default index of squad_corpus + squad_dev_official_corpus")
    p.add_argument("--teacher-dir", default=None)
    p.add_argument("--distractors", type=int, default=4)
    p.add_argument("--limit", type=int, default=None)
    t = sub.add_parser("train")
    t.add_argument("--data", required=True)
    t.add_argument("--student", required=True)
    t.add_argument("--teacher", default=None, help="HF directory (or DIR whose DIR-t1, DIR-t2 ... hold pack_encoder's parts)")
    t.add_argument("--out", required=True)
    t.add_argument("--budget", type=float, default=540, help="seconds for the whole run")
    t.add_argument("--reserve", type=float, default=60, help="seconds kept for saving and evaluation")
    t.add_argument("--teacher-budget", type=float, default=170)
    t.add_argument("--teacher-epochs", type=float, default=1.0)
    t.add_argument("--teacher-batch", type=int, default=64)
    t.add_argument("--teacher-lr", type=float, default=5e-5)
    t.add_argument("--teacher-distractors", type=int, default=1)
    t.add_argument("--epochs", type=float, default=2.0)
    t.add_argument("--batch-size", type=int, default=64)
    t.add_argument("--lr", type=float, default=4e-5)
    t.add_argument("--distractors", type=int, default=3)
    t.add_argument("--no-answer-share", type=float, default=0.3)
    t.add_argument("--near-miss-share", type=float, default=0.5)
    t.add_argument("--distill", type=float, default=0.5)
    t.add_argument("--temperature", type=float, default=1.0)
    t.add_argument("--max-len", type=int, default=384)
    t.add_argument("--stride", type=int, default=128)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--probe", type=int, default=25, help="steps timed (from the 5th) to fix each phase's length")
    t.add_argument("--log-every", type=int, default=100)
    t.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    t.add_argument("--limit", type=int, default=None)
    t.add_argument("--eval-limit", type=int, default=None)
    u = sub.add_parser("unpack")
    u.add_argument("--delta", required=True, help="OUT/student_kd (its .partN.safetensors and .config.json)")
    u.add_argument("--init", required=True)
    u.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.cmd == "train" and args.probe <= 5:
        ap.error("--probe must be above 5 (the first 5 steps are not timed)")
    {"prepare": prepare, "train": train, "unpack": unpack}[args.cmd](args)


if __name__ == "__main__":
    main()
