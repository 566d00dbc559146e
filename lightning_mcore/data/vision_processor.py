"""A vision-language model's processor: images to patches and grids, one image placeholder token
to as many copies as the image has merged tokens.

Why not always ``AutoProcessor``: the Qwen-VL style processors (Qwen2.5-VL, Qwen3-VL) load a
video processor that needs torchvision, so ``AutoProcessor.from_pretrained`` raises ImportError
where torchvision is not installed, though images need none of it. ``load_vision_processor``
then pairs ``AutoImageProcessor`` (its PIL backend) with ``AutoTokenizer`` and expands the
placeholders by the same rule as those processors' ``replace_image_token``: each image token
becomes ``grid_t * grid_h * grid_w // merge_size**2`` copies, the i-th for the i-th image. The
token ids come from the model's config.json (``image_token_id``, ``video_token_id``,
``vision_start_token_id``, ``vision_end_token_id``), so nothing here depends on the family.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer
from transformers.image_utils import SizeDict

from lightning_mcore.data.preprocess import tokenizer_dir
from lightning_mcore.hf.config import read_config_json

TOKEN_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


@dataclass
class VisionProcessor:
    """What the multimodal data needs of a model's processor. ``processor`` is the transformers
    processor when it loaded (then ``__call__`` is its own), else None."""

    tokenizer: Any
    image_processor: Any
    token_ids: dict[str, int]
    chat_template: Optional[str] = None
    processor: Any = None

    @property
    def image_token_id(self) -> int:
        return self.token_ids["image_token_id"]

    @property
    def video_token_id(self) -> Optional[int]:
        return self.token_ids.get("video_token_id")

    @property
    def merge_size(self) -> int:
        return int(self.image_processor.merge_size)

    @property
    def patch_dim(self) -> int:
        """Values per patch: channels * temporal_patch_size * patch_size**2."""
        ip = self.image_processor
        return 3 * int(ip.temporal_patch_size) * int(ip.patch_size) ** 2

    @property
    def pixels_per_token(self) -> int:
        """Image pixels behind one merged token: (patch_size * merge_size)**2."""
        return (int(self.image_processor.patch_size) * self.merge_size) ** 2

    def set_max_image_tokens(self, tokens: int) -> None:
        """Resize images down to at most ``tokens`` merged tokens (the processor's max_pixels),
        lowering min_pixels to match where it was above."""
        size = self.image_processor.size
        most = tokens * self.pixels_per_token
        least = min(getattr(size, "shortest_edge", None) or most, most)
        self.image_processor.size = SizeDict(shortest_edge=least, longest_edge=most)

    def images(self, images: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
        """(pixel_values [patches, patch_dim] float32, image_grid_thw [images, 3] int64)."""
        if not images:
            return np.zeros((0, self.patch_dim), np.float32), np.zeros((0, 3), np.int64)
        out = self.image_processor(list(images), return_tensors="np")
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        return pixels, np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(-1, 3)

    def tokens_per_image(self, grids: np.ndarray) -> list[int]:
        return [int(np.prod(g)) // self.merge_size**2 for g in grids]

    def expand(self, ids: Sequence[int], grids: np.ndarray,
               mask: Optional[Sequence[int]] = None) -> tuple[list[int], list[int]]:
        """(``ids`` with the i-th image token repeated for the i-th image's merged tokens, the
        per-token ``mask`` expanded alike: 0 on image tokens, which never carry loss)."""
        counts, out, flags, image = self.tokens_per_image(grids), [], [], 0
        for k, token in enumerate(ids):
            if token == self.image_token_id:
                if image == len(counts):
                    raise ValueError(f"more image tokens than the {len(counts)} images")
                out.extend([token] * counts[image])
                flags.extend([0] * counts[image])
                image += 1
            else:
                out.append(token)
                flags.append(0 if mask is None else mask[k])
        if image != len(counts):
            raise ValueError(f"{image} image tokens for {len(counts)} images")
        return out, flags

    def __call__(self, text: str, images: Sequence[Any]) -> dict[str, np.ndarray]:
        """``input_ids`` [1, L], ``pixel_values``, ``image_grid_thw`` of one text (placeholders
        not yet expanded) and its images: the transformers processor's own output when it
        loaded, else the same computed here."""
        if self.processor is not None:
            out = self.processor(text=[text], images=list(images) or None, return_tensors="np")
            return {k: np.asarray(out[k]) for k in ("input_ids", "pixel_values", "image_grid_thw")}
        pixels, grids = self.images(images)
        ids = self.tokenizer([text], add_special_tokens=True)["input_ids"][0]
        expanded = np.asarray([self.expand(ids, grids)[0]], dtype=np.int64)
        return {"input_ids": expanded, "pixel_values": pixels, "image_grid_thw": grids}


def load_vision_processor(path: str) -> VisionProcessor:
    """The model directory's processor: ``AutoProcessor`` where it loads, else its image
    processor and tokenizer (see the module's docstring)."""
    path = tokenizer_dir(path)
    token_ids = _token_ids(path)
    try:
        processor = AutoProcessor.from_pretrained(path)
    except ImportError:  # torchvision missing: the video processor cannot load
        processor = None
    if processor is not None and hasattr(processor, "image_processor"):
        tokenizer, image_processor = processor.tokenizer, processor.image_processor
    else:
        processor = None
        tokenizer, image_processor = AutoTokenizer.from_pretrained(path), None
    if image_processor is None:
        try:
            image_processor = AutoImageProcessor.from_pretrained(path)
        except (OSError, ValueError) as err:
            raise ValueError(f"{path!r} has no image processor config it can load: {err}") from None
    for name in ("patch_size", "merge_size", "temporal_patch_size"):
        if not isinstance(getattr(image_processor, name, None), int):
            raise ValueError(
                f"{path!r}: the image processor {type(image_processor).__name__} has no integer "
                f"{name}: only patch-grid image processors (Qwen-VL style) are supported"
            )
    template = getattr(processor, "chat_template", None) or None
    return VisionProcessor(tokenizer, image_processor, token_ids, template, processor)


def _token_ids(path: str) -> dict[str, int]:
    """The vision token ids of config.json (top level), refusing a config without them."""
    config = read_config_json(path)
    ids = {name: config[name] for name in TOKEN_FIELDS if isinstance(config.get(name), int)}
    if "image_token_id" not in ids:
        raise ValueError(
            f"{os.path.join(path, 'config.json')!r} has no image_token_id: the directory must hold a "
            "vision-language model's config (with image_token_id, vision_start_token_id, ...)"
        )
    return ids
