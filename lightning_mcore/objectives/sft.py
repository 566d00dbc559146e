"""Supervised fine-tuning: next-token loss on assistant tokens only, packed samples isolated.

Batches come from SFTDataModule: tokens, labels, loss_mask, position_ids and segment_ids,
each [micro_batch, seq]. Every microbatch goes through the model as one packed THD row
(model/packing.py), so samples sharing a row never attend to each other and their positions
restart; the loss is summed over assistant tokens and divided by their count over the whole
global batch (objectives/loss.py).
"""

from __future__ import annotations

from functools import partial

from lightning_mcore.model.packing import packed_seq_params
from lightning_mcore.objectives.base import MegatronModule
from lightning_mcore.objectives.loss import masked_token_loss


class SFTModule(MegatronModule):
    packed_sequences = True

    def forward_step(self, batch: dict, chunk):
        if "segment_ids" not in batch:
            raise KeyError(
                "SFTModule needs batches with segment_ids (one id per sample in a row, as "
                "SFTDataModule makes them); got keys " + ", ".join(sorted(batch)) + "."
            )
        flat = {k: batch[k].reshape(1, -1) for k in ("tokens", "labels", "position_ids")}
        token_losses = chunk(
            input_ids=flat["tokens"],
            position_ids=flat["position_ids"],
            attention_mask=None,
            labels=flat["labels"],
            packed_seq_params=packed_seq_params(batch["segment_ids"]),
        )
        return token_losses, partial(masked_token_loss, loss_mask=batch["loss_mask"])
