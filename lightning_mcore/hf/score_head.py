"""The Hugging Face `...ForSequenceClassification` layout (num_labels=1) of a reward model.

transformers' scalar-head models (GenericForSequenceClassification) keep the causal LM's backbone
under the same names (`model.*`) and replace `lm_head` with `score.weight` [num_labels, hidden],
no bias. In our chunks the head sits where the output layer was (`output_layer.weight`, [1, h],
the same on every tensor-parallel rank), so a family's weight table becomes a reward model's
by swapping that one entry.
"""

from __future__ import annotations

from typing import Optional

import torch

from lightning_mcore.hf.mappings import Entry
from lightning_mcore.hf.transforms import Replicated, Transform

HEAD = "output_layer.weight"
SCORE = "score.weight"


class FreshHead(Transform):
    """A head that the checkpoint does not have: zeros [1, hidden], whatever it reads. Used
    with the causal LM's output tensor as its `hf` name, so that the loader (which refuses
    tensors nothing reads) accounts for lm_head without putting it anywhere."""

    def __init__(self, hidden: int) -> None:
        self.hidden = hidden

    def load(self, reader, names, rank, size, dims):
        return torch.zeros(1, self.hidden)

    def save(self, shards, names, dims):
        return {}


def reward_weights(entries: list[Entry], hidden: int, fresh: bool = False) -> list[Entry]:
    """A family's weight table with the output layer replaced by the score head: read from and
    written to `score.weight`, or (`fresh`, importing a causal LM) started at zero."""
    out = []
    for entry in entries:
        if entry.mcore != HEAD:
            out.append(entry)
        elif fresh:  # lm_head.weight (or the tied embedding): shape-checked, then dropped
            out.append(Entry(HEAD, entry.hf, FreshHead(hidden), entry.shapes, export=False))
        else:
            out.append(Entry(HEAD, (SCORE,), Replicated(), (("1", "h"),)))
    return out


def seq_cls_config(config: dict, class_name: str, pad_token_id: Optional[int]) -> dict:
    """config.json of the scalar-head model: `class_name` as the architecture, one label, and a
    pad_token_id (transformers scores the last token that is not padding, and refuses batches
    of more than one row without one)."""
    out = {k: v for k, v in config.items() if k not in ("id2label", "label2id")}
    out.update(architectures=[class_name], num_labels=1, id2label={"0": "LABEL_0"},
               label2id={"LABEL_0": 0}, problem_type=None)
    if pad_token_id is not None:
        out["pad_token_id"] = int(pad_token_id)
    return out
