"""Memory options as typed settings (issue 22): each reaches mcore's TransformerConfig or
OptimizerConfig as mcore names it, and each combination that cannot work is refused with its
message before any worker starts (acceptance 5). No processes: configs are built directly."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types

import lightning as L
import pytest
import torch

from lightning_mcore.model import te
from lightning_mcore.model.config import te_available, to_transformer_config
from lightning_mcore.strategy import checkpoint_io
from lightning_mcore.strategy.memory import RECOMPUTE_MODULES, MemoryOptionError, validate_memory
from lightning_mcore.strategy.optimizer import OptimizerSettings, optimizer_config, uses_precision_aware
from lightning_mcore.strategy.parallel import ParallelConfig
from test_bad_inputs import MODEL, refused, write_config
from toy import tiny_config

PP2 = ParallelConfig(pipeline_model_parallel_size=2)
GPU_DIST = ParallelConfig(use_distributed_optimizer=True)


def tf_config(**fields):
    """mcore's TransformerConfig of a tiny model, as the strategy builds it on CPU."""
    return to_transformer_config(tiny_config(**fields), ParallelConfig(), torch.float32, True, False)


def refuse(match: str, parallel=ParallelConfig(), settings=None, accelerator="gpu", use_te=True, **fields):
    model = tiny_config(**fields) if fields else None
    with pytest.raises(MemoryOptionError, match=match) as info:
        validate_memory(parallel, model, settings, accelerator, use_te)
    return info.value


# --------------------------------------------------------------- recompute reaches mcore
def test_full_recompute_block_reaches_mcore():
    tf = tf_config(recompute_granularity="full", recompute_method="block", recompute_num_layers=3)
    assert (tf.recompute_granularity, tf.recompute_method, tf.recompute_num_layers) == ("full", "block", 3)


def test_full_recompute_uniform_defaults_to_one_layer_units():
    tf = tf_config(recompute_granularity="full")
    assert (tf.recompute_method, tf.recompute_num_layers) == ("uniform", 1)


def test_selective_recompute_modules_reach_mcore():
    tf = tf_config(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])
    assert tf.recompute_modules == ["core_attn", "mlp"] and tf.recompute_num_layers is None
    assert tf_config(recompute_granularity="selective").recompute_modules == ["core_attn"]  # mcore's


def test_recompute_module_names_are_mcores():
    """Every name we allow passes mcore's own list (selective recompute of a model that has
    what the name needs: MoE with grouped GEMM and shared experts, MLA for mla_up_proj)."""
    source = inspect.getsource(type(tf_config()).__post_init__)
    for name in RECOMPUTE_MODULES:
        assert f'"{name}"' in source, name
    for name in ("moe", "moe_act", "shared_experts", "core_attn", "mlp", "layernorm"):
        moe = tiny_config(num_moe_experts=4, moe_ffn_hidden_size=64, moe_grouped_gemm=True,
                          moe_shared_expert_intermediate_size=64,
                          recompute_granularity="selective", recompute_modules=[name])
        validate_memory(ParallelConfig(), moe)
    refuse("unknown names \\['attention'\\]; choose from \\['core_attn', 'mlp'",
           recompute_granularity="selective", recompute_modules=["core_attn", "attention"])


# --------------------------------------------------------------- recompute refusals
def test_block_without_full_granularity():
    refuse("recompute_method='block' chooses the layers of full recompute, but "
           "recompute_granularity='selective': set recompute_granularity='full', or remove recompute_method",
           recompute_granularity="selective", recompute_method="block")


def test_num_layers_without_granularity():
    refuse("recompute_num_layers=2 chooses the layers of full recompute, but recompute_granularity=None",
           recompute_num_layers=2)


def test_modules_without_selective():
    refuse("recompute_modules=\\['mlp'\\] choose what selective recompute recomputes, but "
           "recompute_granularity='full': set recompute_granularity='selective'",
           recompute_granularity="full", recompute_modules=["mlp"])


def test_empty_modules():
    refuse("recompute_modules is empty", recompute_granularity="selective", recompute_modules=[])


@pytest.mark.parametrize("name, fields, needs", [
    ("moe", {}, "a MoE model"),
    ("moe_act", dict(num_moe_experts=4, moe_ffn_hidden_size=64), "a MoE model with moe_grouped_gemm=True"),
    ("shared_experts", dict(num_moe_experts=4, moe_ffn_hidden_size=64), "shared experts"),
    ("mla_up_proj", {}, "multi-latent attention"),
])
def test_module_the_model_lacks(name, fields, needs):
    refuse(f"recompute_modules has '{name}', which needs {needs}",
           recompute_granularity="selective", recompute_modules=[name], **fields)


