#!/usr/bin/env bash
# Session 29's GPU work on one 4-GPU H200 machine: three queues started in a new process session (setsid), so
# that they outlive the device's 600-s calls, and `collect` to bring back what they wrote so far (one archive:
# the device returns only a few files a call). Before `start`: bash .gpu/kit/install.sh && source .gpu/kit/env.sh,
# bitsandbytes in /tmp/site and the real-text tokens in /tmp/text (run_issue49_gpu.sh's header says how).
#   GPU 0     run_issue49_gpu.sh's control of the FP8 base's loss margin (the bf16 base on mcore's local layers, one
#             GPU, the same 200 steps of real text as session 28's two runs)
#   GPUs 1,2  run_issue47_gpu.sh profile seed30, lora8b and 30b (HF at session 28's sweep's fastest: micro batch 4,
#             checkpointed, compiled), then sweepours30 (ours at micro batch 4 and 1, as HF was swept)
#   GPU 3     run_issue49_gpu.sh gptoss, then sweepqlora
# Everything lands in $Q (default /tmp/q29) as the scripts name it (TAG=s29); `collect` waits up to $WAIT seconds
# (default 0) for all three queues and archives $Q as $OUT/s29_q.tgz.
set -uo pipefail
Q=${Q:-/tmp/q29}
export TAG=s29 PYTHONUNBUFFERED=1
case ${1:?stage} in
  start)
    mkdir -p "$Q"
    for q in q0 q12 q3; do setsid bash "$0" $q > "$Q/$q.out" 2>&1 < /dev/null & done
    echo "queues started in $Q" ;;
  q0)
    OUT=$Q CONTROL_GPU=0 TIME_LIMIT=${TIME_LIMIT:-900} bash benchmarks/run_issue49_gpu.sh fgcontrol
    touch "$Q/q0.done" ;;
  q12)
    export CUDA_VISIBLE_DEVICES=1,2 OUT=$Q
    bash benchmarks/run_issue47_gpu.sh profile seed30
    bash benchmarks/run_issue47_gpu.sh profile lora8b
    HF30="--mbs 4 --ac --compile" bash benchmarks/run_issue47_gpu.sh profile 30b
    BUDGET=${SWEEP_BUDGET:-360} bash benchmarks/run_issue47_gpu.sh sweepours30
    touch "$Q/q12.done" ;;
  q3)
    OUT=$Q GPU=3 bash benchmarks/run_issue49_gpu.sh gptoss
    OUT=$Q GPU=3 bash benchmarks/run_issue49_gpu.sh sweepqlora
    touch "$Q/q3.done" ;;
  collect)
    for _ in $(seq "${WAIT:-0}"); do [ -f "$Q/q0.done" ] && [ -f "$Q/q12.done" ] && [ -f "$Q/q3.done" ] && break; sleep 1; done
    ls "$Q"; tail -n 3 "$Q"/*.out
    grep -h '^{' "$Q"/*.jsonl 2>/dev/null | grep -v '"STEP"' | cut -c1-300
    tar czf "${OUT:-.}/s29_q.tgz" -C "$Q" . ;;
  *) echo "unknown stage (start, q0, q12, q3, collect)"; exit 2 ;;
esac
