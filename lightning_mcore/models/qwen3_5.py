"""Qwen3.5, text only (Qwen3_5ForCausalLM, model_type qwen3_5_text): a hybrid stack of Gated
DeltaNet linear-attention layers (model/gated_delta_net.py) and, every few layers
(`layer_types`), softmax attention whose q_proj also projects a per-head output gate
(attention output * sigmoid(gate)); per-head q/k norms, RoPE on the first
partial_rotary_factor of each head, RMSNorms that scale by (1 + weight) (the linear layers'
output norm excepted), a dense SwiGLU MLP.

The multi-token-prediction layer of published checkpoints (mtp.*) is carried through to
exports untouched (not trained). rope_parameters may carry mrope_section / mrope_interleaved
(the multimodal model's 3-D positions): text has one position per token, on which they rotate
as plain RoPE.
"""

from __future__ import annotations

from lightning_mcore.hf.config import HFCheckpointError
from lightning_mcore.models import parts
from lightning_mcore.models.architecture import Architecture

class Qwen3_5(Architecture):
    hf_class, model_type, config_class = "Qwen3_5ForCausalLM", "qwen3_5_text", "Qwen3_5TextConfig"
    required = ("intermediate_size", "num_key_value_heads", "head_dim", "linear_num_key_heads",
                "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    grouped_in_proj = False  # in_proj_qkvz / in_proj_ba per key head (Qwen3-Next)

    def gpt_config(self, hf):
        parts.refuse_unless(hf, "hidden_act", ("silu", None), "only silu is supported.")
        # RoPE scaling with partial rotary is not computed here (plain RoPE only: refused by name)
        return parts.decoder(hf, rope_types=("default",), partial_rotary=True, qk_layernorm=True,
                             zero_centered_norm=True, attention_output_gate=True) | parts.linear_attention(hf)

    def carried(self, hf):
        # The published multi-token-prediction layer (mtp.*, mtp_num_hidden_layers): not
        # trained here; kept for the export, as transformers ignores it.
        return ("mtp.",)

    def hf_config(self, cfg):
        return self.hybrid_hf(cfg)

    def hybrid_hf(self, cfg, free: tuple[str, ...] = ()) -> dict:
        """transformers config kwargs of the hybrid decoder; `free`: fields a subclass sets."""
        if cfg.linear_attention is None:
            raise HFCheckpointError(f"{self.model_type} needs GPTConfig.linear_attention.")
        parts.expressible(cfg, self.model_type, rope_types=("default",),
                          free=("layer_types", "linear_attention", "rotary_percent") + free,
                          qk_layernorm=True, zero_centered_norm=True, attention_output_gate=True)
        return parts.decoder_hf(cfg, partial_rotary=True) | parts.linear_attention_hf(cfg)

    def weights(self, cfg):
        return (parts.ends(cfg.tie_word_embeddings) + parts.gated_attention()
                + parts.gated_delta_net(cfg, self.grouped_in_proj) + self.mlp(cfg))

    def mlp(self, cfg):
        return parts.dense_mlp()


ARCHITECTURE = Qwen3_5()
