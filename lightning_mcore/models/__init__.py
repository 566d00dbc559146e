"""The architectures we map, one module each, and the entry points that pick one.

Every module in this package that defines `ARCHITECTURE` is registered on import; `register`
adds one from elsewhere (a Llama clone in your own code is a few lines: see the README).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from pathlib import Path
from typing import Any, Optional, Union

import transformers

from lightning_mcore.hf.config import HFCheckpointError, read_config_json
from lightning_mcore.hf.mappings import Entry
from lightning_mcore.hf.mxfp4 import ONLY_MXFP4, other_quantization
from lightning_mcore.hf.peft_export import experts_layout
from lightning_mcore.lora.config import adapts_experts, resolve_targets
from lightning_mcore.model.config import GPTConfig
from lightning_mcore.model.vision import attach_vision_encoder
from lightning_mcore.models.architecture import Architecture, HFConfig

ARCHITECTURES: dict[str, Architecture] = {}  # by HF class name, e.g. "LlamaForCausalLM"
SEQ_CLS: dict[str, Architecture] = {}  # by scalar-head class name, e.g. "LlamaForSequenceClassification"
DEFAULT_SEQ_LENGTH_CAP = 4096
PathOrDict = Union[str, os.PathLike, dict]


def register(architecture: Architecture) -> Architecture:
    ARCHITECTURES[architecture.hf_class] = architecture
    if architecture.seq_cls_class:
        SEQ_CLS[architecture.seq_cls_class] = architecture
    return architecture


def _discover() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        if isinstance(getattr(module, "ARCHITECTURE", None), Architecture):
            register(module.ARCHITECTURE)


def architecture_of(hf: HFConfig) -> Architecture:
    """The entry for config.json's architectures[0] (or its model_type when a config was saved
    without a model), with its required fields checked."""
    names = hf.get("architectures") or []
    if not names:
        by_type = {a.model_type: n for n, a in ARCHITECTURES.items()}
        names = [by_type[hf.get("model_type")]] if hf.get("model_type") in by_type else []
    supported = ", ".join(sorted(ARCHITECTURES))
    if not names:
        raise HFCheckpointError(f"{hf.source}: no 'architectures' field; supported: {supported}.")
    arch = ARCHITECTURES.get(names[0]) or SEQ_CLS.get(names[0])
    if arch is None:
        raise HFCheckpointError(
            f"{hf.source}: architecture {names[0]!r} is not supported; supported: {supported}.")
    missing = arch.missing(hf)
    if missing:
        raise HFCheckpointError(f"{hf.source}: missing required field(s): {', '.join(missing)}.")
    return arch


def by_family(family: str) -> Architecture:
    """The architecture recorded as `family` (its model_type) in our checkpoints."""
    for arch in ARCHITECTURES.values():
        if arch.model_type == family:
            return arch
    raise HFCheckpointError(f"unknown family {family!r}; supported: "
                            f"{', '.join(sorted(a.model_type for a in ARCHITECTURES.values()))}.")


def read_hf_config(path: Union[str, os.PathLike]) -> dict:
    """`<path>/config.json` as a dict, checked to be an architecture we support."""
    data = read_config_json(path)
    architecture_of(HFConfig(data, str(Path(path) / "config.json")))
    return data


def gpt_config_from_hf(path_or_dict: PathOrDict, seq_length: Optional[int] = None,
                       **overrides: Any) -> tuple[GPTConfig, str]:
    """(GPTConfig, family) for a checkpoint directory or a config.json dict.

    `seq_length` defaults to min(max_position_embeddings, 4096) and may not exceed it;
    `overrides` replace any GPTConfig field afterwards (e.g. transformer_impl). Inputs longer
    than seq_length are refused where they enter.
    """
    if isinstance(path_or_dict, dict):
        hf = HFConfig(path_or_dict)
    else:
        hf = HFConfig(read_config_json(path_or_dict), str(Path(path_or_dict) / "config.json"))
    arch = architecture_of(hf)
    if other_quantization(hf.data):
        hf.refuse("quantization_config", ONLY_MXFP4)
    fields = arch.gpt_config(hf)
    hf = arch.text(hf)
    longest = hf["max_position_embeddings"]
    seq_length = seq_length or min(longest, DEFAULT_SEQ_LENGTH_CAP)
    if seq_length > longest:
        hf.refuse("max_position_embeddings", f"seq_length={seq_length} (model_overrides) is "
                  f"longer than the model was built for; use seq_length <= {longest}.")
    types = set(hf.get("layer_types") or [])
    known = {"full_attention", "sliding_attention"} | (
        {"linear_attention"} if fields.get("linear_attention") is not None else set())
    if types - known:
        hf.refuse("layer_types", f"layer types {sorted(types - known)} are not supported.")
    if "sliding_attention" in types and fields.get("sliding_window") is None:
        hf.refuse("layer_types", "sliding_attention layers without a sliding window.")
    return GPTConfig(**{**fields, "seq_length": seq_length, **overrides}), arch.model_type


def hf_config_dict_from_gpt(cfg: GPTConfig, family: str, **hf_overrides: Any) -> dict:
    """config.json contents for `cfg` as a `family` model, via transformers' own config class.

    `max_position_embeddings` is cfg.seq_length; pass it (or bos/eos_token_id, ...) in
    `hf_overrides` to write something else.
    """
    arch = by_family(family)
    kwargs = dict(architectures=[arch.hf_class]) | arch.hf_config(cfg) | hf_overrides
    return getattr(transformers, arch.config_class)(**kwargs).to_dict()


def family_of(cfg: GPTConfig) -> Optional[str]:
    """The HF family a model built from a GPTConfig is exported as: the first architecture
    (by `scratch_order`, then name) that expresses it; None if none does."""
    for arch in sorted(ARCHITECTURES.values(), key=lambda a: (a.scratch_order, a.model_type)):
        try:
            arch.hf_config(cfg)
        except HFCheckpointError:
            continue
        return arch.model_type
    return None


def weights(cfg: GPTConfig, family: Optional[str]) -> list[Entry]:
    """The weight table of `family` for `cfg`."""
    return _family(cfg, family).weights(cfg)


def carried(family: Optional[str], directory) -> tuple[str, ...]:
    """The HF tensor-name prefixes the `family` checkpoint in `directory` holds untouched
    (Architecture.carried; none without a directory or its config.json)."""
    if family is None or directory is None or not (Path(directory) / "config.json").is_file():
        return ()
    arch = by_family(family)
    return arch.carried(arch.text(HFConfig(read_config_json(directory), str(Path(directory) / "config.json"))))


def peft_weights(cfg: GPTConfig, family: Optional[str]) -> tuple[list[Entry], Optional[str]]:
    """(the weight table under transformers' in-memory module paths, which PEFT adapter names
    follow; the decoder's path when PEFT targets must match under it only, else None)."""
    arch = _family(cfg, family)
    return arch.peft_weights(cfg), arch.peft_decoder


def export_config(cfg: GPTConfig, family: Optional[str], source_dir=None) -> Optional[dict]:
    """The config.json an export writes: None when `source_dir` (the HF directory the model
    came from) has one, which is copied instead."""
    if source_dir is not None and (Path(source_dir) / "config.json").is_file():
        return None
    return hf_config_dict_from_gpt(cfg, _family(cfg, family).model_type)


def export_layout(cfg: GPTConfig, family: Optional[str], lora, mode: str, requested: Optional[str] = None) -> str:
    """The layout of the expert adapters in an export of `mode` (`lora_experts_layout`; None: the
    default), after refusing one the model cannot hold or that peft would load wrong."""
    layout = experts_layout(requested, mode, lora is not None and adapts_experts(lora, cfg),
                            peft_experts(cfg, family))
    if mode == "peft":
        refuse_peft_export(cfg, family, lora, layout)
    return layout


def refuse_peft_export(cfg: GPTConfig, family: Optional[str], lora, experts_layout: str = "fused") -> None:
    """Refuse a PEFT export that peft would load wrong (the adapter is fine merged).
    `experts_layout="per_expert"`: expert adapters under per-expert names, peft's limits aside."""
    arch = _family(cfg, family)
    if adapts_experts(lora, cfg):
        if experts_layout == "per_expert":
            return
        if arch.peft_experts is None:
            raise HFCheckpointError(
                f"a PEFT export of LoRA on the routed experts of {arch.hf_class} models is not "
                f"supported yet. Export it merged (mode='merged', `lightning-mcore export --mode "
                f"merged`), or keep experts frozen (LoRAConfig experts=False).")
        if arch.peft_misreads_mlp and _has_unrouted_mlp(cfg):
            raise HFCheckpointError(
                f"a PEFT export of LoRA on the routed experts of {arch.hf_class} models with dense "
                f"layers or shared experts would load wrong: peft (transformers 5) turns their "
                f"gate/up/down_proj targets into the fused experts' target_parameters (doubling "
                f"gate_up_proj's rank) and drops the dense/shared MLP adapters. Export it merged "
                f"(mode='merged', `lightning-mcore export --mode merged`), or keep experts frozen "
                f"(LoRAConfig experts=False) and adapt attention only.")
        if lora.dropout:
            raise HFCheckpointError(
                f"peft cannot load LoRA dropout={lora.dropout} on fused expert parameters "
                f"(target_parameters); train with dropout 0, or export merged.")
        return
    mlp = sorted({"linear_fc1", "linear_fc2"} & set(resolve_targets(lora.target_modules)))
    if arch.peft_misreads_mlp and mlp:
        raise HFCheckpointError(
            f"a PEFT export of LoRA on {', '.join(mlp)} would load wrong: peft takes the MLP "
            f"targets of {arch.hf_class} models for their routed experts. Export it merged "
            f"(mode='merged', `lightning-mcore export --mode merged`), or adapt attention only.")


def _has_unrouted_mlp(cfg: GPTConfig) -> bool:
    """Whether the model has MLPs besides its routed experts (dense layers, shared experts)."""
    dense = any(not cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    return dense or bool(cfg.moe_shared_expert_intermediate_size)


def peft_experts(cfg: GPTConfig, family: Optional[str]):
    """How transformers holds `family`'s routed experts (hf/mappings.py FusedExperts), or None."""
    return _family(cfg, family).peft_experts if family is not None else None


def sequence_classifier(cfg: GPTConfig, family: Optional[str]) -> str:
    """The transformers class of `family`'s scalar-head model (a reward model's HF layout), or
    an error naming the family and those that have one."""
    arch = _family(cfg, family)
    if arch.seq_cls_class is None:
        supported = ", ".join(sorted(a.model_type for a in SEQ_CLS.values()))
        raise HFCheckpointError(
            f"reward models of the {arch.model_type} family ({arch.hf_class}) are not supported: "
            f"no ...ForSequenceClassification layout is declared for it; supported families: "
            f"{supported}.")
    return arch.seq_cls_class


def vision_encoder(cfg: GPTConfig, family: Optional[str]):
    """The vision encoder + merger module of a vision-language model (its family builds it)."""
    return _family(cfg, family).vision_encoder(cfg)


def attach_vision_encoders(chunks, cfg: GPTConfig, family: Optional[str]) -> None:
    """Give each first-stage chunk of a vision-language model its vision encoder (in the chunk's
    dtype, before weights go in) and deepstack hooks (model/vision.py); a text model: nothing."""
    if cfg.vision is None:
        return

    for chunk in chunks:
        if chunk.pre_process:
            encoder = vision_encoder(cfg, family).to(dtype=chunk.config.params_dtype)
            attach_vision_encoder(chunk, encoder, cfg.vision.deepstack_layers)


def is_sequence_classifier(path: Union[str, os.PathLike]) -> bool:
    """Whether the HF directory holds a scalar-head model (architectures[0] a declared
    ...ForSequenceClassification) rather than a causal LM."""
    names = read_config_json(path).get("architectures") or []
    return bool(names) and names[0] in SEQ_CLS


def _family(cfg: GPTConfig, family: Optional[str]) -> Architecture:
    if family is None:
        reasons = []
        for arch in ARCHITECTURES.values():
            try:
                arch.hf_config(cfg)
            except HFCheckpointError as e:
                reasons.append(str(e))
        raise HFCheckpointError("no Hugging Face architecture expresses this model: "
                                + "; ".join(sorted(reasons)))
    return by_family(family)


_discover()