def test_module_mcore_refuses_with_delayed_fp8():
    refuse("'moe_act' and 'layernorm' do not work with fp8='delayed'",
           recompute_granularity="selective", recompute_modules=["layernorm"], fp8="delayed")


def test_num_layers_below_one():
    refuse("recompute_num_layers=0 must be >= 1", recompute_granularity="full", recompute_num_layers=0)


def test_block_needs_num_layers():
    refuse("set recompute_num_layers", recompute_granularity="full", recompute_method="block")


def test_block_more_layers_than_the_model():
    refuse("recompute_num_layers=5 is more than the 4 layers of each pipeline stage "
           "\\(num_layers \\(4\\) / pipeline_model_parallel_size \\(1\\)\\)",
           recompute_granularity="full", recompute_method="block", recompute_num_layers=5)


def test_block_more_layers_than_a_pipeline_stage():
    """4 layers over 2 stages: 3 would be fine for the model, not for a stage of 2."""
    validate_memory(ParallelConfig(), tiny_config(recompute_granularity="full", recompute_method="block",
                                                  recompute_num_layers=3))
    error = refuse("recompute_num_layers=3 is more than the 2 layers of each pipeline stage "
                   "\\(num_layers \\(4\\) / pipeline_model_parallel_size \\(2\\)\\): set recompute_num_layers <= 2",
                   parallel=PP2, recompute_granularity="full", recompute_method="block", recompute_num_layers=3)
    assert error.options == ("pipeline_model_parallel_size",)


def test_uniform_units_need_not_divide_the_stage():
    """mcore's uniform loop ends its last unit at the stage's last layer (recompute.py,
    checkpointed_forward): units of 3 over a 4-layer stage are taken as given."""
    validate_memory(ParallelConfig(), tiny_config(recompute_granularity="full", recompute_num_layers=3))
    tf = tf_config(recompute_granularity="full", recompute_num_layers=3)
    assert (tf.recompute_method, tf.recompute_num_layers) == ("uniform", 3)


def test_recompute_in_extra_points_to_the_typed_keys():
    refuse("extra sets recompute_method, recompute_num_layers: set the typed model keys recompute_method, "
           "recompute_num_layers instead", recompute_granularity="full",
           extra={"recompute_method": "block", "recompute_num_layers": 2})



def test_extra_fields_reach_mcore_and_unknown_ones_are_refused():
    """GPTConfig.extra passes any other TransformerConfig field; one mcore does not have is named,
    not dropped (every field we set ourselves is one of 0.19's)."""
    assert tf_config().attention_softmax_in_fp32  # mcore's default
    assert not tf_config(extra={"attention_softmax_in_fp32": False}).attention_softmax_in_fp32
    with pytest.raises(ValueError, match="GPTConfig.extra: TransformerConfig has no field 'no_such_field'"):
        tf_config(extra={"no_such_field": 1, "attention_softmax_in_fp32": False})

# --------------------------------------------------------------- activation offload
def test_activation_offload_reaches_mcore():
    tf = tf_config(activation_offload_layers=2)
    assert (tf.cpu_offloading, tf.cpu_offloading_num_layers) == (True, 2)
    assert tf.cpu_offloading_activations and not tf.cpu_offloading_weights
    assert not tf_config().cpu_offloading


@pytest.mark.parametrize("n", [-1, 4])
def test_activation_offload_layer_count(n):
    refuse(f"activation_offload_layers={n} must be between 1 and num_layers - 1 \\(3\\)",
           activation_offload_layers=n)


def test_activation_offload_layer_count_matches_mcore():
    """mcore refuses the same count in its own config (with PP=1 and no recompute)."""
    with pytest.raises(ValueError, match="CPU offloading can be done only for layers less than 4"):
        tf_config(activation_offload_layers=4)


@pytest.mark.parametrize("accelerator, use_te", [("cpu", False), ("gpu", False)])
def test_activation_offload_needs_te_on_gpu(accelerator, use_te):
    error = refuse("activation_offload_layers=2 needs Transformer Engine layers on a GPU",
                   accelerator=accelerator, use_te=use_te, activation_offload_layers=2)
    assert error.accelerator and "transformer_impl" in error.fields


