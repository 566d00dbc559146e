"""Full-vocabulary logits of whole token rows through the strategy's forward-only schedule (no
KV cache: predict_step and MegatronModule.forward_logits).

Collective: every rank calls it with the same tokens and gets the same result. Generation with a
KV cache: generation/batched.py.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import tensor_parallel

from lightning_mcore.model.config import refuse_longer


@torch.no_grad()
def forward_logits(strategy, chunks, tokens: torch.Tensor, cfg,
                   position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Full-vocabulary logits [batch, seq, vocab] for `tokens`, on every rank: one row per
    microbatch, vocab-parallel logits gathered over tensor-parallel ranks, shared from the
    last pipeline stage (`strategy`: a MegatronStrategy, a callable giving one, so that
    wrong inputs are refused first; `cfg`: the GPTConfig)."""
    refuse_longer(tokens.shape[-1], cfg.seq_length, "forward_logits (generation, predict): token rows")
    strategy = strategy() if callable(strategy) else strategy
    strategy.refuse_context_parallel("forward_logits (generation, predict)")
    vocab = cfg.vocab_size
    device = strategy.root_device
    tokens = tokens.to(device)
    rows, length = tokens.shape
    if position_ids is None:
        position_ids = torch.arange(length, device=device).expand(rows, length)
    position_ids = position_ids.to(device)
    seq = length
    if strategy.parallel.sequence_parallel:
        # The sequence is split over tensor-parallel ranks: pad on the right to a multiple of
        # their number (causal attention: the padding changes no logit before it).
        seq += -length % strategy.parallel.tensor_model_parallel_size
        tokens = torch.cat([tokens, tokens.new_zeros(rows, seq - length)], dim=1)
        position_ids = torch.cat([position_ids, position_ids[:, -1:].expand(rows, seq - length)], dim=1)
    micro = [{"tokens": tokens[i : i + 1], "position_ids": position_ids[i : i + 1]} for i in range(rows)]

    def step(mb, model):
        out = model(input_ids=mb["tokens"], position_ids=mb["position_ids"], attention_mask=None)
        gather = tensor_parallel.gather_from_tensor_model_parallel_region
        return out, lambda logits: gather(logits)[..., :vocab]

    logits = strategy.forward_only(micro, step, list(chunks), (seq, 1), (rows, seq, vocab))
    return logits if seq == length else logits[:, :length].contiguous()

