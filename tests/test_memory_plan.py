"""The memory plan (lightning_mcore/plan/) against what the built model holds on CPU.

(a) parameters per rank exactly as the built chunks hold them, at TP=2 x PP=2, at EP=2 (MoE) and
    with LoRA (trained adapters, frozen base), on forked gloo ranks;
(b) gradient buffers and optimizer state as mcore allocates them after one step (the sum of its
    grad buffers and of the optimizer's state tensors), distributed optimizer on and off;
(c) activations against torch's own count of what one forward saves for backward
    (saved_tensors_hooks, one count per storage, parameters left out);
(d) `lightning-mcore plan` on a bundled config, and its one-line refusals (exit code 2); the
    command docs/gpu.md shows, with the output it shows.
"""

import json
import os
import sys

import lightning as L
import pytest
import torch
import transformers
from forked_process import cli_command, run as run_forked
from megatron.core import parallel_state
from readme import ROOT, clean_env, code_blocks, commands, section, user_dir
from readme import run as run_readme
from test_configs import QWEN3_30B_A3B
from toy import fit, tiny_config

from lightning_mcore import LoRAConfig, OptimizerSettings
from lightning_mcore.callbacks.console import default_console
from lightning_mcore.callbacks.memory_plan import MemoryPlanReport, report_line
from lightning_mcore.lora.quantized_base import CODECS
from lightning_mcore.plan.activations import logits_elements
from lightning_mcore.plan.inputs import PlanInputs
from lightning_mcore.plan.memory import optimizer_bytes, stage_plan
from lightning_mcore.plan.parameters import stage_parameters
from lightning_mcore.strategy.optimizer import mcore_parts
from lightning_mcore.strategy.parallel import ParallelConfig

MOE = dict(num_moe_experts=4, moe_ffn_hidden_size=64, moe_router_topk=2, moe_aux_loss_coeff=0.01)


