"""What a cached generation step (generation/kv_cache.py) feeds a vision-language chunk.

Prompts of different lengths go through the cache column by column (generation/batched.py), so a
step may hold, for some rows, image placeholders of a prompt still being read. The images are
encoded once, at the first step, and each step looks up the embedding of every placeholder it
holds:

    prompt 0   t t I I I t t | new new ...        columns [start, start + n) of all rows
    prompt 1   t I I t t t t t t I I t | new ...
    index 0   -1 -1 0 1 2 -1 -1 | -1 ...         row-major number of each image token among
    index 1   -1 3 4 -1 ...                      the encoder's output rows; -1 for text

The M-RoPE positions [3, rows, total] come with the prompts (objectives/vision_generation.py).
mcore's cached attention rotates the whole cache at every step, so each step gets the positions
from 0 to its end. A deepstack encoder's features (Qwen3-VL) are looked up the same way as the
embeddings and added by the hooks of model/vision.py.
"""

from __future__ import annotations

import torch

from lightning_mcore.model.vision import encode_images, unwrap


class VisionColumns:
    """Step inputs for prompts (token ids, patches [n, dim], grids [images, 3]) at M-RoPE
    `positions` [3, rows, total], generating up to `total` positions."""

    def __init__(self, prompts: list[tuple[list[int], torch.Tensor, torch.Tensor]], positions: torch.Tensor,
                 image_token_id: int) -> None:
        self.prompts, self.positions = prompts, positions
        total = positions.shape[-1]
        self.index = torch.full((len(prompts), total), -1, dtype=torch.long)
        count = 0
        for row, (ids, _, _) in enumerate(prompts):
            at = torch.tensor(ids) == image_token_id
            self.index[row, :len(ids)][at] = torch.arange(count, count + int(at.sum()))
            count += int(at.sum())
        self.images = None  # encoder output rows and deepstack features, at the first step

    def batch(self, columns: torch.Tensor, start: int) -> dict:
        if self.positions.device != columns.device:  # once: not a host copy per decode step
            self.positions = self.positions.to(columns.device)
        return {"tokens": columns, "start": start, "position_ids": self.positions[:, :, :start + columns.shape[1]]}

    def forward(self, model, mb: dict, context):
        kwargs = dict(input_ids=mb["tokens"], position_ids=mb["position_ids"], attention_mask=None,
                      inference_context=context, runtime_gather_output=True)
        gpt = unwrap(model)
        if not gpt.pre_process or getattr(gpt, "visual", None) is None:
            return model(**kwargs)
        embeddings = gpt.embedding(input_ids=mb["tokens"], position_ids=None)  # [n, rows, hidden]
        images, deep = self._encoded(gpt.visual)
        index = self.index[:, mb["start"]:mb["start"] + embeddings.shape[0]].t()
        features = []
        if (index >= 0).any():  # asked on the host: a decode step of text waits for nothing
            index = index.to(embeddings.device)
            here = index >= 0
            embeddings = embeddings.clone()
            embeddings[here] = images[index[here]].to(embeddings.dtype)
            for f in deep:
                feature = embeddings.new_zeros(embeddings.shape)
                feature[here] = f[index[here]].to(embeddings.dtype)
                features.append(feature)
        with gpt.deepstack.using(features):
            return model(**kwargs, decoder_input=embeddings)

    def _encoded(self, encoder):
        if self.images is None:
            with_images = [(pixels, grids) for _, pixels, grids in self.prompts if len(grids)]
            batch = {"pixel_values": [p for p, _ in with_images], "image_grid_thw": [g for _, g in with_images]}
            device = next(encoder.parameters()).device
            batch = {k: [t.to(device) for t in v] for k, v in batch.items()}
            images, deep = encode_images(encoder, batch) if with_images else (None, [])
            expected = int((self.index >= 0).sum())
            found = 0 if images is None else images.shape[0]
            if found != expected:
                raise ValueError(f"generate: the prompts hold {expected} image placeholder tokens but "
                                 f"their images give {found} embeddings (image_grid_thw and input_ids disagree).")
            self.images = (images, deep)
        return self.images
