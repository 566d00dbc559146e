"""Per-token loss: the one reduction every objective reuses.

Each microbatch returns the *sum* of its token losses and its token count; mcore's schedule
(with `calculate_per_token_loss=True`) adds the counts over microbatches and finalize_model_grads
divides the gradients by the total over data-parallel ranks. The reported loss is therefore
sum(losses) / sum(tokens) over the whole global batch, however it is split into microbatches
and ranks: micro batch 1 x 4 and micro batch 4 x 1 train the same model.

Metrics travel as {name: tensor([sum, count])} so that any objective (DPO rewards, accuracy)
reduces the same way.
"""

from __future__ import annotations

import torch


def masked_token_loss(token_losses: torch.Tensor, loss_mask: torch.Tensor, name: str = "loss"):
    """mcore loss_func result: (summed loss, token count, {name: [sum, count]})."""
    losses = token_losses.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    total = torch.sum(losses * mask)
    count = mask.sum()
    return total, count.to(torch.int), {name: torch.stack([total.detach(), count.detach()])}
