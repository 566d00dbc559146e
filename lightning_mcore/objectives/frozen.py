"""A frozen model beside the trained one: DPO's and GRPO's reference, distillation's teacher.

Built and sharded like the policy (MegatronModule._build_chunks), never trained and never saved:
held as a plain attribute, not a submodule, so neither state_dict nor the optimizer sees it.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

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
