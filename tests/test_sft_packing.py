"""Acceptance (SFT packing): a packed batch gives the summed loss and the gradients of the same
samples run one per row, through the plain causal path (fp32, 1e-5), at TP=1, TP=2+SP, PP=2.

The reference is PretrainModule on unpacked rows: standard causal attention, positions 0..L-1,
no segment ids. The packed run is SFTModule on rows holding several samples (THD, block-diagonal
attention, positions restarting per sample). Per-token loss over the same assistant tokens
makes both the same number; one SGD step (lr=1, no clipping) turns equal gradients into equal
weights.
"""

import pytest
import torch

from lightning_mcore import OptimizerSettings
from lightning_mcore.data.packing import build_row, pack
from lightning_mcore.objectives.sft import SFTModule
from toy import assemble, fit, tiny_config

SEQ = 32
LENGTHS = [20, 12, 18, 14, 25, 7, 16, 16]  # best-fit decreasing packs them into 4 full rows


def samples():
    gen = torch.Generator().manual_seed(5)
    out = []
    for n in LENGTHS:
        ids = torch.randint(0, 500, (n,), generator=gen).tolist()
        mask = (torch.rand(n, generator=gen) < 0.6).int().tolist()
        out.append((ids, mask))
    return out


def run(tmp_path, name, rows, module_cls, devices=1, config=None, **parallel):
    optim = OptimizerSettings(lr=1.0, optimizer="sgd", clip_grad=0.0, weight_decay=0.0)
    losses = fit(tmp_path, devices=devices, steps=1, gbs=len(rows), mbs=2, optim=optim,
                 config=config or tiny_config(seq_length=SEQ), dataset=rows, dump_weights=True, name=name,
                 module_cls=module_cls, **parallel)
    return losses[0], assemble(sorted(tmp_path.glob(f"{name}.end*.pt")))


@pytest.mark.distributed
def test_packed_equals_one_sample_per_row(tmp_path):
    from lightning_mcore import PretrainModule

    data = samples()
    layout = pack(LENGTHS, SEQ)
    assert len(layout) == 4 and all(len(r) == 2 for r in layout)
    packed_rows = [build_row([data[i] for i in row], SEQ, pad_id=0) for row in layout]
    single_rows = [{k: v for k, v in build_row([s], SEQ, pad_id=0).items() if k != "segment_ids"}
                   for s in data]

    ref_loss, ref = run(tmp_path, "reference", single_rows, PretrainModule)
    init = assemble([tmp_path / "reference.init0.pt"])
    for name, devices, parallel in (
        ("packed", 1, {}),
        ("packed_tp2_sp", 2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
        ("packed_pp2", 2, dict(pipeline_model_parallel_size=2)),
    ):
        loss, got = run(tmp_path, name, packed_rows, SFTModule, devices, **parallel)
        assert abs(loss - ref_loss) <= 1e-5 * ref_loss, (name, loss, ref_loss)
        for key in ref:
            assert not torch.equal(ref[key], init[key]), f"{key} was not updated"
            torch.testing.assert_close(got[key], ref[key], rtol=0, atol=1e-5, msg=f"{name} {key}")


@pytest.mark.distributed
def test_packing_is_what_makes_it_equal(tmp_path):
    """Control: the packed rows through the plain causal path (samples see each other,
    positions do not restart) give a different loss, so the test above can fail."""
    from lightning_mcore import PretrainModule

    data = samples()
    packed_rows = [build_row([data[i] for i in row], SEQ, pad_id=0) for row in pack(LENGTHS, SEQ)]
    single_rows = [build_row([s], SEQ, pad_id=0) for s in data]
    cross_loss, _ = run(tmp_path, "cross", packed_rows, PretrainModule)
    ref_loss, _ = run(tmp_path, "reference", single_rows, PretrainModule)
    assert abs(cross_loss - ref_loss) > 1e-3
