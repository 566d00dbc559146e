"""Acceptance: every parallel layout trains the same model with the same losses (CPU, gloo, fp32)."""

import pytest
import torch

from toy import assemble, fit

LAYOUTS = {
    "tp2": (2, dict(tensor_model_parallel_size=2)),
    "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
    "pp2_vpp2": (2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)),
    "dp2_distopt": (2, dict(use_distributed_optimizer=True)),
    "tp2_pp2": (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, no parallelism: the losses and initial weights every layout must reproduce."""
    tmp = tmp_path_factory.mktemp("ref")
    losses = fit(tmp, devices=1, dump_weights=True, name="ref")
    return losses, assemble([tmp / "ref.init0.pt"]), assemble([tmp / "ref.end0.pt"])


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, reference, tmp_path):
    ref_losses, ref_weights, ref_trained = reference
    devices, parallel = LAYOUTS[layout]
    losses = fit(tmp_path, devices=devices, dump_weights=True, **parallel)

    weights = assemble(sorted(tmp_path.glob("run.init*.pt")))
    assert weights.keys() == ref_weights.keys()
    for key, full in ref_weights.items():
        assert torch.equal(weights[key], full), f"initial {key} differs under {layout}"

    assert len(losses) == 3 and len(ref_losses) == 3
    assert losses[0] > losses[-1] - 1.0  # sanity: real training numbers, not NaN
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: {got} vs {want} ({layout})"

    trained = assemble(sorted(tmp_path.glob("run.end*.pt")))
    for key, full in ref_trained.items():
        assert not torch.equal(full, ref_weights[key]), f"{key} was not trained"
        torch.testing.assert_close(trained[key], full, rtol=0, atol=1e-5, msg=f"{key} ({layout})")
