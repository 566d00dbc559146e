"""Checks on the memory options, pure: activation recompute and offload (GPTConfig), optimizer
offload (OptimizerSettings) and reference offload (DPO's and GRPO's offload_reference). The
strategy runs them before any process starts, so that a setting mcore would refuse inside every
rank, index past a stage's layers with, or quietly ignore, ends in one error naming the key and
the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from lightning_mcore.model import te
from lightning_mcore.strategy.parallel import LayoutError, ParallelConfig

if TYPE_CHECKING:  # pragma: no cover
    from lightning_mcore.model.config import GPTConfig
    from lightning_mcore.strategy.optimizer import OptimizerSettings

# Selective-recompute modules that mcore accepts (TransformerConfig's allowed_modules, less
# "gdn_norm_out", for gated delta-net attention, which we do not build).
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "moe", "moe_act", "shared_experts", "mla_up_proj")
# TransformerConfig fields that GPTConfig sets from a typed field, by that field.
TYPED_EXTRA = {"recompute_granularity": "recompute_granularity",
               "recompute_method": "recompute_method",
               "recompute_num_layers": "recompute_num_layers",
               "recompute_modules": "recompute_modules",
               "cpu_offloading": "activation_offload_layers",
               "cpu_offloading_num_layers": "activation_offload_layers",
               "cpu_offloading_activations": "activation_offload_layers",
               "cpu_offloading_weights": "activation_offload_layers"}


class MemoryOptionError(LayoutError):
    """A memory option that cannot work with this model, layout, optimizer or device.
    `optim`: the OptimizerSettings fields involved, `module`: the module's own arguments
    (the CLI names them)."""

    what = "memory setting"

    def __init__(self, message: str, fields: tuple = (), options: tuple = (),
                 accelerator: bool = False, optim: tuple = (), module: tuple = ()) -> None:
        super().__init__(message, options=options, fields=fields, accelerator=accelerator)
        self.optim_fields, self.module_fields = tuple(optim), tuple(module)


def validate_memory(parallel: ParallelConfig, model: Optional["GPTConfig"] = None,
                    settings: Optional["OptimizerSettings"] = None, accelerator: str = "cpu",
                    use_te: bool = False) -> None:
    """Raise MemoryOptionError naming the problem and the fix; None when every option can work."""
    if model is not None:
        validate_recompute(parallel, model)
        validate_activation_offload(parallel, model, accelerator, use_te)
    if settings is not None:
        validate_optimizer_offload(settings, parallel, accelerator)
        validate_precision_aware(settings, parallel, accelerator)


def layers_per_stage(parallel: ParallelConfig, model: "GPTConfig") -> tuple[int, str]:
    """Layers of one (virtual) pipeline stage, and how that number comes about."""
    pp, vpp = parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_model_parallel_size
    how = f"num_layers ({model.num_layers}) / pipeline_model_parallel_size ({pp})"
    if vpp:
        how += f" / virtual_pipeline_model_parallel_size ({vpp})"
    return model.num_layers // (pp * parallel.virtual_stages), how


def validate_recompute(parallel: ParallelConfig, model: "GPTConfig") -> None:
    typed = sorted(k for k in model.extra if k in TYPED_EXTRA)
    if typed:
        raise MemoryOptionError(
            f"extra sets {', '.join(typed)}: set the typed model key"
            f"{'s' if len({TYPED_EXTRA[k] for k in typed}) > 1 else ''} "
            f"{', '.join(sorted({TYPED_EXTRA[k] for k in typed}))} instead and drop "
            f"{'them' if len(typed) > 1 else 'it'} from extra.", fields=("extra",))
    granularity, method, n = model.recompute_granularity, model.recompute_method, model.recompute_num_layers
    if granularity != "full" and (method != "uniform" or n is not None):
        given = ([f"recompute_method={method!r}"] if method != "uniform" else []) + \
                ([f"recompute_num_layers={n}"] if n is not None else [])
        raise MemoryOptionError(
            f"{' and '.join(given)} choose{'s' if len(given) == 1 else ''} the layers of full "
            f"recompute, but recompute_granularity={granularity!r}: set "
            f"recompute_granularity='full', or remove {' and '.join(g.split('=')[0] for g in given)}.",
            fields=("recompute_granularity",) + tuple(g.split("=")[0] for g in given))
    if model.recompute_modules is not None:
        _validate_recompute_modules(model)
    if granularity != "full":
        return
    if n is not None and n < 1:
        raise MemoryOptionError(f"recompute_num_layers={n} must be >= 1 (or None: 1 with "
                                f"recompute_method='uniform').", fields=("recompute_num_layers",))
    if method == "block" and n is None:
        raise MemoryOptionError(
            "recompute_method='block' recomputes the first recompute_num_layers layers of each "
            "pipeline stage: set recompute_num_layers.", fields=("recompute_method", "recompute_num_layers"))
    stage, how = layers_per_stage(parallel, model)
    if stage and (n or 1) > stage:
        raise MemoryOptionError(
            f"recompute_num_layers={n} is more than the {stage} layers of each pipeline stage "
            f"({how}): set recompute_num_layers <= {stage}"
            + (" (block: that many of each stage recompute)." if method == "block" else "."),
            fields=("recompute_num_layers", "num_layers"),
            options=("pipeline_model_parallel_size",)
            + (("virtual_pipeline_model_parallel_size",) if parallel.virtual_pipeline_model_parallel_size else ()))


def _validate_recompute_modules(model: "GPTConfig") -> None:
    modules = list(model.recompute_modules)
    if model.recompute_granularity != "selective":
        raise MemoryOptionError(
            f"recompute_modules={modules} choose what selective recompute recomputes, but "
            f"recompute_granularity={model.recompute_granularity!r}: set "
            f"recompute_granularity='selective', or remove recompute_modules.",
            fields=("recompute_modules", "recompute_granularity"))
    unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
    if unknown or not modules:
        what = f"has unknown names {unknown}" if unknown else "is empty (nothing would recompute)"
        raise MemoryOptionError(f"recompute_modules {what}; choose from {list(RECOMPUTE_MODULES)}.",
                                fields=("recompute_modules",))
    moe = model.num_moe_experts
    needs = {  # module: (what it needs, the model fields involved); mcore's own refusals marked
        "moe": (moe, "a MoE model (num_moe_experts)", ("num_moe_experts",)),
        "moe_act": (moe and model.mcore_grouped_gemm,  # mcore's TE experts
                    "a MoE model with moe_grouped_gemm=True and moe_grouped_gemm_backend='te'",
                    ("num_moe_experts", "moe_grouped_gemm", "moe_grouped_gemm_backend")),
        "shared_experts": (moe and model.moe_shared_expert_intermediate_size,
                           "shared experts (moe_shared_expert_intermediate_size)",
                           ("moe_shared_expert_intermediate_size",)),
        "mla_up_proj": (model.mla is not None, "multi-latent attention (mla)", ("mla",)),  # mcore
    }
    for name in modules:
        if name in needs and not needs[name][0]:
            raise MemoryOptionError(
                f"recompute_modules has {name!r}, which needs {needs[name][1]}: remove it.",
                fields=("recompute_modules",) + needs[name][2])
    if model.fp8 == "delayed" and {"moe_act", "layernorm"} & set(modules):  # mcore
        raise MemoryOptionError(
            "recompute_modules 'moe_act' and 'layernorm' do not work with fp8='delayed' (mcore): "
            "use fp8='current' or remove them.", fields=("recompute_modules", "fp8"))


def validate_activation_offload(parallel: ParallelConfig, model: "GPTConfig", accelerator: str,
                                use_te: bool) -> None:
    """mcore's cpu_offloading: Transformer Engine's offload context (the
    block asserts TE), fewer layers than the model's, no pipeline parallelism, no recompute."""
    n = model.activation_offload_layers
    if not n:
        return
    fields = ("activation_offload_layers",)
    if n < 0 or n >= model.num_layers:
        raise MemoryOptionError(
            f"activation_offload_layers={n} must be between 1 and num_layers - 1 "
            f"({model.num_layers - 1}): the last layer's activations are used at once (0: off).",
            fields=fields + ("num_layers",))
    if accelerator == "cpu" or not use_te:
        raise MemoryOptionError(
            f"activation_offload_layers={n} needs Transformer Engine layers on a GPU (mcore "
            f"offloads through TE): run on GPU with transformer_impl 'auto' or "
            f"'transformer_engine', or set activation_offload_layers=0.",
            fields=fields + ("transformer_impl",), accelerator=True)
    if parallel.pipeline_model_parallel_size > 1:
        raise MemoryOptionError(
            f"activation_offload_layers={n} does not work with pipeline_model_parallel_size="
            f"{parallel.pipeline_model_parallel_size} (mcore): use one pipeline stage or set "
            f"activation_offload_layers=0.", fields=fields, options=("pipeline_model_parallel_size",))
    if model.recompute_granularity is not None:
        raise MemoryOptionError(
            f"activation_offload_layers={n} does not work with recompute_granularity="
            f"{model.recompute_granularity!r} (mcore): choose one of them.",
            fields=fields + ("recompute_granularity",))


