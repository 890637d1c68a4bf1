#!/usr/bin/env bash
# A successor to the package's reader (src/ralm/data/reader), made by the product's own commands
# from recipes/reader.json. Its last run was measured and not shipped: it declines more of what a
# corpus does not state, but loses SQuAD EM (benchmarks/RESULTS.md, "Reader training"); the package
# still ships the reader of ralm 0.4. Run from the repository root:
#
#   bash recipes/reader.sh [WORKDIR]        # default WORKDIR: runs
#
# Every step resumes where it stopped: the trainer from its last checkpoint (the same command
# continues a stopped leg), finished steps are skipped.
#  1. inputs: the reader of ralm 0.4 (git f0647ed) to start from, a BM25 index of the SQuAD
#     training articles for distractors, the default index of those + the official dev articles
#  2. ralm train-reader --recipe recipes/reader.json (RUN/final/reader records its command, the
#     recipe's sha256, its config and the fingerprints of its data in made_by.json)
#  3. calibration: benchmarks/qa/selective.py runs `ralm eval qa --calibrate` per side (hybrid and
#     the fallback, dense, BM25) on the calibration half of the official dev questions (half of
#     their articles deleted) and generated corpora of three sizes, then reports on the held-out half
#  4. ralm export --format package: fp16 shards, as the package ships them
# Shipping a reader that wins on the calibration half is a copy: cp WORKDIR/reader-package/* src/ralm/data/reader/
set -euo pipefail
W=${1:-runs}
DATA=${DATA:-../shared/data}
mkdir -p "$W"

[ -f "$W/reader-0.4/config.json" ] || { mkdir -p "$W/reader-0.4" &&
  git archive f0647ed src/ralm/data/reader | tar -x --strip-components=4 -C "$W/reader-0.4"; }
[ -f "$W/squad-bm25/LATEST" ] || ralm index build "$DATA/squad_corpus.jsonl" --out "$W/squad-bm25" --retriever bm25 --json
[ -f "$W/dev-corpus.jsonl" ] || cat "$DATA/squad_corpus.jsonl" "$DATA/squad_dev_official_corpus.jsonl" > "$W/dev-corpus.jsonl"
[ -f "$W/dev/LATEST" ] || ralm index build "$W/dev-corpus.jsonl" --out "$W/dev" --json

# the recipe names runs/... paths: run it from a WORKDIR of runs, or edit its inputs
ralm train-reader --recipe recipes/reader.json --out "$W/reader-0.5" --json
python benchmarks/qa/selective.py --index "$W/dev" --work "$W/selective" --reader "$W/reader-0.5"
[ -d "$W/reader-package" ] || ralm export "$W/selective/reader" --format package --out "$W/reader-package" --json
du -sh "$W/reader-package"
