#!/usr/bin/env bash
# Issue 49 on 2 GPUs of one H200 machine, one stage per call (each within the device's 600 s limit).
# Before the first: bash .gpu/kit/install.sh && source .gpu/kit/env.sh, bitsandbytes installed for `ep2`'s
# QLoRA baseline, and the real-text tokens (benchmarks/real_text.py) in $TEXT. Session 27 brought both in
# the ignored .gpu/: `pip download bitsandbytes==0.50.2 --no-deps -d .gpu/bnb` (43 MB, carried with .gpu/kit
# to the install call: python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/bnb/*.whl) and
# `python benchmarks/real_text.py --out .gpu/text --vocab 32768` (18 MB, carried alone, copied to /tmp/text).
#   one30  GPU 0: Qwen3-30B-A3B (all 48 layers, random weights) LoRA r8 on every linear, experts included,
#          over an FP8 base on ONE GPU with torch's allocator capped at 78 GiB (an 80 GB H100 leaves torch
#          ~79 GiB), mcore's local layers (what an fp8 base runs on) and torch's grouped experts, full
#          recompute, seq 4096, global batch 2, real text, up to 200 steps (each step's loss printed)
#          GPU 1 meanwhile: dequant_speed.py; then Llama-3-8B-shape LoRA r16 with a bf16 base (TE layers,
#          and mcore's local layers), an fp8 base and an nf4 base (local layers), 10 steps each
#   ep2    the same Qwen3-30B-A3B LoRA with the bf16 base on 2 GPUs at EP=2 (TE layers, torch's grouped
#          experts: the recipe's layout), the same rows and steps: the loss curve the FP8 one is held to;
#          then ours (nf4 base) against HF + peft + bitsandbytes QLoRA, Llama-3-8B shape, one GPU each at
#          the same time, then again with the GPUs swapped
#   bg30   4 GPUs: both 30B runs above at once (fp8 on GPU $FP8_GPU, default 0; bf16 at EP=2 on $EP2_GPUS, default
#          2,3), all 200 steps, started in a new session (setsid) so that they outlive the call; logs in $BG;
#          with CONTROL_GPU set, on that GPU the control of the FP8 run's loss margin: the bf16 base on mcore's
#          local layers on one GPU, uncapped (what separates the FP8 base from the layers and the layout)
#   control30  bg30's control alone, in a new session (session 28 ran the other two runs): the bf16 base on mcore's local
#          layers on GPU $CONTROL_GPU (default 0), uncapped; `collect` waits for it as for bg30
#   eight  one GPU ($GPU, default 1): the 8B bases of one30, then HF + peft + bitsandbytes QLoRA on the same GPU
#   qlora  one GPU ($GPU, default 1): HF + peft + bitsandbytes QLoRA, then ours with the nf4 base (eight's pair in the
#          other order)
#   sweepqlora one GPU ($GPU, default 1): HF + peft + bitsandbytes QLoRA swept as issue 47 sweeps HF: eager at micro
#          batch 1, 2, 4 (one process, ends at the first OOM), then each decoder layer compiled (torch.compile) at 1, 2, 4
#   gptoss one GPU ($GPU, default 1): dequant_speed.py (each codec's fused kernel against its eager ops, mxfp4's
#          first time on a GPU), then 4 layers of GPT-OSS-20B (its 201k vocabulary), LoRA r16 on every linear, mcore's
#          local layers: the base in bf16, then MXFP4 (the format its experts are published in), then NF4
#   fp8gemm real FP8 GEMMs (LoRAConfig.base_gemm "fp8", lora/fp8_gemm.py): on GPU ${GPU:-0} their kernels against the
#          hand computation (tests/test_gpu_lora_fp8_gemm.py), then Llama-3-8B LoRA r16 over the fp8 base dequantized into
#          bf16 GEMMs, and by FP8 GEMMs on GPU ${GPU8B:-3} at the same time, 10 steps each; meanwhile one30's Qwen3-30B-A3B run (78 GiB cap, real text) for
#          ${STEPS30:-50} steps by FP8 GEMMs on GPU ${GPU30:-1} and dequantized on GPU ${GPU30B:-2}: speed, and the loss step by step
#          (ONLY30 set: the 30B pair alone)
#   fp8check fp8gemm's kernel test, then its two 8B runs profiled side by side on two GPUs (writing a profile's
#          tables takes a minute or more after the last step: session 29's were cut before, at 110 s a run)
#   sweepnf4 one GPU ($GPU, default 1): ours over the NF4 base of eight/qlora at micro batch 2 and 4 (HF's QLoRA was
#          swept in sweepqlora; ours had run at 1 only)
#   collect waits up to $WAIT seconds (default 540) for bg30's runs, then copies their raw lines to $OUT and their logs
#          as one archive, ${TAG}_bg30_logs.tgz
#   grow   the check of session 27's fix: 8 layers of the Llama-3-8B shape over an fp8 base without recompute, the allocator's history
#          (steps 2-4) written to $OUT/${TAG}_grow_fp8_snapshot.pickle; with recompute and nf4 on GPU 1
# Raw lines (RESULT and STEP, each with its "label") go to $OUT/${TAG}_<stage>.jsonl, logs to
# $OUT/${TAG}_<stage>_<label>.log. DRY_RUN=FILE: each command's GPUs and arguments go to FILE instead of running.
set -uo pipefail
OUT=${OUT:-.}
TAG=${TAG:-s28}
TEXT=${TEXT:-/tmp/text}
BG=${BG:-/tmp/bg30}
stage=${1:?stage}
JSONL=$OUT/${TAG}_$stage.jsonl

