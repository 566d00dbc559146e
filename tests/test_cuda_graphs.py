"""GPTConfig.cuda_graphs (issue 20): the parts reach mcore's TransformerConfig
(cuda_graph_modules), every combination mcore would assert on inside each rank (or fail at capture)
is refused before launch naming the key, and a batch of another shape is refused once graphs are
captured. On GPU the capture itself is measured by benchmarks/bench_pretrain.py --cuda-graphs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_mcore.model.config import to_transformer_config
from lightning_mcore.strategy.cuda_graphs import (CudaGraphError, check_graph_shape, graph_safe_rng,
                                                   validate_cuda_graphs, validate_graphed_module)
from lightning_mcore.strategy.parallel import ParallelConfig
from test_bad_inputs import MODEL, refused, write_config
from test_memory_options import no_fit  # noqa: F401  (fixture)
from toy import tiny_config

MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=True)
MOE_PARTS = ["attn", "moe_router", "moe_preprocess"]


def mcore_parts(tf) -> list[str]:
    """The captured parts as mcore holds them (enums in cuda_graph_modules)."""
    return [getattr(p, "name", p) for p in tf.cuda_graph_modules]


@pytest.mark.parametrize("parts, moe", [(MOE_PARTS, True), (["attn", "mlp"], False), ([], False)])
def test_parts_reach_mcore(parts, moe):
    cfg = tiny_config(cuda_graphs=parts, **(MOE if moe else {}))
    validate_cuda_graphs(cfg, "gpu")
    tf = to_transformer_config(cfg, ParallelConfig(), torch.bfloat16, True, False)
    assert tf.cuda_graph_impl == "local" and mcore_parts(tf) == parts


def test_off_by_default():
    tf = to_transformer_config(tiny_config(), ParallelConfig(), torch.bfloat16, True, False)
    assert tf.cuda_graph_impl == "none"


@pytest.mark.parametrize("accelerator, fields, match", [
    ("cpu", dict(cuda_graphs=["attn"]), "needs a GPU"),
    ("gpu", dict(cuda_graphs=["attn", "router"]), r"unknown part\(s\) \['router'\]"),
    ("gpu", dict(cuda_graphs=["moe_router"]), "need MoE layers"),
    ("gpu", dict(cuda_graphs=["attn", "moe_preprocess"], **MOE), "add 'moe_router'"),
    ("gpu", dict(cuda_graphs=[], **MOE), "cannot be captured whole"),
    ("gpu", dict(cuda_graphs=["attn", "mlp"], **MOE), "cannot be captured whole"),
    ("gpu", dict(cuda_graphs=["attn"], recompute_granularity="full"), "recompute_granularity='full'"),
    ("gpu", dict(cuda_graphs=["attn"], activation_offload_layers=1), "activation_offload_layers=1"),
])
def test_refused_before_launch(accelerator, fields, match):
    with pytest.raises(CudaGraphError, match=match) as info:
        validate_cuda_graphs(tiny_config(**fields), accelerator)
    assert "cuda_graphs" in info.value.fields


def test_dense_mlp_of_a_mixed_model_is_capturable():
    # moe_layer_freq [0, 1, 1, 1]: the first layer dense, its MLP can be captured
    validate_cuda_graphs(tiny_config(cuda_graphs=["attn", "mlp", "moe_router"], moe_layer_freq=[0, 1, 1, 1], **MOE),
                         "gpu")


@pytest.mark.parametrize("module", ["SFTModule", "VisionLanguageSFTModule", "DPOModule", "KTOModule",
                                    "GRPOModule", "DistillModule", "RewardModule"])
def test_packed_modules_are_refused(module):
    """Their packed rows' sequence boundaries change every step; a replay would keep the captured
    ones. Each module really packs (the flag the strategy reads), and PretrainModule does not."""
    import lightning_mcore

    assert getattr(lightning_mcore, module).packed_sequences and not lightning_mcore.PretrainModule.packed_sequences
    with pytest.raises(CudaGraphError, match=f"with {module}: its microbatches are packed rows") as info:
        validate_graphed_module(tiny_config(cuda_graphs=["attn"]), module, packed=True)
    assert info.value.fields == ("cuda_graphs",)
    validate_graphed_module(tiny_config(cuda_graphs=["attn"]), "PretrainModule", packed=False)
    validate_graphed_module(tiny_config(), module, packed=True)  # graphs off: nothing to refuse


def test_another_shape_after_capture_is_refused():
    cfg = tiny_config(cuda_graphs=["attn"])
    first = check_graph_shape(cfg, None, (4, 128))
    assert check_graph_shape(cfg, first, torch.Size([4, 128])) == (4, 128)
    with pytest.raises(ValueError, match=r"shape \(4, 96\), the captured steps \(4, 128\)"):
        check_graph_shape(cfg, first, (4, 96))


def test_cli_refuses_cuda_graphs_on_cpu(capsys, tmp_path, no_fit):  # noqa: F811
    line = refused(capsys, tmp_path, write_config(tmp_path, model=dict(MODEL, cuda_graphs=["attn"])))
    assert line.startswith("error: invalid CUDA graph setting (trainer.accelerator=cpu, "
                           "model.init_args.model.cuda_graphs=['attn']): cuda_graphs=['attn'] needs a GPU"), line


@pytest.mark.parametrize("parts, use_te, want", [
    (None, True, {"te_rng_tracker": False, "use_cudagraphable_rng": False}),  # mcore's default tracker
    (["attn"], True, {"te_rng_tracker": True, "use_cudagraphable_rng": False}),  # TE attention needs TE's
    (["attn"], False, {"te_rng_tracker": False, "use_cudagraphable_rng": True}),
])
def test_graph_safe_rng_tracker(parts, use_te, want):
    assert graph_safe_rng(tiny_config(cuda_graphs=parts), use_te) == want
    tf = to_transformer_config(tiny_config(cuda_graphs=parts), ParallelConfig(), torch.bfloat16, True, use_te=False)
    assert tf.use_te_rng_tracker is False  # without TE layers, mcore's own cudagraphable tracker


def test_resume_may_change_cuda_graphs(tmp_path):
    """Graphs change no weight: a checkpoint saved with them resumes without them, and the other
    way round (as the recompute settings do); the model check still runs."""
    from lightning_mcore.strategy import checkpoint_io

    path = tmp_path / "x.ckpt"
    (path / checkpoint_io.WEIGHTS).mkdir(parents=True)
    saved = tiny_config(cuda_graphs=["attn"])
    torch.save({"megatron": {"model_config": dataclasses.asdict(saved)}}, path / checkpoint_io.COMMON)
    checkpoint_io.read_common(path, dataclasses.replace(saved, cuda_graphs=None))
    checkpoint_io.read_common(path, dataclasses.replace(saved, cuda_graphs=["attn", "mlp"]))
    with pytest.raises(checkpoint_io.CheckpointLoadError, match="num_layers"):
        checkpoint_io.read_common(path, dataclasses.replace(saved, num_layers=2))