class Measure(L.Callback):
    """After the first step, each rank writes what it holds: parameters (trained, frozen), the
    bytes of mcore DDP's grad buffers and of the optimizer's state tensors and master copies."""

    def __init__(self, out) -> None:
        self.out = out

    def on_train_batch_end(self, trainer, module, *args) -> None:
        if trainer.global_step != 1:
            return
        params = [p for chunk in module.chunks for p in chunk.parameters()]
        grads = sum(b.grad_data.nbytes for chunk in module.chunks
                    for b in chunk.buffers + chunk.expert_parallel_buffers)
        state, seen = 0, set()
        for part in mcore_parts(trainer.strategy.optimizers[0].optimizer):
            tensors = [v for s in part.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
            for group in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
                tensors += [p for g in getattr(part, group, []) for p in g]
            for t in tensors:
                if t.numel() > 1 and t.untyped_storage().data_ptr() not in seen:  # not Adam's step count
                    seen.add(t.untyped_storage().data_ptr())
                    state += t.untyped_storage().nbytes()
        # frozen weights as held (LoRA over a quantized base: the codes and scales; its parameters are
        # one-element placeholders between calls)
        frozen_bytes = sum(p.untyped_storage().nbytes() for p in params
                           if not p.requires_grad and not hasattr(p, "quantized_base"))
        frozen_bytes += sum(b.nbytes for chunk in module.chunks for name, b in chunk.named_buffers()
                            if name.endswith((*(f"_{codec}" for codec in CODECS), "_scale")))
        record = dict(stage=parallel_state.get_pipeline_model_parallel_rank(), frozen_bytes=frozen_bytes,
                      trainable=sum(p.numel() for p in params if p.requires_grad),
                      frozen=sum(p.numel() for p in params if not p.requires_grad), grads=grads, state=state)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


SHARED = dict(MOE, moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=True)
DENSE = dict(tie_word_embeddings=True, qk_layernorm=True, add_qkv_bias=True)  # a tied head at PP=2

# name: (ranks, model overrides, parallel sizes)
LAYOUTS = {
    "tp2_pp2": (4, DENSE, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                               use_distributed_optimizer=False)),
    "pp2_vpp2": (2, {}, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                             use_distributed_optimizer=False)),
    "ep2_distributed": (2, SHARED, dict(expert_model_parallel_size=2, use_distributed_optimizer=True)),
    "lora_ep2": (2, SHARED, dict(expert_model_parallel_size=2, use_distributed_optimizer=False)),
    "lora_fp8_ep2": (2, SHARED, dict(expert_model_parallel_size=2, use_distributed_optimizer=False)),
    # FFNs 128 wide: two of NF4's 64-input blocks (two scales) a row of the fc2s
    "lora_nf4_ep2": (2, dict(SHARED, moe_ffn_hidden_size=128, moe_shared_expert_intermediate_size=128),
                     dict(expert_model_parallel_size=2, use_distributed_optimizer=False)),
    # MXFP4: a byte-sized exponent per 32 inputs
    "lora_mxfp4_ep2": (2, SHARED, dict(expert_model_parallel_size=2, use_distributed_optimizer=False)),
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parameters_grads_and_optimizer_state_per_rank(layout, tmp_path):
    ranks, overrides, parallel = LAYOUTS[layout]
    precision = next((p for p in ("fp8", "nf4", "mxfp4") if p in layout), "bf16")
    lora = LoRAConfig(rank=4, alpha=8, base_precision=precision) \
        if layout.startswith("lora") else None
    config = tiny_config(**overrides)
    fit(tmp_path, devices=ranks, steps=1, gbs=4, mbs=2, config=config, callbacks=(Measure(tmp_path),),
        module_kwargs={"lora": lora} if lora else None, **parallel)
    inputs = PlanInputs(model=config, parallel=ParallelConfig(**parallel), world_size=ranks,
                        micro_batch_size=2, global_batch_size=4, bf16=False, lora=lora,
                        optim=OptimizerSettings(lr=1e-3))
    for rank in range(ranks):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        counted = stage_parameters(inputs, measured["stage"])
        assert (counted.trainable, counted.frozen) == (measured["trainable"], measured["frozen"]), (rank, measured)
        assert (counted.frozen > 0) == (lora is not None) and (counted.experts > 0) == ("num_moe_experts" in overrides)
        plan = stage_plan(inputs, measured["stage"])
        if lora is not None:  # fp32 weights here: 4 bytes a frozen parameter, the codes' bytes (fp8: 1
            # a weight, nf4 and mxfp4: 1/2), the scales' (fp8: 4 a row, nf4: 4 per 64 inputs, mxfp4: 1 per 32)
            frozen = (counted.frozen - counted.quantized) * 4 + counted.code_bytes + counted.scale_bytes
            assert frozen == measured["frozen_bytes"], (rank, measured)
            assert plan.weights == frozen + counted.trainable * 4 + counted.largest_quantized * 4
            assert (counted.quantized > 0) == (lora.base_precision != "bf16")
        if parallel["use_distributed_optimizer"]:
            # mcore pads the grad buffer to whole shards, so a rank's shard (its state) may hold
            # up to that padding more or less than an even share: within it, not exact
            pad = measured["grads"] - plan.gradients
            assert 0 <= pad < 4 * 64 * ranks and abs(measured["state"] - plan.optimizer) <= 2 * pad, measured
            assert plan.optimizer == optimizer_bytes(inputs, counted) < 8 * counted.trainable
        else:
            assert (plan.gradients, plan.optimizer) == (measured["grads"], measured["state"]), (rank, measured)


class SavedForBackward(L.Callback):
    """The bytes of the tensors one training step's forward saves for backward (torch's
    saved_tensors_hooks), each storage once, the parameters' left out."""

    def __init__(self, out) -> None:
        self.out, self.storages, self.hooks = out, {}, None

    def on_train_batch_start(self, trainer, module, *args) -> None:
        weights = {p.untyped_storage().data_ptr() for p in module.parameters()}

        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in weights:
                self.storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self.hooks.__enter__()

    def on_train_batch_end(self, trainer, *args) -> None:
        self.hooks.__exit__(None, None, None)
        # from each rank's (forked) process
        (self.out / f"saved{trainer.global_rank}").write_text(str(sum(self.storages.values())))


