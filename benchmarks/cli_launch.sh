#!/usr/bin/env bash
set -u
# How the CLI starts its CPU ranks (benchmarks/RESULTS.md, session 21): `lightning-mcore fit
# --config configs/sft.yaml` (2 ranks, TP=2, 12 steps) with the default on CPU (rank 1 forked from
# the command's process, strategy/forked_ranks.py) and with start_method popen (rank 1 re-runs the
# command), alternating, REPEATS times each. Run from the repo root on an idle machine:
#   PYTHON=.venv/bin/python bash benchmarks/cli_launch.sh      (OUT: where cli_launch.jsonl goes)
# "rank1_s": seconds from the start until rank 1 says "Initializing distributed".
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
ROOT=$PWD
PY=${PYTHON:-python}
OUT=${OUT:-/tmp}
REPEATS=${REPEATS:-3}
export PYTHONPATH=$ROOT CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
nproc; $PY -c "import torch, megatron.core, lightning; print(torch.__version__, megatron.core.__version__, lightning.__version__)"
run() {  # label [extra args]
  rm -rf /tmp/cli_launch && mkdir -p /tmp/cli_launch && cp -r "$ROOT/configs" /tmp/cli_launch/ && cd /tmp/cli_launch
  s=$(date +%s%N)
  $PY -m lightning_mcore.cli fit --config configs/sft.yaml "${@:2}" 2>&1 | while IFS= read -r line; do
    case "$line" in *"GLOBAL_RANK: 1"*) echo "RANK1 $(date +%s%N)";; esac
    echo "$line"
  done > out.txt
  rc=${PIPESTATUS[0]}; e=$(date +%s%N)
  r1=$(grep -o "^RANK1 [0-9]*" out.txt | head -1 | cut -d' ' -f2)
  loss=$(grep -o "loss=[0-9.]*" out.txt | tail -1)
  echo "{\"label\": \"$1\", \"rc\": $rc, \"wall_s\": $(( (e - s) / 1000000 ))e-3, \"rank1_s\": $(( (${r1:-$s} - s) / 1000000 ))e-3, \"last\": \"$loss\"}" | tee -a "$OUT/cli_launch.jsonl"
  cd "$ROOT"
}
for _ in $(seq "$REPEATS"); do
  run forked
  run popen --trainer.strategy.init_args.start_method popen
done
