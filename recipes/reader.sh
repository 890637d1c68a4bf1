#!/usr/bin/env bash
# The package's reader (src/ralm/data/reader), made by the product's own commands from a recipe
# file: recipes/reader-b.json is the shipped one's (benchmarks/RESULTS.md, "Reader training");
# RECIPE=recipes/reader.json makes the first candidate and RECIPE=recipes/reader-c.json the
# shipped reader trained 900 steps more, both measured and not shipped. Run from the repository
# root:
#
#   bash recipes/reader.sh [WORKDIR]        # default WORKDIR: runs
#
# Every step resumes where it stopped: the trainer from its last checkpoint (the same command
# continues a stopped leg), finished steps are skipped.
#  1. inputs: the reader of ralm 0.4 (git f0647ed) to start from (reader-c.json's: the shipped
#     reader, git ea0c28b), a BM25 index of the SQuAD training articles for distractors, the
#     default index of those + the official dev articles
#  2. ralm train-reader --recipe RECIPE (RUN/final/reader records its command, the recipe's
#     sha256, its config and the fingerprints of its data in made_by.json)
#  3. ralm export --format package: fp16 shards, as the package ships them. The package is what
#     is calibrated: a confidence map records the reader it was fitted with, and fp16 weights are
#     another reader to it
#  4. calibration: benchmarks/qa/selective.py runs `ralm eval qa --calibrate` per side (hybrid and
#     the fallback, dense, BM25) on the calibration half of the official dev questions (half of
#     their articles deleted), constructed near misses of its kept articles and generated corpora
#     of three sizes, each threshold at the coverage of the reader it replaces (ralm 0.4's answers
#     62.08% of the half's answerable questions at its 0.41), then reports on the held-out half
# Shipping it is a copy: cp WORKDIR/selective-NAME/reader/* src/ralm/data/reader/
set -euo pipefail
W=${1:-runs}
DATA=${DATA:-../shared/data}
RECIPE=${RECIPE:-recipes/reader-b.json}
NAME=$(basename "$RECIPE" .json)
mkdir -p "$W"

[ -f "$W/reader-0.4/config.json" ] || { mkdir -p "$W/reader-0.4" &&
  git archive f0647ed src/ralm/data/reader | tar -x --strip-components=4 -C "$W/reader-0.4"; }
[ -f "$W/reader-b-package/config.json" ] || { mkdir -p "$W/reader-b-package" &&
  git archive ea0c28b src/ralm/data/reader | tar -x --strip-components=4 -C "$W/reader-b-package"; }
[ -f "$W/squad-bm25/LATEST" ] || ralm index build "$DATA/squad_corpus.jsonl" --out "$W/squad-bm25" --retriever bm25 --json
[ -f "$W/dev-corpus.jsonl" ] || cat "$DATA/squad_corpus.jsonl" "$DATA/squad_dev_official_corpus.jsonl" > "$W/dev-corpus.jsonl"
[ -f "$W/dev/LATEST" ] || ralm index build "$W/dev-corpus.jsonl" --out "$W/dev" --json

# the recipe names runs/... paths: run it from a WORKDIR of runs, or edit its inputs
ralm train-reader --recipe "$RECIPE" --out "$W/$NAME" --json
[ -d "$W/$NAME-package" ] || ralm export "$W/$NAME" --format package --out "$W/$NAME-package" --json
python benchmarks/qa/selective.py --index "$W/dev" --work "$W/selective-$NAME" --reader "$W/$NAME-package" \
  --coverage 0.6208 --swaps "${SWAPS:-240}"
du -sh "$W/selective-$NAME/reader"
