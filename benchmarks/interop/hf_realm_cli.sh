#!/bin/bash
# Every user-facing command on HF-REALM weights converted by `ralm convert hf-realm`.
# Needs the tiny models of a previous `python benchmarks/interop/hf_realm_compat.py --work HF` run.
# Random weights: the answers are meaningless; this shows the commands run on converted weights.
#   benchmarks/interop/hf_realm_cli.sh /tmp/hf-realm-compat /tmp/hfrealm
HF=${1:-/tmp/hf-realm-compat}
W=${2:-/tmp/hfrealm}
DATA=/work/shared/data
mkdir -p "$W" && cd "$W" || exit 1
rm -rf run idx pt ft
head -200 $DATA/squad_corpus.jsonl > corpus200.jsonl
grep '"Montana' $DATA/squad_dev.jsonl | head -5 > q5.jsonl
grep '"Beyonc' $DATA/squad_train.jsonl | head -20 > qtrain.jsonl
t() { local s=$(date +%s.%N); "$@" > last.out 2> last.err; local rc=$?; printf '%6.1f s  rc=%d  %s\n' "$(echo "$(date +%s.%N) - $s" | bc)" $rc "$*"; }
t ralm convert hf-realm "$HF/scorer" --out run --json
t ralm convert hf-realm "$HF/encoder" --out run --json
t ralm convert hf-realm "$HF/reader" --out run --json
t ralm index build corpus200.jsonl --out idx --model run/final/retriever --device cpu --json; cat last.out
t ralm search idx "Where does the state's name come from?" -k 3 --json
t ralm ask "Where does the state's name come from?" --model run --index idx -k 3 --json
t ralm eval qa --model run --index idx --questions q5.jsonl -k 3 --json; cat last.out
t ralm pretrain --corpus corpus200.jsonl --init run --model run/final/encoder --index idx --out pt --steps 2 --batch-size 2 -k 2 --refresh none --masking random --save-every 2 --device cpu --json
t ralm finetune --questions qtrain.jsonl --index idx --init run --out ft --steps 2 --batch-size 2 -k 2 --save-every 2 --device cpu --json
