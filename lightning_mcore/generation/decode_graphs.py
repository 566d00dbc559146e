"""Decode steps replayed from CUDA graphs (GPU, PP=1; at TP>1 with the TP collectives inside).

An eager decode step of a 1B Llama shape costs ~35 ms of host time on an H100 (the mcore and TE
modules' Python), against ~2 ms for the same kernels replayed from a CUDA graph (measured, see
benchmarks/RESULTS.md). mcore's own graphed decoding needs flash-attn's KV-cache kernel
(`flash_decode`), which our GPU machines lack; its static path slices the cache up to the current
length, a Python int, so one graph holds one position. Hence one graph per position, captured
the first time that position is decoded and replayed by every later call with the same number
of rows: GRPO's rollouts decode the same rows every step with new weights.

What a graph bakes in, and how it stays true:
- buffers: the KV cache, the token/position inputs and the logits output are allocated once per
  row count (the cache for a power of two of positions) and kept, in `DecodeGraphs`;
- weights are read by address: the optimizer updates them in place;
- Python branches (eval mode and sequence parallelism off, as next_token_logits sets them; LoRA
  adapters on, off or merged): the adapters' state is part of the key, a change recaptures.
- routing (GRPO's replay records every MoE layer's experts): mcore's RouterReplay copies them
  into static buffers kept here, read after each replay; whether they are recorded is in the key.
MoE layers are captured where generation dispatches their tokens without the host
(model/generation_dispatcher.py: one expert-parallel rank, torch's grouped experts, expert-TP 1,
dropless), in bf16: in fp32 torch's grouped GEMM copies its offsets to the host, the capture
fails and those steps run eagerly, with a warning. Left eager: other
MoE layers (the all-to-all dispatcher copies token counts to the host) and pipeline parallelism
(see graphs_unavailable).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_layer import MoELayer

from lightning_mcore.lora.adapters import adapters_of
from lightning_mcore.model import inference_context, routing_replay

# chunk -> its DecodeGraphs (one row count at a time: a new count frees the old cache)
_KEPT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def graphs_unavailable(strategy, cfg, chunks) -> str:
    """Why decode steps run eagerly for this model and layout ("" when graphs are used)."""
    if strategy.root_device.type != "cuda":
        return "not on a GPU"
    if strategy.parallel.pipeline_model_parallel_size > 1:
        return "pipeline parallelism (each step crosses stages through the schedule)"
    if cfg.num_moe_experts and not all(getattr(m, "generation_dispatcher", None) is not None
                                       for c in chunks for m in c.modules() if isinstance(m, MoELayer)):
        return ("MoE layers whose tokens generation cannot dispatch without the host (expert "
                "parallelism, TE's grouped experts, expert-TP > 1 or capacity-limited routing)")
    if cfg.linear_attention is not None:
        return "linear-attention layers (their recurrent state is not captured yet)"
    return ""


def release() -> None:
    """Drop every kept graph and its cache. The strategy calls this before its process groups go:
    a live graph holding NCCL collectives (TP>1) makes destroy_process_group hang at exit
    (pytorch/pytorch#115388; seen at TP=2 on 2x H200)."""
    if _KEPT and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # no replay still running on what is freed
    _KEPT.clear()


def decode_graphs(chunk, rows: int, vocab: int, length: int, longest: int,
                  new_context, memory_fraction: float = 1.0) -> "DecodeGraphs":
    """The kept DecodeGraphs of this chunk for `rows` rows and sequences of `length` positions,
    made (with `new_context(capacity)`, an inference context with its buffers) when there is
    none for that row count or its cache is too short. The capacity is `length` rounded up to a
    power of two (at most `longest`, the model's seq_length), so that calls whose prompts vary a
    little keep the same cache, and its graphs, without holding seq_length positions."""
    kept = _KEPT.get(chunk)
    if kept is None or kept.rows != rows or kept.capacity < length:
        _KEPT.pop(chunk, None)  # free the old cache before allocating the new one
        capacity = min(longest, 1 << max(length - 1, 1).bit_length())
        kept = _KEPT[chunk] = DecodeGraphs(chunk, rows, vocab, capacity, new_context(capacity))
    kept.memory_fraction = memory_fraction
    return kept


class DecodeGraphs:
    def __init__(self, chunk, rows: int, vocab: int, capacity: int, context) -> None:
        self.chunk, self.rows, self.vocab, self.context = chunk, rows, vocab, context
        self.capacity = capacity  # positions the KV cache holds
        device = next(chunk.parameters()).device
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.logits = torch.zeros(rows, vocab, device=device)  # written by every graph
        self.graphs: dict = {}  # (position, adapters' state, recording) -> torch.cuda.CUDAGraph
        self.routers = routing_replay.moe_routers([chunk])
        self.routing = None  # each router's static buffer [rows, topk], made on the first recording
        self.pool = None  # one memory pool for all: the graphs never run concurrently
        self.warm = False
        self.failed = ""  # why a capture failed: the steps then run eagerly
        # Memory the captures took (the device's used bytes, NCCL's included). At TP>1 a graph keeps
        # the tensors of its collectives allocated for its life (~57 MiB a position for the 8B recipe's
        # 64 rows at TP=2 on 2x H200; none at TP=1): positions past `memory_fraction` of the GPU decode
        # eagerly, as the TP group agrees (its ranks decode the same positions).
        self.held = 0
        self.memory_fraction = 1.0
        self.tp_group = (parallel_state.get_tensor_model_parallel_group()
                         if parallel_state.model_parallel_is_initialized()
                         and parallel_state.get_tensor_model_parallel_world_size() > 1 else None)

    def adapters_state(self) -> tuple:
        """The LoRA adapters' Python switches, which a graph bakes in (fixed during a call)."""
        return tuple((a.enabled, a.merged) for _, a, _ in adapters_of([self.chunk]))

    @contextlib.contextmanager
    def _recording_into_buffers(self, recording: bool):
        """While capturing with a recording on: each router copies its choice into its static
        buffer in self.routing (mcore's RouterReplay.set_static_buffer), inside the graph."""
        if not recording:
            yield
            return
        if self.routing is None:
            self.routing = [torch.zeros(self.rows, r.topk, dtype=torch.long, device=self.tokens.device)
                            for r in self.routers]
        try:
            for router, buffer in zip(self.routers, self.routing):
                router.router_replay.set_static_buffer(buffer)
            yield
        finally:
            for router in self.routers:
                router.router_replay.clear_static_buffer()

    def replayable(self, position: int, adapters_state: tuple, recording: bool = False) -> bool:
        """Whether this step has a graph or may capture one: its captures so far hold less than
        memory_fraction of the GPU, on every rank of the TP group."""
        if (position, adapters_state, recording) in self.graphs:
            return True
        total = torch.cuda.get_device_properties(self.tokens.device).total_memory
        full = torch.tensor([float(self.held >= self.memory_fraction * total)], device=self.tokens.device)
        if self.tp_group is not None:
            torch.distributed.all_reduce(full, op=torch.distributed.ReduceOp.MAX, group=self.tp_group)
        return not bool(full.item())

    def step(self, columns: torch.Tensor, position: int, adapters_state: tuple,
             recording: bool = False) -> torch.Tensor:
        """Logits [rows, vocab] after appending `columns` [rows, 1] at `position` (the prefill
        up to `position` went into self.context before; `adapters_state`: adapters_state() of
        this call; `recording`: the routers' choices land in self.routing, one [rows, topk] per
        router)."""
        self.tokens.copy_(columns)
        self.positions.fill_(position)
        key = (position, adapters_state, recording)
        graph = self.graphs.get(key)
        if graph is None:
            try:
                free_before = torch.cuda.mem_get_info(self.tokens.device)[0]
                with self._recording_into_buffers(recording):
                    graph = self.graphs[key] = self._capture(position)
                self.held += free_before - torch.cuda.mem_get_info(self.tokens.device)[0]
            except RuntimeError as err:  # an op of some model that cannot be captured
                self.failed = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                raise
        graph.replay()
        return self.logits

    def _run(self) -> None:
        out = self.chunk(input_ids=self.tokens, position_ids=self.positions, attention_mask=None,
                         inference_context=self.context, runtime_gather_output=True)
        self.logits.copy_(out[:, -1, :self.vocab])

    def _capture(self, position: int):
        inference_context.go_to(self.context, position)
        if not self.warm:
            # Lazy state (cuBLAS handles, TE workspaces) is made by an eager step on a side
            # stream, as torch asks; it writes the same K/V at `position` as the replay will.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._run()
            torch.cuda.current_stream().wait_stream(side)
            self.warm = True
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local, as mcore captures: other threads (NCCL's watchdog) may use CUDA meanwhile
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self._run()
        return graph
