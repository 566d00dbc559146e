"""Preference pairs for reward models: DPODataModule's rows, plus an optional per-pair margin.

A reward model (objectives/reward.py) is trained on the same rows as DPO (one pair per row,
chosen then rejected); a record may add a number, the margin by which the chosen reply should
outscore the rejected one (Llama 2's reward-model loss). Batches then carry ``margin`` [B]
(0 where the dataset has no margin column).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_mcore.data.chat_module import load_records
from lightning_mcore.data.dpo import DPODataModule
from lightning_mcore.data.two_rows import RowsWith


class RewardDataModule(DPODataModule):
    """Preference pairs for a reward model (RewardModule), each with an optional margin.
    DPODataModule's arguments, and ``margin``: the dataset's column of per-pair margins
    (numbers; absent column: every margin 0; None: ignore the column)."""

    def __init__(self, *args: Any, margin: Optional[str] = "margin", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.margin_column = margin
        self._margins: Optional[np.ndarray] = None

    def _rows(self, split: str, tokenized: Any, pairs: list[int], lengths: np.ndarray) -> Dataset:
        rows = super()._rows(split, tokenized, pairs, lengths)
        margins = self._read_margins()
        return RowsWith(rows, "margin", [float(margins[i]) for i in pairs], torch.float32)

    def _read_margins(self) -> np.ndarray:
        """Every record's margin (records and tokenized pairs share their order)."""
        if self._margins is None:
            records = load_records(self.paths, self.hparams.cache_dir)
            name = self.margin_column
            if name is None or name not in records.column_names:
                self._margins = np.zeros(len(records))
                return self._margins
            values = records[name]
            for index, value in enumerate(values):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ValueError(f"sample {index}: margin column {name!r} holds {value!r}; margins "
                                     f"are finite numbers (or leave the column out: 0).")
            self._margins = np.asarray(values, dtype=np.float64)
        return self._margins
