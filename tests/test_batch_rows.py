"""A training batch must be the rank's share of the global batch (MegatronStrategy.check_training_rows)."""

import lightning as L
import pytest
from torch.utils.data import DataLoader

from lightning_mcore import MegatronStrategy, PretrainModule
from toy import TokenRows, tiny_config


def test_training_batch_other_than_the_data_parallel_share_is_refused():
    """A DataLoader yielding the global batch on each rank (or any other size) would train more
    rows a step than global_batch_size says, silently: the strategy refuses it at the first step."""
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        strategy=MegatronStrategy(global_batch_size=4, micro_batch_size=2, start_method="fork"))
    # forked rank: the ValueError comes back inside torch's ProcessRaisedException
    with pytest.raises(Exception, match=r"ValueError: a training batch of 8 rows on each of the 1 data-parallel "
                                         r"rank\(s\) would train 8 rows a step, but global_batch_size=4: "
                                         r".*DataLoader\(batch_size=4\)"):
        trainer.fit(PretrainModule(tiny_config()), DataLoader(TokenRows(n=8), batch_size=8))
