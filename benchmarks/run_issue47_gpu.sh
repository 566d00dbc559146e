#!/usr/bin/env bash
# Issue 47 part 1: lightning-mcore against transformers' own model under FSDP2 (benchmarks/hf_fsdp2.py, the
# accelerate/trl path; its settings are in each of its RESULT lines' "hf"), on NGPU GPUs of one H200 machine
# (2; NGPU=4 for 4), one stage per call. A stage keeps within the device's 600 s command limit: each command
# runs under `timeout` for what is left of BUDGET (570 s), and one that would get less than it needs is skipped
# (said in the log). Both sides: global batch 8, sequence 4096, bf16 compute with fp32 master weights, fp32
# gradients and fp32 AdamW state (LoRA: a bf16 frozen base), random tokens (LoRA: bench_lora_sft's rows of one
# sample, loss on the second half).
#
#   Each sweep runs HF without activation checkpointing at micro batch 1, 2, 4 (those that divide each rank's
#   rows; one process, which ends at the first OOM), then checkpointed only at those that did not fit, or fit
#   crowded (over 128 GiB: issue47_summary.py unfit): at a micro batch that fits, checkpointing only adds a
#   forward.
#   sweep30     HF + FSDP2, L30 (16) layers of Qwen3-30B-A3B, full FT: compiled; then eager and checkpointed at 2
#               (what compilation buys; EAGER30=0: not)
#   pair30      ours at EP=NGPU (micro batch 2, permute and router fusions, torch's grouped GEMM; OURS30_EXTRA: more
#               bench_pretrain.py arguments, e.g. sweepours30's fastest) and HF at the sweep's fastest settings (HF30
#               to choose them), interleaved: ours, hf, ours, hf
#   sweepours30 ours as in pair30 at the largest micro batch up to 4 with selective, then full recompute, and at
#               micro batch 1 (session 28 ran pair30 only at 2, where HF's best was at 4)
#   sweep8b     HF + FSDP2, Llama-3-8B, full FT: compiled (SWEEP8B_MBS: other micro batches than 1 2 4); eager at
#               1 (EAGER8B=0: not)
#   pair8b      ours TP=2 + SP (TP8B=0: not), ours DP=NGPU (distributed optimizer; micro batch OURS8B_MBS, default
#               1, as in opg8b and profile 8b), HF at the sweep's best (HF8B), interleaved
#   opg8b       pair8b's ours data-parallel without, then with the parameter all-gather overlapped with the next
#               forward (--overlap-param-gather: 32 ms a step left serial in session 30's profile), each step's loss
#               listed (the two must agree), then HF at the sweep's best
#   sweeplora8b HF + FSDP2 + peft, LoRA r16 (alpha 32) on every linear, Llama-3-8B: compiled
#   pairlora8b  ours (bench_lora_sft.py, DP=NGPU, micro batch 1; OURS_LORA_EXTRA: more of its arguments) and HF at
#               the sweep's best (HFLORA8B), twice
#   sweeplora30 the same on LORA30 (24) layers of Qwen3-30B-A3B, the experts' adapters through peft's
#               target_parameters: eager (peft's parametrized experts break the compiled graph: hf_fsdp2.py's
#               docstring)
#   pairlora30  ours (EP=NGPU) and HF at the sweep's best (HFLORA30), twice
#   lora30      ours only: all 48 layers of Qwen3-30B-A3B, LoRA r8 (alpha 32) on every linear, experts included, at
#               EP=NGPU, global batch 8 of rows packing 4 samples, micro batch 1: full recompute (the recipe's), selective,
#               none (the seed case of part 2: MFU and memory of each)
#   lora30mbs   lora30's seed case with full recompute at micro batch 4, then 2 (rows per rank allowing): fewer layer
#               passes per token for a step that session 29's profile found host-bound (385 host waits a step at micro
#               batch 1); checkpoints of 48 layers' inputs cost 0.8 GiB a row (selective recompute and none were over
#               the issue's 50 GB already at micro batch 1: 58.5 and 56.8 GiB; session 30: 46.1 GiB at 4, 39.4 at 2)
#   vlm         Qwen2.5-VL-7B LoRA r16 (issue 47 part 2): ours data-parallel on NGPU GPUs (TP=1; the TP=2 + SP run
#               was 0.43x HF per GPU, RESULTS.md session 9) and HF + peft compiled at micro batch 4 on one GPU, the
#               same 16 samples of 1,022 tokens (one 392x392 image each) a step; interleaved, twice
#   vlmpacked   vlm after its profile (session 30: the GPU idle half the step, the vision encoder's 452 attention calls
#               an image): ours with the vision encoder's windows attended in one packed call a block
#               (model/vision_attention.py), at micro batch 1 and 2; HF with its vision encoder packed the same way (as
#               flash-attn's users run it) and as transformers runs it without flash-attn (one SDPA call a window)
#   profile CASE  CASE = 30b, 8b, lora8b, lora30, seed30 (lora30's full-recompute case, ours only) or vlm (vlm's pair,
#               each side's steps 4-6, $OUT/${TAG}_profile_vlm/{ours/rank{N},hf/hf}.txt): torch.profiler
#               tables of three steps (HF's 10-12, ours' first three timed), one file per rank, in
#               $OUT/${TAG}_profile_CASE/{hf,ours}/rank{N}.txt
#               (HF30, HFLORA30: the HF side's settings, as in the pair stages; SIDES=ours: profile 30b's ours only)
# A pair stage without its sweep's file uses the settings written below as fallbacks (the memory estimate's
# choice), so the pairs can run first when time is short; ROUNDS (default 2) sets a pair stage's interleaved
# rounds. `profile 8b` profiles ours data-parallel, pair8b's faster layout (session 27: 10,691 against TP=2's
# 8,479 tokens/s/GPU). Raw lines (each RESULT with its "label") go to
# $OUT/${TAG}_<stage>.jsonl, logs to $OUT/${TAG}_<stage>.log; a pair stage ends with its ratios
# (benchmarks/issue47_summary.py). Before the first stage: bash .gpu/kit/install.sh && source .gpu/kit/env.sh.
# DRY_RUN=FILE: each command's GPU count, script and arguments go to FILE instead of running
# (tests/test_run_issue47_gpu.py parses them on CPU).
#
# Memory on 2x H200 (torch sees 139 GiB each; ~8 GiB left for the CUDA context, NCCL and fragmentation):
# - Qwen3-30B-A3B, per layer: attention 18.9M + router 0.26M + 128 experts x 3 x 2048 x 768 = 604.0M ->
#   623.1M parameters; embedding + LM head 2 x 151936 x 2048 = 622.3M.
# - HF + FSDP2, full FT: fp32 weight + grad + AdamW m, v = 16 B/param, sharded over 2 = 8 B/param per GPU:
#   4.64 GiB per layer, 4.64 GiB for embedding and head. Transients ~6 GiB: two layers gathered in bf16 (the
#   one running and the prefetched, 2.3), one layer's bf16 gradients and their fp32 copy to reduce-scatter
#   (3.5). The loss: logits of micro batch x 4096 x 151936 in bf16, an fp32 copy and its fp32 gradient, ~6 GiB
#   per row. Activations: ~1 GiB per layer per row without checkpointing; with it 16 MiB per layer per row
#   plus one layer's recompute. 16 layers: 79 GiB of state; micro batch 1 without checkpointing 79 + 6 + 6 +
#   16 = 107 GiB; checkpointed at 1, 2, 4: ~92, ~98, ~111 GiB. 20 layers: +19 GiB (110 at 1, 130 at 4: the
#   sweep's top end would not fit); 24 layers: 116 GiB of state alone (no).
# - Ours at EP=2: experts (302M per layer per GPU, expert data-parallel size 1) at 18 B/param (bf16 2, fp32
#   grad 4, fp32 master 4, m and v 8), the dense rest (19.2M per layer, 622M) at 2 + 4 + 12 / 2 (distributed
#   optimizer over DP=2) = 12 B/param: 5.27 GiB per layer + 7 GiB. Activations ~0.75 GiB per layer per row
#   (the 8-layer micro-batch-4 run peaked at 73.5 GiB: RESULTS.md, session 11). 16 layers at micro batch 2:
#   84 + 7 + 24 = 115 GiB. So L30 = 16 is the depth both fit with room for HF's sweep; at 20, ours would
#   need micro batch 1 (112 GiB) and HF checkpointing at 1-2.
# - Llama-3-8B (8.03B): HF + FSDP2 8 B/param per GPU = 60 GiB; micro batch 1 without checkpointing +26
#   (~0.8 GiB per layer per row) +5 (loss) = 91 GiB; checkpointed at 4: 60 + 4 + 20 = 84 GiB. Ours TP=2: 77
#   GiB measured (session 4); DP=2: bf16 2 + fp32 grad 4 + 12 / 2 = 12 B/param = 90 GiB + 17 (activations,
#   micro batch 1) + 3 (loss) = 110 GiB.
# - LoRA, a bf16 base: HF shards it (2 B/param over 2 GPUs: 24 layers of 30B-A3B, 15.6B, 14.5 GiB); peft
#   materialises each layer's W + scale B A for its experts (1.1 GiB bf16), kept for backward without
#   checkpointing (26 GiB over 24 layers), plus ~1 GiB per layer per row. Ours at EP=2: experts sharded,
#   the rest replicated, ~15.6 GiB + 0.75 GiB per layer per row (34 GiB at micro batch 1). 8B: HF 7.5 GiB,
#   ours 15 GiB, plus activations.
set -uo pipefail
OUT=${OUT:-.}
TAG=${TAG:-s26}
NGPU=${NGPU:-2}
GBS=8
L30=${L30:-16}
LORA30=${LORA30:-24}
BUDGET=${BUDGET:-570}
ROUNDS=${ROUNDS:-2}  # interleaved rounds of each pair stage
stage=${1:?stage}
case_=${2:-}
name=$stage${case_:+_$case_}
LOG=$OUT/${TAG}_$name.log
JSONL=$OUT/${TAG}_$name.jsonl
deadline=$((SECONDS + BUDGET))
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OURS_ENV="CUDA_DEVICE_MAX_CONNECTIONS=1"  # mcore's TP/SP overlap needs one hardware queue
HF_ENV="CUDA_DEVICE_MAX_CONNECTIONS=8"    # FSDP2 overlaps its all-gathers and reduce-scatters on their own streams

