"""M-RoPE positions (temporal, height, width) of one sample's tokens, as the Qwen-VL models'
``get_rope_index`` computes them in transformers, for text and images (videos are refused).

Text tokens get t = h = w = the running position, which then advances by one. An image's
``t*h*w // merge**2`` tokens (row-major over the merged ``t x h/merge x w/merge`` grid) get
t = start + frame, h = start + row, w = start + column; the running position then advances by
``max(h, w) // merge``. ``start`` is the running position where the image begins.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


def mrope_positions(
    input_ids: Sequence[int],
    image_grid_thw: np.ndarray,
    image_token_id: int,
    merge_size: int,
    video_token_id: Optional[int] = None,
) -> np.ndarray:
    """``[3, len(input_ids)]`` int64 positions of one sample. ``image_grid_thw`` [images, 3]
    holds the grids of its images in order; each image's tokens must be consecutive."""
    ids = np.asarray(input_ids, dtype=np.int64)
    grids = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
    if video_token_id is not None and (ids == video_token_id).any():
        raise NotImplementedError(
            "video tokens found: M-RoPE positions of videos are not supported, only images"
        )
    out = np.empty((3, len(ids)), dtype=np.int64)
    image_at = np.flatnonzero(ids == image_token_id)
    pos = i = image = 0
    while i < len(ids):
        later = image_at[np.searchsorted(image_at, i) :]
        stop = int(later[0]) if len(later) else len(ids)
        if stop > i:  # text up to the next image token
            out[:, i:stop] = np.arange(pos, pos + stop - i)
            pos, i = pos + stop - i, stop
            continue
        if image == len(grids):
            raise ValueError(f"image tokens at position {i} but only {len(grids)} image grids")
        t, h, w = (int(x) for x in grids[image])
        if h % merge_size or w % merge_size:
            raise ValueError(f"image {image}: grid {t}x{h}x{w} is not divisible by {merge_size}")
        h, w = h // merge_size, w // merge_size
        n = t * h * w
        if len(ids) < i + n or not (ids[i : i + n] == image_token_id).all():
            raise ValueError(
                f"image {image} (grid {t}x{h * merge_size}x{w * merge_size}) needs {n} "
                f"consecutive image tokens from position {i}"
            )
        frame, row, col = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        out[:, i : i + n] = np.stack([frame, row, col]).reshape(3, -1) + pos
        pos, i, image = pos + max(h, w), i + n, image + 1
    if image != len(grids):
        raise ValueError(f"{len(grids)} image grids but image tokens for {image}")
    return out
