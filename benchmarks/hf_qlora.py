"""The model of `benchmarks/hf_fsdp2.py --qlora`: transformers' QLoRA recipe on one GPU as its users
run it (from_pretrained(quantization_config=BitsAndBytesConfig(...)), peft's
prepare_model_for_kbit_training, get_peft_model, Trainer(bf16=True)), the baseline of issue 49's
4-bit base.

- every nn.Linear of the decoder layers is a bitsandbytes Linear4bit: NF4 in blocks of 64, double
  quantization (bnb_4bit_use_double_quant=True, as QLoRA: each block's fp32 absmax quantized again,
  8-bit in blocks of 256 around their mean), bf16 compute dtype, uint8 storage; lm_head (and the
  embedding, not a Linear) unquantized, as from_pretrained leaves them (get_keys_to_not_convert);
- built on the device without writing a 16 GB checkpoint: transformers' model in bf16 with its own
  random init (normal(0, 0.02), norms 1), then transformers' replace_with_bnb_linear (what
  from_pretrained calls before loading) and, per weight, Params4bit(weight, **placeholder.__dict__)
  .to(device) (what from_pretrained's Bnb4bitQuantize.convert does with each checkpoint tensor),
  which quantizes it there: the same codes and quant states as from_pretrained of this model saved
  (tests/test_hf_qlora_baseline.py compares them bit for bit);
- prepare_model_for_kbit_training (peft's own): the base frozen, the other weights (norms,
  embedding, lm_head) cast to fp32; with --ac transformers' gradient checkpointing of each decoder
  layer, non-reentrant (transformers' default);
- LoRA: hf_fsdp2.add_lora (peft on q/k/v/o and gate/up/down, alpha 2r unless given, no dropout,
  fp32 adapters);
- forward and backward under torch.autocast(bf16) ("mixed"), as Trainer(bf16=True) runs it
  (accelerate wraps model.forward so); "fp32" (the CPU test): fp32 weights and compute, no autocast;
- optimizer: hf_fsdp2's torch AdamW (fused, fp32 state), not the QLoRA paper's paged AdamW: paging
  only moves the adapters' state (~0.3 GB at r16 on 8B) to host memory when the GPU runs short,
  and this keeps the optimizer the same as ours and the FSDP2 baseline's.
"""

from __future__ import annotations

import bitsandbytes as bnb
import torch
from hf_baseline import build_model
from hf_fsdp2 import FsdpSettings, add_lora
from peft import prepare_model_for_kbit_training
from transformers import BitsAndBytesConfig
from transformers.integrations import replace_with_bnb_linear
from transformers.quantizers.base import get_keys_to_not_convert


def bnb_config(precision: str) -> BitsAndBytesConfig:
    """QLoRA's quantization: NF4, double quantization, compute in bf16 (fp32 for the CPU test)."""
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16 if precision == "mixed" else torch.float32)


def quantize(model, config: BitsAndBytesConfig, device: torch.device):
    """Each linear's weights into NF4 on `device`, as from_pretrained(quantization_config=config)
    would have loaded them; each bf16 weight is freed once quantized."""
    dense = {name: m.weight for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    replace_with_bnb_linear(model, modules_to_not_convert=get_keys_to_not_convert(model), quantization_config=config)
    for name in list(dense):
        weight = dense.pop(name).data
        module = model.get_submodule(name)
        if isinstance(module, bnb.nn.Linear4bit):
            module.weight = bnb.nn.Params4bit(weight, requires_grad=False, **module.weight.__dict__).to(device)
    model.is_loaded_in_4bit = True  # from_pretrained's mark, which peft reads
    return model


def build_qlora(shape: dict, seq: int, s: FsdpSettings, device: torch.device):
    """transformers' model for `shape` in NF4 with peft's LoRA, ready to train on `device`."""
    mixed = s.precision == "mixed"
    model = build_model(shape, seq, "bf16" if mixed else "fp32", device, attn=s.attn)
    model = quantize(model, bnb_config(s.precision), device)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=s.ac,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    model = add_lora(model, s)
    if mixed:
        model.forward = torch.autocast(device.type, dtype=torch.bfloat16)(model.forward)
    return model.train()


def qlora_settings(s: FsdpSettings) -> dict:
    """What the result says about the QLoRA baseline, over hf_fsdp2's FSDP settings."""
    config = bnb_config(s.precision)
    return {"fsdp": None, "grad_reduce": None, "frozen_base_dtype": "nf4", "master_dtype": "float32",
            "param_dtype": "bfloat16 (autocast)" if s.precision == "mixed" else "float32",
            "optimizer": "torch AdamW fused, fp32 state (not paged)",
            "gradient_checkpointing": "transformers', non-reentrant" if s.ac else None,
            "bnb": {"quant_type": config.bnb_4bit_quant_type, "blocksize": 64,
                    "double_quant": config.bnb_4bit_use_double_quant,
                    "compute_dtype": str(config.bnb_4bit_compute_dtype).removeprefix("torch."),
                    "quant_storage": "uint8", "prepare_model_for_kbit_training": True},
            "bitsandbytes": bnb.__version__}
