"""A Llama-style model description and its translation to mcore's TransformerConfig."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import torch
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_config import MLATransformerConfig

from lightning_mcore.model.mla import mla_config_kwargs
from lightning_mcore.model.rope import yarn_attention_factor
from lightning_mcore.model.te import te_available, te_cross_entropy_in_fp32

TransformerImpl = Literal["auto", "transformer_engine", "local"]
# Of the gated MLP: silu (SwiGLU), gelu_tanh (GeGLU), quick_gelu (x * sigmoid(1.702 x) gating;
# with glu_linear_offset=1 and activation_clamp, GPT-OSS's clamped SwiGLU)
Activation = Literal["silu", "gelu_tanh", "quick_gelu"]


@dataclass
class MLAConfig:
    """Multi-latent attention (DeepSeek-V2/V3): queries and keys/values pass through low-rank
    latents; each head's query/key is a part without RoPE plus a RoPE part shared by all heads
    on the key side."""

    kv_lora_rank: int
    qk_head_dim: int  # per-head query/key part without RoPE (HF qk_nope_head_dim)
    qk_pos_emb_head_dim: int  # per-head RoPE part (HF qk_rope_head_dim)
    v_head_dim: int
    q_lora_rank: Optional[int] = None  # None: queries projected directly from the hidden state
    # How HF checkpoints order the RoPE rows of q/k weights: interleaved pairs (2i, 2i+1), as
    # mcore rotates, or halves (i, i + d/2; HF's rope_interleave=False), reordered on load/export.
    rope_interleave: bool = True
    # eps of the q/kv latent norms; None: norm_epsilon (transformers' DeepSeek: 1e-6 always)
    latent_norm_epsilon: Optional[float] = None


@dataclass
class MRoPEConfig:
    """Multimodal RoPE (Qwen2-VL family): every token has three positions (t, h, w: an image's
    frame, row and column; text repeats its one position), and each rotary frequency turns by one
    of them. `section`: how many of the head_dim/2 frequencies follow t, h and w (in order, or
    alternating t h w t h w ... when `interleaved`, as Qwen3-VL)."""

    section: list[int]
    interleaved: bool = False


@dataclass
class VisionConfig:
    """A vision encoder and merger in front of the decoder (first pipeline stage): images become
    embeddings that replace the `image_token_id` placeholders. The family module builds it from
    `hf` (config.json's vision_config); `deepstack_layers`: how many of the first decoder layers
    also add a merged feature of an inner vision layer at the image positions (Qwen3-VL)."""

    hf: dict
    image_token_id: int
    deepstack_layers: int = 0


@dataclass
class LinearAttentionConfig:
    """Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next) on the layers `layer_types` names
    "linear_attention": a causal depthwise convolution over q/k/v, then a recurrent state per
    value head, decayed and updated by the delta rule at each token, read out by the query and
    gated by z through an RMSNorm (model/gated_delta_net.py). Query/key heads are shared by
    num_value_heads // num_key_heads value heads."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_dim: int = 4


