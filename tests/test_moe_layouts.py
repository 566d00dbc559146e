"""Acceptance for mixture of experts: expert-parallel layouts train the single-process model.

4 experts, top-2, SequentialMLP experts on the local spec (CPU, gloo, fp32). Each layout's
losses, initial weights and trained weights are compared with a one-process run of the same
config and data (the independent reference, computed here, never a stored number).

micro_batch_size=1: mcore's load-balancing loss is computed per microbatch and is not additive
over tokens, and toy.fit's plain DataLoader gets Lightning's DistributedSampler, which deals
rows to data-parallel ranks in turn (rank 0's first microbatch of two would be rows 0 and 2, one
process's rows 0 and 1). With one row per microbatch every layout sees the same microbatches.
Every layout trains with the aux loss, the TP x EP one under sequence parallelism too
(Megatron-LM #1652: mcore once scaled its gradient by one TP rank's tokens there; #5047 fixed it).
"""

import math

import pytest
import torch

from toy import assemble, fit, tiny_config

AUX = 0.1
EXPERT_KEYS = (
    "decoder.layers.mlp.router.weight",
    "decoder.layers.mlp.experts.experts.linear_fc1.weight",
    "decoder.layers.mlp.experts.experts.linear_fc2.weight",
)

# name: (processes, dispatcher, aux loss coefficient, parallel sizes)
LAYOUTS = {
    "ep2_alltoall": (2, "alltoall", AUX, dict(expert_model_parallel_size=2)),
    "ep2_allgather": (2, "allgather", AUX, dict(expert_model_parallel_size=2)),
    "tp2_sp_ep2_alltoall": (4, "alltoall", AUX, dict(
        expert_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True)),
    "pp2_ep1": (2, "alltoall", AUX, dict(pipeline_model_parallel_size=2)),
}


def moe_config(dispatcher: str, aux: float):
    return tiny_config(num_moe_experts=4, moe_ffn_hidden_size=64, moe_router_topk=2,
                       moe_token_dispatcher_type=dispatcher, moe_aux_loss_coeff=aux)


def run(tmp, devices, dispatcher, aux, name="run", **parallel):
    losses = fit(tmp, devices=devices, mbs=1, config=moe_config(dispatcher, aux),
                 dump_weights=True, name=name, **parallel)
    return (losses, assemble(sorted(tmp.glob(f"{name}.init*.pt"))),
            assemble(sorted(tmp.glob(f"{name}.end*.pt"))))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, no parallelism, per (dispatcher, aux): computed once, when first needed."""
    cache = {}

    def get(dispatcher: str, aux: float):
        if (dispatcher, aux) not in cache:
            tmp = tmp_path_factory.mktemp(f"ref_{dispatcher}_{aux}")
            cache[dispatcher, aux] = run(tmp, 1, dispatcher, aux, name="ref")
        return cache[dispatcher, aux]

    return get


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_layout_matches_single_process(layout, reference, tmp_path):
    devices, dispatcher, aux, parallel = LAYOUTS[layout]
    ref_losses, ref_weights, ref_trained = reference(dispatcher, aux)
    losses, weights, trained = run(tmp_path, devices, dispatcher, aux, **parallel)

    assert set(EXPERT_KEYS) <= ref_weights.keys()
    assert ref_weights["decoder.layers.mlp.experts.experts.linear_fc1.weight"].shape[:2] == (4, 4)
    assert weights.keys() == ref_weights.keys()
    for key, full in ref_weights.items():  # NaN marks a shard no rank wrote
        assert torch.equal(weights[key], full), f"initial {key} differs under {layout}"

    assert len(losses) == 3 and len(ref_losses) == 3
    assert all(math.isfinite(x) for x in losses) and losses[0] > losses[-1] - 1.0
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: {got} vs {want} ({layout})"

    for key, full in ref_trained.items():
        assert not torch.equal(full, ref_weights[key]), f"{key} was not trained"
        torch.testing.assert_close(trained[key], full, rtol=0, atol=1e-5, msg=f"{key} ({layout})")


@pytest.mark.distributed
def test_aux_loss_takes_part_in_training(reference):
    """The aux-loss layouts above compare something real: the aux loss moves the weights far
    beyond the 1e-5 tolerance (and the experts themselves), compared with no aux loss."""
    _, init_aux, trained_aux = reference("alltoall", AUX)
    _, init_plain, trained_plain = reference("alltoall", 0.0)
    for key in init_aux:
        assert torch.equal(init_aux[key], init_plain[key])
    for key in EXPERT_KEYS:
        assert (trained_aux[key] - trained_plain[key]).abs().max() > 1e-4, key


def test_cpu_compat_moe_patches_are_undone():
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    from lightning_mcore.strategy.cpu import CpuCompat

    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    before = (dispatcher.__dict__.get("_maybe_dtoh_and_synchronize"),
              dispatcher.__dict__.get("cuda_dtoh_stream"), mappings._gather_along_first_dim,
              moe_utils.te_general_gemm)
    compat = CpuCompat()
    compat.install()
    try:
        assert dispatcher._maybe_dtoh_and_synchronize is not before[0]
        assert mappings._gather_along_first_dim is not before[2]
        assert moe_utils.te_general_gemm is None
    finally:
        compat.uninstall()
    after = (dispatcher.__dict__.get("_maybe_dtoh_and_synchronize"),
             dispatcher.__dict__.get("cuda_dtoh_stream"), mappings._gather_along_first_dim,
             moe_utils.te_general_gemm)
    assert after == before
