"""Acceptance: each bad layout is refused with a clear message before any process group exists."""

import lightning as L
import pytest
import torch.distributed as dist

from lightning_mcore import (
    BatchConfig,
    LayoutError,
    MegatronStrategy,
    OptimizerSettings,
    ParallelConfig,
    PretrainModule,
)
from lightning_mcore.strategy.parallel import resolve_fast_path, validate_layout
from toy import tiny_config


def refuse(match, world=4, batch=BatchConfig(8, 1), model=None, accelerator="cpu", use_te=False, **p):
    with pytest.raises(LayoutError, match=match):
        validate_layout(world, ParallelConfig(**p), batch, model or tiny_config(), accelerator, use_te)


def test_world_size_not_divisible_by_model_parallel():
    refuse(r"world size 6 is not divisible by .* = 4", world=6,
           tensor_model_parallel_size=2, pipeline_model_parallel_size=2)


def test_world_size_not_divisible_with_context_parallel():
    refuse(r"context_parallel_size \(2\) = 4", world=2, tensor_model_parallel_size=2, context_parallel_size=2)


def test_global_batch_not_divisible_by_micro_batch_times_dp():
    refuse(r"global_batch_size \(6\) is not divisible by micro_batch_size \(2\) x data-parallel size \(2\)",
           world=4, batch=BatchConfig(6, 2), tensor_model_parallel_size=2)


def test_heads_not_divisible_by_tp():
    refuse(r"num_attention_heads \(6\) is not divisible by tensor_model_parallel_size \(4\)",
           model=tiny_config(num_attention_heads=6, num_query_groups=2, hidden_size=96),
           tensor_model_parallel_size=4)


def test_query_groups_not_divisible_by_tp():
    refuse(r"num_query_groups \(2, the key/value heads; num_key_value_heads .*\) is not divisible by "
           r"tensor_model_parallel_size \(4\)",
           tensor_model_parallel_size=4)


def test_layers_not_divisible_by_pp():
    refuse(r"num_layers \(3\) is not divisible by pipeline_model_parallel_size \(2\)",
           model=tiny_config(num_layers=3), world=2, pipeline_model_parallel_size=2)


def test_layers_not_divisible_by_pp_times_vpp():
    refuse(r"num_layers \(4\) is not divisible by .*virtual_pipeline_model_parallel_size \(4\) = 8",
           world=2, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=4)


def test_sequence_parallel_without_tp():
    refuse(r"sequence_parallel=True needs tensor_model_parallel_size > 1", sequence_parallel=True)


def test_vpp_without_pp():
    refuse(r"virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size > 1",
           virtual_pipeline_model_parallel_size=2)


def test_ep_not_dividing_experts():
    refuse(r"expert_model_parallel_size \(4\) does not divide num_moe_experts \(6\)",
           model=tiny_config(num_moe_experts=6), expert_model_parallel_size=4)


def test_context_parallel_without_te_attention():
    refuse(r"context_parallel_size=2 needs Transformer Engine attention", world=2,
           context_parallel_size=2)


def test_fp8_without_te():
    refuse(r"fp8='delayed' needs Transformer Engine", model=tiny_config(fp8="delayed"))


def test_fast_path_defaults_follow_the_device():
    """None means: distributed optimizer + overlapped grad reduce on GPU, both off on CPU;
    an explicit value is kept."""
    strategy = MegatronStrategy(global_batch_size=8)
    L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    assert strategy.parallel.use_distributed_optimizer is False
    assert strategy.parallel.overlap_grad_reduce is False
    strategy = MegatronStrategy(global_batch_size=8, use_distributed_optimizer=True)
    L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    assert strategy.parallel.use_distributed_optimizer is True


def test_fast_path_keeps_the_plain_optimizer_for_sgd():
    """mcore's distributed optimizer takes Adam only: left unset, it stays off for SGD on GPU;
    asked for explicitly, it is refused with SGD."""
    unset = ParallelConfig(use_distributed_optimizer=None, overlap_grad_reduce=None)
    gpu_adam = resolve_fast_path(unset, on_gpu=True, optimizer="adam")
    assert gpu_adam.use_distributed_optimizer and gpu_adam.overlap_grad_reduce
    gpu_sgd = resolve_fast_path(unset, on_gpu=True, optimizer="sgd")
    assert not gpu_sgd.use_distributed_optimizer and gpu_sgd.overlap_grad_reduce
    assert not resolve_fast_path(unset, on_gpu=False, optimizer="adam").use_distributed_optimizer
    asked = resolve_fast_path(ParallelConfig(use_distributed_optimizer=True), on_gpu=True, optimizer="sgd")
    assert asked.use_distributed_optimizer
    with pytest.raises(LayoutError, match="use_distributed_optimizer=True cannot run optimizer='sgd'") as info:
        validate_layout(2, asked, BatchConfig(8, 1), tiny_config(), "gpu", optimizer="sgd")
    assert info.value.options == ("use_distributed_optimizer",) and info.value.optimizer
    validate_layout(2, gpu_sgd, BatchConfig(8, 1), tiny_config(), "gpu", optimizer="sgd")


