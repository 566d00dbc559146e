"""Seed-OSS (SeedOssForCausalLM): a Qwen2 whose q/k/v biases follow attention_bias and whose
dropout sits after attention and MLP (mcore's hidden_dropout)."""

from lightning_mcore.models import parts
from lightning_mcore.models.qwen2 import Qwen2


class SeedOss(Qwen2):
    hf_class, model_type, config_class = "SeedOssForCausalLM", "seed_oss", "SeedOssConfig"
    seq_cls_class = "SeedOssForSequenceClassification"
    required = Qwen2.required + ("head_dim",)

    def gpt_config(self, hf):
        parts.refuse_unless(hf, "attention_bias", True, "q/k/v without biases is not supported.")
        parts.refuse_unless(hf, "attention_out_bias", (False, None), "o_proj biases are not supported.")
        return super().gpt_config(hf) | dict(hidden_dropout=hf.get("residual_dropout", 0.0))

    def hf_config(self, cfg):
        return super().hf_config(cfg) | dict(residual_dropout=cfg.hidden_dropout)


ARCHITECTURE = SeedOss()
