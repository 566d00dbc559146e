"""Text from a vision-language model: prompts with their images, greedy or sampled.

A prompt is what the model's processor gives for one sample: `input_ids` (image placeholders
included), `pixel_values` [patches, dim] and `image_grid_thw` [images, 3]. Each new token runs the
whole rows again through the model (model/vision.py: images encoded again, no KV cache): exact
and simple, for looking at a fine-tuned model on a few samples; long or many completions are
faster through transformers on the export. The M-RoPE positions of prompt and completion are
transformers' (data/mrope_positions.py: text after an image continues from the running position).

    row i   [prompt i | completion so far | pad ...]    one packed row per prompt, the rows one
    seg     [1 1 ...  1 1 1 ...            | 0 ...  ]    length (a multiple of the TP size)
"""

from __future__ import annotations

import torch

from lightning_mcore.data.multimodal import collate_rows
from lightning_mcore.data.mrope_positions import mrope_positions
from lightning_mcore.data.packing import build_row
from lightning_mcore.model import vision
from lightning_mcore.model.generation import SamplingSettings, choose_tokens, refuse_too_long, uniform_for


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


def rows_batch(sequences: list[list[int]], images: list[tuple[torch.Tensor, torch.Tensor]],
               length: int, image_token_id: int, merge_size: int) -> dict:
    """One row per sequence, padded to `length`, with its M-RoPE positions and images: a row as
    the training data builds it (build_row), stacked by the data module's collate_rows."""
    dim = max(p.shape[1] for p, _ in images)  # a prompt without images gives no patch width
    rows = []
    for ids, (pixels, grids) in zip(sequences, images):
        positions = torch.zeros(3, length, dtype=torch.int64)
        positions[:, :len(ids)] = torch.from_numpy(mrope_positions(ids, grids.numpy(), image_token_id, merge_size))
        rows.append({**build_row([(ids, [0] * len(ids))], length, pad_id=0), "position_ids": positions,
                     "pixel_values": pixels if len(pixels) else pixels.new_zeros(0, dim),
                     "image_grid_thw": grids})
    return collate_rows(rows)


@torch.no_grad()
def generate_vision_language(strategy, chunks, cfg, prompts: list[dict],
                             sampling: SamplingSettings) -> list[list[int]]:
    """The completion (new tokens only) of each prompt; collective, every rank gets the same."""
    parts = [prompt_parts(p, i) for i, p in enumerate(prompts)]
    sequences = [ids for ids, _, _ in parts]
    refuse_too_long(sequences, sampling.max_new_tokens, cfg.seq_length)
    if not prompts or sampling.max_new_tokens == 0:
        return [[] for _ in prompts]
    tp = strategy.parallel.tensor_model_parallel_size
    length = -(-max(len(s) + sampling.max_new_tokens for s in sequences) // tp) * tp
    merge = int(cfg.vision.hf.get("spatial_merge_size", 2))
    images = [(pixels, grids) for _, pixels, grids in parts]
    completions: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    stop = set(sampling.stop)
    while not all(done):
        batch = rows_batch(sequences, images, length, cfg.vision.image_token_id, merge)
        logits = vision.forward_logits(strategy, chunks, batch, cfg)
        last = logits[torch.arange(len(sequences)), [len(s) - 1 for s in sequences]]
        uniform = torch.cat([uniform_for(sampling.seed, len(s)) for s in sequences])
        for i, token in enumerate(choose_tokens(last, sampling, uniform).tolist()):
            if done[i]:
                continue
            sequences[i].append(token)
            completions[i].append(token)
            done[i] = token in stop or len(completions[i]) == sampling.max_new_tokens
    return completions