def test_trainer_refuses_sgd_with_distributed_optimizer(tmp_path):
    """The module's optimizer is checked in setup_environment, before torch.distributed starts."""
    strategy = MegatronStrategy(global_batch_size=4, use_distributed_optimizer=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    module = PretrainModule(tiny_config(), OptimizerSettings(optimizer="sgd"))
    with pytest.raises(LayoutError, match="shards Adam's state only"):
        trainer.fit(module, [])
    assert not dist.is_initialized() and module.chunks is None


def test_te_on_cpu():
    refuse(r"Transformer Engine layers need a CUDA GPU", use_te=True)


def test_good_layout_passes():
    validate_layout(8, ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                      sequence_parallel=True), BatchConfig(8, 2), tiny_config())


def test_trainer_refuses_layout_when_built():
    """Through the real Trainer: a bad layout fails at Trainer(...), in the main process."""
    strategy = MegatronStrategy(tensor_model_parallel_size=2, global_batch_size=4, start_method="fork")
    with pytest.raises(LayoutError, match="world size 3 is not divisible"):
        L.Trainer(accelerator="cpu", devices=3, strategy=strategy, logger=False)
    assert not dist.is_initialized()


def test_trainer_refuses_model_shape_before_process_group(tmp_path):
    """Model-shape checks run in setup_environment, before torch.distributed starts."""
    strategy = MegatronStrategy(pipeline_model_parallel_size=1, global_batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        default_root_dir=tmp_path)
    module = PretrainModule(tiny_config(transformer_impl="transformer_engine"))
    with pytest.raises(LayoutError, match="Transformer Engine layers need a CUDA GPU"):
        trainer.fit(module, [])
    assert not dist.is_initialized()
    assert module.chunks is None  # no model was built


def test_context_parallel_slice_keeps_balanced_chunks():
    """cp=2: chunks [c0 c1 c2 c3] of every row go to rank 0 as [c0 c3], to rank 1 as [c1 c2];
    together the ranks hold each token exactly once."""
    import torch

    from lightning_mcore.strategy.parallel import context_parallel_slice

    tokens = torch.arange(2 * 16).reshape(2, 16)
    batch = {"tokens": tokens, "loss_mask": tokens.float()}
    r0 = context_parallel_slice(batch, 2, 0)["tokens"]
    r1 = context_parallel_slice(batch, 2, 1)["tokens"]
    assert r0[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert r1[0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert r0[1].tolist() == [16, 17, 18, 19, 28, 29, 30, 31]
    assert sorted(torch.cat([r0, r1], 1).flatten().tolist()) == list(range(32))
    assert torch.equal(context_parallel_slice(batch, 2, 1)["loss_mask"], r1.float())
    with pytest.raises(LayoutError, match="not divisible by 2 x context_parallel_size"):
        context_parallel_slice({"tokens": torch.zeros(1, 6)}, 2, 0)


BAD_LAYOUTS = [  # (world, batch, model overrides, accelerator, use_te, parallel sizes)
    (6, BatchConfig(8, 1), {}, "cpu", False, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
    (4, BatchConfig(6, 2), {}, "cpu", False, dict(tensor_model_parallel_size=2)),
    (4, BatchConfig(8, 1), {}, "cpu", False, dict(tensor_model_parallel_size=4)),
    (2, BatchConfig(8, 1), dict(num_layers=3), "cpu", False, dict(pipeline_model_parallel_size=2)),
    (2, BatchConfig(8, 1), {}, "cpu", False, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=4)),
    (4, BatchConfig(8, 1), {}, "cpu", False, dict(sequence_parallel=True)),
    (4, BatchConfig(8, 1), {}, "cpu", False, dict(expert_model_parallel_size=2)),
    (4, BatchConfig(8, 1), {}, "cpu", True, {}),
    (4, BatchConfig(8, 1), dict(fp8="delayed"), "cpu", False, {}),
    (2, BatchConfig(8, 1), {}, "cpu", False, dict(context_parallel_size=2)),
    (4, BatchConfig(8, 1), {}, "cpu", False, dict(overlap_param_gather=True, use_distributed_optimizer=False)),
    (2, BatchConfig(3, 1), {}, "cpu", False, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)),
]


@pytest.mark.parametrize("world,batch,model,accelerator,use_te,sizes", BAD_LAYOUTS)
def test_layout_errors_name_the_settings(world, batch, model, accelerator, use_te, sizes):
    """The CLI points at config keys from what a LayoutError names: every name must be a real
    MegatronStrategy argument or GPTConfig field, and each one the message itself talks about."""
    import inspect

    from lightning_mcore import GPTConfig

    with pytest.raises(LayoutError) as info:
        validate_layout(world, ParallelConfig(**sizes), batch, tiny_config(**model), accelerator, use_te)
    error = info.value
    assert error.options or error.fields or error.devices or error.accelerator, str(error)
    arguments = inspect.signature(MegatronStrategy).parameters
    for option in error.options:
        assert option in arguments, option
    for field in error.fields:
        assert field in GPTConfig.__dataclass_fields__, field
    named = error.options + error.fields
    for name in named:
        assert name in str(error), (name, str(error))
