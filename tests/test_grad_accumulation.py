"""Acceptance: micro batch 1 x 4 microbatches and micro batch 4 x 1 make the same update.

SGD (no momentum effect on the first step, no clipping) makes the update -lr * grad, so equal
weights mean equal gradients: what microbatching must preserve. Adam is not the instrument here:
it divides by |grad|, so a coordinate whose gradient is ~1e-9 (fp32 summation-order noise) can
move by a full lr either way.
"""


import torch

from lightning_mcore import OptimizerSettings
from toy import assemble, fit


def test_microbatching_does_not_change_the_update(tmp_path):
    optim = OptimizerSettings(lr=0.5, optimizer="sgd", clip_grad=0.0, weight_decay=0.0)
    runs, losses = {}, {}
    for mbs in (1, 4):
        name = f"mbs{mbs}"
        losses[mbs] = fit(tmp_path, devices=1, steps=2, gbs=4, mbs=mbs, optim=optim,
                          dump_weights=True, name=name)
        runs[mbs] = (assemble([tmp_path / f"{name}.init0.pt"]), assemble([tmp_path / f"{name}.end0.pt"]))

    (init1, end1), (init4, end4) = runs[1], runs[4]
    for key in end1:
        assert torch.equal(init1[key], init4[key])
        assert not torch.equal(end1[key], init1[key]), f"{key} was not updated"
        torch.testing.assert_close(end1[key], end4[key], rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[4]), rtol=1e-6, atol=0)
