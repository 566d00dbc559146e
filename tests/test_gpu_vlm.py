"""Vision-language models on GPU (issue 24): on Transformer Engine's spec, Qwen2.5-VL and Qwen3-VL
logits of packed multimodal rows equal transformers' fp32 logits in fp32 (1e-4) and within bf16
rounding in bf16-mixed; a few training steps on a repeated batch lower the loss. One GPU."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from test_vlm_model import SEQ
from vlm_models import batch, hf_logits, make_vlm, sample
from lightning_mcore import MegatronStrategy, OptimizerSettings
from lightning_mcore.objectives.vision_language import VisionLanguageSFTModule
from lightning_mcore.verify import relative_diff

pytestmark = [pytest.mark.gpu]


class Record(L.Callback):
    def __init__(self) -> None:
        self.losses, self.logits = [], None

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.logits = outputs.float().cpu()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["loss"]))


def trainer(precision: str, steps: int, record: Record) -> L.Trainer:
    return L.Trainer(accelerator="gpu", devices=1, precision=precision, max_steps=steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     strategy=MegatronStrategy(global_batch_size=4), callbacks=[record])


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_vlm_on_te(family, precision, tmp_path):
    hf = make_vlm(family, tmp_path / "source")
    gen = torch.Generator().manual_seed(1)
    a, b = sample(hf, [[1, 4, 4]], SEQ, gen), sample(hf, [[1, 2, 2], [1, 4, 2]], SEQ, gen)
    c, d = sample(hf, [[1, 2, 4]], SEQ // 2, gen), sample(hf, [[1, 4, 2], [1, 2, 2]], SEQ // 2, gen)
    data = batch(hf, [[a], [b], [c, d], [a]])
    expected = torch.stack([hf_logits(hf, a), hf_logits(hf, b),
                            torch.cat([hf_logits(hf, c), hf_logits(hf, d)]), hf_logits(hf, a)])
    rows = [{k: v[i] for k, v in data.items()} for i in range(4)]
    record = Record()
    module = VisionLanguageSFTModule(str(tmp_path / "source"), OptimizerSettings(lr=3e-3, warmup_steps=0))
    trainer(precision, 0, record).predict(module, DataLoader(rows, batch_size=4))
    error = relative_diff(record.logits, expected)
    print(f"{family} {precision}: relative logit difference {error:.2e}")
    assert error <= (1e-4 if precision == "32-true" else 0.1)

    for row in rows:
        row["labels"] = torch.cat([row["tokens"][1:], row["tokens"][:1]])
        row["loss_mask"] = (row["labels"] < 280).float()
    record = Record()
    trainer(precision, 6, record).fit(
        VisionLanguageSFTModule(str(tmp_path / "source"), OptimizerSettings(lr=3e-3, warmup_steps=0)),
        DataLoader(rows * 6, batch_size=4))
    print(f"{family} {precision}: losses {record.losses}")
    assert all(torch.isfinite(torch.tensor(record.losses))) and record.losses[-1] < record.losses[0]
