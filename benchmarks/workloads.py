"""The named workloads: the rows of the table at the top of benchmarks/RESULTS.md, each with the
command that reproduces it and where its latest raw measurement lies. benchmarks/compare.py runs
the ones built from bench_pretrain.py runs (`--cases NAME`); benchmarks/results_table.py reads
every one's raw lines and writes the table.

A row's raw lines keep the case and label names of the call that measured them (the `where` of a
Reading), which may be older than the workload's own name."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Run:
    """One implementation's bench_pretrain.py run (under torchrun) in a compare.py workload."""

    gpus: int
    label: str
    args: str


@dataclass(frozen=True)
class Reading:
    """Which raw lines hold a side's number: the files (under benchmarks/results/), the lines
    whose fields equal `where`'s values (a tuple: any of them; "label" is compared without a
    repeat's "#N"), and the field read from each."""

    files: tuple[str, ...]
    metric: str
    where: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Side:
    """One side of a comparison: what it is, the command that measures it, and its lines."""

    name: str
    command: str
    reading: Reading


@dataclass(frozen=True)
class Goal:
    """A goal an issue set: `metric` ("ratio", or a field of our side's lines) at least (or, with
    higher_is_better False, at most) `bound`; unit "x", "%" (a fraction shown in percent) or ""."""

    issue: int
    text: str
    metric: str
    bound: float
    unit: str = "x"
    higher_is_better: bool = True


@dataclass(frozen=True)
class Workload:
    """A row of the table. `paired`: our k-th line and the baseline's k-th were measured one
    after the other (interleaved repeats), so the ratio is the median of the pairs' ratios;
    otherwise it is the ratio of the two medians. `drop_paused`: runs (or pairs) in which Python's
    collector paused a rank for 100 ms or more in the timed steps are left out, as the notes do."""

    name: str
    what: str
    device: str  # as the raw lines' "device" names it
    gpus: int
    versions: str
    unit: str
    ours: Side
    baseline: Side | None = None
    goals: tuple[Goal, ...] = ()
    setup: str = ""  # a command to run once before the sides' commands
    runs: tuple[Run, ...] = ()  # compare.py's runs, when the sides' command is compare.py
    paired: bool = False
    drop_paused: bool = False

    @property
    def commands(self) -> tuple[str, ...]:
        """The commands that reproduce the row, in order (each once)."""
        found = [self.setup, self.ours.command, self.baseline.command if self.baseline else ""]
        return tuple(dict.fromkeys(c for c in found if c))


H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
KIT = "torch 2.11.0+cu130, megatron-core 0.19.2, Transformer Engine 2.20.2"
TOKENS = "tokens_per_s_per_gpu"

# bench_pretrain.py's arguments: mcore's permute and router fusions; the small MoE at EP=2; 4 layers
# of Qwen3-30B-A3B's layer shape on one GPU; 8 of them at EP=2
_FUSED = "--set moe_permute_fusion=true --set moe_router_fusion=true"
_MOE2 = f"--shape qwen3-moe-small --ep 2 --mbs 4 --gbs 8 {_FUSED} --experts torch --steps 16 --warmup 6"
_MOE30B = f"--shape qwen3-30b-a3b --layers 4 --gbs 8 --mbs 4 {_FUSED} --experts torch --steps 14 --warmup 6"
_MOE30B_EP2 = (f"--shape qwen3-30b-a3b --layers 8 --ep 2 --gbs 8 --steps 14 --warmup 6 --mbs 4 {_FUSED} "
               "--experts torch")
_VLM = "/tmp/vl7b"
_MOE_MODEL = "/tmp/moe_a3b_8l"
# session 28's issue 49 runs: both 30B runs at once (4 GPUs), then their logs; the 8B bases and QLoRA, both orders
_BG30 = "OUT=. TAG=s28 bash benchmarks/run_issue49_gpu.sh bg30; WAIT=900 bash benchmarks/run_issue49_gpu.sh collect"
_QLORA = "OUT=. TAG=s28 bash benchmarks/run_issue49_gpu.sh eight; OUT=. TAG=s28 bash benchmarks/run_issue49_gpu.sh qlora"
# session 29: HF's QLoRA swept (GPU 3 of a 4-GPU machine); FP8 GEMMs against the dequantized FP8 base, side by side
_SWEEPQLORA = "OUT=. TAG=s29 GPU=3 bash benchmarks/run_issue49_gpu.sh sweepqlora"
_FP8GEMM = "OUT=. TAG=s29 STEPS30=30 TIME_LIMIT=300 bash benchmarks/run_issue49_gpu.sh fp8gemm"
_FP8GEMM30 = "OUT=. TAG=s30 ONLY30=1 STEPS30=30 TIME_LIMIT=300 bash benchmarks/run_issue49_gpu.sh fp8gemm"
# session 30's PLAN=s30 queues (run_queues_gpu.sh) as single stages
_PAIR30 = ('ROUNDS=1 OURS30_EXTRA="--mbs 4 --recompute selective" HF30="--mbs 4 --ac --compile" OUT=. TAG=s30 '
           'bash benchmarks/run_issue47_gpu.sh pair30')