def test_activation_offload_without_pipeline_parallelism():
    refuse("activation_offload_layers=1 does not work with pipeline_model_parallel_size=2",
           parallel=PP2, activation_offload_layers=1)


def test_activation_offload_without_recompute():
    refuse("activation_offload_layers=1 does not work with recompute_granularity='full'",
           activation_offload_layers=1, recompute_granularity="full")
    validate_memory(ParallelConfig(), tiny_config(activation_offload_layers=3), None, "gpu", True)


# --------------------------------------------------------------- optimizer offload
def test_optimizer_offload_reaches_mcore(monkeypatch):
    """The precision-aware path asks for TE's version (None here, without TE): pretend one."""
    import megatron.core.optimizer.optimizer_config as mcore_config

    monkeypatch.setattr(mcore_config, "is_te_min_version", lambda *a, **k: True)
    config = optimizer_config(OptimizerSettings(cpu_offload=True, offload_fraction=0.5), GPU_DIST,
                              torch.bfloat16)
    assert config.optimizer_cpu_offload and config.optimizer_offload_fraction == 0.5
    assert config.use_precision_aware_optimizer and config.use_distributed_optimizer
    plain = optimizer_config(OptimizerSettings(), GPU_DIST, torch.bfloat16)
    assert not plain.optimizer_cpu_offload and not plain.use_precision_aware_optimizer


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5])
def test_offload_fraction_outside_range(fraction):
    with pytest.raises(ValueError, match=f"offload_fraction={fraction} must be in \\(0, 1\\]"):
        OptimizerSettings(cpu_offload=True, offload_fraction=fraction)


def test_optimizer_offload_needs_adam():
    with pytest.raises(ValueError, match="cpu_offload=True works with optimizer='adam' only.*not 'sgd'"):
        OptimizerSettings(cpu_offload=True, optimizer="sgd")


def test_optimizer_offload_on_cpu():
    error = refuse("cpu_offload=True moves the optimizer state off the GPU; on accelerator='cpu'",
                   settings=OptimizerSettings(cpu_offload=True), accelerator="cpu")
    assert error.optim_fields == ("cpu_offload",)


def test_optimizer_offload_needs_the_distributed_optimizer():
    error = refuse("cpu_offload=True needs use_distributed_optimizer=True",
                   settings=OptimizerSettings(cpu_offload=True))
    assert error.options == ("use_distributed_optimizer",)


@pytest.mark.skipif(te_available(), reason="Transformer Engine is installed here")
def test_optimizer_offload_needs_te_installed():
    refuse("cpu_offload=True needs Transformer Engine installed", parallel=GPU_DIST,
           settings=OptimizerSettings(cpu_offload=True))


# --------------------------------------------------------------- precision-aware optimizer
@pytest.mark.parametrize("settings, parallel, dtype, on_gpu, expected", [
    (OptimizerSettings(), GPU_DIST, torch.bfloat16, True, True),  # the GPU fast path
    (OptimizerSettings(), GPU_DIST, torch.bfloat16, False, False),  # CPU: torch's Adam
    (OptimizerSettings(), ParallelConfig(), torch.bfloat16, True, False),  # not the distributed optimizer
    (OptimizerSettings(), GPU_DIST, torch.float32, True, False),  # fp32 weights: nothing to save
    (OptimizerSettings(optimizer="sgd"), GPU_DIST, torch.bfloat16, True, False),
    (OptimizerSettings(precision_aware=False), GPU_DIST, torch.bfloat16, True, False),
    (OptimizerSettings(precision_aware=True), GPU_DIST, torch.float32, True, True),  # asked for
    (OptimizerSettings(cpu_offload=True), GPU_DIST, torch.float32, True, True),  # offload needs it
])
def test_precision_aware_default(monkeypatch, settings, parallel, dtype, on_gpu, expected):
    monkeypatch.setattr(te, "te_available", lambda: True)
    assert uses_precision_aware(settings, parallel, dtype, on_gpu) is expected


