"""On GPU the optimizer runs on mcore's precision-aware path by default (OptimizerSettings
precision_aware None): Transformer Engine's FusedAdam holds the fp32 master weights (as bf16
weights plus 16-bit remainders) and writes the bf16 weights in its kernel, where mcore otherwise
keeps its own fp32 copies and copies them over each step. Same AdamW in fp32, so the losses follow
mcore's copies within rounding (the bf16 weights may round a tie the other way), and a checkpoint
of either path resumes under the other. Skipped without CUDA."""

import dataclasses

import lightning as L
import pytest
from toy import TokenRows, fit, fit_with_checkpoints, tiny_config

from lightning_mcore import OptimizerSettings

pytestmark = [pytest.mark.gpu]


class MasterWeights(L.Callback):
    """After fit: whether mcore ran the precision-aware path, and whether TE's Adam held the
    master weights."""

    def on_train_end(self, trainer, pl_module):
        parts = trainer.optimizers[0].parts  # mcore's optimizers behind ours
        self.precision_aware = {part.config.use_precision_aware_optimizer for part in parts}
        self.in_adam = {getattr(part.optimizer, "master_weights", False) for part in parts}


def te_config(**overrides):
    return tiny_config(**{**dict(transformer_impl="transformer_engine", num_layers=2, hidden_size=256,
                                 ffn_hidden_size=512, num_attention_heads=4, seq_length=128,
                                 vocab_size=1024), **overrides})


def test_default_trains_as_mcore_master_copies(tmp_path):
    data = TokenRows(n=16, seq=128, vocab=1024)  # 16 rows seen 10 times: the loss falls
    common = dict(steps=20, gbs=8, mbs=2, config=te_config(), dataset=data, accelerator="gpu",
                  precision="bf16-mixed", start_method="popen", use_distributed_optimizer=True)
    where = {name: MasterWeights() for name in ("default", "copies")}
    runs = {name: fit(tmp_path, name=name, callbacks=[where[name]],
                      optim=OptimizerSettings(lr=3e-3, precision_aware=None if name == "default" else False),
                      **common)
            for name in where}
    assert (where["default"].precision_aware, where["default"].in_adam) == ({True}, {True})
    assert (where["copies"].precision_aware, where["copies"].in_adam) == ({False}, {False})
    new, old = runs["default"], runs["copies"]
    print("losses copies", old, "precision-aware", new)
    assert len(old) == len(new) == 20 and new[0] == old[0]  # the same weights and batch before any update
    assert old[-1] < old[0] - 1.0, "the reference did not learn"
    for step, (a, b) in enumerate(zip(old, new)):
        assert b == pytest.approx(a, rel=1e-3), f"step {step}: mcore's copies {a} vs precision-aware {b}"


@pytest.mark.parametrize("saved_with, resumed_with", [(False, None), (None, False)],
                         ids=["copies-to-default", "default-to-copies"])
def test_checkpoints_resume_across_the_two_paths(tmp_path, saved_with, resumed_with):
    common = dict(config=te_config(vocab_size=512, seq_length=32), accelerator="gpu", start_method="popen",
                  precision="bf16-mixed", use_distributed_optimizer=True)
    optim = OptimizerSettings(lr=1e-3, warmup_steps=2)
    first, then = (dataclasses.replace(optim, precision_aware=p) for p in (saved_with, resumed_with))
    straight = fit_with_checkpoints(tmp_path, "straight", 1, optim=first, **common)
    fit_with_checkpoints(tmp_path, "first", 1, stop=3, optim=first, **common)
    saved = str(tmp_path / "first-ckpts" / "epoch=0-step=3.ckpt")
    resumed = fit_with_checkpoints(tmp_path, "resumed", 1, ckpt_path=saved, optim=then, **common)
    print("straight", straight, "resumed", resumed)
    assert len(resumed) == 3
    for got, want in zip(resumed, straight[3:]):
        assert abs(got - want) <= 1e-3 * abs(want), (resumed, straight[3:])
    assert max(abs(x - straight[0]) for x in straight) > 5e-3 * straight[0], straight  # training moved it