# session 31's PLAN=s31b: HF 8B uncheckpointed at micro batch 2, ours at 2 in the 8B pairs
_PAIR8B = ("OUT=. TAG=s31b EAGER8B=0 SWEEP8B_MBS=2 bash benchmarks/run_issue47_gpu.sh sweep8b; "
           'OUT=. TAG=s31b ROUNDS=1 TP8B=0 OURS8B_MBS=2 HF8B="--mbs 4 --ac --compile" '
           "bash benchmarks/run_issue47_gpu.sh pair8b")
_PAIR8B_4 = ('NGPU=4 OUT=. TAG=s31b4 ROUNDS=1 TP8B=0 OURS8B_MBS=2 HF8B="--mbs 2 --compile" '
             "bash benchmarks/run_issue47_gpu.sh pair8b")
_PAIRLORA8B = ("OUT=. TAG=s30 bash benchmarks/run_issue47_gpu.sh sweeplora8b; "
               "OUT=. TAG=s30 ROUNDS=1 bash benchmarks/run_issue47_gpu.sh pairlora8b")
# session 30's second machine (PLAN=s30b)
_VLMPACKED = "OUT=. TAG=s30b bash benchmarks/run_issue47_gpu.sh vlmpacked"
_PAIRLORA30 = ("OUT=. TAG=s30 bash benchmarks/run_issue47_gpu.sh sweeplora30; "
               'OUT=. TAG=s30b ROUNDS=1 OURS_LORA_EXTRA="--mbs 4" HFLORA30="--mbs 2" '
               "bash benchmarks/run_issue47_gpu.sh pairlora30")
# session 31's 4-GPU queue (PLAN=s31 q4) as single stages
_S31 = "NGPU=4 OUT=. TAG=s31"
_PAIR30_4 = (f"{_S31} EAGER30=0 bash benchmarks/run_issue47_gpu.sh sweep30; "
             f"{_S31} ROUNDS=1 bash benchmarks/run_issue47_gpu.sh pair30")
_PAIRLORA30_4 = (f"{_S31} bash benchmarks/run_issue47_gpu.sh sweeplora30; "
                 f'{_S31} ROUNDS=1 OURS_LORA_EXTRA="--mbs 2" bash benchmarks/run_issue47_gpu.sh pairlora30')
_PAIRLORA8B_4 = (f"{_S31} bash benchmarks/run_issue47_gpu.sh sweeplora8b; "
                 f'{_S31} ROUNDS=1 OURS_LORA_EXTRA="--mbs 2" bash benchmarks/run_issue47_gpu.sh pairlora8b')
_GRPO = f"CUDA_DEVICE_MAX_CONNECTIONS=1 python benchmarks/bench_moe_grpo.py grpo --model {_MOE_MODEL} --ep 1 --steps 3"


def _compare(name: str, repeat: int = 1) -> str:
    return f"python benchmarks/compare.py --cases {name}" + (f" --repeat {repeat}" if repeat > 1 else "")


def _pretrain(name: str, label: str, files: tuple[str, ...], case: str, command: str) -> Side:
    """A bench_pretrain.py side: tokens/s per GPU of the lines of `case`'s run `label`."""
    return Side(name, command, Reading(files, TOKENS, {"case": case, "label": label}))


