"""Phi-3 and Phi-4 (Phi3ForCausalLM): a Llama-style decoder whose q/k/v projections are one
tensor (qkv_proj, [q; k; v] rows) and whose gate/up projections are one (gate_up_proj,
[gate; up]); RoPE on partial_rotary_factor of each head (Phi-4-mini: 0.75); with sliding_window,
every layer windowed. LongRoPE (the 128k checkpoints) is refused by name."""

from __future__ import annotations

from lightning_mcore.hf.config import HFCheckpointError
from lightning_mcore.hf.mappings import Entry
from lightning_mcore.hf.transforms import FusedQKV, Sections, Split
from lightning_mcore.models import parts
from lightning_mcore.models.architecture import Architecture

M, H = parts.M, parts.H


class Phi3(Architecture):
    hf_class, model_type, config_class = "Phi3ForCausalLM", "phi3", "Phi3Config"
    required = ("intermediate_size", "num_key_value_heads")

    def gpt_config(self, hf):
        for field in ("resid_pdrop", "embd_pdrop"):
            parts.refuse_unless(hf, field, (0, 0.0, None), "dropout is not supported; set it to 0.")
        window = dict(sliding_window=hf["sliding_window"]) if "sliding_window" in hf else {}
        return parts.decoder(hf, partial_rotary=True, **window)

    def hf_config(self, cfg):
        parts.expressible(cfg, self.model_type, free=("rotary_percent", "sliding_window"))
        if cfg.layer_types is not None:
            raise HFCheckpointError(f"{self.model_type} windows every layer or none.")
        return parts.decoder_hf(cfg, partial_rotary=True) | dict(
            sliding_window=cfg.sliding_window, original_max_position_embeddings=cfg.seq_length)

    def weights(self, cfg):
        f = cfg.ffn_hidden_size
        return parts.ends(cfg.tie_word_embeddings) + [
            parts.norm("input_layernorm.weight", "input_layernorm.weight"),
            Entry(M + "self_attention.linear_qkv.weight", (H + "self_attn.qkv_proj.weight",), FusedQKV(),
                  (("q+2kv", "h"),)),
            Entry(M + "self_attention.linear_proj.weight", (H + "self_attn.o_proj.weight",), Split(1), (("h", "q"),)),
            parts.norm("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
            Entry(M + "mlp.linear_fc1.weight", (H + "mlp.gate_up_proj.weight",), Sections(((0, 0, f), (0, f, f))),
                  (("2f", "h"),)),
            Entry(M + "mlp.linear_fc2.weight", (H + "mlp.down_proj.weight",), Split(1), (("h", "f"),)),
        ]


ARCHITECTURE = Phi3()
