"""Preference training: DPO (sigmoid, with label smoothing) and IPO on mcore.

Each batch row holds one pair, packed as two segments (DPODataModule): [prompt + chosen |
prompt + rejected], so chosen and rejected always share a microbatch and travel the pipeline
together. A sequence's log-probability is the sum over its response tokens of -cross-entropy,
which mcore computes from the vocab-parallel logits without gathering them.

The reference model's log-probs come from a forward-only pass at the start of every step:
with LoRA, the same chunks with the adapters switched off (no second copy of the weights);
without LoRA, a frozen copy of the starting weights sharded like the policy (twice the weight
memory, no gradients or optimizer state; `offload_reference` keeps that copy in CPU memory and
on the GPU only during its forward pass).

    sigmoid: loss = -(1-ls) log s(beta m) - ls log s(-beta m),   m = (pc - rc) - (pr - rr)
    ipo:     loss = (m' - 1 / (2 beta))^2  with length-averaged log-probs in m' (as in IPO / trl)
"""

from __future__ import annotations

from typing import Literal, Optional, Union

import torch
import torch.nn.functional as F

from lightning_mcore.lora.config import LoRAConfig
from lightning_mcore.model.config import GPTConfig
from lightning_mcore.objectives.base import MegatronModule
from lightning_mcore.objectives.frozen import ADAPTERS_OFF, WithFrozenModel, nothing_to_offload
from lightning_mcore.sequence.cp_reduce import context_parallel_first, context_parallel_sum
from lightning_mcore.sequence.packing import forward_packed
from lightning_mcore.strategy.optimizer import OptimizerSettings

METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")


def pair_logps(token_losses: torch.Tensor, batch: dict, average: bool = False,
               rows: Optional[int] = None) -> torch.Tensor:
    """[rows, 2]: (chosen, rejected) summed (or averaged) response log-probs of each row. Under
    context parallelism (`batch` is this rank's share, with row_ids; `rows`: the microbatch's
    rows) the sums of all cp ranks' shares are added (sequence/cp_reduce.py)."""
    sums, counts = pair_sums(token_losses, batch, rows)
    if "row_ids" in batch:
        sums, counts = context_parallel_sum(sums), context_parallel_sum(counts)
    return sums / counts.clamp(min=1) if average else sums


def pair_sums(token_losses: torch.Tensor, batch: dict, rows: Optional[int] = None):
    """([rows, 2] response log-prob sums, [rows, 2] response token counts) of the tokens in
    `batch`: a [rows, seq] microbatch, or one THD row whose tokens say their row in row_ids."""
    segment = batch["segment_ids"].reshape(-1)
    mask = batch["loss_mask"].reshape(-1).float()
    if "row_ids" in batch:
        row = batch["row_ids"].reshape(-1).long()
    else:
        rows = batch["segment_ids"].shape[0]
        row = torch.arange(rows, device=segment.device).repeat_interleave(batch["segment_ids"].shape[1])
    logp = -token_losses.float().reshape(-1) * mask
    sums = logp.new_zeros(rows * 2)
    counts = mask.new_zeros(rows * 2)
    for side in (0, 1):  # segment 1: chosen, 2: rejected; padding (0) counts nowhere
        take = segment == side + 1
        index = row[take] * 2 + side
        sums = sums.index_add(0, index, logp[take])
        counts = counts.index_add(0, index, mask[take])
    return sums.reshape(rows, 2), counts.reshape(rows, 2)


def preference_loss(policy: torch.Tensor, reference: torch.Tensor, beta: float,
                    label_smoothing: float = 0.0, loss_type: str = "sigmoid"):
    """Per-pair losses and metrics from [pairs, 2] log-probs (chosen, rejected)."""
    chosen = beta * (policy[:, 0] - reference[:, 0])
    rejected = beta * (policy[:, 1] - reference[:, 1])
    margin = (policy[:, 0] - policy[:, 1]) - (reference[:, 0] - reference[:, 1])
    if loss_type == "ipo":
        losses = (margin - 1.0 / (2.0 * beta)) ** 2
    else:
        losses = (-(1.0 - label_smoothing) * F.logsigmoid(beta * margin)
                  - label_smoothing * F.logsigmoid(-beta * margin))
    metrics = {
        "loss": losses, "rewards/chosen": chosen, "rewards/rejected": rejected,
        "rewards/accuracies": (chosen > rejected).float(), "rewards/margins": chosen - rejected,
        "logps/chosen": policy[:, 0], "logps/rejected": policy[:, 1],
    }
    return losses, metrics


class DPOModule(WithFrozenModel, MegatronModule):
    """Direct Preference Optimization on preference pairs (DPODataModule), against a frozen
    reference: the model it starts from.

    `beta`, `label_smoothing` (sigmoid only) and `loss_type` ("sigmoid" DPO or "ipo").
    `offload_reference` (GPU only): the frozen reference (no LoRA) waits in CPU memory and comes
    to the GPU for its forward pass, one copy of the weights less on the GPU for a host-to-device
    copy each step."""

    packed_sequences = True
    # under context parallelism each rank sums its share of every sequence and the shares are
    # added over the cp group (pair_logps), so packed rows split over cp ranks
    packed_context_parallel = True

    def __init__(
        self,
        model: Union[GPTConfig, str],
        optim: Optional[OptimizerSettings] = None,
        model_overrides: Optional[dict] = None,
        lora: Optional[LoRAConfig] = None,
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        loss_type: Literal["sigmoid", "ipo"] = "sigmoid",
        offload_reference: bool = False,
    ) -> None:
        super().__init__(model, optim, model_overrides, lora)
        if beta <= 0:
            raise ValueError(f"beta must be > 0, got {beta}.")
        if not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}.")
        if loss_type not in ("sigmoid", "ipo"):
            raise ValueError(f"loss_type must be 'sigmoid' or 'ipo', got {loss_type!r}.")
        if offload_reference and lora is not None:
            raise nothing_to_offload(f" with lora: {ADAPTERS_OFF}")
        self.beta, self.label_smoothing, self.loss_type = beta, label_smoothing, loss_type
        self.offload_reference = offload_reference

    # ---------------------------------------------------------------- steps
    def _reference_logps(self, batch: dict) -> torch.Tensor:
        average = self.loss_type == "ipo"
        rows = self._strategy().batch.micro_batch_size  # of each microbatch (a cp share is one THD row)

        def step(mb, chunk):
            return forward_packed(chunk, mb), lambda out: pair_logps(out, mb, average, rows)

        return self._frozen_collect(batch, step, 2)

    def forward_step(self, batch: dict, chunk):
        out = forward_packed(chunk, batch)

        def loss_fn(token_losses):
            reference = batch["ref_logps"]
            policy = pair_logps(token_losses, batch, self.loss_type == "ipo", len(reference))
            losses, metrics = preference_loss(policy, reference, self.beta,
                                              self.label_smoothing, self.loss_type)
            # every cp rank holds the same pair losses: counted (and reported) on the first only
            once = float(context_parallel_first())
            pairs = torch.tensor(losses.numel() * once, device=losses.device)
            report = {k: torch.stack([v.detach().float().sum() * once, pairs]) for k, v in metrics.items()}
            return losses.sum(), pairs.to(torch.int), report

        return out, loss_fn

    def _with_reference(self, batch: dict) -> dict:
        return {**batch, "ref_logps": self._reference_logps(batch).to(batch["tokens"].device)}
