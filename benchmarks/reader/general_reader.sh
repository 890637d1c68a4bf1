#!/usr/bin/env bash
# The recipe of the general-purpose reader shipped in src/ralm/data/reader (what `ralm ask`,
# `eval qa`, `serve` and `demo` use without --model), as it was trained. Run from the repository root:
#
#   bash benchmarks/reader/general_reader.sh [WORKDIR]        # default WORKDIR: runs/general-reader
#
# Every stage resumes where it stopped (trainers from their last checkpoint, finished stages are
# skipped), so rerunning the same command after a crash continues the run. Every training stage
# uses the reading objective: one softmax shared by all spans of all windows and blocks read for
# a question (shared normalisation; docs/openqa.md).
#  1. Gold-paragraph (SQuAD-style) training of all layers of the bundled MiniLM, windows of 256
#     wordpieces with stride 128, in three legs, each starting from the previous leg's packed weights:
#       leg 1: the first 32,000 questions of squad_train.jsonl in the trainer's seed-0 order, lr 1e-4
#       leg 2: 38,400 of the 46,449 questions leg 1 did not see, lr 5e-5
#       leg 3: the 8,049 never seen + 23,951 of the 70,400 seen once (a second pass), lr 3e-5
#     (LEG_STEPS x 16 questions each; every question once, 23,951 of them twice).
#     INIT=DIR skips these legs and starts stage 2 from that reader (the shipped reader's stage 2
#     started from INIT=DIR holding these legs' result, the package's reader before it).
#  2. Distractor legs (DISTRACTOR_STEPS, one number per leg; "" skips the stage): each question's
#     gold paragraph plus the top 3 blocks of other articles from a BM25 index over
#     squad_corpus.jsonl, every window of them in one shared softmax (models/reader.py
#     `shared_nll`), 32 questions a step, windows of 384 (a whole 288-wordpiece block), each leg
#     from the previous leg's pack with its own seed (the leg's number - 1: a new question order),
#     learning rate DISTRACTOR_LR with DISTRACTOR_WARMUP steps of warm-up, then linear decay.
#     The shipped reader: legs of 306, 520, 500 and 300 steps (51,968 questions), lr 3e-5, 3e-5,
#     2e-5, 1.5e-5; the first three on one H100 in 6.7 min of training (2.0-5.4 steps/s), the
#     fourth on a 2-core CPU in 61 min (12.2 s a step).
#  2b. The GPU stage (benchmarks/reader/reader_gpu.py; not run by this script: it needs a GPU lease and
#     its files travel both ways): from the reader of stage 2, students on all of SQuAD train
#     with the answer rule's labels, the null span (30% of questions read without their gold
#     paragraph, half of those a near miss) and 4 distractors, one also distilled from a teacher
#     (all-mpnet-base-v2 fine-tuned in the same lease), returned as int8 deltas and unpacked.
#     The shipped reader is the mean of two students' weights (a model soup, 0.17 and 0.38
#     epoch), the best on the calibration half: the same EM as stage 2's held out, a better
#     confidence (benchmarks/RESULTS.md, "Reader training"). Give a candidate here as INIT=DIR
#     with DISTRACTOR_STEPS="" to calibrate and measure it.
#  3. Optional (OPEN_STEPS > 0): open-domain fine-tuning (the same objective over the top 5 blocks
#     of a dense index over squad_corpus.jsonl, p(z|x) from retrieval, retriever frozen). 500 steps of its earlier,
#     per-block form lowered held-out EM by about a point (benchmarks/RESULTS.md): OPEN_STEPS=0.
#  4. Pack: fp16 weights in two safetensors shards (45 MB; no file over 30 MB) -> WORKDIR/reader.
#  5. Calibrate (benchmarks/qa/selective.py): a two-stage map per index kind and a fallback map, fitted on the odd
#     lines of squad_dev_official.jsonl (articles no model here was trained on) over the default
#     hybrid index of the SQuAD corpus + those articles, with half of the questions' articles
#     deleted from it; EM/F1 and a reliability plot on the even lines.
# Shipping it is a copy: cp WORKDIR/reader-calibrated/* src/ralm/data/reader/
#
# The stage-1 legs of the shipped weights ran on a 2-core CPU under the earlier per-window objective (only
# windows holding the answer, each normalised alone), with two schedule changes at resumes (leg 1
# ran 1,200 steps and was resumed to 2,000; leg 2 was shortened from 2,900 to 2,400 steps at
# step 800): a clean run follows the same data and settings, not the same learning-rate curve.
# About 2.3 h of training on that CPU; this script has not been rerun end to end there.
# Knobs: DATA (the data folder), LEG_STEPS ("2000 2400 2000"), BATCH (16), INIT (none),
# DISTRACTOR_STEPS ("306 520 500 300"), DISTRACTOR_LR ("3e-5 3e-5 2e-5 1.5e-5"), DISTRACTOR_WARMUP ("16 25 25 15"),
# OPEN_STEPS (0), DEVICE (auto), DTYPE (auto: bf16 on CUDA and on CPUs with native bf16).
set -euo pipefail
W=${1:-runs/general-reader}
DATA=${DATA:-../shared/data}
read -r -a LEG_STEPS <<< "${LEG_STEPS:-2000 2400 2000}"
LR=(1e-4 5e-5 3e-5)
WARMUP=(200 100 100)
BATCH=${BATCH:-16}
read -r -a DISTRACTOR_STEPS <<< "${DISTRACTOR_STEPS-306 520 500 300}"
read -r -a DISTRACTOR_LR <<< "${DISTRACTOR_LR:-3e-5 3e-5 2e-5 1.5e-5}"
read -r -a DISTRACTOR_WARMUP <<< "${DISTRACTOR_WARMUP:-16 25 25 15}"
OPEN_STEPS=${OPEN_STEPS:-0}
INIT=${INIT:-}
OPT=(--device "${DEVICE:-auto}" --dtype "${DTYPE:-auto}")
mkdir -p "$W"

