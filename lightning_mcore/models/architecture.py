"""What one Hugging Face architecture is in our terms: a subclass of `Architecture`.

A family module (lightning_mcore/models/<name>.py) names the HF classes, translates config.json
into GPTConfig fields and back, gives the weight table, and refuses by name what our model
cannot express: a model that loads and then computes something else is worse than an error.
It ends with `ARCHITECTURE = <its class>()`, which the registry (models/__init__.py) collects.
"""

from __future__ import annotations

from typing import Any, NoReturn, Optional

from lightning_mcore.hf.config import HFCheckpointError
from lightning_mcore.hf.mappings import Entry, FusedExperts
from lightning_mcore.model.config import GPTConfig

# Every architecture needs these in config.json; `Architecture.required` adds its own.
COMMON_FIELDS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
    "max_position_embeddings",
)


class HFConfig:
    """A config.json dict and where it came from, so that refusals name the file and field."""

    def __init__(self, data: dict, source: str = "config") -> None:
        self.data, self.source = data, source

    def get(self, field: str, default: Any = None) -> Any:
        value = self.data.get(field)
        return default if value is None else value

    def __getitem__(self, field: str) -> Any:
        if self.data.get(field) is None:
            raise HFCheckpointError(f"{self.source}: missing required field {field}.")
        return self.data[field]

    def __contains__(self, field: str) -> bool:
        return self.data.get(field) is not None

    def refuse(self, field: str, why: str) -> NoReturn:
        raise HFCheckpointError(f"{self.source}: {field}={self.data.get(field)!r}: {why}")


class Architecture:
    """Subclass it, set the three names, override what differs from the base family."""

    hf_class: str = ""  # config.json architectures[0], e.g. "LlamaForCausalLM"
    model_type: str = ""  # config.json model_type; also the family name checkpoints record
    config_class: str = ""  # the transformers config class an export writes
    # Fields beyond COMMON_FIELDS whose absence transformers fills with something other than
    # what we would assume (e.g. Mistral's num_key_value_heads=8).
    required: tuple[str, ...] = ()
    # A model built from a GPTConfig is exported as the first family (lowest first) that can
    # express it; a base family goes before the ones that extend it.
    scratch_order: int = 50
    # peft (on transformers 5) takes the gate/up/down_proj targets of this architecture for its
    # fused routed experts: an adapter on the dense/shared MLPs would load in the wrong place.
    peft_misreads_mlp: bool = False
    # How transformers holds the routed experts, for a PEFT export of expert adapters (None:
    # not known, such an export is refused; merged works).
    peft_experts: Optional[FusedExperts] = None
    # The transformers class of this family's scalar-head model (the CausalLM's `model.*` plus a
    # `score` [num_labels, hidden] linear; transformers' GenericForSequenceClassification), e.g.
    # "LlamaForSequenceClassification": what a reward model (objectives/reward.py) loads from and
    # exports as. None: reward models of this family are not supported. Declare it in each
    # family's own class (a subclass would otherwise inherit its base family's name).
    seq_cls_class: Optional[str] = None
    # Where transformers' in-memory model holds the decoder when that differs from the
    # checkpoint's layout or other modules there share the decoder linears' names (a vision
    # encoder): a PEFT adapter is keyed by in-memory module paths (peft renames nothing on load)
    # and its target_modules must then match under this path only. None: the checkpoint's names.
    peft_decoder: Optional[str] = None

    def gpt_config(self, hf: HFConfig) -> dict:
        """GPTConfig fields for this config.json (seq_length aside); refuse with hf.refuse."""
        raise NotImplementedError

    def hf_config(self, cfg: GPTConfig) -> dict:
        """transformers config kwargs describing `cfg`; HFCheckpointError if `cfg` is not
        something this family can express."""
        raise NotImplementedError

    def weights(self, cfg: GPTConfig) -> list[Entry]:
        """The weight table for `cfg`: every mcore parameter and the HF tensors it is made of."""
        raise NotImplementedError

    def peft_weights(self, cfg: GPTConfig) -> list[Entry]:
        """The weight table under transformers' in-memory module paths (PEFT adapter names)."""
        return self.weights(cfg)

    def carried(self, hf: HFConfig) -> tuple[str, ...]:
        """HF tensor-name prefixes of the parts of this checkpoint we keep but do not compute
        (published multi-token-prediction layers): loaded nowhere, copied into an export
        unchanged from the source checkpoint."""
        return ()

    def missing(self, hf: HFConfig) -> list[str]:
        return [f for f in COMMON_FIELDS + self.required if f not in self.text(hf)]

    def text(self, hf: HFConfig) -> HFConfig:
        """The part of config.json that describes the decoder (a vision-language model nests it)."""
        return hf

    def vision_encoder(self, cfg: GPTConfig):
        """The vision encoder + merger module of a vision-language `cfg` (transformers' own)."""
        raise HFCheckpointError(f"{self.hf_class} has no vision encoder.")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.hf_class})"
