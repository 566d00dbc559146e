"""Next-token pretraining: mcore computes vocab-parallel cross-entropy, we mask and reduce."""

from __future__ import annotations

from functools import partial

from lightning_mcore.objectives.base import MegatronModule
from lightning_mcore.objectives.loss import masked_token_loss


class PretrainModule(MegatronModule):
    """Pretraining (PretrainDataModule): next-token loss on the tokens loss_mask keeps.
    Batches carry tokens, labels, loss_mask and position_ids, each [micro_batch, seq]."""

    def forward_step(self, batch: dict, chunk):
        token_losses = chunk(
            input_ids=batch["tokens"],
            position_ids=batch["position_ids"],
            attention_mask=None,
            labels=batch["labels"],
        )
        return token_losses, partial(masked_token_loss, loss_mask=batch["loss_mask"])
