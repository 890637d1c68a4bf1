#!/usr/bin/env bash
# Retrain the reader shipped in src/ralm/data/demo/reader (used by `ralm demo`).
# The bundled MiniLM with its top 3 layers + span scorer trained (a 22 MB checkpoint), on the
# demo corpus's 845 training questions, reading the top-2 blocks of the demo's dense index with
# the retriever frozen (the cached demo index keeps matching). 500 steps x 8 questions (~4.7
# epochs): 30 min wall on 2 CPU cores shared with other jobs (1.5 s/step on an idle box).
# On the 10 sample questions (none in the training set) it got EM 50 / F1 61.7 on the index it was
# trained with, EM 50 / F1 50.0 on a 0.2.0 demo index (scaled scores, see benchmarks/RESULTS.md):
#   ralm eval qa --model src/ralm/data/demo/reader --index ~/.cache/ralm/demo-index-* \
#       --questions src/ralm/data/demo/questions.jsonl -k 3
set -euo pipefail
RUN=${1:-/tmp/demo-reader}
INDEX=$(python -c "import torch; from ralm.demo import demo_index; print(demo_index(torch.device('cpu'))[0])")
ralm finetune --questions src/ralm/data/demo/train.jsonl --index "$INDEX" --out "$RUN" \
  --trainable-layers 3 --freeze-retriever -k 2 --max-len 256 --steps 500 --batch-size 8 --lr 1e-4 \
  --save-every 100 --log-every 25 --json
rm -rf src/ralm/data/demo/reader
cp -r "$RUN/final/reader" src/ralm/data/demo/reader
