"""KTO (Kahneman-Tversky Optimization) on unpaired desirable/undesirable examples, as trl's
KTOTrainer computes its "kto" loss.

Each batch row holds one example (KTODataModule): [prompt + completion | prompt + mismatched
completion] and a ``label``. With r = policy - reference summed log-probs of the completion and
z0 the KL reference point:

    desirable:   desirable_weight   * (1 - s(beta (r - z0)))
    undesirable: undesirable_weight * (1 - s(beta (z0 - r)))
    z0 = max(0, mean over the global batch of (policy - reference) of the mismatched completions)

z0 carries no gradient. It is computed before the step in forward-only passes (the strategy's
forward_collect, as DPO's reference log-probs): the reference on both segments, the policy
(current weights, no grad) on the mismatched one; the per-row differences are then summed over
the data-parallel ranks, so every rank and microbatch uses the same z0, whatever the layout.

Its own module rather than a ``loss_type`` of DPOModule: the batch (one example and a label per
row, not a pair), the loss and the metrics all differ; what it shares, the reference (LoRA base
with adapters off, else a frozen copy) and its pre-step pass, it inherits from DPOModule.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from lightning_mcore.lora.config import LoRAConfig
from lightning_mcore.model.config import GPTConfig
from lightning_mcore.objectives.dpo import DPOModule, pair_logps
from lightning_mcore.sequence.packing import forward_packed
from lightning_mcore.strategy.optimizer import OptimizerSettings

METRICS = ("loss", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")


def kto_loss(policy: torch.Tensor, reference: torch.Tensor, kl: torch.Tensor, desirable: torch.Tensor,
             beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0):
    """Per-example losses and metrics as {name: (values, which rows count)} from [rows] summed
    completion log-probs, the reference point `kl` and a bool `desirable` per row."""
    logratio = policy - reference
    losses = torch.where(
        desirable,
        desirable_weight * (1.0 - torch.sigmoid(beta * (logratio - kl))),
        undesirable_weight * (1.0 - torch.sigmoid(beta * (kl - logratio))),
    )
    rewards, every = beta * logratio.detach(), torch.ones_like(desirable)
    metrics = {
        "loss": (losses, every), "kl": (kl.expand_as(losses), every),
        "rewards/chosen": (rewards, desirable), "rewards/rejected": (rewards, ~desirable),
        "logps/chosen": (policy, desirable), "logps/rejected": (policy, ~desirable),
    }
    return losses, metrics


class KTOModule(DPOModule):
    """KTO (Kahneman-Tversky Optimization) on unpaired desirable and undesirable examples
    (KTODataModule), against a frozen reference: the model it starts from.

    `beta` (> 0), `desirable_weight` and `undesirable_weight` (> 0; trl's advice: keep
    desirable_weight * desirable examples / (undesirable_weight * undesirable examples) in
    [1, 4/3])."""

    # its KL estimate pairs rows across the batch; not wired for context parallel shares
    packed_context_parallel = False

    def __init__(
        self,
        model: Union[GPTConfig, str],
        optim: Optional[OptimizerSettings] = None,
        model_overrides: Optional[dict] = None,
        lora: Optional[LoRAConfig] = None,
        beta: float = 0.1,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
    ) -> None:
        super().__init__(model, optim, model_overrides, lora, beta=beta)
        weights = {"desirable_weight": desirable_weight, "undesirable_weight": undesirable_weight}
        for name, value in weights.items():
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}.")
        if not math.isfinite(beta):
            raise ValueError(f"beta must be finite, got {beta}.")
        self.desirable_weight, self.undesirable_weight = desirable_weight, undesirable_weight

    # ---------------------------------------------------------------- steps
    def _kl_point(self, batch: dict, reference: torch.Tensor) -> torch.Tensor:
        """z0: the policy's (current weights, no grad) minus the reference's log-probs of the
        mismatched completions, averaged over the global batch, clamped at 0."""
        def step(mb, chunk):
            return forward_packed(chunk, mb), lambda out: pair_logps(out, mb).detach()

        with torch.no_grad():
            policy = self._strategy().forward_collect(batch, step, 2, packed=True)
        gaps = (policy[:, 1] - reference[:, 1]).double()
        total = torch.stack([gaps.sum(), torch.tensor(float(len(gaps)), dtype=torch.float64,
                                                      device=gaps.device)])
        group = parallel_state.get_data_parallel_group()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
        return (total[0] / total[1]).clamp(min=0).float()

    def _with_reference(self, batch: dict) -> dict:
        if "label" not in batch or "segment_ids" not in batch:
            raise ValueError(
                f"KTOModule trains on rows of one example with a 'label' and two segments "
                f"(KTODataModule); this batch holds {sorted(batch)}"
            )
        reference = self._reference_logps(batch)
        kl = self._kl_point(batch, reference)
        device, rows = batch["tokens"].device, batch["tokens"].shape[0]
        return {**batch, "ref_logps": reference.to(device), "kl": kl.to(device).expand(rows).clone()}

    def forward_step(self, batch: dict, chunk):
        out = forward_packed(chunk, batch)

        def loss_fn(token_losses):
            policy = pair_logps(token_losses, batch)[:, 0]
            losses, metrics = kto_loss(policy, batch["ref_logps"][:, 0], batch["kl"], batch["label"] > 0.5,
                                       self.beta, self.desirable_weight, self.undesirable_weight)
            report = {k: torch.stack([torch.where(rows, v.detach().float(), 0.0).sum(), rows.float().sum()])
                      for k, (v, rows) in metrics.items()}
            return losses.sum(), torch.tensor(losses.numel(), device=losses.device, dtype=torch.int), report

        return out, loss_fn
