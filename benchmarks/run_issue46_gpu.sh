#!/usr/bin/env bash
# Issue 46 on 2 GPUs, one stage per call (each within the device's 10-minute command limit):
#   grpo  make the Qwen3-30B-A3B-shaped 8-layer model, then GRPO + LoRA at EP=2, replay off and r3
#   hf    transformers' generate of the same rollout shape on one GPU: eager and static cache (compiled)
# Results (JSON lines) go to ${OUT:-.}/s23_<stage>.jsonl, logs to ${OUT:-.}/s23_<stage>.log.
set -uo pipefail
OUT=${OUT:-.}
stage=$1
MODEL=/tmp/moe_a3b_8l
log() { tee -a "$OUT/s23_$stage.log" | grep '^RESULT' | sed 's/^RESULT //' >> "$OUT/s23_$stage.jsonl"; }
case $stage in
  grpo)
    [ -f $MODEL/config.json ] || python benchmarks/bench_moe_grpo.py make --out $MODEL --layers 8 2>&1 | tail -2
    for replay in off r3; do
      CUDA_DEVICE_MAX_CONNECTIONS=1 python benchmarks/bench_moe_grpo.py grpo --model $MODEL --replay $replay --steps 3 2>&1 | log
    done ;;
  hf)
    for impl in hf-eager hf-static; do
      CUDA_VISIBLE_DEVICES=0 python benchmarks/bench_moe_grpo.py hf --model $MODEL --impl $impl --rows 64 2>&1 | log
    done ;;
esac
cat "$OUT"/s23_"$stage".jsonl 2>/dev/null; grep -i "error\|Traceback" "$OUT/s23_$stage.log" | tail -5
