"""LightningDataModule for vision-language fine-tuning on chats with images (Qwen-VL style
processors: patch grids, one placeholder token per merged patch).

A record is ``{"messages": [...]}`` whose turns' ``content`` is a string or a list of parts
``{"type": "image", "image": "red.png"}`` / ``{"type": "text", "text": "..."}``; relative image
paths are read from the data file's directory (or ``ImageOptions.image_dir``). Each sample is
rendered with the chat template, tokenized with the assistant-only mask of ``chat``, its images
turned into patches, and each image placeholder expanded to the image's tokens, in a cached
``datasets.map``. Rows are built as SFT's (``packing``), never cutting inside an image.

A batch is a dict (``tokens`` first) of:

* ``tokens``, ``labels``, ``loss_mask``, ``segment_ids``: ``[B, S]`` as ``SFTDataModule``'s;
* ``position_ids``: ``[B, 3, S]`` int64 M-RoPE (t, h, w) positions, each sample's restarting
  at 0 (see ``mrope_positions``), 0 on padding;
* ``pixel_values``: ``[B, P, D]`` float32, each row's image patches in the order of its image
  tokens, zero-padded to the batch's largest row;
* ``image_grid_thw``: ``[B, I, 3]`` int64, the row's image grids in the same order, zero rows
  padding; a row's patches are the first ``sum(t*h*w)`` of ``pixel_values``.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Optional, Union

import numpy as np
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from PIL import Image
from torch.utils.data import Dataset

from lightning_mcore.data import peek
from lightning_mcore.data.chat import ChatFormat, drop_reason, resolve_template
from lightning_mcore.data.chat import tokenize_conversation
from lightning_mcore.data.feeding import DataParallelDataModule
from lightning_mcore.data.mrope_positions import mrope_positions
from lightning_mcore.data.packing import TRUNCATION, build_row, efficiency, fit_samples, pack
from lightning_mcore.data.chat_module import (
    check_options,
    conversation_files,
    load_records,
    map_cached,
    split_samples,
)
from lightning_mcore.data.vision_processor import VisionProcessor, load_vision_processor

log = logging.getLogger(__name__)

BAD_SAMPLES = ("refuse", "drop")
PART_TYPES = ("text", "image", "video")


@dataclass(frozen=True)
class ImageOptions:
    """How images are read and sized.

    Args:
        max_image_tokens: at most this many merged tokens per image (the processor's
            ``max_pixels``, like ms-swift's ``IMAGE_MAX_TOKEN_NUM``): larger images are resized
            down, as the processor does; None keeps the processor's own limit.
        max_pixels: refuse (or drop, see ``bad_samples``) an image whose file has more than
            this many pixels (width * height) before any resizing; None: no limit.
        bad_samples: ``"refuse"`` (raise, naming the sample and file) or ``"drop"`` (count it
            in ``stats["dropped"]`` and list it in ``stats["bad_samples"]``) for a missing,
            unreadable or too large image, a remote image, or image tokens that do not match
            the images.
        image_dir: directory of relative image paths (None: each data file's directory).

    A sample whose image would not fit in ``seq_length`` (or be cut by truncation) is always
    dropped and counted: a row never holds part of an image.
    """

    max_image_tokens: Optional[int] = None
    max_pixels: Optional[int] = None
    bad_samples: str = "refuse"
    image_dir: Optional[str] = None

    def __post_init__(self) -> None:
        if self.bad_samples not in BAD_SAMPLES:
            raise ValueError(f"bad_samples must be one of {BAD_SAMPLES}, got {self.bad_samples!r}")
        for name in ("max_image_tokens", "max_pixels"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")


class BadSample(ValueError):
    """A sample that cannot be used: ``reason`` (counted in stats), ``message`` (names it)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class VisionLanguageRows(Dataset):
    """Rows of ``seq_length`` tokens with their images, each built from the samples listed."""

    COLUMNS = ["input_ids", "assistant_mask", "pixel_values", "image_grid_thw"]

    def __init__(self, processed: Any, rows: list[list[int]], seq_length: int, pad_id: int,
                 processor: VisionProcessor):
        self.processed = processed.select_columns(self.COLUMNS).with_format("numpy")
        self.rows, self.seq_length, self.pad_id = rows, seq_length, pad_id
        self.image_token_id, self.merge_size = processor.image_token_id, processor.merge_size
        self.patch_dim = processor.patch_dim

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        got, cut = self.processed[self.rows[index]], self.seq_length
        ids = [i[:cut] for i in got["input_ids"]]
        row = build_row(
            [(i, m[:cut]) for i, m in zip(ids, got["assistant_mask"])], cut, self.pad_id
        )
        grids = [_grid(g) for g in got["image_grid_thw"]]
        positions, start = torch.zeros((3, cut), dtype=torch.int64), 0
        for sample_ids, sample_grids in zip(ids, grids):
            found = mrope_positions(sample_ids, sample_grids, self.image_token_id, self.merge_size)
            positions[:, start : start + len(sample_ids)] = torch.from_numpy(found)
            start += len(sample_ids)
        grid = np.concatenate(grids) if grids else np.zeros((0, 3), np.int64)
        pixels = np.concatenate([np.asarray(p, dtype=np.float32) for p in got["pixel_values"]])
        pixels = pixels.reshape(-1, self.patch_dim)
        image_tokens = int((row["tokens"] == self.image_token_id).sum())
        expected = int(grid.prod(axis=1).sum()) // self.merge_size**2
        if image_tokens != expected or len(pixels) != int(grid.prod(axis=1).sum()):
            raise ValueError(
                f"row {index}: {image_tokens} image tokens and {len(pixels)} patches for grids "
                f"{grid.tolist()} ({expected} tokens): the processed data is inconsistent"
            )
        return {
            "tokens": row["tokens"],
            "labels": row["labels"],
            "loss_mask": row["loss_mask"],
            "segment_ids": row["segment_ids"],
            "position_ids": positions,
            "pixel_values": torch.from_numpy(pixels),
            "image_grid_thw": torch.from_numpy(grid),
        }


def _grid(grids: Any) -> np.ndarray:
    """A sample's grids as [images, 3] (the numpy format nests ragged lists in object arrays)."""
    return np.asarray([np.asarray(g) for g in grids], dtype=np.int64).reshape(-1, 3)


def collate_rows(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack rows; ``pixel_values`` and ``image_grid_thw`` zero-padded to the largest row."""
    batch = {}
    for key in rows[0]:
        parts = [row[key] for row in rows]
        if key in ("pixel_values", "image_grid_thw"):
            longest = max(len(p) for p in parts)
            padded = parts[0].new_zeros((len(parts), longest, parts[0].shape[1]))
            for k, part in enumerate(parts):
                padded[k, : len(part)] = part
            batch[key] = padded
        else:
            batch[key] = torch.stack(parts)
    return batch


class VisionLanguageDataModule(DataParallelDataModule):
    """Vision-language chat fine-tuning data from jsonl/json/parquet files or ``save_to_disk``
    directories (see the module's docstring for records and batches).

    Args:
        paths: files or globs (``.jsonl``/``.json``, ``.parquet``) or saved dataset directories.
        tokenizer: the model's directory: its processor (image processor, tokenizer, chat
            template) and config.json (the vision token ids).
        seq_length: tokens per row ``S``, image tokens included.
        columns: our field names to the dataset's, e.g. ``{"messages": "conversations",
            "role": "from", "content": "value"}``.
        roles: the dataset's role names to ours, e.g. ``{"human": "user", "gpt": "assistant"}``.
        chat_template: None (the processor's or tokenizer's) or a Jinja template string.
        images: ``ImageOptions`` (or a dict of them): pixel budget, bad samples, image directory.
        truncation: samples longer than ``S`` are ``"drop"``-ped or ``"truncate"``-d to the
            first ``S`` tokens, the latter only where every image token stays.
        packing: several samples per row (best-fit decreasing) instead of one.
        val_split, seed, shuffle, num_workers, num_proc, cache_dir: as ``SFTDataModule``'s.

    After ``setup``, ``stats`` holds the counts dropped by reason, truncated, the messages of
    bad samples dropped (``bad_samples``), and per split samples, rows, tokens, images and
    packing efficiency. The cache is keyed by the records and the processor, not the image
    files: use a new ``cache_dir`` after changing images in place.
    """

    collate_fn = staticmethod(collate_rows)

    def __init__(
        self,
        paths: Union[str, list[str]],
        tokenizer: str,
        seq_length: int,
        columns: Optional[dict[str, str]] = None,
        roles: Optional[dict[str, str]] = None,
        chat_template: Optional[str] = None,
        images: Union[ImageOptions, dict, None] = None,
        truncation: str = "drop",
        packing: bool = True,
        val_split: float = 0.0,
        seed: int = 1234,
        shuffle: bool = True,
        num_workers: int = 0,
        num_proc: Optional[int] = None,
        cache_dir: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.paths = [paths] if isinstance(paths, str) else list(paths)
        check_options(self.paths, seq_length, val_split, tokenizer)
        if truncation not in TRUNCATION:
            raise ValueError(f"truncation must be one of {TRUNCATION}")
        self.image_options = images if isinstance(images, ImageOptions) else ImageOptions(
            **(images or {})
        )
        self.save_hyperparameters(ignore=["images"])
        self.stats: dict[str, Any] = {}
        self._processor: Optional[VisionProcessor] = None
        self.template = self._template(chat_template)
        peek.check_records(self.paths, lambda names: _reader(names, columns, roles))

    @property
    def processor(self) -> VisionProcessor:
        """The model directory's processor, with ``max_image_tokens`` applied."""
        if self._processor is None:
            processor = load_vision_processor(self.hparams.tokenizer)
            if self.image_options.max_image_tokens is not None:
                processor.set_max_image_tokens(self.image_options.max_image_tokens)
            self._processor, self._tokenizer = processor, processor.tokenizer
        return self._processor

    def _template(self, chat_template: Optional[str]) -> str:
        try:
            return resolve_template(self.processor.tokenizer,
                                    chat_template or self.processor.chat_template)
        except ValueError as err:
            raise ValueError(f"model directory {self.hparams.tokenizer!r}: {err}") from None

    def prepare_data(self) -> None:
        """Process once per node (Lightning runs this on local rank 0); setup() hits the cache."""
        self._process()

    def _process(self) -> Any:
        # lazy: datasets' import takes ~0.4 s, which `import lightning_mcore` and `--help` skip
        import datasets

        hp, parts = self.hparams, []
        for path in self.paths:
            expanded = os.path.expanduser(path)
            files = [path] if os.path.isdir(expanded) else conversation_files(path)
            for file in files:
                records = load_records([file], hp.cache_dir)
                chat = ChatFormat.detect(records.column_names, "messages", hp.columns, hp.roles)
                records = records.select_columns(chat.record_columns)
                base = self.image_options.image_dir or (
                    expanded if os.path.isdir(expanded) else os.path.dirname(file)
                )
                parts.append(process_records(records, self.processor, chat, self.template,
                                             file, os.path.abspath(os.path.expanduser(base)),
                                             self.image_options, hp.num_proc, hp.cache_dir))
        return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_dataset is not None:
            return
        hp, processed = self.hparams, self._process()
        numbers = processed.select_columns(
            ["length", "first_loss", "image_end", "largest_image"]
        ).with_format("numpy")[:]
        lengths, first = numbers["length"], numbers["first_loss"]
        columns = processed.select_columns(["dropped", "problem"])
        dropped = Counter(r for r in columns["dropped"] if r)
        bad = [p for p in columns["problem"] if p]
        usable = np.flatnonzero(lengths > 0)
        huge = numbers["largest_image"][usable] > hp.seq_length
        dropped[f"an image longer than seq_length={hp.seq_length}"] += int(huge.sum())
        usable = usable[~huge]
        keep, fitted, lost, truncated = fit_samples(
            lengths[usable], first[usable], hp.seq_length, hp.truncation
        )
        dropped.update(lost)
        cut = fitted < numbers["image_end"][usable[keep]]
        dropped[f"image tokens cut by seq_length={hp.seq_length}"] += int(cut.sum())
        truncated -= int(cut.sum())
        keep, fitted = keep[~cut], fitted[~cut]
        self.stats = {"samples": len(processed), "dropped": dict(+dropped),
                      "truncated": truncated, "bad_samples": bad}
        if len(keep) == 0:
            raise ValueError(f"no sample left to train on of {len(processed)}: {dict(+dropped)}")
        kept_lengths = dict(zip(usable[keep].tolist(), fitted.tolist()))
        train, val = split_samples(usable[keep].tolist(), hp.val_split, hp.seed)
        images = processed.select_columns(["image_grid_thw"])["image_grid_thw"]
        self.train_dataset = self._rows("train", processed, train, kept_lengths, images)
        self.val_dataset = (
            self._rows("val", processed, val, kept_lengths, images) if val else None
        )
        _log_stats(self.stats)

    def _rows(self, split: str, processed: Any, samples: list[int], lengths: dict,
              images: list) -> VisionLanguageRows:
        S, sizes = self.hparams.seq_length, [lengths[i] for i in samples]
        rows = pack(sizes, S) if self.hparams.packing else [[i] for i in range(len(sizes))]
        self.stats[split] = {
            "samples": len(samples),
            "rows": len(rows),
            "tokens": sum(sizes),
            "images": sum(len(images[i]) for i in samples),
            "packing_efficiency": efficiency(sizes, rows, S),
        }
        rows = [[samples[i] for i in row] for row in rows]
        return VisionLanguageRows(processed, rows, S, self.pad_token_id, self.processor)


def _reader(names: list[str], columns: Optional[dict], roles: Optional[dict]):
    chat = ChatFormat.detect(names, "messages", columns, roles)
    return lambda record, index: read_messages(chat, record, f"sample {index}")


def read_messages(chat: ChatFormat, record: dict, where: str) -> tuple[list[dict], list[str]]:
    """(turns ``[{"role", "content"}]`` with our role names and content a string or a list of
    text/image parts, the image references in order of appearance)."""
    messages = record.get(chat.names["messages"])
    if not isinstance(messages, list):
        raise ValueError(f"{where}: field {chat.names['messages']!r} must be a list of turns")
    contents, images, views = [], [], []
    for number, message in enumerate(messages):
        content = message.get(chat.names["content"]) if isinstance(message, dict) else None
        if isinstance(content, list):  # Arrow gives every part every key: drop the nulls
            content = [_no_nulls(part) for part in content]
            images += _check_parts(content, f"{where}, message {number}")
            message = {**message, chat.names["content"]: _text(content)}
        contents.append(content)
        views.append(message)
    turns = chat.read_messages(views, where)
    return [{"role": t["role"], "content": c} for t, c in zip(turns, contents)], images


def _no_nulls(part: Any) -> Any:
    return {k: v for k, v in part.items() if v is not None} if isinstance(part, dict) else part


def _check_parts(parts: list, at: str) -> list[str]:
    images = []
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in PART_TYPES:
            raise ValueError(
                f"{at}, part {k}: expected a dict with 'type' one of {PART_TYPES}, got {part!r}"
            )
        if kind == "video":
            raise NotImplementedError(f"{at}, part {k}: videos are not supported, only images")
        if not isinstance(part.get(kind), str):
            raise ValueError(f"{at}, part {k}: a {kind!r} part needs a string {kind!r} field")
        if kind == "image":
            images.append(part["image"])
    return images


def process_records(records: Any, processor: VisionProcessor, chat: ChatFormat, template: str,
                    file: str, image_dir: str, options: ImageOptions,
                    num_proc: Optional[int] = None, cache_dir: Optional[str] = None) -> Any:
    """``datasets.map`` the records of one data file to ``input_ids`` (image tokens expanded),
    ``assistant_mask``, ``length``, ``first_loss``, ``dropped`` (the reason, or ""),
    ``problem`` (a bad sample's message), ``pixel_values`` (flat), ``image_grid_thw``,
    ``image_end`` (tokens up to the last image token) and ``largest_image`` (its tokens).
    Cached, see ``chat_module.map_cached``."""
    import datasets  # lazy: datasets' import takes ~0.4 s, which `import lightning_mcore` and `--help` skip

    ints, ids = datasets.Value("int32"), datasets.Sequence(datasets.Value("int32"))
    features = dict(input_ids=ids, assistant_mask=datasets.Sequence(datasets.Value("int8")),
                    length=ints, first_loss=ints, dropped=datasets.Value("string"),
                    problem=datasets.Value("string"),
                    pixel_values=datasets.Sequence(datasets.Value("float32")),
                    image_grid_thw=datasets.Sequence(ids), image_end=ints, largest_image=ints)
    image_processor = processor.image_processor.to_dict()
    how = ("vlm-v1", sorted(chat.names.items()), sorted(chat.roles.items()), file, image_dir,
           asdict(options), sorted(image_processor.items(), key=str), processor.token_ids)
    return map_cached(
        records, _process_batch, features, key=("vlm", processor.tokenizer, template, how),
        fn_kwargs=dict(processor=processor, chat=chat, template=template, file=file,
                       image_dir=image_dir, options=options),
        num_proc=num_proc, cache_dir=cache_dir, desc="Processing image chats",
    )


def _process_batch(batch: dict, indices: list, processor: VisionProcessor, chat: ChatFormat,
                   template: str, file: str, image_dir: str, options: ImageOptions) -> dict:
    out: dict[str, list] = {}
    for row, index in enumerate(indices):
        record = {column: values[row] for column, values in batch.items()}
        try:
            sample = process_sample(record, index, file, processor, chat, template, image_dir,
                                    options)
        except BadSample as bad:
            if options.bad_samples == "refuse":
                raise ValueError(
                    f"{bad}; fix the sample or pass images={{'bad_samples': 'drop'}} to skip "
                    "such samples"
                ) from None
            sample = _empty(bad.reason, str(bad))
        for key, value in sample.items():
            out.setdefault(key, []).append(value)
    return out


def _empty(reason: str, problem: str = "") -> dict:
    return dict(input_ids=[], assistant_mask=[], length=0, first_loss=0, dropped=reason,
                problem=problem, pixel_values=np.zeros(0, np.float32), image_grid_thw=[],
                image_end=0, largest_image=0)


def process_sample(record: dict, index: int, file: str, processor: VisionProcessor,
                   chat: ChatFormat, template: str, image_dir: str, options: ImageOptions) -> dict:
    """One record's columns (see ``process_records``); ``BadSample`` for a bad one."""
    where = f"{file}, sample {index}"
    messages, references = read_messages(chat, record, where)
    reason = drop_reason([{**m, "content": _text(m["content"])} for m in messages])
    if reason:
        return _empty(reason)
    pictures = [open_image(ref, image_dir, where, options) for ref in references]
    pixels, grids = processor.images(pictures)
    try:
        ids, mask = tokenize_conversation(processor.tokenizer, messages, template, index)
    except ValueError as err:  # "sample N: ..."
        raise ValueError(f"{file}, {err}") from None
    placeholders = ids.count(processor.image_token_id)
    if placeholders != len(references):
        raise BadSample(
            "image tokens do not match the images",
            f"{where}: the chat template renders {placeholders} image tokens for "
            f"{len(references)} images (an image part the template drops, or an image token "
            "written in the text)",
        )
    if processor.video_token_id is not None and processor.video_token_id in ids:
        raise BadSample("video tokens", f"{where}: video tokens in the text; videos are not "
                        "supported")
    counts = processor.tokens_per_image(grids)
    ids_out, mask_out = processor.expand(ids, grids, mask)  # image tokens never carry loss
    at = np.flatnonzero(np.asarray(ids_out) == processor.image_token_id)
    image_end = int(at[-1]) + 1 if len(at) else 0
    first = next((j for j in range(1, len(mask_out)) if mask_out[j]), len(ids_out))
    return dict(input_ids=ids_out, assistant_mask=mask_out, length=len(ids_out), first_loss=first,
                dropped="", problem="", pixel_values=pixels.reshape(-1),
                image_grid_thw=grids.tolist(), image_end=image_end,
                largest_image=max(counts, default=0))


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def open_image(reference: str, image_dir: str, where: str, options: ImageOptions) -> Any:
    """The image file as an RGB PIL image, or ``BadSample`` naming it."""
    if reference.startswith(("http://", "https://", "data:")):
        raise BadSample("remote image", f"{where}: image {reference[:80]!r} is not a local "
                        "file; download it and give its path")
    path = reference.removeprefix("file://")
    path = os.path.join(image_dir, os.path.expanduser(path))
    if not os.path.isfile(path):
        raise BadSample("image file not found", f"{where}: image {reference!r} not found "
                        f"({path})")
    try:
        with Image.open(path) as image:
            pixels = image.width * image.height
            if options.max_pixels is not None and pixels > options.max_pixels:
                raise BadSample(
                    f"image over max_pixels={options.max_pixels}",
                    f"{where}: image {reference!r} has {image.width}x{image.height} = {pixels} "
                    f"pixels, over max_pixels={options.max_pixels}",
                )
            return image.convert("RGB")
    except BadSample:
        raise
    except Exception as err:  # noqa: BLE001 - PIL raises many types for a damaged file
        raise BadSample("image file unreadable", f"{where}: image {reference!r} ({path}) "
                        f"cannot be read: {type(err).__name__}: {err}") from None


@rank_zero_only
def _log_stats(stats: dict) -> None:
    train, val = stats["train"], stats.get("val")
    log.info(
        f"Image chat data: {stats['samples']} samples; training: {train['samples']} samples, "
        f"{train['images']} images in {train['rows']} rows, {train['tokens']} tokens, packing "
        f"efficiency {train['packing_efficiency']:.1%}"
        + (f"; validation: {val['rows']} rows" if val else "")
    )
    if stats["dropped"] or stats["truncated"]:
        log.warning(
            f"Image chat data: dropped {stats['dropped'] or 'none'}, truncated "
            f"{stats['truncated']} of {stats['samples']} samples"
            + "".join(f"\n  {message}" for message in stats["bad_samples"][:10])
        )