@dataclass
class GPTConfig:
    """Decoder-only transformer: RMSNorm, gated MLP, RoPE, GQA; the defaults are a Llama.

    `rope_scaling` takes the Hugging Face dict (e.g. {"rope_type": "llama3", "factor": 8.0,
    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}).
    The architecture variants below are what the family modules (lightning_mcore/models/) set.
    """

    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 256
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None  # None: one per head (MHA)
    kv_channels: Optional[int] = None  # head dim; None: hidden_size // num_attention_heads
    vocab_size: int = 512
    seq_length: int = 128
    rotary_base: float = 10000.0
    rope_scaling: Optional[dict] = None
    tie_word_embeddings: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    # with qk_layernorm: normalise each token's whole query / key projection (all heads
    # together), not each head (model/norm.py: ProjectionRMSNorm)
    qk_norm_across_heads: bool = False
    norm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    # Architecture variants
    activation: Activation = "silu"  # of the gated MLP (see Activation)
    glu_linear_offset: float = 0.0  # the gated MLP computes act(gate) * (up + offset)
    # gate clamped to <= it and up to [-it, it] before the activation (mcore's
    # activation_func_clamp_value); None: no clamp
    activation_clamp: Optional[float] = None
    add_bias_linear: bool = False  # every linear has a bias (attention, MLP, router, experts)
    # A learnable per-head logit ("sink") in every attention softmax's denominator: weights
    # exp(s_j) / (exp(sink) + sum_k exp(s_k)) (mcore's softmax_type="learnable")
    attention_sinks: bool = False
    zero_centered_norm: bool = False  # norms scale by (1 + weight) (Gemma)
    post_norms: bool = False  # also a norm on the attention and MLP outputs (Gemma 2/3)
    embedding_scale: Optional[float] = None  # embeddings are multiplied by it (Gemma: sqrt(h))
    softmax_scale: Optional[float] = None  # attention scale; None: 1/sqrt(head_dim)
    # Sliding-window attention: a windowed layer's token q sees keys q-W < k <= q (HF's rule).
    sliding_window: Optional[int] = None
    # Per layer "sliding_attention" or "full_attention" (HF's layer_types); None: every layer
    # is windowed when sliding_window is set.
    layer_types: Optional[list[str]] = None
    local_rotary_base: Optional[float] = None  # RoPE base of windowed layers (Gemma 3)
    rotary_percent: float = 1.0  # RoPE on the first rotary_percent of each head's dims (Qwen3.5: 0.25)
    # The attention output times sigmoid(gate), a per-head gate projected with the queries
    # (Qwen3.5, Qwen3-Next); mcore's attention_output_gate.
    attention_output_gate: bool = False
    # Gated DeltaNet on the layers layer_types names "linear_attention" (None: no such layers)
    linear_attention: Optional[LinearAttentionConfig] = None
    mla: Optional[MLAConfig] = None  # multi-latent attention instead of GQA
    mrope: Optional[MRoPEConfig] = None  # 3-D positions (vision-language models)
    vision: Optional[VisionConfig] = None  # a vision encoder in front of the decoder
    # Mixture of experts (None: dense MLP)
    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_token_dispatcher_type: str = "alltoall"
    # The routed experts as grouped GEMMs (True) or mcore's SequentialMLP, a loop over experts
    # (False). None: grouped where torch's kernel computes them (moe_grouped_gemm_backend below;
    # on CPU too), else the loop; or grouped whenever the backend is set to 'te' or 'torch'.
    moe_grouped_gemm: Optional[bool] = None
    # The grouped GEMM's kernel (with moe_grouped_gemm): "torch" (torch's grouped_mm reads the
    # per-expert token counts on the GPU: no host wait at one EP rank; model/torch_experts.py), "te"
    # (Transformer Engine's GroupedLinear: counts on the host, one wait per MoE layer and micro
    # batch), or "auto": torch's where it runs (not fp8, hidden and expert FFN sizes multiples of
    # 8, no 'moe_preprocess' graph, no 'moe_act' recompute, a LoRA rank on
    # experts that is a multiple of 8), else TE's.
    # torch's ran 2.3-2.4x the tokens/s of TE's on one H100 (benchmarks/RESULTS.md, session 7).
    moe_grouped_gemm_backend: Literal["auto", "te", "torch"] = "auto"
    moe_router_pre_softmax: bool = False
    moe_layer_freq: Union[int, list[int]] = 1  # 1: every layer MoE; a list: 1 MoE, 0 dense
    moe_shared_expert_gate: bool = False  # the shared expert's output scaled by a sigmoid gate
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    moe_router_enable_expert_bias: bool = False  # aux-loss-free balancing bias (DeepSeek-V3)
    moe_router_num_groups: Optional[int] = None  # group-limited routing
    moe_router_group_topk: Optional[int] = None
    moe_router_topk_scaling_factor: Optional[float] = None
    # The router's matmul, scores and top-k in float32, as transformers' DeepSeek gates compute
    # them. None: the matmul in the model's dtype and top-k over the scores rounded to it, which
    # on bf16 picks the experts of transformers' Qwen-MoE and Mixtral gates (tests/test_moe_router.py).
    # mcore warns for 32+ experts without it; it changes no weight.
    moe_router_dtype: Optional[Literal["fp32"]] = None
    # Routers that can record and replay their choices (GRPO's routing replay and its routing
    # mismatch, model/routing_replay.py); set by the objective, not a property of the weights.
    # TE's fused router kernel, which would skip the replay, is then not used.
    moe_routing_replay: bool = False
    # The LM head's logits accumulated and returned in fp32, not rounded to bf16
    # (model/fp32_logits.py): generation and training then agree closer on log-probs. Set by the
    # objective (GRPO's RolloutCorrection.fp32_logits), not a property of the weights.
    fp32_logits: bool = False
    # Execution
    transformer_impl: TransformerImpl = "auto"
    # Activation recompute (GPU; checks: strategy/memory.py). "full" recomputes whole layers:
    # "uniform" all of them, recompute_num_layers (default 1) per checkpointed unit, or "block"
    # only the first recompute_num_layers of each pipeline stage. "selective" recomputes parts of
    # every layer: recompute_modules, mcore's names (None: its default, ["core_attn"]).
    recompute_granularity: Optional[Literal["full", "selective"]] = None
    recompute_method: Literal["uniform", "block"] = "uniform"
    recompute_num_layers: Optional[int] = None
    recompute_modules: Optional[list[str]] = None
    # Activations of the first N layers wait in CPU memory between forward and backward (mcore's
    # cpu_offloading through Transformer Engine; PP=1, no recompute). 0: off.
    activation_offload_layers: int = 0
    # FP8 matmuls through Transformer Engine (E4M3 forward, E5M2 gradients): "delayed" scaling
    # (amax history) or "current" (per-tensor amax of the tensor being cast). GPU only.
    fp8: Optional[Literal["delayed", "current"]] = None
    # CUDA graphs (GPU; mcore's "local" implementation; checks: strategy/cuda_graphs.py): these
    # parts of every layer are captured in the first training step and replayed after it, so the
    # host stops launching their kernels one by one. mcore's cuda_graph_modules names: "attn",
    # "mlp" (dense layers), "moe_router", "moe_preprocess"; [] captures whole dense layers.
    # None: off. Every training batch must then have the first one's shape, in fixed rows
    # (PretrainModule; modules packing THD rows are refused). Experimental: ["attn", "moe_router"]
    # ran on one H100 with torch's experts, 3-8% faster (benchmarks/RESULTS.md, session 7).
    cuda_graphs: Optional[list[str]] = None
    make_vocab_size_divisible_by: int = 128
    extra: dict[str, Any] = field(default_factory=dict)  # any other TransformerConfig field

    def __post_init__(self) -> None:
        if isinstance(self.mla, dict):  # from a checkpoint's common.pt or a YAML config
            self.mla = MLAConfig(**self.mla)
        if isinstance(self.mrope, dict):
            self.mrope = MRoPEConfig(**self.mrope)
        if isinstance(self.vision, dict):
            self.vision = VisionConfig(**self.vision)
        if isinstance(self.linear_attention, dict):
            self.linear_attention = LinearAttentionConfig(**self.linear_attention)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def grouped_experts(self) -> bool:
        """Whether the routed experts run as grouped GEMMs (moe_grouped_gemm, None resolved)."""
        if not self.num_moe_experts:
            return False
        if self.moe_grouped_gemm is not None:
            return self.moe_grouped_gemm
        return self.moe_grouped_gemm_backend != "auto" or self.torch_experts_obstacle() is None

    @property
    def torch_experts(self) -> bool:
        """Routed experts on torch's grouped GEMM (model/torch_experts.py)."""
        if not self.grouped_experts or self.moe_grouped_gemm_backend == "te":
            return False
        return self.moe_grouped_gemm_backend == "torch" or self.torch_experts_obstacle() is None

    @property
    def mcore_grouped_gemm(self) -> bool:
        """mcore's own grouped experts (TE's); torch's are built as mcore's SequentialMLP."""
        return self.grouped_experts and not self.torch_experts

    def torch_experts_obstacle(self) -> Optional[tuple[str, tuple[str, ...]]]:
        """Why torch's grouped GEMM cannot compute this model's experts, with the fields involved;
        None when it can. 'auto' then keeps TE's kernel, an explicit 'torch' is refused
        (strategy/expert_gemm.py). LoRA on experts with a rank that is not a multiple
        of 8 resolves 'auto' to 'te' before (lora/checks.py)."""
        ffn = self.moe_ffn_hidden_size or self.ffn_hidden_size
        if self.hidden_size % 8 or ffn % 8:
            return (f"torch's grouped GEMM needs hidden_size ({self.hidden_size}) and moe_ffn_hidden_size "
                    f"({ffn}) to be multiples of 8 (16-byte rows)", ("hidden_size", "moe_ffn_hidden_size"))
        if self.fp8:
            return f"it runs the experts unquantized: fp8={self.fp8!r} would not reach them", ("fp8",)
        if "moe_act" in (self.recompute_modules or ()):
            return ("it has no 'moe_act' recompute (TE's experts do); remove it from recompute_modules",
                    ("recompute_modules",))
        if "moe_preprocess" in (self.cuda_graphs or ()):
            return ("it keeps the token counts on the GPU: the cuda_graphs part 'moe_preprocess' (which "
                    "captures their copy to the host) has nothing to capture; remove it", ("cuda_graphs",))
        return None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether 0-based `layer` has an MoE MLP (mcore's moe_layer_freq rule)."""
        if not self.num_moe_experts:
            return False
        if isinstance(self.moe_layer_freq, int):
            return layer % self.moe_layer_freq == 0
        return bool(self.moe_layer_freq[layer])

    def is_window_layer(self, layer: int) -> bool:
        """Whether 0-based `layer` attends within the sliding window."""
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == "sliding_attention"

    def is_linear_attention_layer(self, layer: int) -> bool:
        """Whether 0-based `layer` is a Gated DeltaNet layer (else softmax attention)."""
        return (self.linear_attention is not None and self.layer_types is not None
                and self.layer_types[layer] == "linear_attention")

    def uses_sliding_window(self) -> bool:
        """Whether some layer's window is shorter than seq_length (inputs are never longer, so
        a window at least that long changes nothing and attention keeps its causal kernels)."""
        return (self.sliding_window is not None and self.sliding_window < self.seq_length
                and any(self.is_window_layer(i) for i in range(self.num_layers)))

    def padded_vocab_size(self, tensor_parallel_size: int) -> int:
        """Vocab rounded up so every tensor-parallel rank holds an equal, aligned slice."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return -(-self.vocab_size // multiple) * multiple

    def uses_te(self, accelerator: str) -> bool:
        if self.transformer_impl == "local":
            return False
        if self.transformer_impl == "transformer_engine":
            return True
        return accelerator == "gpu" and te_available()


def refuse_longer(seq: int, seq_length: int, what: str) -> None:
    """Refuse sequences longer than the model's seq_length: beyond it the model computes
    something else than it was configured for (positions past max_position_embeddings)
    without any error."""
    if seq > seq_length:
        raise ValueError(
            f"{what} have {seq} tokens, more than the model's seq_length={seq_length}: "
            f"shorten them (or raise the model's seq_length, where the model allows it)."
        )


ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu_tanh": functools.partial(torch.nn.functional.gelu, approximate="tanh"),
}


def activation_func(name: str):
    """The activation function mcore is given; quick_gelu is mcore's own (its fused expert
    kernels recognise it)."""
    return quick_gelu if name == "quick_gelu" else ACTIVATIONS[name]


def attention_scale(cfg: GPTConfig) -> Optional[float]:
    """The softmax scale: softmax_scale (1/sqrt(head_dim) when None) times YaRN's attention
    factor squared, which transformers applies to the RoPE cos/sin of queries and keys alike
    (the cached keys included), i.e. to every score."""
    factor = yarn_attention_factor(cfg.rope_scaling) if cfg.mla is None else 1.0
    if factor == 1.0:
        return cfg.softmax_scale
    return (cfg.softmax_scale or cfg.head_dim**-0.5) * factor**2


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def to_transformer_config(
    cfg: GPTConfig,
    parallel,  # strategy.parallel.ParallelConfig
    dtype: torch.dtype,
    on_cpu: bool,
    use_te: bool,
):
    """Build mcore's TransformerConfig; execution flags follow the device (fusions need CUDA)."""
    p = parallel
    kwargs = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups or cfg.num_attention_heads,
        kv_channels=cfg.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_epsilon,
        layernorm_zero_centered_gamma=cfg.zero_centered_norm,
        gated_linear_unit=True,
        activation_func=activation_func(cfg.activation),
        softmax_scale=attention_scale(cfg),
        add_bias_linear=cfg.add_bias_linear,
        add_qkv_bias=cfg.add_qkv_bias or cfg.add_bias_linear,
        glu_linear_offset=cfg.glu_linear_offset,
        activation_func_clamp_value=cfg.activation_clamp,
        softmax_type="learnable" if cfg.attention_sinks else "vanilla",
        qk_layernorm=cfg.qk_layernorm,
        init_method_std=cfg.init_method_std,
        attention_dropout=cfg.attention_dropout,
        hidden_dropout=cfg.hidden_dropout,
        **p.sizes(),
        sequence_parallel=p.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        autocast_dtype=dtype,
        calculate_per_token_loss=True,
        # Interleaved PP with batched p2p sends to one peer in both directions gives wrong
        # results (Megatron-LM #750); unbatched, overlapped p2p is exact.
        batch_p2p_comm=p.virtual_pipeline_model_parallel_size is None,
        overlap_p2p_comm=p.virtual_pipeline_model_parallel_size is not None,
        use_cpu_initialization=on_cpu,
        gradient_accumulation_fusion=False,
        # TE's fused RoPE reads positions from cu_seqlens; 3-D positions need mcore's own.
        apply_rope_fusion=use_te and cfg.mrope is None,
        bias_activation_fusion=use_te and cfg.activation == "silu",  # mcore fuses silu/gelu only
        masked_softmax_fusion=use_te,
        persist_layer_norm=use_te,
        bias_dropout_fusion=use_te and not cfg.add_bias_linear,  # TE's grouped experts refuse both
        cross_entropy_loss_fusion=use_te,
        # TE's kernel keeps the logits in bf16 (mcore's saves their float32 softmax)
        cross_entropy_fusion_impl="te" if use_te and te_cross_entropy_in_fp32() else "native",
        recompute_granularity=cfg.recompute_granularity,
        attention_output_gate=cfg.attention_output_gate,
    )
    if cfg.linear_attention is not None:
        la = cfg.linear_attention
        kwargs.update(linear_conv_kernel_dim=la.conv_kernel_dim, linear_key_head_dim=la.key_head_dim,
                      linear_value_head_dim=la.value_head_dim, linear_num_key_heads=la.num_key_heads,
                      linear_num_value_heads=la.num_value_heads,
                      # layers of two kinds: checkpoint keys per layer, not stacked over layers
                      hetereogenous_dist_checkpoint=True)
    if cfg.fp8 is not None:
        # "delayed" keeps mcore's amax history (1 step, most recent). NeMo's 1024 steps / max
        # ended 3% above bf16 after 200 steps on the 3B shape; this one 0.6% (benchmarks/RESULTS.md).
        kwargs.update(fp8="hybrid", fp8_recipe="delayed" if cfg.fp8 == "delayed" else "tensorwise")
    if cfg.recompute_granularity == "full":
        kwargs.update(recompute_method=cfg.recompute_method,
                      recompute_num_layers=cfg.recompute_num_layers or 1)
    if cfg.recompute_granularity == "selective" and cfg.recompute_modules is not None:
        kwargs.update(recompute_modules=list(cfg.recompute_modules))
    if cfg.cuda_graphs is not None:
        # use_te_rng_tracker: the seeding gives TE's tracker (strategy/cuda_graphs.graph_safe_rng)
        kwargs.update(cuda_graph_impl="local", use_te_rng_tracker=use_te, cuda_graph_modules=list(cfg.cuda_graphs))
    if cfg.activation_offload_layers:
        kwargs.update(cpu_offloading=True, cpu_offloading_num_layers=cfg.activation_offload_layers,
                      cpu_offloading_activations=True, cpu_offloading_weights=False)
    if cfg.uses_sliding_window():
        # TE's window (left, right) keeps keys q-left <= k <= q+right; HF's q-W < k <= q.
        kwargs.update(window_size=(cfg.sliding_window - 1, 0), window_attn_skip_freq=[
            int(cfg.is_window_layer(i)) for i in range(cfg.num_layers)])
    if cfg.num_moe_experts:
        kwargs.update(
            num_moe_experts=cfg.num_moe_experts,
            moe_router_topk=cfg.moe_router_topk,
            moe_ffn_hidden_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
            moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
            moe_router_load_balancing_type=cfg.moe_router_load_balancing_type,
            moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
            moe_token_dispatcher_type=cfg.moe_token_dispatcher_type,
            moe_grouped_gemm=cfg.mcore_grouped_gemm,
            moe_router_pre_softmax=cfg.moe_router_pre_softmax,
            moe_layer_freq=cfg.moe_layer_freq,
            moe_shared_expert_gate=cfg.moe_shared_expert_gate,
            moe_router_score_function=cfg.moe_router_score_function,
            moe_router_enable_expert_bias=cfg.moe_router_enable_expert_bias,
            moe_router_num_groups=cfg.moe_router_num_groups,
            moe_router_group_topk=cfg.moe_router_group_topk,
            moe_router_topk_scaling_factor=cfg.moe_router_topk_scaling_factor,
            moe_router_dtype=cfg.moe_router_dtype,
            moe_enable_routing_replay=cfg.moe_routing_replay,
        )
        if use_te and cfg.torch_experts:
            # TE's fused permutation sorts by expert on the device (mcore's unfused sort reads the
            # counts on the host); both fusions as measured with torch's experts
            kwargs.update(moe_permute_fusion=True, moe_router_fusion=not cfg.moe_routing_replay)
    config_class = TransformerConfig
    if cfg.mla is not None:
        config_class = MLATransformerConfig
        kwargs.update(mla_config_kwargs(cfg))
    unknown = sorted(set(cfg.extra) - _fields(config_class))
    if unknown:
        raise ValueError(f"GPTConfig.extra: TransformerConfig has no field {unknown[0]!r}.")
    kwargs.update(cfg.extra)
    return config_class(**kwargs)
