"""Gradient clipping by the global norm (mcore's clip_grad_by_total_norm_fp32, queued by the
step's check): one SGD step's update is the unclipped update times clip_grad / ||g||, with ||g||
computed by hand from the unclipped step."""

import math

import pytest
import torch

from lightning_mcore import OptimizerSettings
from toy import fit


def one_step_update(tmp, name: str, clip_grad: float) -> dict:
    optim = OptimizerSettings(lr=0.5, optimizer="sgd", clip_grad=clip_grad, weight_decay=0.0,
                              decay_style="constant")
    fit(tmp, steps=1, optim=optim, dump_weights=True, name=name)
    init, end = (torch.load(tmp / f"{name}.{when}0.pt") for when in ("init", "end"))
    return {(key, offset): after - before  # each layer's weights share a key, at their own offset
            for (key, offset, _, before), (_, _, _, after) in zip(init, end, strict=True)}


@pytest.mark.distributed
def test_clipping_scales_the_update_by_clip_over_the_global_norm(tmp_path):
    free = one_step_update(tmp_path, "free", clip_grad=0.0)  # SGD's first step: -lr * g
    norm = math.sqrt(sum(float(d.double().pow(2).sum()) for d in free.values())) / 0.5
    clip = norm / 4
    clipped = one_step_update(tmp_path, "clipped", clip_grad=clip)
    assert free.keys() == clipped.keys() and len(free) > 20
    for key, update in free.items():
        torch.testing.assert_close(clipped[key], update * (clip / norm), rtol=1e-4, atol=1e-7, msg=str(key))
