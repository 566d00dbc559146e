"""Routed experts on torch's grouped GEMM (moe_grouped_gemm_backend='torch') train exactly the
model mcore's SequentialMLP trains: the same initial weights (the same parameter names), losses
and trained weights, on one process, at EP=2, at expert-TP 2 and with top-1 probabilities on
the input (CPU, fp32, gloo). The reference is the one-process SequentialMLP run, computed here.
Plus what 'auto' picks, the refusals, and the config mcore receives."""

import pytest
import torch

from lightning_mcore import GPTConfig
from lightning_mcore.strategy.expert_gemm import ExpertGemmError, validate_expert_gemm, validate_expert_kernel
from lightning_mcore.strategy.parallel import ParallelConfig
from toy import assemble, fit, fit_with_checkpoints, tiny_config

TOL = dict(rtol=0, atol=1e-5)  # as test_moe_layouts.py: Adam steps on reductions in another order


def moe(**overrides) -> GPTConfig:
    return tiny_config(**{**dict(num_moe_experts=4, moe_ffn_hidden_size=64, moe_router_topk=2,
                                 moe_aux_loss_coeff=0.1), **overrides})


def run(tmp, devices, config, name, **parallel):
    losses = fit(tmp, devices=devices, mbs=1, config=config, dump_weights=True, name=name, **parallel)
    return (losses, assemble(sorted(tmp.glob(f"{name}.init*.pt"))),
            assemble(sorted(tmp.glob(f"{name}.end*.pt"))))


@pytest.mark.distributed
@pytest.mark.parametrize("devices,parallel,model", [
    (1, {}, dict(moe_aux_loss_coeff=0.1)),
    (2, dict(expert_model_parallel_size=2), dict(moe_aux_loss_coeff=0.1)),
    # expert-TP 2: each rank's grouped GEMMs on its shards of every expert
    (2, dict(tensor_model_parallel_size=2, sequence_parallel=True), dict(moe_aux_loss_coeff=0.1)),
    (2, dict(pipeline_model_parallel_size=2), dict(moe_aux_loss_coeff=0.1)),
    # top-1 routing with the probability applied to the expert's input (mcore's option)
    (1, {}, dict(moe_router_topk=1, moe_router_pre_softmax=True, extra={"moe_apply_probs_on_input": True}))],
    ids=["ep1", "ep2", "etp2", "pp2", "probs_on_input"])
def test_torch_experts_train_as_sequential_mlp(tmp_path, devices, parallel, model):
    ref_losses, ref_init, ref_end = run(tmp_path, 1, moe(**model), "ref")
    losses, init, end = run(tmp_path, devices, moe(moe_grouped_gemm=True, moe_grouped_gemm_backend="torch",
                                                   **model), "torch", **parallel)
    assert init.keys() == ref_init.keys()
    assert "decoder.layers.mlp.experts.experts.linear_fc1.weight" in init
    for key in ref_init:
        assert torch.equal(init[key], ref_init[key]), key
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert len(losses) == 3 and losses[0] != losses[-1]
    for key in ref_end:
        torch.testing.assert_close(end[key], ref_end[key], **TOL, msg=key)
        if "experts" in key:
            assert not torch.equal(end[key], init[key]), f"{key} did not train"


def _check(message, **kw):
    with pytest.raises(ExpertGemmError, match=message):
        validate_expert_gemm(moe(moe_grouped_gemm_backend="torch", **kw))


def test_refusals_name_the_key():
    validate_expert_gemm(moe(moe_grouped_gemm=True, moe_grouped_gemm_backend="torch"))
    validate_expert_gemm(moe(moe_grouped_gemm=True, moe_grouped_gemm_backend="te"))
    _check("moe_grouped_gemm True or None", moe_grouped_gemm=False)
    _check("fp8", moe_grouped_gemm=True, fp8="current")
    _check("multiples of 8", moe_grouped_gemm=True, moe_ffn_hidden_size=60)
    _check("moe_preprocess", moe_grouped_gemm=True, cuda_graphs=["attn", "moe_router", "moe_preprocess"])
    # TE's grouped experts without TE (CPU): refused before a rank builds mcore's legacy GroupedMLP
    with pytest.raises(ExpertGemmError, match="needs TE on a GPU"):
        validate_expert_kernel(moe(moe_grouped_gemm_backend="te"), use_te=False)
    validate_expert_kernel(moe(moe_grouped_gemm_backend="te"), use_te=True)
    validate_expert_kernel(moe(), use_te=False)  # the default: torch's kernel, on CPU too