pack() {  # fp16 copy of a trained reader (loading casts it back to fp32): word embeddings | the rest
  rm -rf "$2.tmp" && cp -r "$1" "$2.tmp"
  python - "$2.tmp" <<'EOF'
import sys
from pathlib import Path
from safetensors.torch import load_file, save_file
d = Path(sys.argv[1])
state = load_file(str(d / "model.safetensors"))
emb = sorted(k for k in state if "word_embeddings" in k)
rest = sorted(k for k in state if k not in emb)
for i, part in enumerate((emb, rest), 1):
    save_file({k: state[k].half().contiguous() for k in part}, str(d / f"model-0000{i}-of-00002.safetensors"),
              metadata={"format": "ralm.reader/1"})
(d / "model.safetensors").unlink()
EOF
  rm -rf "$2" && mv "$2.tmp" "$2"
}

init=()
if [ -n "$INIT" ]; then
  init=(--init "$INIT")
else
# The legs' question files: leg 1 reads squad_train.jsonl itself; the trainer visits it in the
# seed-0 permutation of `batch_indices`, so the questions it saw are known without running it.
[ -f "$W/leg3.jsonl" ] || python - "$DATA/squad_train.jsonl" "$W" "$BATCH" "${LEG_STEPS[@]}" <<'EOF'
import sys
from pathlib import Path
import numpy as np
from ralm.atomic import atomic_path
from ralm.train.parallel import batch_indices
train, work, batch, s1, s2, s3 = sys.argv[1], Path(sys.argv[2]), *map(int, sys.argv[3:])
lines = Path(train).read_text(encoding="utf-8").splitlines(keepends=True)
if (s1 + s2) * batch > len(lines):
    sys.exit(f"legs 1 and 2 ({s1} + {s2} steps x {batch}) pass one epoch of {len(lines)} questions")
order = batch_indices(0, len(lines), len(lines), seed=0)  # the trainer's seed-0 order (first epoch)
first, unseen = order[: s1 * batch], order[s1 * batch :]  # leg 1 reads `first`; leg 2 `unseen`, in this order
second = batch_indices(0, s2 * batch, len(unseen), seed=0)  # the positions of `unseen` that leg 2 reads
never = np.delete(unseen, second)  # leg 2 did not reach them
once = np.sort(np.concatenate([first, unseen[second]]))
again = np.random.default_rng(4).choice(once, max(0, s3 * batch - len(never)), replace=False)
for name, rows in (("leg2", unseen), ("leg3", np.concatenate([never, again]))):
    with atomic_path(work / f"{name}.jsonl") as tmp:
        tmp.write_text("".join(lines[i] for i in rows), encoding="utf-8")