mbs_list() {  # the micro batches among $* that divide each rank's rows (GBS / NGPU)
  local rows=$((GBS / NGPU)) out=""
  for m in "$@"; do [ $((rows % m)) -eq 0 ] && out=$out${out:+,}$m; done
  echo "$out"
}
biggest() {  # the largest of 1, 2, 4 up to $1 that divides each rank's rows
  local m; for m in 4 2 1; do [ "$m" -le "$1" ] && [ $((GBS / NGPU % m)) -eq 0 ] && { echo $m; return; }; done
}

run() {  # label, environment, seconds it needs at least, script, its arguments; GPUS=1: one process on the first
        # of CUDA_VISIBLE_DEVICES (GPU 0 when unset), so that two stages can share a 4-GPU machine
  local label=$1 envs=$2 need=$3 script=$4 gpus=${GPUS:-$NGPU}; shift 4
  if [ -n "${DRY_RUN:-}" ]; then echo "$gpus $script $*" >> "$DRY_RUN"; return; fi
  local left=$((deadline - SECONDS))
  if [ $left -lt "$need" ]; then echo "skipped $label: $left s left, it needs $need" | tee -a "$LOG"; return; fi
  echo "== $label ($left s left): $script $*" >> "$LOG"
  local launch="torchrun --standalone --nproc-per-node $gpus"
  local first=${CUDA_VISIBLE_DEVICES:-0}
  [ "$gpus" -eq 1 ] && launch="python" && envs="$envs CUDA_VISIBLE_DEVICES=${first%%,*}"
  env $envs timeout -k 15 $((left - 15)) $launch "benchmarks/$script" "$@" 2>&1 \
    | tee -a "$LOG" | grep '^RESULT' | sed "s/^RESULT {/{\"label\": \"$label\", /" >> "$JSONL"
}
hf() { local label=$1 need=$2; shift 2; run "$label" "$HF_ENV" "$need" hf_fsdp2.py "$@"; }
one_gpu() { local label=$1 need=$2 script=$3; shift 3; GPUS=1 run "$label" "" "$need" "$script" "$@"; }
ours() { local label=$1 need=$2 script=$3; shift 3; run "$label" "$OURS_ENV" "$need" "$script" "$@"; }
best() {  # the sweep stage's fastest HF settings, or the fallback
  [ -n "${DRY_RUN:-}" ] && { echo "$2"; return; }
  python benchmarks/issue47_summary.py best "$OUT/${TAG}_$1.jsonl" --fallback "$2"
}
vl7b() {  # the random Qwen2.5-VL-7B checkpoint both VLM sides load, made once
  [ -n "${DRY_RUN:-}" ] || [ -f /tmp/vl7b/config.json ] || python benchmarks/bench_vlm_sft.py make --out /tmp/vl7b >> "$LOG" 2>&1
}
unfit() {  # the micro batches of $2 that sweep stage $1's uncheckpointed runs did not fit (in room)
  [ -n "${DRY_RUN:-}" ] && { echo "$2"; return; }
  python benchmarks/issue47_summary.py unfit "$OUT/${TAG}_$1.jsonl" --mbs "$2"
}
ratios() { [ -z "${DRY_RUN:-}" ] && python benchmarks/issue47_summary.py ratios "$JSONL" --ours "$1" --hf hf | tee -a "$LOG"; }