def test_device_counts_only_at_one_expert_rank():
    """The dispatcher keeps the counts on the device only where nothing reads them on the host."""
    from lightning_mcore.model.torch_experts import uses_device_counts
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    class Fake(MoEAlltoAllTokenDispatcher):
        def __init__(self, ep, tp, drop_and_pad=False):
            self.ep_size, self.tp_size, self.drop_and_pad = ep, tp, drop_and_pad

    cfg = type("Cfg", (), {"moe_expert_capacity_factor": None})()
    assert not uses_device_counts(Fake(1, 1), cfg)  # a subclass: not the dispatcher mcore built
    base = MoEAlltoAllTokenDispatcher.__new__(MoEAlltoAllTokenDispatcher)
    for ep, tp, drop, cap, expected in [(1, 1, False, None, True), (2, 1, False, None, False),
                                        (1, 2, False, None, False), (1, 1, True, 1.0, False),
                                        (1, 1, False, 1.0, False)]:
        base.ep_size, base.tp_size, base.drop_and_pad = ep, tp, drop
        cfg.moe_expert_capacity_factor = cap
        assert uses_device_counts(base, cfg) is expected, (ep, tp, drop, cap)


def test_auto_picks_torch_where_it_runs():
    """'auto' (the default) is torch's kernel unless a setting needs TE's; LoRA on experts with a
    rank that is not a multiple of 8 resolves it to 'te' in the module, an explicit 'te' stays TE's.
    moe_grouped_gemm=None (the default) groups the experts where torch's kernel runs, else
    leaves them to the SequentialMLP loop."""
    from lightning_mcore.lora.checks import expert_backend_for_lora
    from lightning_mcore.lora.config import LoRAConfig

    grouped = moe(moe_grouped_gemm=True)
    assert grouped.moe_grouped_gemm_backend == "auto" and grouped.torch_experts
    assert moe().moe_grouped_gemm is None and moe().torch_experts  # the default
    assert not moe(moe_grouped_gemm=False).grouped_experts  # mcore's SequentialMLP loop
    assert not moe(moe_grouped_gemm=True, moe_grouped_gemm_backend="te").torch_experts
    assert moe(moe_grouped_gemm_backend="te").mcore_grouped_gemm  # a backend asked for: grouped
    for needs_te in (dict(fp8="delayed"), dict(moe_ffn_hidden_size=60),
                     dict(recompute_granularity="selective", recompute_modules=["moe_act"]),
                     dict(cuda_graphs=["attn", "moe_router", "moe_preprocess"])):
        assert not moe(moe_grouped_gemm=True, **needs_te).torch_experts, needs_te
        validate_expert_gemm(moe(moe_grouped_gemm=True, **needs_te))  # auto: no refusal
        assert not moe(**needs_te).grouped_experts, needs_te  # the default: the loop, as before
    default = moe()
    assert expert_backend_for_lora(LoRAConfig(rank=4), default).grouped_experts is False  # any rank
    assert expert_backend_for_lora(LoRAConfig(rank=8), default) is default
    lora_experts = expert_backend_for_lora(LoRAConfig(rank=4), grouped)
    assert lora_experts.moe_grouped_gemm_backend == "te" and not lora_experts.torch_experts
    assert expert_backend_for_lora(LoRAConfig(rank=8), grouped) is grouped  # torch's takes rank 8
    assert expert_backend_for_lora(LoRAConfig(rank=4, experts=False), grouped) is grouped
    assert expert_backend_for_lora(None, grouped) is grouped


def test_torch_experts_reach_mcore_as_sequential_mlp():
    """mcore builds SequentialMLP parameters (moe_grouped_gemm off in its config)."""
    from lightning_mcore.model.config import to_transformer_config

    tf = to_transformer_config(moe(moe_grouped_gemm=True), ParallelConfig(), torch.float32, on_cpu=True, use_te=False)
    assert not tf.moe_grouped_gemm and tf.num_moe_experts == 4


def test_with_te_the_permutation_runs_fused():
    """With TE the permutation and router run fused, which keeps the expert sort on the device
    (run where Transformer Engine is installed: the GPU machine)."""
    pytest.importorskip("transformer_engine")
    from lightning_mcore.model.config import to_transformer_config

    tf = to_transformer_config(moe(moe_grouped_gemm=True), ParallelConfig(), torch.bfloat16,
                               on_cpu=False, use_te=True)
    assert not tf.moe_grouped_gemm and tf.moe_permute_fusion
    te = to_transformer_config(moe(moe_grouped_gemm=True, moe_grouped_gemm_backend="te"), ParallelConfig(),
                               torch.bfloat16, on_cpu=False, use_te=True)
    assert te.moe_grouped_gemm and not te.moe_permute_fusion