WORKLOADS = (
    Workload(
        name="dense-1b-hf",
        what="1.2B Llama shape (untied), seq 4096, global batch 8, micro batch 4, against HF transformers "
             "compiled at its best in the same precision (fp32 master weights + bf16 autocast)",
        device=H100, gpus=1, versions=f"{KIT}, transformers 5.17.0", unit="tokens/s/GPU",
        ours=_pretrain("lightning-mcore", "lightning", ("2026-11-23/issue20_1b-profile_1b-levers.jsonl",),
                       "1b-levers", _compare("dense-1b-hf")),
        baseline=_pretrain("HF compiled, amp, micro batch 4", "hf-compile-mbs4",
                           ("2026-11-23/issue20_hf-sweep.jsonl",), "hf-sweep", _compare("dense-1b-hf")),
        goals=(Goal(20, "≥ 1.4× HF's best compiled", "ratio", 1.4),
               Goal(20, "MFU ≥ 60%", "mfu", 0.60, unit="%")),
        runs=(Run(1, "lightning", "--impl lightning --mbs 4"), Run(1, "hf-compile-mbs4", "--impl hf-compile --mbs 4")),
    ),
    Workload(
        name="dense-1b-raw",
        what="1.2B Llama shape (untied), seq 4096, global batch 8, micro batch 4, against mcore's own "
             "training loop on the same model and batches",
        device=H100, gpus=1, versions=f"{KIT}, lightning 2.6.6", unit="tokens/s/GPU",
        ours=_pretrain("lightning-mcore", "lightning", ("2026-11-21/h100_a.jsonl",), "1b", _compare("dense-1b-raw")),
        baseline=_pretrain("raw mcore", "raw", ("2026-11-21/h100_a.jsonl",), "1b", _compare("dense-1b-raw")),
        goals=(Goal(9, "≥ 0.98× raw mcore", "ratio", 0.98),),
        runs=(Run(1, "raw", "--impl raw --mbs 4"), Run(1, "lightning", "--impl lightning --mbs 4")),
    ),
    Workload(
        name="moe-ep2",
        what="12 layers of a small Qwen3-MoE (64 experts, top-8), EP=2, global batch 8, micro batch 4, "
             "torch's experts, permute and router fusions; 5 interleaved pairs",
        device=H200, gpus=2, versions=KIT, unit="tokens/s/GPU",
        ours=_pretrain("lightning-mcore", "lightning-mbs4-fused-torch", ("2026-11-24/issue20_s11_ep2_pairs.jsonl",),
                       "moe-ep2-pairs", _compare("moe-ep2", 5)),
        baseline=_pretrain("raw mcore", "raw-mbs4-fused-torch", ("2026-11-24/issue20_s11_ep2_pairs.jsonl",),
                           "moe-ep2-pairs", _compare("moe-ep2", 5)),
        goals=(Goal(20, "≥ 0.98× raw mcore", "ratio", 0.98),),
        runs=tuple(Run(2, f"{impl}-mbs4-fused-torch", f"--impl {impl} {_MOE2}") for impl in ("raw", "lightning")),
        paired=True, drop_paused=True,
    ),
    Workload(
        name="moe30b-ep2",
        what="8 layers of Qwen3-30B-A3B's layer shape (128 experts, 64 per GPU), EP=2, global batch 8, "
             "micro batch 4, torch's experts, the fusions",
        device=H200, gpus=2, versions=KIT, unit="tokens/s/GPU",
        ours=_pretrain("lightning-mcore", "lightning-mbs4-fused-torch", ("2026-11-24/issue20_s11_moe30b_ep2.jsonl",),
                       "moe30b-ep2", _compare("moe30b-ep2")),
        baseline=_pretrain("raw mcore", "raw-mbs4-fused-torch", ("2026-11-24/issue20_s11_moe30b_ep2.jsonl",),
                           "moe30b-ep2", _compare("moe30b-ep2")),
        goals=(Goal(20, "MFU ≥ 30%", "mfu", 0.30, unit="%"), Goal(20, "≥ 0.98× raw mcore", "ratio", 0.98)),
        runs=tuple(Run(2, f"{impl}-mbs4-fused-torch", f"--impl {impl} {_MOE30B_EP2}") for impl in ("raw", "lightning")),
    ),
    Workload(
        name="moe30b-1gpu",
        what="4 layers of Qwen3-30B-A3B's layer shape on one GPU, global batch 8, micro batch 4, torch's "
             "experts, the fusions, the default check before the update; 5 interleaved pairs",
        device=H100, gpus=1, versions=f"{KIT}, lightning 2.6.6", unit="tokens/s/GPU",
        ours=_pretrain("lightning-mcore", "lightning-mbs4-fused-torch",
                       ("2026-11-24/issue20_s15_moe30b_default_pairs.jsonl",
                        "2026-11-24/issue20_s15_moe30b_default_pair5.jsonl"),
                       "moe30b-1gpu-wait", _compare("moe30b-1gpu", 5)),
        baseline=_pretrain("raw mcore", "raw-mbs4-fused-torch",
                           ("2026-11-24/issue20_s15_moe30b_default_pairs.jsonl",
                            "2026-11-24/issue20_s15_moe30b_default_pair5.jsonl"),
                           "moe30b-1gpu-wait", _compare("moe30b-1gpu", 5)),
        goals=(Goal(20, "≥ 0.98× raw mcore", "ratio", 0.98),),
        runs=tuple(Run(1, f"{impl}-mbs4-fused-torch", f"--impl {impl} {_MOE30B}") for impl in ("raw", "lightning")),
        paired=True, drop_paused=True,
    ),
    Workload(
        name="dense-8b-fsdp2",
        what="Llama-3-8B shape, full fine-tuning, seq 4096, global batch 8, random tokens; ours data parallel on "
             "2 GPUs (distributed optimizer, micro batch 2; at 1: 10,835; 97% of the step busy, profile_8b) against "
             "transformers' model under FSDP2 (fp32 master, bf16 compute) at its fastest: compiled, micro batch 2 "
             "without checkpointing, run just before ours (session 30's sweep ran micro batch 2 only checkpointed; "
             "checkpointed at 4, the earlier best, run just after ours: 8,537, 1.29x)",
        device=H200, gpus=2, versions=f"{KIT}, transformers 5.17.0", unit="tokens/s/GPU",
        ours=Side("lightning-mcore, DP=2, micro batch 2", _PAIR8B,
                  Reading(("2026-11-28/s31b_pair8b.jsonl",), TOKENS, {"label": "ours-dp2"})),
        baseline=Side("HF + FSDP2, compiled, micro batch 2", _PAIR8B,
                      Reading(("2026-11-28/s31b_sweep8b.jsonl",), TOKENS, {"label": "sweep"})),
        goals=(Goal(47, "≥ 1.3× HF + FSDP2", "ratio", 1.3),),
    ),
    Workload(
        name="dense-8b-fsdp2-4gpu",
        what="dense-8b-fsdp2 on 4 GPUs (2 rows a GPU): ours data parallel, micro batch 2 (at 1: 10,126), against HF "
             "+ FSDP2 at its sweep's fastest: compiled, micro batch 2 (at 1: 8,617); one interleaved pair",
        device=H200, gpus=4, versions=f"{KIT}, transformers 5.17.0", unit="tokens/s/GPU",
        ours=Side("lightning-mcore, DP=4, micro batch 2", _PAIR8B_4,
                  Reading(("2026-11-28/s31b4_pair8b.jsonl",), TOKENS, {"label": "ours-dp4"})),
        baseline=Side("HF + FSDP2, compiled, micro batch 2", _PAIR8B_4,
                      Reading(("2026-11-28/s31b4_pair8b.jsonl",), TOKENS, {"label": "hf"})),
        goals=(Goal(47, "≥ 1.3× HF + FSDP2", "ratio", 1.3),),
        paired=True,
    ),
    Workload(
        name="moe30b-16l-fsdp2",
        what="16 layers of Qwen3-30B-A3B (all 128 experts), full fine-tuning, seq 4096, global batch 8, random "
             "tokens; ours at EP=2 at its sweep's fastest (micro batch 4, selective recompute, torch's experts, the "
             "fusions; session 29's sweep: full recompute 20,394, micro batch 2 without recompute 21,905) against "
             "transformers' model (its grouped_mm experts) under FSDP2 at its sweep's fastest (session 28): "
             "compiled, checkpointed, micro batch 4; one interleaved pair. HF was not run uncheckpointed at micro "
             "batch 2 here (the 8B's was 13% faster than its checkpointed best: dense-8b-fsdp2)",
        device=H200, gpus=2, versions=f"{KIT}, transformers 5.17.0", unit="tokens/s/GPU",
        ours=Side("lightning-mcore, EP=2, micro batch 4, selective recompute", _PAIR30,
                  Reading(("2026-11-28/s30_pair30.jsonl",), TOKENS, {"label": "ours-ep2"})),
        baseline=Side("HF + FSDP2, compiled, checkpointed, micro batch 4", _PAIR30,
                      Reading(("2026-11-28/s30_pair30.jsonl",), TOKENS, {"label": "hf"})),
        goals=(Goal(47, "≥ 5× HF + FSDP2", "ratio", 5.0),),
        paired=True,
    ),
    Workload(
        name="moe30b-lora-ep2",
        what="Qwen3-30B-A3B (48 layers), LoRA r8 on every linear including the experts, EP=2, global batch 8 "
             "of rows packing 4 samples, full recompute (the recipe's), micro batch 4 (the recipe's since session "
             "30: 46.1 GB a GPU; at 1, session 28's default: 3,418 tokens/s, 9.6%, 36.1 GB, a step found host-bound; "
             "at 2: 6,407, 39.4 GB)",
        device=H200, gpus=2, versions=KIT, unit="tokens/s/GPU",
        ours=Side("lightning-mcore, EP=2", "OUT=. TAG=s30 bash benchmarks/run_issue47_gpu.sh lora30mbs",
                  Reading(("2026-11-28/s30_lora30mbs.jsonl",), TOKENS, {"label": "full-mbs4"})),
        goals=(Goal(47, "MFU ≥ 25% (full-model FLOPs)", "mfu_full_model_flops", 0.25, unit="%"),),
    ),
    Workload(
        name="moe30b-lora-fp8-1gpu",
        what="Qwen3-30B-A3B (48 layers), LoRA r8 on every linear, on ONE GPU over an FP8 base (torch's "
             "allocator capped at 78 GiB, as an 80 GB H100), mcore's local layers, full recompute, real text, "
             "seq 4096, global batch 2, 200 steps; against the bf16 base at EP=2 on 2 GPUs (the same rows). Since "
             "lora/grouped_base.py the one-GPU run does 3,834 (moe30b-lora-fp8gemm-1gpu's baseline, 30 steps)",
        device=H200, gpus=1, versions=KIT, unit="tokens/s/GPU",
        ours=Side("lightning-mcore, FP8 base, 1 GPU", _BG30,
                  Reading(("2026-11-28/s28_fg30.jsonl",), TOKENS, {"label": "fp8-1gpu", "line": "RESULT"})),
        baseline=Side("lightning-mcore, bf16 base, EP=2 on 2 GPUs", _BG30,
                      Reading(("2026-11-28/s28_fg30.jsonl",), TOKENS, {"label": "bf16-ep2", "line": "RESULT"})),
    ),
    Workload(
        name="lora8b-fsdp2",
        what="Llama-3-8B shape, LoRA r16 (alpha 32) on every linear, seq 4096, global batch 8 of one-sample rows "
             "(loss on the second half); ours data parallel on 2 GPUs (micro batch 1, not swept) against "
             "transformers + peft under FSDP2 at its sweep's fastest: compiled, micro batch 4 (at 1: 11,600; at 2: "
             "12,752; checkpointed at 4: 10,303); one interleaved pair",
        device=H200, gpus=2, versions=f"{KIT}, transformers 5.17.0, peft 0.21.0", unit="tokens/s/GPU",
        ours=Side("lightning-mcore, DP=2", _PAIRLORA8B,
                  Reading(("2026-11-28/s30_pairlora8b.jsonl",), TOKENS, {"label": "ours-dp2"})),
        baseline=Side("HF + peft + FSDP2, compiled, micro batch 4", _PAIRLORA8B,
                      Reading(("2026-11-28/s30_pairlora8b.jsonl",), TOKENS, {"label": "hf"})),
        paired=True,
    ),
    Workload(
        name="moe30b-lora-fsdp2",
        what="24 layers of Qwen3-30B-A3B, LoRA r16 (alpha 32) on every linear including the experts, seq 4096, "
             "global batch 8 of one-sample rows (loss on the second half); ours at EP=2 (micro batch 4, no recompute; "
             "at micro batch 1 in session 30's pair: 10,874 against HF's 12,134) against transformers + peft (the "
             "experts' adapters through target_parameters) under FSDP2 at its sweep's fastest: eager, micro batch 2 "
             "(at 1: 9,040; at 4: 6,225, thrashing at 137 GiB; checkpointed at 4: 11,074; peft's parametrized "
             "experts break the compiled graph); one interleaved pair. Both GPU-bound (profile_lora30, session 31): "
             "HF's step spends ~0.3 s gathering the frozen base's shards and ~0.4 s forming each expert's W + BA",
        device=H200, gpus=2, versions=f"{KIT}, transformers 5.17.0, peft 0.21.0", unit="tokens/s/GPU",
        ours=Side("lightning-mcore, EP=2, micro batch 4", _PAIRLORA30,
                  Reading(("2026-11-28/s30b_pairlora30.jsonl",), TOKENS, {"label": "ours-ep2"})),
        baseline=Side("HF + peft + FSDP2, eager, micro batch 2", _PAIRLORA30,
                      Reading(("2026-11-28/s30b_pairlora30.jsonl",), TOKENS, {"label": "hf"})),
        paired=True,
    ),
    Workload(
        name="moe30b-16l-fsdp2-4gpu",
        what="moe30b-16l-fsdp2 on 4 GPUs (2 rows a GPU): ours at EP=4, micro batch 2 without recompute against HF + "
             "FSDP2 at its sweep's fastest, compiled, micro batch 2 without checkpointing (at 1: 14,930), the "
             "sweep's run: in the interleaved pair's HF run, Python's collector paused two ranks 573 and 704 ms, one "
             "step of 1.06 s among 0.38 s ones (16,583, 1.29×). "
             "Ours' step (profile_30b, s31b4): 9% idle, a quarter in the experts' all-to-alls (96 a step, 1.1 ms each)",
        device=H200, gpus=4, versions=f"{KIT}, transformers 5.17.0", unit="tokens/s/GPU",
        ours=Side("lightning-mcore, EP=4, micro batch 2", _PAIR30_4,
                  Reading(("2026-11-28/s31_pair30.jsonl",), TOKENS, {"label": "ours-ep4"})),
        baseline=Side("HF + FSDP2, compiled, micro batch 2", _PAIR30_4,
                      Reading(("2026-11-28/s31_sweep30.jsonl",), TOKENS, {"label": "sweep", "mbs": 2})),
        goals=(Goal(47, "≥ 5× HF + FSDP2", "ratio", 5.0),),
    ),
    Workload(
        name="moe30b-lora-fsdp2-4gpu",
        what="moe30b-lora-fsdp2 on 4 GPUs (2 rows a GPU): ours at EP=4, micro batch 2, no recompute, against HF + "
             "peft + FSDP2 at its sweep's fastest: eager, micro batch 2 (at 1: 8,714); one interleaved pair",
        device=H200, gpus=4, versions=f"{KIT}, transformers 5.17.0, peft 0.21.0", unit="tokens/s/GPU",
        ours=Side("lightning-mcore, EP=4, micro batch 2", _PAIRLORA30_4,
                  Reading(("2026-11-28/s31_pairlora30.jsonl",), TOKENS, {"label": "ours-ep4"})),
        baseline=Side("HF + peft + FSDP2, eager, micro batch 2", _PAIRLORA30_4,
                      Reading(("2026-11-28/s31_pairlora30.jsonl",), TOKENS, {"label": "hf"})),
        paired=True,
    ),
    Workload(
        name="lora8b-fsdp2-4gpu",
        what="lora8b-fsdp2 on 4 GPUs (2 rows a GPU): ours data parallel, micro batch 2, against HF + peft + FSDP2 "
             "at its sweep's fastest: compiled, micro batch 2 (at 1: 11,667); one interleaved pair",
        device=H200, gpus=4, versions=f"{KIT}, transformers 5.17.0, peft 0.21.0", unit="tokens/s/GPU",
        ours=Side("lightning-mcore, DP=4, micro batch 2", _PAIRLORA8B_4,
                  Reading(("2026-11-28/s31_pairlora8b.jsonl",), TOKENS, {"label": "ours-dp4"})),
        baseline=Side("HF + peft + FSDP2, compiled, micro batch 2", _PAIRLORA8B_4,
                      Reading(("2026-11-28/s31_pairlora8b.jsonl",), TOKENS, {"label": "hf"})),
        paired=True,
    ),
    Workload(
        name="lora8b-nf4-qlora",
        what="Llama-3-8B shape, LoRA r16 on every linear over an NF4 base, one GPU, seq 4096, global batch 8, "
             "no recompute; ours (mcore's local layers, micro batch 1; not swept) against transformers + peft + "
             "bitsandbytes QLoRA (NF4, double quantization, autocast bf16) at its sweep's fastest: each decoder layer "
             "compiled, micro batch 2 (eager 8,113-8,534; micro batch 4 out of memory). Ours: two runs, session 28; "
             "HF's sweep: session 29, another machine of the same kind (against HF eager at micro batch 1, "
             "interleaved in session 28: 1.315x)",
        device=H200, gpus=1, versions=f"{KIT}, transformers 5.17.0, peft 0.21.0, bitsandbytes 0.50.2",
        unit="tokens/s/GPU",
        ours=Side("lightning-mcore, NF4 base", _QLORA,
                  Reading(("2026-11-28/s28_eight.jsonl", "2026-11-28/s28_qlora.jsonl"), TOKENS,
                          {"label": ("8b-nf4-local", "ours-nf4-2"), "line": "RESULT"})),
        baseline=Side("HF + peft + bitsandbytes QLoRA, compiled, micro batch 2", _SWEEPQLORA,
                      Reading(("2026-11-28/s29_sweepqlora.jsonl",), TOKENS,
                              {"label": "hf-qlora-compiled", "mbs": 2, "line": "RESULT"})),
    ),
    Workload(
        name="moe30b-lora-fp8gemm-1gpu",
        what="Qwen3-30B-A3B (48 layers), LoRA r8 on every linear over an FP8 base on ONE GPU (allocator capped at "
             "78 GiB), mcore's local layers, torch's grouped experts, full recompute, real text, seq 4096, global batch "
             "2, 30 steps: FP8 GEMMs on the codes (lora.base_gemm fp8) against the codes dequantized into bf16 GEMMs, "
             "at the same time on two GPUs of one machine, both computing the experts from the codes' block "
             "(lora/grouped_base.py; session 29's pair, before it: 3,363 against 2,213); the losses agree within the "
             "runs' noise",
        device=H200, gpus=1, versions=KIT, unit="tokens/s/GPU",
        ours=Side("lightning-mcore, FP8 GEMMs", _FP8GEMM30,
                  Reading(("2026-11-28/s30_fp8gemm.jsonl",), TOKENS, {"label": "fp8gemm-30b", "line": "RESULT"})),
        baseline=Side("lightning-mcore, the FP8 base dequantized into bf16 GEMMs", _FP8GEMM30,
                      Reading(("2026-11-28/s30_fp8gemm.jsonl",), TOKENS, {"label": "bf16gemm-30b", "line": "RESULT"})),
    ),
    Workload(
        name="lora8b-fp8gemm",
        what="Llama-3-8B shape, LoRA r16 on every linear over an FP8 base, one GPU, seq 4096, global batch 8, micro "
             "batch 1, no recompute, mcore's local layers: FP8 GEMMs (lora.base_gemm fp8) against the codes "
             "dequantized into bf16 GEMMs, at the same time on two GPUs of one machine (not profiled: the profiled "
             "runs were cut before writing their tables)",
        device=H200, gpus=1, versions=KIT, unit="tokens/s/GPU",
        ours=Side("lightning-mcore, FP8 GEMMs", _FP8GEMM,
                  Reading(("2026-11-28/s29_fp8gemm.jsonl",), TOKENS, {"label": "8b-fp8-fp8gemm", "line": "RESULT"})),
        baseline=Side("lightning-mcore, the FP8 base dequantized into bf16 GEMMs", _FP8GEMM,
                      Reading(("2026-11-28/s29_fp8gemm.jsonl",), TOKENS, {"label": "8b-fp8-bf16gemm", "line": "RESULT"})),
    ),
    Workload(
        name="gptoss-lora-mxfp4",
        what="4 layers of GPT-OSS-20B (its 201k vocabulary, 32 experts, top-4), LoRA r16 on every linear, one GPU, "
             "seq 4096, global batch 8, micro batch 1, mcore's local layers, torch's experts: the adapted base in "
             "MXFP4 (the format GPT-OSS's experts are published in; 21.1 GB peak) against the same in bf16 (25.6 GB); "
             "NF4: 23,788 tokens/s, 21.2 GB",
        device=H200, gpus=1, versions=KIT, unit="tokens/s/GPU",
        ours=Side("lightning-mcore, MXFP4 base", "OUT=. TAG=s29 GPU=3 bash benchmarks/run_issue49_gpu.sh gptoss",
                  Reading(("2026-11-28/s29_gptoss.jsonl",), TOKENS, {"label": "gptoss-mxfp4", "line": "RESULT"})),
        baseline=Side("lightning-mcore, bf16 base", "OUT=. TAG=s29 GPU=3 bash benchmarks/run_issue49_gpu.sh gptoss",
                      Reading(("2026-11-28/s29_gptoss.jsonl",), TOKENS, {"label": "gptoss-bf16", "line": "RESULT"})),
    ),
    Workload(
        name="vlm-7b-lora-dp2",
        what="Qwen2.5-VL-7B shape, LoRA r16 on the decoder, 1,022-token samples with one 392x392 image, 16 "
             "per step; ours data parallel on 2 GPUs (4 samples packed per row, micro batches of 2 rows, the vision "
             "encoder's windows in one packed call a block: model/vision_attention.py; at micro batch 1: 10,636), HF + "
             "peft compiled on one GPU at micro batch 4 with its vision encoder packed the same way (as with "
             "flash-attn; transformers' per-window SDPA: 9,584); one run each, interleaved",
        device=H200, gpus=2, versions=f"{KIT}, transformers 5.17.0, peft 0.21.0", unit="tokens/s/GPU",
        setup=f"python benchmarks/bench_vlm_sft.py make --out {_VLM}",
        ours=Side("lightning-mcore, DP=2, micro batch 2", _VLMPACKED,
                  Reading(("2026-11-28/s30b_vlmpacked.jsonl",), TOKENS, {"label": "ours-dp2-mbs2"})),
        baseline=Side("HF + peft compiled, micro batch 4, vision encoder packed, 1 GPU", _VLMPACKED,
                      Reading(("2026-11-28/s30b_vlmpacked.jsonl",), TOKENS, {"label": "hf-packed"})),
        goals=(Goal(47, "per GPU ≥ HF + peft on one GPU", "ratio", 1.0),),
    ),
    Workload(
        name="grpo-moe-rollout",
        what="GRPO rollouts of 8 layers of Qwen3-30B-A3B's layer shape, LoRA r8 on all linears, EP=1 and "
             "DP=2, decode steps as CUDA graphs, routing replay r3; 64 completions of 256 tokens per GPU; "
             "steps 2-3 (step 1 captures the graphs)",
        device=H200, gpus=2, versions=f"{KIT}, transformers 5.17", unit="rollout tokens/s/GPU",
        setup=f"python benchmarks/bench_moe_grpo.py make --out {_MOE_MODEL} --layers 8",
        ours=Side("lightning-mcore", f"{_GRPO} --replay r3",
                  Reading(("2026-11-28/s26_speed.jsonl",), "rollout_tokens_per_s",
                          {"bench": "moe_grpo", "replay": "r3", "step": (2, 3)})),
        # transformers' best of the same call's machine: eager (2,301) beat the static cache compiled
        # (1,995, s26_hf.jsonl), as in sessions 23-24
        baseline=Side("transformers eager generate (its best), 64 rows, 1 GPU",
                      f"CUDA_VISIBLE_DEVICES=0 python benchmarks/bench_moe_grpo.py hf --model {_MOE_MODEL} "
                      "--impl hf-eager --rows 64",
                      Reading(("2026-11-28/s26_speed.jsonl",), "tokens_per_s", {"impl": "hf-eager"})),
        goals=(Goal(46, "≥ 3× transformers' best", "ratio", 3.0),),
    ),
    Workload(
        name="grpo-moe-mismatch",
        what="GRPO as in grpo-moe-rollout (EP=1, bf16, session 24's runs): mean |training's log-prob - the "
             "rollout's| over completion tokens, routing replay r3 against off; steps 2-3",
        device=H200, gpus=2, versions=f"{KIT}, transformers 5.17", unit="mean |Δ log-prob|",
        setup=f"python benchmarks/bench_moe_grpo.py make --out {_MOE_MODEL} --layers 8",
        ours=Side("replay r3", f"{_GRPO} --replay r3",
                  Reading(("2026-11-28/s24_grpo.jsonl",), "rollout_logp_diff", {"replay": "r3", "step": (2, 3)})),
        baseline=Side("replay off", f"{_GRPO} --replay off",
                      Reading(("2026-11-28/s24_grpo.jsonl",), "rollout_logp_diff", {"replay": "off", "step": (2, 3)})),
        goals=(Goal(46, "≤ 1e-3 with replay", "rollout_logp_diff", 1e-3, unit="", higher_is_better=False),),
    ),
    Workload(
        name="grpo-8b-recipe",
        what="configs/grpo_8b_lora.yaml at TP=2 on a random Llama-3.1-8B-shaped checkpoint: 64 completions "
             "of up to 1,024 tokens a step, decode steps as CUDA graphs (all 1,024 positions: the run "
             "predates graph_memory_fraction); step 2 (step 1 captures the graphs); completion tokens/s "
             "of the TP pair",
        device=H200, gpus=2, versions=f"{KIT}, lightning 2.6.6", unit="completion tokens/s of the 2 GPUs",
        ours=Side("lightning-mcore", "OUT=. TAG=s26 bash benchmarks/run_issue46_gpu.sh 8b",
                  Reading(("2026-11-28/s26_8b_metrics.csv",), "train/rollout_tokens_per_s", {"step": 1})),
        # the same recipe decoding eagerly (session 25, before TP>1 graphs)
        baseline=Side("the same, eager decode steps (session 25)",
                      "OUT=. TAG=s25 bash benchmarks/run_issue46_gpu.sh 8b",
                      Reading(("2026-11-28/s25_8b_metrics.csv",), "train/rollout_tokens_per_s", {"step": 1})),
    ),
)

BY_NAME = {w.name: w for w in WORKLOADS}
