#!/usr/bin/env bash
# Issue 50 on a 4-GPU H200 machine (what its text asks while no 8-GPU kind is lent): the layouts of the
# 8-GPU configs at half size, full fine-tuning, real text, every step's loss, one stage per call (each within
# the device's 600 s limit). Before the first: bash .gpu/kit/install.sh && source .gpu/kit/env.sh, and the
# real-text tokens in $TEXT (`python benchmarks/real_text.py --out .gpu/text --vocab 32768`, carried to the
# machine and copied to /tmp/text, as for run_issue49_gpu.sh).
#   moe30b   24 of Qwen3-30B-A3B's 48 layers (configs/qwen3_30b_a3b_sft.yaml's model: 128 experts, top-8, torch's
#            grouped experts, the permute and router fusions, full recompute), global batch 16, micro batch 1:
#            TP=2 + SP x EP=2 (DP=2), then PP=2 x EP=2 (DP=2); 40 steps each
#   dense8b  configs/llama3_8b_sft.yaml's layout: Llama-3-8B, TP=2 x PP=2 (DP=1), the distributed optimizer,
#            global batch 16, micro batch 1, 40 steps
# Memory (H200, 139 GiB to torch): the 24-layer model at TP=2 x EP=2 holds 64 experts a GPU split over
# expert-TP 2 (3.6 B parameters) at 18 bytes each (bf16 weight, fp32 gradient, fp32 master, Adam's two
# moments; expert data parallel 1) = 61 GiB, the dense rest ~5 GiB; PP=2 x EP=2: 12 layers x 64 experts
# unsplit, the same 3.6 B. Activations with full recompute: a few GiB.
# Raw lines (RESULT, with "label", and the losses) go to $OUT/${TAG}_<stage>.jsonl, logs to $OUT/${TAG}_<stage>.log.
# DRY_RUN=FILE: each command's GPU count, script and arguments go to FILE instead (tests/test_run_issue50_gpu.py).
set -uo pipefail
OUT=${OUT:-.}
TAG=${TAG:-s29}
TEXT=${TEXT:-/tmp/text}
NGPU=${NGPU:-4}
STEPS=${STEPS:-40}
stage=${1:?stage}
LOG=$OUT/${TAG}_$stage.log
JSONL=$OUT/${TAG}_$stage.jsonl
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True CUDA_DEVICE_MAX_CONNECTIONS=1

run() {  # label, seconds, then bench_pretrain.py's arguments
  local label=$1 seconds=$2; shift 2
  if [ -n "${DRY_RUN:-}" ]; then echo "$NGPU bench_pretrain.py $*" >> "$DRY_RUN"; return; fi
  echo "== $label: $*" >> "$LOG"
  timeout -k 15 "$seconds" torchrun --standalone --nproc-per-node "$NGPU" benchmarks/bench_pretrain.py "$@" 2>&1 \
    | tee -a "$LOG" | grep '^RESULT' | sed "s/^RESULT {/{\"label\": \"$label\", /" >> "$JSONL"
}
COMMON="--impl lightning --gbs 16 --mbs 1 --seq 4096 --steps $STEPS --warmup 5 --data $TEXT --losses"
MOE30="--shape qwen3-30b-a3b --layers 24 --experts torch --set moe_permute_fusion=true --set moe_router_fusion=true
  --recompute full"

case $stage in
  moe30b)
    run tp2sp-ep2 280 $COMMON $MOE30 --tp 2 --ep 2
    run pp2-ep2 280 $COMMON $MOE30 --pp 2 --ep 2 ;;
  dense8b)
    run tp2-pp2 400 $COMMON --shape llama-8b --tp 2 --pp 2 ;;
  *) echo "unknown stage $stage (moe30b, dense8b)"; exit 2 ;;
esac
[ -n "${DRY_RUN:-}" ] && exit 0
cut -c1-400 "$JSONL" 2>/dev/null; grep -i "error\|Traceback" "$LOG" 2>/dev/null | tail -5
