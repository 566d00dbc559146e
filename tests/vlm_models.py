"""Tiny random vision-language models built with transformers' own classes, and multimodal
batches for them (tests only)."""

from __future__ import annotations

from pathlib import Path

import torch

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=512)
TOKENS = dict(image_token_id=290, video_token_id=291, vision_start_token_id=292, vision_end_token_id=293)
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
              spatial_merge_size=2, temporal_patch_size=2)


def make_vlm(family: str, directory: Path, seed: int = 0, **rope):
    """A tiny `family` model ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe") saved to `directory`, in eval mode.
    `rope`: rope_parameters entries to set (None leaves one out), e.g. mrope_section=[1, 3, 3]."""
    import transformers

    def rope_parameters(**defaults) -> dict:
        given = dict(rope_type="default", rope_theta=10000.0, **defaults) | rope
        return {k: v for k, v in given.items() if v is not None}

    torch.manual_seed(seed)
    if family == "qwen2_5_vl":
        config = transformers.Qwen2_5_VLConfig(
            text_config=dict(TEXT, rope_parameters=rope_parameters(mrope_section=[2, 3, 3])),
            vision_config=dict(VISION, patch_size=14, window_size=56, fullatt_block_indexes=[1]),
            **TOKENS)
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    elif family == "qwen3_5":  # the hybrid decoder (linear attention on layer 0), RoPE on half of each head
        config = transformers.Qwen3_5Config(
            text_config=dict(TEXT, rope_parameters=rope_parameters(
                mrope_section=[2, 1, 1], mrope_interleaved=True, partial_rotary_factor=0.5),
                linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"]),
            vision_config=dict(VISION, patch_size=16, num_position_embeddings=64), **TOKENS)
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    elif family == "qwen3_5_moe":  # and 4 experts top-2 with a gated shared expert
        config = transformers.Qwen3_5MoeConfig(
            text_config=dict(TEXT, rope_parameters=rope_parameters(
                mrope_section=[2, 1, 1], mrope_interleaved=True, partial_rotary_factor=0.5),
                linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"],
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=48),
            vision_config=dict(VISION, patch_size=16, num_position_embeddings=64), **TOKENS)
        model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    else:
        config = transformers.Qwen3VLConfig(
            text_config=dict(TEXT, rope_parameters=rope_parameters(mrope_section=[2, 3, 3],
                                                                   mrope_interleaved=True)),
            vision_config=dict(VISION, patch_size=16, num_position_embeddings=64,
                               deepstack_visual_indexes=[0]),
            **TOKENS)
        model = transformers.Qwen3VLForConditionalGeneration(config)
    model.save_pretrained(directory)
    return model.eval()


def patch_dim(model) -> int:
    v = model.config.vision_config
    return v.in_channels * v.temporal_patch_size * v.patch_size ** 2


def sample(model, grids: list, length: int, gen: torch.Generator) -> dict:
    """One sample of exactly `length` tokens: random text around each image's
    <vision_start> <image_pad> x n <vision_end>, and the images' random patches."""
    c, merge = model.config, model.config.vision_config.spatial_merge_size
    parts = []
    for t, h, w in grids:
        parts.append([c.vision_start_token_id] + [c.image_token_id] * (t * h * w // merge ** 2)
                     + [c.vision_end_token_id])
    n_text = length - sum(len(p) for p in parts)
    assert n_text >= len(parts) + 1, "length too short for the images"
    text = torch.randint(0, 280, (n_text,), generator=gen).tolist()
    cut = n_text // (len(parts) + 1)
    ids = text[:cut]
    for i, p in enumerate(parts):
        ids += p + text[cut * (i + 1): cut * (i + 2)] if i < len(parts) - 1 else p + text[cut * (i + 1):]
    patches = sum(t * h * w for t, h, w in grids)
    return dict(ids=torch.tensor(ids), grids=torch.tensor(grids),
                pixels=torch.randn(patches, patch_dim(model), generator=gen))


def hf_logits(model, s: dict) -> torch.Tensor:
    """transformers' logits [seq, vocab] of one sample."""
    ids = s["ids"][None]
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=s["pixels"], image_grid_thw=s["grids"],
                     mm_token_type_ids=(ids == model.config.image_token_id).int()).logits[0].float()


def positions(model, s: dict) -> torch.Tensor:
    """[3, seq] M-RoPE positions of one sample, as transformers computes them."""
    ids = s["ids"][None]
    pos, _ = model.model.get_rope_index(ids, mm_token_type_ids=(ids == model.config.image_token_id).int(),
                                        image_grid_thw=s["grids"])
    return pos[:, 0]


def batch(model, rows: list[list[dict]]) -> dict:
    """Our batch: each row the listed samples packed one after another (segment ids 1, 2, ...),
    all rows the same length; images zero-padded per row."""
    toks, segs, pos, pix, grid = [], [], [], [], []
    for samples in rows:
        toks.append(torch.cat([s["ids"] for s in samples]))
        segs.append(torch.cat([torch.full_like(s["ids"], i + 1) for i, s in enumerate(samples)]))
        pos.append(torch.cat([positions(model, s) for s in samples], dim=1))
        pix.append(torch.cat([s["pixels"] for s in samples]))
        grid.append(torch.cat([s["grids"] for s in samples]))
    longest_p, longest_i = max(p.shape[0] for p in pix), max(g.shape[0] for g in grid)
    pix = [torch.cat([p, p.new_zeros(longest_p - p.shape[0], p.shape[1])]) for p in pix]
    grid = [torch.cat([g, g.new_zeros(longest_i - g.shape[0], 3)]) for g in grid]
    tokens = torch.stack(toks)
    return dict(tokens=tokens, labels=torch.zeros_like(tokens), loss_mask=torch.ones(tokens.shape),
                segment_ids=torch.stack(segs), position_ids=torch.stack(pos),
                pixel_values=torch.stack(pix), image_grid_thw=torch.stack(grid))