print(f"legs: {len(first)} | {len(second)} of {len(unseen)} | {len(never)} never seen + {len(again)} again")
EOF

for leg in 1 2 3; do
  questions="$DATA/squad_train.jsonl"; [ "$leg" = 1 ] || questions="$W/leg$leg.jsonl"
  [ -d "$W/leg$leg-packed" ] || {
    ralm train-reader --questions "$questions" --corpus "$DATA/squad_corpus.jsonl" "${init[@]}" --out "$W/leg$leg" \
      --steps "${LEG_STEPS[leg-1]}" --batch-size "$BATCH" --lr "${LR[leg-1]}" --warmup "${WARMUP[leg-1]}" \
      --max-len 256 --stride 128 --save-every 200 "${OPT[@]}" --json
    pack "$W/leg$leg/final/reader" "$W/leg$leg-packed"; }
  init=(--init "$W/leg$leg-packed")
done
fi

[ "${#DISTRACTOR_STEPS[@]}" -eq 0 ] || [ -f "$W/squad-bm25/LATEST" ] ||
  ralm index build "$DATA/squad_corpus.jsonl" --out "$W/squad-bm25" --retriever bm25 --json
for i in "${!DISTRACTOR_STEPS[@]}"; do
  leg=d$((i + 1)); steps=${DISTRACTOR_STEPS[i]}
  [ -d "$W/$leg-packed" ] || {
    ralm train-reader --questions "$DATA/squad_train.jsonl" --corpus "$DATA/squad_corpus.jsonl" "${init[@]}" \
      --index "$W/squad-bm25" --distractors 3 --out "$W/$leg" --steps "$steps" --batch-size 32 --seed "$i" \
      --lr "${DISTRACTOR_LR[i]}" --warmup "${DISTRACTOR_WARMUP[i]}" --max-len 384 --stride 128 --save-every 250 \
      "${OPT[@]}" --json
    pack "$W/$leg/final/reader" "$W/$leg-packed"; }
  init=(--init "$W/$leg-packed")
done

if [ "$OPEN_STEPS" -gt 0 ]; then  # over the training articles' corpus only
  [ -f "$W/squad-dense/LATEST" ] ||
    ralm index build "$DATA/squad_corpus.jsonl" --out "$W/squad-dense" --retriever dense "${OPT[@]}" --json
  ralm finetune --questions "$DATA/squad_train.jsonl" --index "$W/squad-dense" "${init[@]}" --out "$W/open" \
    --freeze-retriever -k 5 --steps "$OPEN_STEPS" --batch-size "$BATCH" --lr 3e-5 --warmup 30 --max-len 384 \
    --save-every 50 "${OPT[@]}" --json
  [ -d "$W/open-packed" ] || pack "$W/open/final/reader" "$W/open-packed"
  init=(--init "$W/open-packed")
fi
rm -rf "$W/reader" && cp -r "${init[1]}" "$W/reader"

# calibrate on one half of the official-dev questions (half of them with their article deleted
# from the index), measure on the other (reading defaults); the calibrated reader is $W/reader-calibrated
[ -f "$W/dev-corpus.jsonl" ] || cat "$DATA/squad_corpus.jsonl" "$DATA/squad_dev_official_corpus.jsonl" > "$W/dev-corpus.jsonl"
[ -f "$W/dev/LATEST" ] || ralm index build "$W/dev-corpus.jsonl" --out "$W/dev" "${OPT[@]}" --json
awk 'NR % 2 == 0' "$DATA/squad_dev_official.jsonl" > "$W/heldout.jsonl"
python benchmarks/qa/selective.py --index "$W/dev" --work "$W/selective" --reader "$W/reader" --kinds hybrid,dense,bm25
rm -rf "$W/reader-calibrated" && cp -r "$W/selective/reader" "$W/reader-calibrated"
ralm eval qa --model "$W/reader-calibrated" --index "$W/dev" --questions "$W/heldout.jsonl" \
  --predictions "$W/heldout.predictions.jsonl" "${OPT[@]}" --json
python benchmarks/qa/reliability.py "$W/heldout.predictions.jsonl" --out "$W/reader_reliability.png"
du -sh "$W/reader"
