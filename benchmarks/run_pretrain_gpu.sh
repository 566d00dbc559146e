#!/usr/bin/env bash
# Issue 2, point 5: the 1.2B Llama shape on 1 GPU and TP=2 on 2 GPUs, Lightning vs raw mcore,
# in one run on one machine. Results (JSON lines) go to ${OUT:-.}/pretrain_results.jsonl.
set -uo pipefail
OUT=${OUT:-.}
STEPS=${STEPS:-30}
run() {  # nproc, impl, extra args
  local n=$1; shift
  CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --standalone --nproc-per-node "$n" benchmarks/bench_pretrain.py \
    --steps "$STEPS" "$@" 2>&1 | tee -a "$OUT/pretrain_log.txt" | grep '^RESULT' | sed 's/^RESULT //' >> "$OUT/pretrain_results.jsonl"
}
for impl in raw lightning; do run 1 --impl $impl --mbs 1 --gbs 8; done
for impl in raw lightning; do run 2 --impl $impl --tp 2 --mbs 1 --gbs 8; done
cat "$OUT/pretrain_results.jsonl"
