"""What the vision-language families share: a text family's decoder with multimodal RoPE, behind
transformers' own vision encoder + merger.

The decoder is our mcore GPTModel (its table is the text family's, under the checkpoint's
prefix); the vision encoder is the transformers module itself, built from config.json's
vision_config and kept replicated on every tensor-parallel rank of the first pipeline stage (a
few percent of the model's FLOPs: exact by construction, and nothing to re-implement); it attends
each batch's windows in one packed call (model/vision_attention.py). Its tensors map one to one. A
family module sets the names below.
"""

from __future__ import annotations

import importlib

import torch
import transformers

from lightning_mcore.hf.config import HFCheckpointError
from lightning_mcore.model.config import GPTConfig, MRoPEConfig, VisionConfig
from lightning_mcore.model.vision_attention import use_packed_attention
from lightning_mcore.models import parts
from lightning_mcore.models.architecture import Architecture, HFConfig


class VisionLanguage(Architecture):
    text_family: Architecture  # the decoder's family (its config fields and weight table)
    vision_class = ""  # transformers class of the vision encoder + merger
    vision_config_class = ""  # and of its config
    text_prefix = "model."  # where the decoder's tensors sit in the checkpoint
    # transformers' rotary of the family: sectioned or interleaved M-RoPE, whatever config.json's
    # mrope_interleaved says (transformers does not read it)
    mrope_interleaved = False
    vision_prefix = "visual."  # and the vision encoder's
    # transformers 5 holds the decoder here in memory, whatever the checkpoint's layout (it
    # renames Qwen2.5-VL's `model.layers.*` on load); PEFT adapters are keyed by it
    peft_decoder = "model.language_model."

    def normalized(self, hf: HFConfig) -> dict:
        """config.json in transformers 5's layout (text_config, vision_config), converted by
        transformers' own config class when it is in the older flat layout."""
        if "text_config" in hf:
            return hf.data

        return getattr(transformers, self.config_class).from_dict(dict(hf.data)).to_dict()

    def text(self, hf: HFConfig) -> HFConfig:
        data = self.normalized(hf)
        text = dict(data["text_config"])
        if data.get("tie_word_embeddings") is not None:
            text["tie_word_embeddings"] = data["tie_word_embeddings"]
        return HFConfig(text, f"{hf.source} (text_config)")

    def gpt_config(self, hf):
        data = self.normalized(hf)
        text = self.text(hf)
        rope = text["rope_parameters"]
        if not rope.get("mrope_section"):
            text.refuse("rope_parameters", "no mrope_section: the decoder's multimodal RoPE is not described.")
        vision = data.get("vision_config") or hf.refuse("vision_config", "missing.")
        if data.get("image_token_id") is None:
            hf.refuse("image_token_id", "missing: the image placeholder token must be known.")
        mrope = MRoPEConfig(section=list(rope["mrope_section"]), interleaved=self.mrope_interleaved)
        self._check_mrope(text, mrope)
        deep = len(vision.get("deepstack_visual_indexes") or [])
        return self.text_family.gpt_config(text) | dict(
            mrope=mrope, vision=VisionConfig(hf=dict(vision), image_token_id=int(data["image_token_id"]),
                                             deepstack_layers=deep))

    def _check_mrope(self, text: HFConfig, mrope: MRoPEConfig) -> None:
        """A sectioned layout splits the head_dim/2 rotary frequencies by the section: a sum
        other than that fails in transformers' forward (torch.split) and in our ranks; refused
        here, before any launch. The interleaved one takes any section, as transformers does."""
        half = (text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]) // 2
        if not mrope.interleaved and sum(mrope.section) != half:
            raise HFCheckpointError(
                f"{text.source}: rope_parameters.mrope_section={mrope.section} sums to "
                f"{sum(mrope.section)}, but {self.hf_class} splits the head_dim/2 = {half} rotary "
                f"frequencies by it (transformers fails on it too): make it sum to {half}.")

    def hf_config(self, cfg):
        raise HFCheckpointError(
            f"{self.hf_class}: a vision-language model is exported next to the HF directory it "
            f"came from (its config.json and processor files are copied), not described anew.")

    def weights(self, cfg: GPTConfig):
        text = parts.renamed(self.text_family.weights(cfg), "model.", self.text_prefix)
        with torch.device("meta"):
            encoder = self.vision_encoder(cfg)
        return text + parts.module_entries(encoder, "visual.", self.vision_prefix)

    def peft_weights(self, cfg: GPTConfig):
        """The decoder's table under `peft_decoder` (adapters are on decoder linears only)."""
        return parts.renamed(self.text_family.weights(cfg), "model.", self.peft_decoder)

    def vision_encoder(self, cfg: GPTConfig) -> torch.nn.Module:
        if cfg.vision is None:
            raise HFCheckpointError(f"{self.hf_class}: the model config has no vision encoder.")
        # from the family's modeling module: not every transformers 5 exports the encoder's class
        module = importlib.import_module(f"transformers.models.{self.model_type}.modeling_{self.model_type}")
        config = importlib.import_module(f"transformers.models.{self.model_type}.configuration_{self.model_type}")
        encoder = getattr(module, self.vision_class)
        return use_packed_attention(encoder._from_config(getattr(config, self.vision_config_class)(**cfg.vision.hf)))