@pytest.mark.distributed
@pytest.mark.parametrize("family,layout", [("qwen3_moe", "tp1"), ("qwen3_moe", "ep2"), ("mixtral", "tp2_sp"),
                                           ("deepseek_v3", "tp1")])
def test_hf_logits_and_export_with_torch_experts(family, layout, tmp_path):
    """Weights from transformers' checkpoint into torch's experts give transformers' logits, and
    export back bit-identical (multi-latent attention's layer spec included)."""
    from test_hf_roundtrip import check_logits_and_export

    from lightning_mcore.models import gpt_config_from_hf

    check_logits_and_export(family, layout, tmp_path, model_overrides={"moe_grouped_gemm": True})
    config, _ = gpt_config_from_hf(str(tmp_path / "source"), moe_grouped_gemm=True)
    assert config.torch_experts  # the run above took torch's kernel ('auto')


@pytest.mark.parametrize("stacked", [False, True, "back_to_back"], ids=["list", "stacked", "back_to_back"])
@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
def test_grouped_linear_gradients_match_per_expert_linears(frozen, stacked, monkeypatch):
    """The grouped GEMM's backward against autograd through one F.linear per expert; frozen
    experts (LoRA) get no weight gradient and skip its GEMM (2 grouped GEMMs, not 3). `stacked`:
    the weights as one [E, out, in] tensor (LoRA adapters), StackedExpertLinear;
    "back_to_back": per-expert weights that are views of one tensor (as TorchGroupedMLP lays
    them out), read in place."""
    from lightning_mcore.model import torch_experts
    from lightning_mcore.model.torch_experts import GroupedExpertLinear, StackedExpertLinear

    calls = []
    grouped_mm = torch_experts.grouped_mm
    monkeypatch.setattr(torch_experts, "grouped_mm", lambda *a, **k: calls.append(1) or grouped_mm(*a, **k))

    gen = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 2]  # an expert without tokens too
    x = torch.randn(sum(counts), 16, generator=gen, requires_grad=True)
    weights = [torch.randn(8, 16, generator=gen, requires_grad=not frozen) for _ in counts]
    dy = torch.randn(sum(counts), 8, generator=gen)
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    if stacked == "back_to_back":
        torch_experts.lay_out_back_to_back(weights)
        assert torch_experts.stacked(weights).data_ptr() == weights[0].data_ptr()  # no copy
        stacked = False
    if stacked:
        weight = torch.stack(weights).detach().requires_grad_(not frozen)
        y = StackedExpertLinear.apply(x, offsets, weight)
        grads = torch.autograd.grad(y, [x, *([weight] if weight.requires_grad else [])], dy)
        grads = grads[:1] + tuple(grads[1].unbind(0)) if not frozen else grads
    else:
        y = GroupedExpertLinear.apply(x, offsets, *weights)
        grads = torch.autograd.grad(y, [x, *[w for w in weights if w.requires_grad]], dy)

    x_ref = x.detach().clone().requires_grad_(True)
    w_ref = [w.detach().clone().requires_grad_(not frozen) for w in weights]
    y_ref = torch.cat([torch.nn.functional.linear(rows, w) for rows, w in zip(x_ref.split(counts), w_ref)])
    want = torch.autograd.grad(y_ref, [x_ref, *[w for w in w_ref if w.requires_grad]], dy)
    torch.testing.assert_close(y, y_ref)
    assert len(grads) == len(want) == (1 if frozen else 1 + len(counts))
    assert len(calls) == (2 if frozen else 3)
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref)


@pytest.mark.distributed
def test_sequential_mlp_checkpoint_resumes_under_the_defaults(tmp_path):
    """A checkpoint of the SequentialMLP (moe_grouped_gemm=False, the default before) resumes with
    the default grouped experts: the resumed steps' losses are the SequentialMLP run's."""
    sequential = moe(vocab_size=512, moe_grouped_gemm=False)
    straight = fit_with_checkpoints(tmp_path, "straight", 1, config=sequential)
    saved = str(tmp_path / "straight-ckpts" / "epoch=0-step=3.ckpt")  # its own step-3 checkpoint
    resumed = fit_with_checkpoints(tmp_path, "resumed", 1, ckpt_path=saved, config=moe(vocab_size=512))
    assert moe(vocab_size=512).torch_experts and len(resumed) == 3
    assert resumed == pytest.approx(straight[3:], rel=0, abs=1e-5)


