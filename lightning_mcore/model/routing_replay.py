"""Routing replay ("R3"): the experts each token was routed to while a rollout was generated,
replayed in the forward passes that train on it, so that training and rollout agree on every MoE
layer's choice (without it, MoE GRPO runs collapsed in Megatron-LM #4168).

The one module that knows mcore's router-replay API (megatron.core.transformer.moe.router_replay):
a TopKRouter built with `moe_enable_routing_replay` holds a RouterReplay, whose action we set per
router of the given chunks only; mcore's process-wide list of instances also holds other models'
routers (a frozen reference's), which keep choosing for themselves.

Token order: a router sees its layer's input [s, b, h] as [s*b, h] (s-major); under sequence
parallelism, its tensor-parallel rank's contiguous 1/tp of that. A packed THD row (training) is
[rows*seq, 1, h]: token (row r, position p) is r*seq + p. Routing is kept per (row, position):
[rows, seq, layers, topk] int16, `layers` being this rank's MoE layers in layer-number order (a
pipeline stage replays its own layers).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.router_replay import RouterReplayAction


def moe_routers(chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """The routers of `chunks` that can record and replay, in layer-number order."""
    found = [m for chunk in chunks for m in chunk.modules() if getattr(m, "router_replay", None) is not None]
    return sorted(found, key=lambda m: m.layer_number)


def routers_by_chunk(chunks: Sequence[torch.nn.Module]) -> dict[int, list[tuple[int, torch.nn.Module]]]:
    """For each chunk (by id), its routers with their column in this rank's routing (the order of
    `moe_routers` over all chunks). Computed once by a caller that keeps its chunks: each forward
    pass then finds its routers without walking the chunk's modules."""
    columns = {id(r): column for column, r in enumerate(moe_routers(chunks))}
    return {id(chunk): [(columns[id(m)], m) for m in chunk.modules() if id(m) in columns]
            for chunk in chunks}


def _action(name: str):
    return {"record": RouterReplayAction.RECORD, "replay": RouterReplayAction.REPLAY_FORWARD}[name]


def _reset(routers) -> None:
    for router in routers:
        router.router_replay.clear_router_replay_action()
        router.router_replay.clear_indices()


class Recording:
    """Every call of the routers while active: `take()` gives, per router, the [tokens, topk]
    choices of each call since the previous take (a forward pass calls each router once per
    microbatch)."""

    def __init__(self, routers) -> None:
        self.routers = list(routers)
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.routers]

    def _hook(self, index: int):
        def hook(module, args, output):
            self.calls[index].append(module.router_replay.get_recorded_indices().detach().clone())
        return hook

    def take(self) -> list[list[torch.Tensor]]:
        calls, self.calls = self.calls, [[] for _ in self.routers]
        return calls


@contextlib.contextmanager
def recording(chunks) -> Iterator[Recording]:
    """Record the choices of the chunks' routers (forward hooks read what mcore recorded)."""
    routers = moe_routers(chunks)
    record = Recording(routers)
    handles = [r.register_forward_hook(record._hook(i)) for i, r in enumerate(routers)]
    try:
        for router in routers:
            router.router_replay.set_router_replay_action(_action("record"))
        yield record
    finally:
        for handle in handles:
            handle.remove()
        _reset(routers)


def local_tokens(flat: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """This rank's share of [tokens, ...] routing: under sequence parallelism the tensor-parallel
    rank's contiguous slice (as mcore scatters a THD row), else all of it."""
    if not sequence_parallel:
        return flat

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    if flat.shape[0] % tp:
        raise ValueError(f"{flat.shape[0]} tokens do not split over {tp} tensor-parallel ranks")
    n = flat.shape[0] // tp
    return flat[rank * n:(rank + 1) * n]


@contextlib.contextmanager
def replaying(routers: list[tuple[int, torch.nn.Module]], routing: torch.Tensor, sequence_parallel: bool):
    """During one forward pass of a chunk whose `routers` are (column, router) pairs
    (`routers_by_chunk`): each takes its layer's experts from `routing` [tokens, layers, topk]
    instead of choosing them."""
    routing = local_tokens(routing, sequence_parallel)
    used = []
    try:
        for column, router in routers:
            router.router_replay.set_target_indices(routing[:, column].long())
            router.router_replay.set_router_replay_action(_action("replay"))
            used.append(router)
        yield
    finally:
        _reset(used)


@contextlib.contextmanager
def recording_chunk(routers: list[tuple[int, torch.nn.Module]]) -> Iterator[dict]:
    """During one forward pass of a chunk whose `routers` are (column, router) pairs: what each
    chose, as {column: [tokens, topk]}, filled when the pass is over."""
    used = list(routers)
    chosen: dict[int, torch.Tensor] = {}
    try:
        for _, router in used:
            router.router_replay.set_router_replay_action(_action("record"))
        yield chosen
        for column, router in used:
            recorded = router.router_replay.get_recorded_indices()
            if recorded is not None:
                chosen[column] = recorded.detach().clone()
    finally:
        _reset([r for _, r in used])


def differing(chosen: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
    """[tokens] bool: where the set of experts in `chosen` [tokens, topk] is not `wanted`'s."""
    return (chosen.sort(-1).values != wanted.to(chosen.device).sort(-1).values).any(-1)
