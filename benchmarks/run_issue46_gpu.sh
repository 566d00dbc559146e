#!/usr/bin/env bash
# Issue 46 on 2 GPUs, one stage per call (each within the device's 10-minute command limit):
#   test  the GPU generation tests (decode CUDA graphs: TE at TP=1, a Qwen3-MoE at EP=1) and fp32
#         logits on CUDA
#   grpo  make the Qwen3-30B-A3B-shaped 8-layer model, then GRPO + LoRA at EP=1 (DP=2), r3, with
#         fp32 logits and without
#   profile  a torch.profiler table of the second rollout (decode steps from CUDA graphs)
#   speed the rollout ratio in one call: GRPO at EP=1 (r3, the defaults), then transformers' eager
#         `generate` of the same rows on one GPU
#   grpo_fp32  the same GRPO in fp32 (r3, 64 new tokens, eager decode): the mismatch without bf16
#         (not run yet)
#   grpo_ep2  the same at EP=2 (r3); then transformers' generate of the rollout shape on one GPU
#         (eager, 64 rows)
#   hf    transformers' generate with the static cache (compiled), 64 rows
#   8b    configs/grpo_8b_lora.yaml at TP=2 on a random Llama-3.1-8B-shaped checkpoint, 2 steps
# Results (JSON lines) go to ${OUT:-.}/${TAG}_<stage>.jsonl, logs to ${OUT:-.}/${TAG}_<stage>.log.
set -uo pipefail
OUT=${OUT:-.}
TAG=${TAG:-s25}
stage=$1
MODEL=/tmp/moe_a3b_8l
made_model() {  # the 8-layer Qwen3-30B-A3B-shaped checkpoint, made once per machine
  [ -f $MODEL/config.json ] || python benchmarks/bench_moe_grpo.py make --out $MODEL --layers 8 2>&1 | tail -2
}
log() { tee -a "$OUT/${TAG}_$stage.log" | grep '^RESULT' | sed 's/^RESULT //' >> "$OUT/${TAG}_$stage.jsonl"; }
case $stage in
  test)
    timeout 450 python -m pytest -p no:cacheprovider -m gpu -rA tests/test_generation.py tests/test_fp32_logits.py \
      > "$OUT/${TAG}_test.log" 2>&1; grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/${TAG}_test.log" ;;
  grpo)  # EP=1 (DP=2, decode CUDA graphs), replay r3, fp32 logits on and off
    made_model
    for logits in on off; do
      CUDA_DEVICE_MAX_CONNECTIONS=1 python benchmarks/bench_moe_grpo.py grpo --model $MODEL --ep 1 --replay r3 \
        --fp32-logits $logits --steps 3 2>&1 | log
    done ;;
  profile)
    made_model
    CUDA_DEVICE_MAX_CONNECTIONS=1 python benchmarks/bench_moe_grpo.py grpo --model $MODEL --ep 1 --replay r3 \
      --fp32-logits on --steps 2 --profile "$OUT/${TAG}_rollout_profile.txt" 2>&1 | log ;;
  speed)
    made_model
    CUDA_DEVICE_MAX_CONNECTIONS=1 python benchmarks/bench_moe_grpo.py grpo --model $MODEL --ep 1 --replay r3 --steps 3 2>&1 | log
    CUDA_VISIBLE_DEVICES=0 python benchmarks/bench_moe_grpo.py hf --model $MODEL --impl hf-eager --rows 64 2>&1 | log ;;
  grpo_fp32)  # fp32 (eager decode: torch's grouped GEMM is not captured in fp32), r3
    made_model
    CUDA_DEVICE_MAX_CONNECTIONS=1 python benchmarks/bench_moe_grpo.py grpo --model $MODEL --ep 1 --replay r3 \
      --precision 32-true --new 64 --steps 2 2>&1 | log ;;
  grpo_ep2)  # EP=2 (eager decode; mcore's all-to-all since generation's dispatcher serves EP=1 only), r3;
             # then transformers eager
    made_model
    CUDA_DEVICE_MAX_CONNECTIONS=1 python benchmarks/bench_moe_grpo.py grpo --model $MODEL --ep 2 --replay r3 --steps 3 2>&1 | log
    CUDA_VISIBLE_DEVICES=0 python benchmarks/bench_moe_grpo.py hf --model $MODEL --impl hf-eager --rows 64 2>&1 | log ;;
  hf)
    made_model
    CUDA_VISIBLE_DEVICES=0 python benchmarks/bench_moe_grpo.py hf --model $MODEL --impl hf-static --rows 64 2>&1 | log ;;
  8b)
    [ -f /tmp/llama8b/config.json ] || python benchmarks/hf_load_8b.py make --out /tmp/llama8b 2>&1 | tail -1
    cp configs/sample_data/tiny-llama/tokenizer* configs/sample_data/tiny-llama/special_tokens_map.json /tmp/llama8b/
    [ -e runs/grpo_8b_lora ] && { echo "runs/grpo_8b_lora exists (an earlier run): move it away first"; exit 2; }
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader -l 2 > "$OUT/${TAG}_8b_gpu_memory.csv" &
    smi=$!
    python -m lightning_mcore.cli fit --config configs/grpo_8b_lora.yaml \
      --model.init_args.model /tmp/llama8b --data.init_args.tokenizer /tmp/llama8b \
      --data.init_args.paths configs/sample_data/prompts.jsonl --trainer.max_steps 2 2>&1 \
      | tee -a "$OUT/${TAG}_8b.log" | grep -v "^\s*$" | tail -25
    kill $smi
    cp runs/grpo_8b_lora/lightning_logs/version_0/metrics.csv "$OUT/${TAG}_8b_metrics.csv" ;;
esac
cat "$OUT/${TAG}_$stage.jsonl" 2>/dev/null; grep -i "error\|Traceback" "$OUT/${TAG}_$stage.log" 2>/dev/null | tail -5
