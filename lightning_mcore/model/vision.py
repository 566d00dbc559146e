"""A vision-language microbatch through a GPTModel chunk: images become decoder inputs.

The first pipeline stage's chunk holds the vision encoder (`chunk.visual`, transformers' module,
replicated over tensor-parallel ranks). Its merged image embeddings replace the embeddings of
the image placeholder tokens, in the order the placeholders appear in the flattened rows; a
deepstack encoder (Qwen3-VL) also gives one feature per image token for each of the first
decoder layers, added to that layer's output at the image positions. Under sequence
parallelism both are cut like the token embeddings:

    tokens          t t I I I t t t | t I I t t t t t      (one THD row, I = image token)
    embeddings      e e v v v e e e | e v v e e e e e      v: encoder output, in order
    SP rank 0 / 1   [first half]      [second half]

Batches: `tokens`, `labels`, `segment_ids` [rows, seq]; `position_ids` [rows, 3, seq] (t, h, w
per sample); `pixel_values` [rows, patches, dim] and `image_grid_thw` [rows, images, 3], each
row's images in placeholder order, zero-padded.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state as ps, tensor_parallel
from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

from lightning_mcore.sequence.packing import packed_seq_params_for


def unwrap(chunk):
    """The GPTModel inside an mcore DDP wrapper (or the chunk itself)."""
    return getattr(chunk, "module", chunk)


def attach_vision_encoder(model, encoder: torch.nn.Module, deepstack_layers: int) -> None:
    """Give a first-stage chunk its vision encoder, and hooks on the first `deepstack_layers`
    decoder layers that add the deepstack features of the microbatch in flight."""
    model.visual = encoder
    model.deepstack = DeepstackInputs()
    layers = list(model.decoder.layers)
    if deepstack_layers > len(layers):
        raise ValueError(f"the vision encoder feeds the first {deepstack_layers} decoder layers, but "
                         f"the first pipeline stage holds {len(layers)}: give it more layers.")
    for i in range(deepstack_layers):
        layers[i].register_forward_hook(model.deepstack.hook(i))


class DeepstackInputs:
    """Features [seq(/tp), 1, hidden] to add to decoder layer i's output, for the microbatch whose
    forward is running (set by `forward_vision_language` around the chunk's forward, cleared
    after it). Full recompute would run the layers again without them: refused with deepstack
    (objectives/vision_language.py)."""

    def __init__(self) -> None:
        self.features: list[torch.Tensor] = []

    def hook(self, layer: int):
        def add(module, args, output):
            if not self.features:
                return output
            hidden, rest = (output[0], output[1:]) if isinstance(output, tuple) else (output, None)
            hidden = hidden + self.features[layer].to(hidden.dtype)
            return (hidden, *rest) if rest is not None else hidden

        return add

    @contextlib.contextmanager
    def using(self, features: list[torch.Tensor]):
        self.features = features
        try:
            yield
        finally:
            self.features = []


def images_of(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel patches [N, dim], grids [images, 3]) of a microbatch, rows in order, padding cut."""
    patches, grids = [], []
    for pixels, grid in zip(batch["pixel_values"], batch["image_grid_thw"]):
        grid = grid[grid.prod(-1) > 0]
        patches.append(pixels[: int(grid.prod(-1).sum())])
        grids.append(grid)
    return torch.cat(patches), torch.cat(grids)


def encode_images(encoder, batch: dict):
    """(merged image embeddings [image tokens, hidden], deepstack features) of a microbatch."""
    pixels, grids = images_of(batch)
    if grids.shape[0] == 0:
        return None, []
    dtype = next(encoder.parameters()).dtype
    out = encoder(pixels.to(dtype), grid_thw=grids)
    return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])


def image_positions(tokens: torch.Tensor, image_token_id: int, count: int) -> torch.Tensor:
    """[seq, 1] bool mask of the placeholders of one THD row [1, seq]; their number must be the
    encoder's output rows (a cut image, or a grid that disagrees with its placeholders, would
    silently shift every later image)."""
    mask = (tokens == image_token_id).transpose(0, 1)
    found = int(mask.sum())
    if found != count:
        raise ValueError(f"the microbatch has {found} image placeholder tokens (id {image_token_id}) but "
                         f"its images give {count} embeddings: the data's image tokens and "
                         f"image_grid_thw disagree (an image cut by seq_length?).")
    return mask


