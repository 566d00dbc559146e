"""A data module that refuses on rank 1 only (tests/test_bad_inputs.py): a refusal that rank 0,
waiting for rank 1 in a collective, never meets itself."""

import os

from lightning_mcore.data import PretrainDataModule, peek


class RankOneRefuses(PretrainDataModule):
    def setup(self, stage=None) -> None:
        if self.trainer.global_rank == 1:
            peek.check_has_text(os.environ["RANK_FAULT_FILE"])  # a blank file: refused
        super().setup(stage)