def validate_optimizer_offload(settings: "OptimizerSettings", parallel: ParallelConfig,
                               accelerator: str) -> None:
    """mcore's optimizer_cpu_offload (HybridDeviceOptimizer) moves Adam's
    state between CUDA and CPU and plugs into the distributed optimizer only; with it, the
    precision-aware optimizer (Megatron-LM asserts the pair), which asks for TE's version."""
    if not settings.cpu_offload:
        return
    if accelerator == "cpu":
        raise MemoryOptionError(
            "cpu_offload=True moves the optimizer state off the GPU; on accelerator='cpu' it "
            "already is there: set cpu_offload=False.", optim=("cpu_offload",), accelerator=True)
    if not parallel.use_distributed_optimizer:
        raise MemoryOptionError(
            "cpu_offload=True needs use_distributed_optimizer=True (mcore's offload runs inside "
            "the distributed optimizer): set it, or leave it unset (on by default on GPU).",
            optim=("cpu_offload",), options=("use_distributed_optimizer",))
    if not te.te_available():
        raise MemoryOptionError(
            "cpu_offload=True needs Transformer Engine installed: mcore runs the offloaded "
            "optimizer on its precision-aware path, which reads TE's version. Install "
            "transformer_engine[pytorch], or set cpu_offload=False.", optim=("cpu_offload",))