def test_precision_aware_reaches_mcore(monkeypatch):
    """mcore checks TE's FusedAdam for the precision-aware arguments: without TE, a stand-in."""
    if not te_available():
        class FusedAdam:  # the arguments mcore looks for
            def __init__(self, params, master_weight_dtype=None, exp_avg_dtype=None,
                         exp_avg_sq_dtype=None, use_decoupled_grad=False):
                pass

        import megatron.core.optimizer.optimizer_config as mcore_config

        monkeypatch.setattr(mcore_config, "is_te_min_version", lambda *a, **k: True)
        for name in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.optimizers"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        sys.modules["transformer_engine.pytorch.optimizers"].FusedAdam = FusedAdam
    config = optimizer_config(OptimizerSettings(precision_aware=True), GPU_DIST, torch.bfloat16, True)
    assert config.use_precision_aware_optimizer and not config.optimizer_cpu_offload
    # fp32 master weights and moments: the update mcore's own copies give
    assert (config.main_params_dtype, config.exp_avg_dtype, config.exp_avg_sq_dtype) == (torch.float32,) * 3
    assert not optimizer_config(OptimizerSettings(), GPU_DIST, torch.bfloat16, False).use_precision_aware_optimizer


@pytest.mark.skipif(te_available(), reason="Transformer Engine is installed here")
def test_precision_aware_default_is_off_without_te():
    assert not uses_precision_aware(OptimizerSettings(), GPU_DIST, torch.bfloat16, True)


def test_precision_aware_settings_that_contradict():
    with pytest.raises(ValueError, match="precision_aware=True works with optimizer='adam' only.*not 'sgd'"):
        OptimizerSettings(precision_aware=True, optimizer="sgd")
    with pytest.raises(ValueError, match="cpu_offload=True runs on mcore's precision-aware optimizer"):
        OptimizerSettings(cpu_offload=True, precision_aware=False)


def test_precision_aware_refused_where_it_cannot_run():
    asked = OptimizerSettings(precision_aware=True)
    error = refuse("precision_aware=True runs Adam on Transformer Engine's FusedAdam, a GPU kernel",
                   settings=asked, accelerator="cpu")
    assert error.optim_fields == ("precision_aware",)
    error = refuse("precision_aware=True needs use_distributed_optimizer=True", settings=asked)
    assert error.options == ("use_distributed_optimizer",)
    validate_memory(GPU_DIST, None, OptimizerSettings(), "cpu")  # unset: nothing to refuse
    if not te_available():
        refuse("precision_aware=True needs Transformer Engine installed", parallel=GPU_DIST, settings=asked)


# --------------------------------------------------------------- resume and the CLI
def test_resume_may_change_recompute_and_offload(tmp_path):
    """These options change no weights: a checkpoint saved without them resumes with them."""
    path = tmp_path / "x.ckpt"
    (path / checkpoint_io.WEIGHTS).mkdir(parents=True)
    saved = tiny_config()
    torch.save({"megatron": {"model_config": dataclasses.asdict(saved)}}, path / checkpoint_io.COMMON)
    checkpoint_io.read_common(path, dataclasses.replace(
        saved, recompute_granularity="full", recompute_method="block", recompute_num_layers=2,
        activation_offload_layers=1))
    checkpoint_io.read_common(path, dataclasses.replace(
        saved, recompute_granularity="selective", recompute_modules=["mlp"]))
    with pytest.raises(checkpoint_io.CheckpointLoadError, match="num_layers"):  # the check still runs
        checkpoint_io.read_common(path, dataclasses.replace(saved, num_layers=2))


@pytest.fixture
def no_fit(monkeypatch):
    @functools.wraps(L.Trainer.fit)
    def refuse_fit(*args, **kwargs):
        raise AssertionError("Trainer.fit must not run: the mistake was not found before launch")

    monkeypatch.setattr(L.Trainer, "fit", refuse_fit)


def test_cli_refuses_a_bad_memory_option_before_launch(capsys, tmp_path, no_fit):
    config = write_config(tmp_path, model=dict(MODEL, recompute_granularity="selective",
                                               recompute_modules=["core_attn", "attn"]))
    line = refused(capsys, tmp_path, config)
    assert line.startswith("error: invalid memory setting (model.init_args.model.recompute_modules="
                           "['core_attn', 'attn']): recompute_modules has unknown names ['attn']"), line


def test_cli_names_the_optimizer_key(capsys, tmp_path, no_fit):
    line = refused(capsys, tmp_path, write_config(tmp_path), "--model.init_args.optim.cpu_offload", "true")
    assert "model.init_args.optim.cpu_offload=True" in line and "trainer.accelerator=cpu" in line, line
