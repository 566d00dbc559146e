"""A frozen model beside the trained one: DPO's and GRPO's reference, distillation's teacher.

Built and sharded like the policy (MegatronModule._build_chunks), never trained and never saved:
held as a plain attribute, not a submodule, so neither state_dict nor the optimizer sees it.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from lightning_mcore.lora.adapters import adapters_disabled
from lightning_mcore.objectives.offload import OffloadedWeights, on_device

# why a LoRA policy's reference has no copy of the weights to offload (DPO's and GRPO's refusals)
ADAPTERS_OFF = "the reference is the policy's own base weights with the adapters off, not a copy"


class FrozenModel:
    """This rank's `chunks`, without gradients and in eval mode. `offload`: their weights wait in
    CPU memory (objectives/offload.py) and are on the device only inside `forward_collect`; give
    chunks whose weights are loaded already."""

    def __init__(self, chunks: list, offload: bool = False) -> None:
        for chunk in chunks:
            chunk.requires_grad_(False).eval()
        self.chunks = chunks
        self.weights: Optional[OffloadedWeights] = OffloadedWeights(chunks) if offload else None

    def forward_collect(self, strategy, batch: dict, step: Callable, width: int,
                        packed: bool = False) -> torch.Tensor:
        """strategy.forward_collect through these chunks (their weights on its device meanwhile)."""
        with on_device(self.weights, strategy.root_device):
            return strategy.forward_collect(batch, step, width, chunks=self.chunks, packed=packed)


def nothing_to_offload(why: str) -> ValueError:
    """The refusal of offload_reference=True where no frozen copy is kept; `why` continues
    "offload_reference=True has nothing to offload" (tests match DPO's and GRPO's words)."""
    return ValueError(f"offload_reference=True has nothing to offload{why}. Set offload_reference=False.")


class WithFrozenModel:
    """For MegatronModule objectives that compare with a frozen model (DPO's, KTO's and GRPO's
    reference, distillation's teacher); put it before MegatronModule. ``_reference`` is the frozen
    copy, built in the first configure_model from ``_frozen_source()``; without one (LoRA) the
    reference is the policy's own chunks with the adapters off."""

    _reference: Optional[FrozenModel] = None
    offload_reference: bool = False

    def _frozen_source(self):
        """What the frozen copy is built from (_build_chunks' `source`: the policy itself, its
        starting weights), or None: no copy (LoRA: the adapters-off policy is the reference)."""
        return self if self.lora is None else None

    def configure_model(self) -> None:
        first = self.chunks is None
        super().configure_model()
        source = self._frozen_source() if first else None
        if source is not None:
            chunks = self._build_chunks(self._strategy(), source)
            self._reference = FrozenModel(chunks, self.offload_reference)

    def _with_reference(self, batch: dict) -> dict:
        """The batch with what the frozen model gives the loss (the objective's to say)."""
        return batch

    def training_step(self, batch: dict, batch_idx: int):
        return super().training_step(self._with_reference(batch), batch_idx)

    def validation_step(self, batch: dict, batch_idx: int):
        return super().validation_step(self._with_reference(batch), batch_idx)

    def _frozen_collect(self, batch: dict, step: Callable, width: int) -> torch.Tensor:
        """strategy.forward_collect (packed rows) through the frozen copy, or without one through
        the policy's chunks with the adapters off."""
        strategy = self._strategy()
        if self._reference is None:
            with adapters_disabled(list(self.chunks)):
                return strategy.forward_collect(batch, step, width, packed=True)
        return self._reference.forward_collect(strategy, batch, step, width, packed=True)
