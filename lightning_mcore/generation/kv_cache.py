"""Next-token logits of a batch of rows, one new column at a time, from the mcore chunks.

`CachedForward` keeps each layer's keys and values in Megatron-Core's inference context
(model/inference_context.py; passed to GPTModel.forward as `inference_context`: every attention
layer appends its K/V and attends over the cache; only the last position reaches the output
layer, whose logits mcore gathers over tensor-parallel ranks). We allocate the cache buffers
ourselves on the strategy's device, as mcore's own allocation asks for a CUDA device. Every call
goes through the strategy's forward-only schedule, so pipeline stages pass hidden states as in
training; one context per chunk, all advanced together.

What a step feeds the model is `TokenColumns` (token ids at consecutive positions) unless the
caller gives its own (generation/vision_columns.py: image embeddings and M-RoPE positions).

Under sequence parallelism the chunks run with it switched off while generating, MoE layers
included (tests/test_generation.py: greedy equals transformers' at TP=2+SP for a Qwen3-MoE and a
DeepSeek-V3, on CPU; on GPU not yet run).
"""

from __future__ import annotations

import contextlib

import torch
from lightning.pytorch.utilities import rank_zero_warn
from megatron.core.transformer.attention import Attention
from megatron.core.transformer.utils import set_model_to_sequence_parallel
from megatron.core.utils import unwrap_model

from lightning_mcore.generation import decode_graphs, reproducible_attention
from lightning_mcore.model import inference_context as ic
from lightning_mcore.model.gated_delta_net import GatedDeltaNet


class TokenColumns:
    """A language model's cached step: token ids at consecutive positions."""

    def batch(self, columns: torch.Tensor, start: int) -> dict:
        rows, n = columns.shape
        return {"tokens": columns,
                "position_ids": torch.arange(start, start + n, device=columns.device).expand(rows, n)}

    def forward(self, model, mb: dict, context):
        return model(input_ids=mb["tokens"], position_ids=mb["position_ids"], attention_mask=None,
                     inference_context=context, runtime_gather_output=True)


@contextlib.contextmanager
def next_token_logits(strategy, chunks, cfg, rows: int, max_length: int, cuda_graphs: bool = False,
                      inputs=None, recording: bool = False, graph_memory_fraction: float = 1.0):
    """A CachedForward, with the chunks in eval mode (mcore reads the inference context only
    there; no dropout) and sequence parallelism off (as mcore's own engine does: a one-token
    step cannot be split over tensor-parallel ranks); both restored after. `cuda_graphs`: decode
    steps replay kept CUDA graphs where generation/decode_graphs.py can (else eager). `inputs`: what
    each step feeds the model (default TokenColumns; another runs without graphs). `recording`:
    the routers record their choices (model/routing_replay.py), in graphs too (graph_routing).
    `graph_memory_fraction`: of the GPU's memory, what the kept graphs may hold (then eager)."""
    training = [c.training for c in chunks]
    sequence_parallel = strategy.parallel.sequence_parallel
    try:
        for c in chunks:
            c.eval()
            if sequence_parallel:
                set_model_to_sequence_parallel(unwrap_model(c), False)
        yield CachedForward(strategy, chunks, cfg, rows, max_length, cuda_graphs and inputs is None,
                            inputs or TokenColumns(), recording, graph_memory_fraction)
    finally:
        for c, mode in zip(chunks, training):
            c.train(mode)
            if sequence_parallel:
                set_model_to_sequence_parallel(unwrap_model(c), True)


def new_context(chunk, rows: int, max_length: int, device):
    """An inference context for `chunk`, with its K/V buffers allocated on `device` (mcore's
    own allocation asks for a CUDA device; a linear-attention layer keeps its convolution window
    and recurrent state there instead)."""
    context = ic.new_context(rows, max_length)
    for module in chunk.modules():
        if isinstance(module, GatedDeltaNet):
            ic.keep_buffers(context, module.layer_number, module.state_buffers(rows, device))
        if isinstance(module, Attention):
            weight = next(module.parameters())
            shape = (max_length, rows, module.num_query_groups_per_partition)
            ic.keep_buffers(context, module.layer_number, tuple(
                torch.zeros(*shape, dim, dtype=weight.dtype, device=device)
                for dim in (module.key_hidden_size, module.val_hidden_size)))
    return context


class CachedForward:
    def __init__(self, strategy, chunks, cfg, rows: int, max_length: int, cuda_graphs: bool,
                 inputs: TokenColumns, recording: bool = False, graph_memory_fraction: float = 1.0) -> None:
        self.strategy, self.chunks, self.cfg, self.rows = strategy, list(chunks), cfg, rows
        self.inputs, self.recording = inputs, recording
        device = strategy.root_device
        self.graphs = None
        self.graphed = False  # whether the last step replayed a graph
        if cuda_graphs and not decode_graphs.graphs_unavailable(strategy, cfg, self.chunks):
            (chunk,) = self.chunks
            self.graphs = decode_graphs.decode_graphs(
                chunk, rows, cfg.vocab_size, max_length, cfg.seq_length,
                lambda capacity: new_context(chunk, rows, capacity, device), graph_memory_fraction)
            self.contexts = [self.graphs.context]
            self.adapters_state = self.graphs.adapters_state()
        else:
            self.contexts = [new_context(c, rows, max_length, device) for c in self.chunks]
        self.length = 0  # positions already in the cache
        # Trainer(deterministic=True): decode steps on TE's unfused attention (reproducible_attention.py)
        self.reproducible = reproducible_attention.wanted(device)

    def __call__(self, columns: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] after appending `columns` [rows, n] (n > 1 only for the first
        call: a cached step after the prefill attends without a causal mask)."""
        vocab, device = self.cfg.vocab_size, self.strategy.root_device
        columns = columns.to(device)
        n = columns.shape[1]
        if self.length and n != 1:
            raise ValueError("CachedForward: after the prefill, append one column per call.")
        if (self.length and self.graphs is not None and not self.graphs.failed
                and self.graphs.replayable(self.length, self.adapters_state, self.recording)):
            try:
                with ic.inference_mode(), reproducible_attention.unfused_attention(self.reproducible):
                    logits = self.graphs.step(columns, self.length, self.adapters_state, self.recording)
                self.length += 1
                self.graphed = True
                return logits
            except RuntimeError:
                if not self.graphs.failed:  # not a capture: a real error of the step
                    raise

                rank_zero_warn(f"generate: CUDA graph capture of a decode step failed "
                               f"({self.graphs.failed}); decoding eagerly from now on "
                               f"(sampling.cuda_graphs: false skips the attempt).")
        contexts = {id(chunk): context for chunk, context in zip(self.chunks, self.contexts)}

        def step(mb, model):
            out = self.inputs.forward(model, mb, contexts[id(model)])
            return out, lambda logits: logits[:, -1, :vocab]  # [rows, 1 (or n), vocab]

        self.graphed = False
        micro = [self.inputs.batch(columns, self.length)]
        for context in self.contexts:
            ic.go_to(context, self.length)  # at 0 a kept context starts a new prefill
        decode = self.length > 0
        with ic.inference_mode(), reproducible_attention.unfused_attention(self.reproducible and decode):
            logits = self.strategy.forward_only(micro, step, self.chunks, (n, self.rows),
                                                (self.rows, vocab))
        self.length += n
        return logits

    def graph_routing(self):
        """After a step replayed from a graph while recording: each router's [rows, topk] choice
        (buffers the next step overwrites); else None (the routers' own records hold it)."""
        return self.graphs.routing if self.graphed and self.recording else None