def test_expert_weights_are_read_in_place_until_moved():
    """TorchGroupedMLP lays its experts' weights out back to back: the grouped GEMM's operand is
    a view of them (the same memory, the same values as stacking them). A weight moved elsewhere
    (as mcore's DDP moves trained ones into its buffer) makes `stacked` copy again, the new
    values included."""
    from lightning_mcore.export_checkpoint import single_process_megatron
    from lightning_mcore.model.build import build_chunks
    from lightning_mcore.model.config import to_transformer_config
    from lightning_mcore.model.torch_experts import TorchGroupedMLP, stacked

    cfg = moe(num_layers=1, moe_grouped_gemm=True, moe_grouped_gemm_backend="torch")
    with single_process_megatron():
        tf_config = to_transformer_config(cfg, ParallelConfig(), torch.float32, on_cpu=True, use_te=False)
        (chunk,) = build_chunks(cfg, tf_config, use_te=False)
    experts = chunk.decoder.layers[0].mlp.experts
    assert isinstance(experts, TorchGroupedMLP)
    for name in ("linear_fc1", "linear_fc2"):
        weights = [getattr(e, name).weight for e in experts.local_experts]
        view = stacked(weights)
        assert view.data_ptr() == weights[0].data_ptr() and not view.requires_grad
        assert torch.equal(view, torch.stack([w.detach() for w in weights]))
        with torch.no_grad():
            weights[1].mul_(2.0)  # an in-place update (an optimizer step) is seen through the view
        assert torch.equal(view[1], weights[1].detach())
        weights[2].data = weights[2].data + 1.0  # moved to new memory
        copy = stacked(weights)
        assert copy.data_ptr() != weights[0].data_ptr()
        assert torch.equal(copy, torch.stack([w.detach() for w in weights]))


def test_frozen_experts_reach_autograd_as_one_block():
    """Frozen experts read in place (LoRA) enter the grouped GEMM as one [E, out, in] operand: the
    same output and input gradient as one operand per expert, bit for bit, and the input is not
    saved for a weight gradient nobody needs; trained experts keep one operand each."""
    from lightning_mcore.export_checkpoint import single_process_megatron
    from lightning_mcore.model import torch_experts
    from lightning_mcore.model.build import build_chunks
    from lightning_mcore.model.config import to_transformer_config

    cfg = moe(num_layers=1, moe_grouped_gemm=True, moe_grouped_gemm_backend="torch")
    with single_process_megatron():
        tf_config = to_transformer_config(cfg, ParallelConfig(), torch.float32, on_cpu=True, use_te=False)
        (chunk,) = build_chunks(cfg, tf_config, use_te=False)
    experts = chunk.decoder.layers[0].mlp.experts
    weights = [e.linear_fc1.weight for e in experts.local_experts]
    counts = torch.tensor([3, 0, 5, 2] + [1] * (len(weights) - 4))
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(int(counts.sum()), weights[0].shape[1], generator=torch.Generator().manual_seed(0))
    dy = torch.randn(x.shape[0], weights[0].shape[0], generator=torch.Generator().manual_seed(1))

    def run(frozen: bool):
        for w in weights:
            w.requires_grad_(not frozen)
        xi = x.clone().requires_grad_()
        y = experts._linear("linear_fc1", xi, offsets)
        (dx,) = torch.autograd.grad(y, [xi], dy, retain_graph=True)
        return y, dx

    y_block, dx_block = run(frozen=True)
    assert type(y_block.grad_fn).__name__ == "StackedExpertLinearBackward"
    assert y_block.grad_fn.saved_tensors[0] is None  # x: only a weight gradient would need it
    y_each, dx_each = run(frozen=False)
    assert type(y_each.grad_fn).__name__ == "GroupedExpertLinearBackward"
    assert torch.equal(y_block, y_each) and torch.equal(dx_block, dx_each)
    weights[1].data = weights[1].data.clone()  # moved out of the block: one operand per expert again
    for w in weights:
        w.requires_grad_(False)
    assert torch_experts.stacked_view(weights) is None
    y_moved = experts._linear("linear_fc1", x, offsets)
    assert torch.equal(y_moved, y_each.detach())
