"""The MoE token dispatcher of generation, at one expert-parallel rank: no all-to-all, no
copy of token counts to the host, static shapes.

Why: mcore's all-to-all dispatcher needs its split sizes on the host, one wait per MoE layer and
step, which keeps a decode step host-bound and out of CUDA graphs. Here every shape depends only
on the token count, nothing reads the device, and the result sums in a fixed order: a step can
be captured (generation/decode_graphs.py). The design extends to expert parallelism, as generation's
tokens are the same on every rank of the group (sequence parallelism off; every data-parallel
rank generates all ranks' prompts, generation/batched.py): each rank would add its experts' share
and one all-reduce sum the shares. On CPU that equals the all-to-all; on GPU it did not yet
(serves_generation), so EP > 1 keeps mcore's dispatcher.

Each token's k = topk chosen experts are its slots, in expert order. Slots sorted by expert are
the experts' rows:

    slots [T, k]  --sort by expert-->  rows [T*k, h] -> experts (grouped GEMM, device counts)
    rows  --back to slots-->  [T, k, h], summed over k in fp32  -->  [T, h]
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher


def serves_generation(dispatcher, config) -> bool:
    """Whether generation may use GenerationDispatcher in place of `dispatcher`: one
    expert-parallel rank, experts not split over tensor-parallel ranks, dropless, no
    shared-expert overlap (which moves the shared experts into the dispatcher) and no latent
    projection. At EP=2 it equals the all-to-all on CPU (fp32 and bf16), but on 2x H200 in
    bf16 the rollouts' log-probs sat 0.05 from training's with replay (0.004 through mcore's
    all-to-all, benchmarks/RESULTS.md session 24); until that is understood, EP > 1 keeps
    mcore's dispatcher."""
    return (dispatcher.ep_size == 1 and dispatcher.tp_size == 1 and config.moe_expert_capacity_factor is None
            and not config.moe_pad_expert_input_to_capacity and not config.moe_shared_expert_overlap
            and not getattr(config, "moe_latent_size", None)
            and not getattr(config, "moe_router_padding_for_quantization", False))


class GenerationDispatcher(MoETokenDispatcher):
    """Generation's dispatcher of one MoE layer (at one expert-parallel rank: every expert here)."""

    def __init__(self, config, training):
        """`training`: the layer's own dispatcher, whose process groups this one takes."""
        groups = SimpleNamespace(ep=training.ep_group, expt_tp=training.tp_group, tp_ep=training.tp_ep_group)
        super().__init__(config=config, pg_collection=groups)
        self.slots = config.moe_router_topk

    def dispatch_preprocess(self, tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        self.shape, self.dtype = tokens.shape, tokens.dtype
        x = tokens.reshape(-1, tokens.shape[-1])
        # each token's chosen experts (routing_map [T, experts] bool), in expert order
        experts = torch.argsort((~routing_map).to(torch.int8), dim=1, stable=True)[:, :self.slots]
        # a slot on an expert not chosen (a row of fewer than topk) weighs 0
        slot_probs = torch.where(routing_map.gather(1, experts), probs.gather(1, experts), 0).reshape(-1)
        experts = experts.reshape(-1)
        order = torch.argsort(experts, stable=True)  # the slot of each expert row
        self.row_of_slot = torch.argsort(order)
        # rows per expert, counted without reading the device (bincount would size its output there)
        ends = torch.searchsorted(experts[order], torch.arange(routing_map.shape[1], device=x.device), right=True)
        self.counts = torch.diff(ends, prepend=ends.new_zeros(1))
        self.tokens = x.shape[0]
        token_of_slot = torch.arange(self.tokens, device=x.device).repeat_interleave(self.slots)
        return x[token_of_slot[order]], slot_probs[order]

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        return hidden_states, self.counts, probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        slots = hidden_states[self.row_of_slot]  # a gather: no atomic adds, a fixed sum order
        return slots.view(self.tokens, self.slots, -1).sum(1, dtype=torch.float32)

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states  # one expert-parallel rank: every expert is here

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.to(self.dtype).view(self.shape)