job() {  # label, GPUs (CUDA_VISIBLE_DEVICES), seconds, then the command
  local label=$1 gpus=$2 seconds=$3; shift 3
  if [ -n "${DRY_RUN:-}" ]; then echo "$gpus $*" >> "$DRY_RUN"; return; fi  # tests/test_run_queues_gpu.py
  echo "== $label on GPU $gpus: $*" > "$OUT/${TAG}_${stage}_$label.log"
  CUDA_VISIBLE_DEVICES=$gpus timeout -k 10 "$seconds" "$@" >> "$OUT/${TAG}_${stage}_$label.log" 2>&1
  echo "== $label exit $?" >> "$OUT/${TAG}_${stage}_$label.log"
  grep -E '^(RESULT|STEP) ' "$OUT/${TAG}_${stage}_$label.log" \
    | sed -E "s/^(RESULT|STEP) \{/{\"label\": \"$label\", \"line\": \"\1\", /" >> "$JSONL"
}
LORA30="benchmarks/bench_lora_sft.py --shape qwen3-30b-a3b --experts torch --rank 8 --alpha 32 --recompute --seq 4096
  --samples-per-row 1 --gbs 2 --mbs 1 --steps 200 --lr 1e-3 --data $TEXT --losses --time-limit ${TIME_LIMIT:-390}"
QLORA8B="benchmarks/hf_fsdp2.py --qlora --shape llama-8b --lora-rank 16 --lora-alpha 32 --data sft --gbs 8 --steps 10
  --warmup 4 ${HFQLORA:---mbs 1}"
GPU_TEST='import sys; sys.path[:0] = ["tests"]; import test_gpu_lora_fp8_gemm as t
for n in [n for n in vars(t) if n.startswith("test_")]: getattr(t, n)(); print("passed", n)'  # no pytest on the GPU machine
LORA8B="benchmarks/bench_lora_sft.py --shape llama-8b --rank 16 --alpha 32 --samples-per-row 1 --gbs 8 --steps 10 --losses"

