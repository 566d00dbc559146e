"""Text from a vision-language model: prompts with their images, greedy or sampled.

A prompt is what the model's processor gives for one sample: `input_ids` (image placeholders
included), `pixel_values` [patches, dim] and `image_grid_thw` [images, 3]. Generation runs through
the KV cache as a language model's does (generation/batched.py), the images encoded once and their
embeddings looked up where a step reaches a placeholder (generation/vision_columns.py). The M-RoPE
positions of prompt and completion are transformers' (data/mrope_positions.py).
"""

from __future__ import annotations

import torch

from lightning_mcore.data.mrope_positions import mrope_positions
from lightning_mcore.generation.batched import SamplingSettings, generate_columns, refuse_too_long
from lightning_mcore.generation.vision_columns import VisionColumns


def prompt_parts(prompt: dict, index: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(token ids, patches [n, dim], grids [images, 3]) of one prompt, checked."""
    missing = {"input_ids", "pixel_values", "image_grid_thw"} - set(prompt)
    if missing:
        raise ValueError(f"prompt {index}: needs {sorted(missing)} (the processor's output for one sample).")
    ids = torch.as_tensor(prompt["input_ids"]).reshape(-1).tolist()
    grids = torch.as_tensor(prompt["image_grid_thw"]).reshape(-1, 3).long()
    pixels = torch.as_tensor(prompt["pixel_values"]).float()
    pixels = pixels.reshape(-1, pixels.shape[-1]) if pixels.numel() else pixels.reshape(0, 1)
    patches = int(grids.prod(-1).sum())
    if pixels.shape[0] != patches:
        raise ValueError(f"prompt {index}: {pixels.shape[0]} patches for image grids {grids.tolist()} "
                         f"({patches} patches).")
    return ids, pixels, grids


def continued_positions(ids: list[int], grids: torch.Tensor, total: int, image_token_id: int,
                        merge_size: int) -> torch.Tensor:
    """[3, total]: the prompt's M-RoPE positions, then text positions counting on from one past
    its largest (transformers' `rope_deltas`)."""
    prompt = torch.from_numpy(mrope_positions(ids, grids.numpy(), image_token_id, merge_size))
    after = torch.arange(total - len(ids)) + int(prompt.max()) + 1  # prompts are never empty
    return torch.cat([prompt, after.expand(3, -1)], dim=1)


@torch.no_grad()
def generate_vision_language(strategy, chunks, cfg, prompts: list[dict],
                             sampling: SamplingSettings) -> list[list[int]]:
    """The completion (new tokens only) of each prompt; collective, every rank gets the same."""
    parts = [prompt_parts(p, i) for i, p in enumerate(prompts)]
    sequences = [ids for ids, _, _ in parts]
    refuse_too_long(sequences, sampling.max_new_tokens, cfg.seq_length)
    if not prompts or sampling.max_new_tokens == 0:
        return [[] for _ in prompts]
    strategy.refuse_context_parallel("generate")
    strategy.sync_weights()
    total = max(len(s) + sampling.max_new_tokens for s in sequences)
    merge, image = int(cfg.vision.hf.get("spatial_merge_size", 2)), cfg.vision.image_token_id
    positions = torch.stack([continued_positions(ids, grids, total, image, merge) for ids, _, grids in parts], dim=1)
    inputs = VisionColumns(parts, positions, image)
    # one stream of numbers per row: a row draws alike whatever else is in the batch
    return generate_columns(strategy, chunks, sequences, cfg, sampling, [1] * len(prompts), inputs).completions