A30="--shape qwen3-30b-a3b --layers $L30 --gbs $GBS"
A8B="--shape llama-8b --gbs $GBS"
OURS8B="--impl lightning $A8B --mbs ${OURS8B_MBS:-1}"  # ours data-parallel: pair8b's, opg8b's, profile 8b's
SWEPT=$(mbs_list 1 2 4)  # a sweep's micro batches
LORA="--lora-rank 16 --lora-alpha 32 --data sft"
OURS30="--impl lightning $A30 --ep $NGPU --mbs $(biggest 2) --set moe_permute_fusion=true --set moe_router_fusion=true --experts torch
  ${OURS30_EXTRA:-}"
OURS_LORA="--rank 16 --alpha 32 --samples-per-row 1 --gbs $GBS --steps 10 ${OURS_LORA_EXTRA:-}"
SWEEP="--steps 8 --warmup 3"
SEED30="--shape qwen3-30b-a3b --experts torch --rank 8 --alpha 32 --seq 4096 --gbs $GBS --steps 12 --ep $NGPU --losses"
PAIR="--steps 10 --warmup 4"

case $stage in
  sweep30)
    hf sweep 200 $A30 $SWEEP --compile --mbs "$SWEPT"
    m=$(unfit sweep30 "$SWEPT"); [ -n "$m" ] && hf sweep 200 $A30 $SWEEP --compile --ac --mbs "$m"
    [ "${EAGER30:-1}" = 1 ] && hf sweep 120 $A30 $SWEEP --ac --mbs "$(biggest 2)" ;;
  sweepours30)
    ours sweep 120 bench_pretrain.py $OURS30 $SWEEP --mbs "$(biggest 4)" --recompute selective
    ours sweep 120 bench_pretrain.py $OURS30 $SWEEP --mbs "$(biggest 4)" --recompute full
    ours sweep 100 bench_pretrain.py $OURS30 $SWEEP --mbs 1 ;;
  pair30)
    HF30=${HF30:-$(best sweep30 "--mbs $(biggest 2) --ac --compile")}
    for k in $(seq "$ROUNDS"); do
      ours "ours-ep$NGPU#$k" 90 bench_pretrain.py $OURS30 $PAIR
      hf "hf#$k" 120 $A30 $PAIR $HF30
    done
    ratios "ours-ep$NGPU" ;;
  sweep8b)
    swept=$(mbs_list ${SWEEP8B_MBS:-1 2 4})
    hf sweep 150 $A8B $SWEEP --compile --mbs "$swept"
    m=$(unfit sweep8b "$swept")
    [ -n "$m" ] && hf sweep 150 $A8B $SWEEP --compile --ac --mbs "$m"
    [ "${EAGER8B:-1}" = 1 ] && hf sweep 90 $A8B $SWEEP --mbs 1 ;;
  pair8b)
    HF8B=${HF8B:-$(best sweep8b "--mbs 1 --compile")}
    for k in $(seq "$ROUNDS"); do
      [ "${TP8B:-1}" = 1 ] && ours "ours-tp2#$k" 90 bench_pretrain.py --impl lightning $A8B --tp 2 --mbs 1 $PAIR
      ours "ours-dp$NGPU#$k" 90 bench_pretrain.py $OURS8B $PAIR
      hf "hf#$k" 100 $A8B $PAIR $HF8B
    done
    [ "${TP8B:-1}" = 1 ] && ratios ours-tp2; ratios "ours-dp$NGPU" ;;
  opg8b)
    HF8B=${HF8B:-$(best sweep8b "--mbs 1 --compile")}
    ours "ours-dp$NGPU" 90 bench_pretrain.py $OURS8B $PAIR --losses
    ours "ours-dp$NGPU-opg" 90 bench_pretrain.py $OURS8B $PAIR --losses --overlap-param-gather
    hf hf 100 $A8B $PAIR $HF8B ;;
  sweeplora8b)
    hf sweep 150 $A8B $LORA $SWEEP --compile --mbs "$SWEPT"
    m=$(unfit sweeplora8b "$SWEPT")
    [ -n "$m" ] && hf sweep 100 $A8B $LORA $SWEEP --compile --ac --mbs "$m" ;;
  pairlora8b)
    HFLORA8B=${HFLORA8B:-$(best sweeplora8b "--mbs $(biggest 2) --compile")}
    for k in $(seq "$ROUNDS"); do
      ours "ours-dp$NGPU#$k" 80 bench_lora_sft.py --shape llama-8b $OURS_LORA
      hf "hf#$k" 100 $A8B $LORA $PAIR $HFLORA8B
    done
    ratios "ours-dp$NGPU" ;;
  sweeplora30)
    hf sweep 200 --shape qwen3-30b-a3b --layers "$LORA30" --gbs $GBS $LORA $SWEEP --mbs "$SWEPT"
    m=$(unfit sweeplora30 "$SWEPT")
    [ -n "$m" ] && hf sweep 120 --shape qwen3-30b-a3b --layers "$LORA30" --gbs $GBS $LORA $SWEEP --ac --mbs "$m" ;;
  pairlora30)
    HFLORA30=${HFLORA30:-$(best sweeplora30 "--mbs 1 --ac")}
    for k in $(seq "$ROUNDS"); do
      ours "ours-ep$NGPU#$k" 100 bench_lora_sft.py --shape qwen3-30b-a3b --layers "$LORA30" --ep "$NGPU" $OURS_LORA
      hf "hf#$k" 150 --shape qwen3-30b-a3b --layers "$LORA30" --gbs $GBS $LORA $PAIR $HFLORA30
    done
    ratios "ours-ep$NGPU" ;;
  lora30)
    ours full 150 bench_lora_sft.py $SEED30 --mbs 1 --recompute
    ours selective 150 bench_lora_sft.py $SEED30 --mbs 1 --recompute-selective
    ours none 150 bench_lora_sft.py $SEED30 --mbs 1 ;;
  lora30mbs)
    ours "full-mbs$(biggest 4)" 150 bench_lora_sft.py $SEED30 --mbs "$(biggest 4)" --recompute
    ours full-mbs2 150 bench_lora_sft.py $SEED30 --mbs "$(biggest 2)" --recompute ;;
  vlm)
    vl7b
    for k in $(seq "$ROUNDS"); do
      ours "ours-dp$NGPU#$k" 120 bench_vlm_sft.py ours --model /tmp/vl7b --dp "$NGPU" --gbs 4 --steps 8
      one_gpu "hf#$k" 120 bench_vlm_sft.py hf --model /tmp/vl7b --micro-batch 4 --compile --steps 8
    done
    ratios "ours-dp$NGPU" ;;
  vlmpacked)
    vl7b
    ours "ours-dp$NGPU" 120 bench_vlm_sft.py ours --model /tmp/vl7b --dp "$NGPU" --gbs 4 --steps 8
    one_gpu hf-packed 120 bench_vlm_sft.py hf --model /tmp/vl7b --micro-batch 4 --compile --steps 8 \
      --vision-attention packed
    ours "ours-dp$NGPU-mbs2" 120 bench_vlm_sft.py ours --model /tmp/vl7b --dp "$NGPU" --gbs 4 --steps 8 --micro-batch 2
    one_gpu hf 120 bench_vlm_sft.py hf --model /tmp/vl7b --micro-batch 4 --compile --steps 8 ;;
  profile)  # steps 10-12 of each side (rank files under $OUT/${TAG}_profile_CASE/)
    P="--steps 13 --warmup 10"
    dir=$OUT/${TAG}_profile_$case_
    case $case_ in
      30b) run ours "$OURS_ENV BENCH_PROFILE_DIR=$dir/ours" 100 bench_pretrain.py $OURS30 $P --profile
           [ "${SIDES:-both}" = ours ] ||
           hf hf 150 $A30 $P ${HF30:-$(best sweep30 "--mbs $(biggest 2) --ac --compile")} --profile-dir "$dir/hf" ;;
      8b) run ours "$OURS_ENV BENCH_PROFILE_DIR=$dir/ours" 100 bench_pretrain.py $OURS8B $P --profile
          hf hf 150 $A8B $P $(best sweep8b "--mbs 1 --compile") --profile-dir "$dir/hf" ;;
      lora8b) ours ours 100 bench_lora_sft.py --shape llama-8b $OURS_LORA --profile "$dir/ours"
              hf hf 150 $A8B $LORA $P $(best sweeplora8b "--mbs $(biggest 2) --compile") --profile-dir "$dir/hf" ;;
      lora30) ours ours 120 bench_lora_sft.py --shape qwen3-30b-a3b --layers "$LORA30" --ep "$NGPU" $OURS_LORA \
                --profile "$dir/ours"
              hf hf 200 --shape qwen3-30b-a3b --layers "$LORA30" --gbs $GBS $LORA $P \
                ${HFLORA30:-$(best sweeplora30 "--mbs 1 --ac")} --profile-dir "$dir/hf" ;;
      seed30) ours ours 150 bench_lora_sft.py --shape qwen3-30b-a3b --experts torch --rank 8 --alpha 32 --gbs $GBS \
                --mbs 1 --steps 7 --ep "$NGPU" --recompute --profile "$dir/ours" ;;  # lora30's recipe case, ours only
      vlm) vl7b
           ours ours 120 bench_vlm_sft.py ours --model /tmp/vl7b --dp "$NGPU" --gbs 4 --steps 8 --profile "$dir/ours"
           one_gpu hf 120 bench_vlm_sft.py hf --model /tmp/vl7b --micro-batch 4 --compile --steps 8 --profile "$dir/hf" ;;
      *) echo "profile needs a case: 30b, 8b, lora8b, lora30, seed30 or vlm"; exit 2 ;;
    esac ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
[ -n "${DRY_RUN:-}" ] && exit 0
cat "$JSONL" 2>/dev/null | cut -c1-400; grep -i "error\|Traceback" "$LOG" 2>/dev/null | tail -5