# name: (ranks, model overrides, parallel sizes)
SAVED = {
    "dense": (1, {}, {}),
    "moe": (1, MOE, {}),
    "tp2_sp": (2, {}, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(SAVED))
def test_activations_against_saved_tensors(name, tmp_path):
    ranks, overrides, parallel = SAVED[name]
    config = tiny_config(seq_length=64, **overrides)
    fit(tmp_path, devices=ranks, steps=1, gbs=2, mbs=2, config=config, callbacks=(SavedForBackward(tmp_path),),
        **parallel)
    inputs = PlanInputs(model=config, parallel=ParallelConfig(**parallel), world_size=ranks, micro_batch_size=2,
                        global_batch_size=2, bf16=False, fused=False)
    plan = stage_plan(inputs, 0)
    # the loss keeps its fp32 softmax of the logits; the logits themselves are live, not saved
    planned = plan.activations + logits_elements(inputs) * 4
    for rank in range(ranks):
        measured = int((tmp_path / f"saved{rank}").read_text())
        # The formula leaves out RoPE's cos/sin, the norms' 1/rms, attention's log-sum-exp, the
        # token ids and the router's indices: 3% of this tiny model (hidden 64), less at real widths.
        assert 0.93 * measured <= planned <= measured, (name, rank, measured, planned)


def plan_command(*args, cwd=ROOT):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    return run_forked(cli_command, ["lightning-mcore", "plan", *args], cwd=cwd, env=env, timeout=300)


def test_plan_command_prints_the_table():
    proc = plan_command("--config", "configs/sft_lora.yaml", "--gpu_memory", "1GiB")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for name in ("weights", "gradients", "optimizer state", "activations", "logits", "buffers", "total"):
        assert any(line.split()[:len(name.split())] == name.split() for line in lines), (name, proc.stdout)
    assert "largest micro batch in 1 GiB:" in proc.stdout and "layout checks: passed" in proc.stdout
    assert "2 CPU ranks, TP=2" in proc.stdout and "LoRA r8" in proc.stdout


@pytest.mark.parametrize("args,key", [
    (["--trainer.strategy.init_args.tensor_model_paralel_size", "2"], "tensor_model_paralel_size"),
    (["--trainer.strategy.init_args.tensor_model_parallel_size", "3"],
     "trainer.strategy.init_args.tensor_model_parallel_size=3"),
    (["--gpu_memory", "eighty"], "gpu_memory"),
])
def test_plan_command_refuses_a_bad_setting_in_one_line(args, key):
    proc = plan_command("--config", "configs/quickstart.yaml", *args)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and key in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("title,page", [("Memory plan before launch", "gpu.md"),
                                        ("Qwen3-30B-A3B on one GPU", "lora.md")])
def test_docs_plan_command_prints_what_the_page_shows(title, page, tmp_path):
    """The page's command, run as a user runs it (a fresh interpreter, a directory with
    configs/ and the model's config.json), prints the output the page shows; a Python block
    on the page gives the same plan."""
    text = section(title, page)
    (argv,) = commands(text)
    cwd = user_dir(tmp_path)
    transformers.Qwen3MoeConfig(**QWEN3_30B_A3B).save_pretrained(cwd / "checkpoints" / "Qwen3-30B-A3B")
    shown = code_blocks(text, "text")[0]
    assert run_readme(argv, cwd).stdout == shown
    for block in code_blocks(text, "python"):
        # the block's code, verbatim, in a process forked from this one (its imports already done)
        # instead of a second fresh interpreter: the command above is the one run as a user runs it
        proc = run_forked(lambda: exec(compile(block, page, "exec"), {"__name__": "__main__"}),
                          [sys.executable, "-c", block], cwd=cwd, env=clean_env(cwd), timeout=300)
        total = next(line.split()[1] for line in shown.splitlines() if line.split()[:1] == ["total"])
        trained = shown.splitlines()[1].split(", ")[-1].split()[0]
        assert proc.returncode == 0 and proc.stdout == f"{total} GiB per GPU, {trained} trained parameters\n", \
            proc.stderr


def test_fit_reports_the_plan_beside_the_peak_on_gpu_only(tmp_path, capfd):
    """The CLI's console adds MemoryPlanReport; on CPU it writes nothing (no allocator peak to
    compare). Its line on GPU: the plan, the peak and the plan's error."""
    fit(tmp_path, devices=1, steps=2, gbs=2, mbs=2, callbacks=(MemoryPlanReport(after_steps=1),))
    assert "memory: planned" not in capfd.readouterr().err
    assert any(isinstance(c, MemoryPlanReport) for c in default_console({}, [])["callbacks"])
    line = report_line(10 * 2**30, 8 * 2**30, 3)
    assert line.startswith("memory: planned 10.0 GiB per GPU (pipeline stage 0), measured peak 8.0 GiB "
                           "allocated after 3 steps (+25.0% planned)"), line
    line = report_line(4 * 2**30, 8 * 2**30, 3, during_setup=True)  # a quantized base's bf16 build
    assert "8.0 GiB allocated after 3 steps (reached while building and loading the model, before " \
           "training: training's own peak is lower) (-50.0% planned)" in line, line