def validate_precision_aware(settings: "OptimizerSettings", parallel: ParallelConfig,
                             accelerator: str) -> None:
    """An explicit precision_aware=True where mcore cannot run it (None turns it off there):
    mcore's precision-aware path is the distributed optimizer's, on TE's FusedAdam (CUDA)."""
    if not settings.precision_aware:
        return
    fields = ("precision_aware",)
    if accelerator == "cpu":
        raise MemoryOptionError(
            "precision_aware=True runs Adam on Transformer Engine's FusedAdam, a GPU kernel: on "
            "accelerator='cpu' leave precision_aware unset (or False).", optim=fields, accelerator=True)
    if not parallel.use_distributed_optimizer:
        raise MemoryOptionError(
            "precision_aware=True needs use_distributed_optimizer=True (mcore's precision-aware "
            "path is the distributed optimizer's): set it, or leave it unset (on by default on GPU).",
            optim=fields, options=("use_distributed_optimizer",))
    if not te.te_available():
        raise MemoryOptionError(
            "precision_aware=True needs Transformer Engine installed (its FusedAdam holds the "
            "master weights): install transformer_engine[pytorch], or leave precision_aware unset.",
            optim=fields)


def validate_reference_offload(offload_reference: bool, accelerator: str) -> None:
    """DPO's and GRPO's offload_reference keeps the frozen reference in CPU memory between its
    forward passes: it saves GPU memory, and on accelerator='cpu' there is none to save."""
    if offload_reference and accelerator == "cpu":
        raise MemoryOptionError(
            "offload_reference=True keeps the frozen reference off the GPU between its forward "
            "passes; on accelerator='cpu' it already is there: set offload_reference=False.",
            module=("offload_reference",), accelerator=True)