case $stage in
  one30)
    job fp8-1gpu 0 555 python $LORA30 --impl local --base-precision fp8 --memory-cap-gib 78 &
    one=$!
    (
      [ -n "${SKIP_DEQUANT:-}" ] || job dequant 1 120 python benchmarks/dequant_speed.py
      job 8b-bf16-te 1 110 python $LORA8B
      for p in bf16 fp8 nf4; do job "8b-$p-local" 1 110 python $LORA8B --impl local --base-precision $p; done
    ) &
    other=$!
    wait $one $other ;;
  ep2)
    job bf16-ep2 0,1 ${EP2_SECONDS:-300} torchrun --standalone --nproc-per-node 2 $LORA30 --ep 2
    for k in $(seq 1 ${PAIRS:-2}); do
      [ $k = 1 ] && a=0 b=1 || a=1 b=0
      job "ours-nf4-$k" $a 110 python $LORA8B --impl local --base-precision nf4 &
      first=$!
      job "hf-qlora-$k" $b 110 python $QLORA8B &
      second=$!
      wait $first $second
    done ;;
  bg30)
    mkdir -p "$BG"
    OUT=$BG TIME_LIMIT=${TIME_LIMIT:-1500} setsid bash "$0" fg30 > "$BG/fg30.out" 2>&1 < /dev/null &
    echo "the 30B runs started in $BG"
    exit 0 ;;
  control30)
    mkdir -p "$BG"
    OUT=$BG TIME_LIMIT=${TIME_LIMIT:-1500} setsid bash "$0" fgcontrol > "$BG/fgcontrol.out" 2>&1 < /dev/null &
    echo "the control run started in $BG"
    exit 0 ;;
  fgcontrol)  # control30's run (in the foreground of its new session)
    job bf16-local-1gpu "${CONTROL_GPU:-0}" 1600 python $LORA30 --impl local
    touch "$OUT/done"
    exit 0 ;;
  fg30)  # bg30's runs (in the foreground of its new session)
    job fp8-1gpu "${FP8_GPU:-0}" 1600 python $LORA30 --impl local --base-precision fp8 --memory-cap-gib 78 &
    one=$!
    job bf16-ep2 "${EP2_GPUS:-2,3}" 1600 torchrun --standalone --nproc-per-node 2 $LORA30 --ep 2 &
    two=$!
    three=""
    if [ -n "${CONTROL_GPU:-}" ]; then
      job bf16-local-1gpu "$CONTROL_GPU" 1600 python $LORA30 --impl local &
      three=$!
    fi
    wait $one $two $three
    touch "$OUT/done"
    exit 0 ;;
  eight)
    g=${GPU:-1}
    job 8b-bf16-te "$g" 110 python $LORA8B
    for p in bf16 fp8 nf4; do job "8b-$p-local" "$g" 110 python $LORA8B --impl local --base-precision $p; done
    job hf-qlora "$g" 110 python $QLORA8B ;;
  qlora)
    g=${GPU:-1}
    job hf-qlora-2 "$g" 110 python $QLORA8B
    job ours-nf4-2 "$g" 110 python $LORA8B --impl local --base-precision nf4 ;;
  sweepqlora)
    g=${GPU:-1}
    job hf-qlora-eager "$g" 300 python $QLORA8B --mbs 1,2,4  # the last --mbs counts
    job hf-qlora-compiled "$g" 300 python $QLORA8B --mbs 1,2,4 --compile ;;
  sweepnf4)
    g=${GPU:-1}
    for m in 2 4; do job "ours-nf4-mbs$m" "$g" 150 python $LORA8B --impl local --base-precision nf4 --mbs $m; done ;;
  gptoss)
    g=${GPU:-1}
    job dequant "$g" 150 python benchmarks/dequant_speed.py
    for p in bf16 mxfp4 nf4; do
      job "gptoss-$p" "$g" 150 python benchmarks/bench_lora_sft.py --shape gpt-oss-20b-layers --experts torch --rank 16 \
        --alpha 32 --samples-per-row 1 --gbs 8 --steps 10 --losses --impl local --base-precision $p
    done ;;
  fp8gemm)
    g=${GPU:-0} n=${STEPS30:-50}
    job fp8gemm-30b ${GPU30:-1} 500 python $LORA30 --impl local --base-precision fp8 --base-gemm fp8 --memory-cap-gib 78 --steps $n &
    one=$!
    job bf16gemm-30b ${GPU30B:-2} 500 python $LORA30 --impl local --base-precision fp8 --memory-cap-gib 78 --steps $n &
    two=$!
    three="" four=""
    if [ -z "${ONLY30:-}" ]; then
      job gpu-test "$g" 150 python -c "$GPU_TEST"
      job 8b-fp8-bf16gemm "$g" 110 python $LORA8B --impl local --base-precision fp8 &
      three=$!
      job 8b-fp8-fp8gemm "${GPU8B:-3}" 110 python $LORA8B --impl local --base-precision fp8 --base-gemm fp8 &
      four=$!
    fi
    wait $one $two $three $four ;;
  fp8check)  # fp8gemm's kernel test again, then the two 8B runs profiled (torch.profiler, 3 steps: DIR/rank0.txt) on
             # GPUs $GPU (default 0) and ${GPU8B:-1}
    g=${GPU:-0}
    job gpu-test "$g" 100 python -c "$GPU_TEST"
    job 8b-fp8-bf16gemm-profile "$g" 240 python $LORA8B --steps 6 --impl local --base-precision fp8 \
      --profile "$OUT/${TAG}_profile_8b_bf16gemm" &
    one=$!
    job 8b-fp8-fp8gemm-profile "${GPU8B:-1}" 240 python $LORA8B --steps 6 --impl local --base-precision fp8 --base-gemm fp8 \
      --profile "$OUT/${TAG}_profile_8b_fp8gemm" &
    two=$!
    wait $one $two ;;
  collect)
    for _ in $(seq "${WAIT:-540}"); do [ -f "$BG/done" ] && break; sleep 1; done
    [ -f "$BG/done" ] || echo "collect: the 30B runs are still going; copying what they wrote so far"
    # the raw lines as files, the logs in one archive (the device returns only a few files a call)
    cp "$BG"/*.jsonl "$OUT"/ 2>/dev/null
    tar czf "$OUT/${TAG}_bg30_logs.tgz" -C "$BG" . 2>/dev/null
    JSONL=$OUT/${TAG}_fg30.jsonl
    cut -c1-300 "$JSONL" | grep -v '"STEP"'; grep -h -i "error\|Traceback\|memory:" "$BG"/*.log | tail -8
    exit 0 ;;
  grow)  # that a quantized base without recompute no longer grows (~25 GiB a step in session 27: a reference
         # cycle, fixed): 8 layers of the 8B shape, allocated memory after each step, the allocator's history
         # over steps 2-4 (fp8), then the same with recompute, then nf4
    G="$LORA8B --layers 8 --impl local"
    job grow-fp8 0 150 python $G --base-precision fp8 --memory-snapshot "$OUT/${TAG}_grow_fp8_snapshot.pickle" &
    one=$!
    ( job grow-fp8-recompute 1 120 python $G --base-precision fp8 --recompute
      job grow-nf4 1 120 python $G --base-precision nf4 ) &
    other=$!
    wait $one $other ;;
  *) echo "unknown stage $stage (one30, ep2, bg30, control30, eight, qlora, sweepqlora, gptoss, fp8gemm, fp8check, sweepnf4, collect, grow)"; exit 2 ;;
esac
[ -n "${DRY_RUN:-}" ] && exit 0
cut -c1-300 "$JSONL" | grep -v '"STEP"' ; grep -h -i "error\|Traceback\|memory:" "$OUT/${TAG}_${stage}"_*.log | tail -8
