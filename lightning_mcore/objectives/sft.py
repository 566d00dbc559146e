"""Supervised fine-tuning: next-token loss on assistant tokens only, packed samples isolated.

Batches come from SFTDataModule: tokens, labels, loss_mask, position_ids and segment_ids,
each [micro_batch, seq]. Every microbatch goes through the model as one packed THD row
(sequence/packing.py), so samples sharing a row never attend to each other and their positions
restart; the loss is summed over assistant tokens and divided by their count over the whole
global batch (objectives/loss.py).
"""

from __future__ import annotations

from functools import partial

from lightning_mcore.objectives.base import MegatronModule
from lightning_mcore.objectives.loss import masked_token_loss
from lightning_mcore.sequence.packing import forward_packed


class SFTModule(MegatronModule):
    """Supervised fine-tuning on chat data (SFTDataModule): next-token loss on the assistant's
    tokens only, over packed rows whose samples never attend to each other."""

    packed_sequences = True
    # forward_packed takes the context-parallel offsets from the sliced microbatch and the loss
    # is a token sum, so packed rows split over cp ranks (strategy._context_parallel_slices).
    packed_context_parallel = True

    def forward_step(self, batch: dict, chunk):
        if "segment_ids" not in batch:
            raise KeyError(
                "SFTModule needs batches with segment_ids (one id per sample in a row, as "
                "SFTDataModule makes them); got keys " + ", ".join(sorted(batch)) + "."
            )
        token_losses = forward_packed(chunk, batch)
        return token_losses, partial(masked_token_loss, loss_mask=batch["loss_mask"])