def scattered(values: torch.Tensor, mask: torch.Tensor, like: torch.Tensor, sequence_parallel: bool):
    """`values` [n, hidden] placed at the mask's positions of a [seq, 1, hidden] zero tensor,
    then cut to this rank's part of the sequence under sequence parallelism (the backward
    gathers, so the encoder gets the whole gradient on every rank)."""
    full = like.new_zeros(mask.shape[0], 1, values.shape[-1]).masked_scatter(
        mask[..., None], values.to(like.dtype))
    if not sequence_parallel:
        return full

    return scatter_to_sequence_parallel_region(full)


def local_mask(mask: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    if not sequence_parallel:
        return mask

    size, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    part = mask.shape[0] // size
    return mask[rank * part:(rank + 1) * part]


def forward_vision_language(chunk, batch: dict, image_token_id: int, losses: bool = True):
    """One packed microbatch through a chunk (first stage: images into the embeddings):
    per-token losses (or, without `losses`, vocab-parallel logits) on the last stage, hidden
    states elsewhere."""
    model = unwrap(chunk)
    tokens = batch["tokens"].reshape(1, -1)
    positions = batch["position_ids"].transpose(0, 1).reshape(3, 1, -1)  # [3, 1, rows * seq]
    kwargs = dict(input_ids=tokens, position_ids=positions, attention_mask=None,
                  labels=batch["labels"].reshape(1, -1) if losses else None,
                  packed_seq_params=packed_seq_params_for(batch))
    visual = getattr(model, "visual", None)
    if not model.pre_process or visual is None:
        return chunk(**kwargs)
    sp = model.config.sequence_parallel
    embeddings = model.embedding(input_ids=tokens, position_ids=None)  # [seq(/tp), 1, hidden]
    images, deep = encode_images(visual, batch)
    features = []
    if images is not None:
        mask = image_positions(tokens, image_token_id, images.shape[0])
        here = local_mask(mask, sp)[..., None]
        embeddings = torch.where(here, scattered(images, mask, embeddings, sp), embeddings)
        features = [scattered(f, mask, embeddings, sp) for f in deep]
    with model.deepstack.using(features):
        return chunk(**kwargs, decoder_input=embeddings)


@torch.no_grad()
def forward_logits(strategy, chunks, batch: dict, cfg) -> torch.Tensor:
    """Full-vocabulary logits [rows, seq, vocab] of a vision-language batch (each row one
    microbatch, its samples apart by segment_ids), on every rank (collective)."""
    strategy.refuse_context_parallel("vision-language logits")
    batch = {k: v.to(strategy.root_device) for k, v in batch.items()}
    rows, seq = batch["tokens"].shape
    tp = strategy.parallel.tensor_model_parallel_size
    if strategy.parallel.sequence_parallel and seq % tp:
        raise ValueError(f"rows of {seq} tokens cannot be split over {tp} sequence-parallel ranks; "
                         f"use a seq_length that is a multiple of {tp}.")
    micro = [{k: v[i:i + 1] for k, v in batch.items()} for i in range(rows)]
    vocab = cfg.vocab_size

    def step(mb, model):
        out = forward_vision_language(model, mb, cfg.vision.image_token_id, losses=False)
        return out, lambda logits: tensor_parallel.gather_from_tensor_model_parallel_region(logits)[..., :vocab]

    return strategy.forward_only(micro, step, list(chunks), (seq, 1), (rows, seq, vocab))


def freeze_parts(chunks, vit: bool, aligner: bool, llm: bool) -> None:
    """Stop training the vision encoder's blocks (`vit`), its merger(s) into the decoder's width
    (`aligner`) or the decoder (`llm`)."""
    for chunk in chunks:
        for name, param in unwrap(chunk).named_parameters():
            if not name.startswith("visual."):
                part = llm
            elif "merger" in name.split(".")[1]:  # merger, deepstack_merger_list
                part = aligner
            else:
                part = vit
            if part:
                param.requires_grad_(False)
