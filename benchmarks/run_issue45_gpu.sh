#!/usr/bin/env bash
# Issue 45 on GPU, one stage per call (each fits the device's 10-minute command limit):
#   families  tests/test_gpu_families.py (every family on TE in bf16 against transformers)
#   gptoss    GPT-OSS-20B's layers at EP=2, lightning vs raw mcore, interleaved
#   glm       GLM-4.5-Air's layers at EP=2, likewise
#   hybrid    the Qwen3.5-shaped hybrid on one GPU with flash-linear-attention's kernel (Triton 3.7.1
#             first on PYTHONPATH), raw vs lightning
# Results (JSON lines) go to ${OUT:-.}/s18_<stage>.jsonl, logs to ${OUT:-.}/s18_<stage>.log.
set -uo pipefail
OUT=${OUT:-.}
stage=$1
run() {  # stage, nproc, port, bench args
  local name=$1 n=$2 port=$3; shift 3
  CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc-per-node "$n" --master-port "$port" benchmarks/bench_pretrain.py "$@" \
    2>&1 | tee -a "$OUT/s18_$name.log" | grep '^RESULT' | sed 's/^RESULT //' >> "$OUT/s18_$name.jsonl"
}
case $stage in
  families)
    python -m pytest -q -s -p no:cacheprovider tests/test_gpu_families.py 2>&1 | tail -40 | tee "$OUT/s18_families.log" ;;
  gptoss)
    port=29611
    for impl in lightning raw lightning raw; do
      run gptoss 2 $((port++)) --impl $impl --shape gpt-oss-20b-layers --ep 2 --experts torch --steps 10 --warmup 4 --gbs 8
    done ;;
  glm)
    port=29621
    for impl in lightning raw; do
      run glm 2 $((port++)) --impl $impl --shape glm4.5-air-layers --ep 2 --experts torch --steps 10 --warmup 4 --gbs 8
    done ;;
  hybrid)
    export PYTHONPATH=/tmp/tri:${PYTHONPATH:-}
    port=29631
    for impl in raw lightning; do
      run hybrid 1 $((port++)) --impl $impl --shape qwen3.5-hybrid --steps 10 --warmup 4 --gbs 4
    done ;;
esac
cat "$OUT"/s18_"$stage".jsonl 2>/dev/null
