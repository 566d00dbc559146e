#!/usr/bin/env bash
# HF interop on GPU: random Llama-3-8B-shaped checkpoint -> TP=2 load -> export (2 GPUs).
set -uo pipefail
OUT=${OUT:-.}
python benchmarks/hf_load_8b.py make --out /tmp/llama8b 2>&1 | tee -a "$OUT/hf_log.txt" | grep -E "MADE|Error"
torchrun --standalone --nproc-per-node 2 benchmarks/hf_load_8b.py run --src /tmp/llama8b \
  2>&1 | tee -a "$OUT/hf_log.txt" | grep -E "^RESULT|Error" | tee -a "$OUT/hf_results.jsonl"
