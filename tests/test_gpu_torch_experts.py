"""On GPU, the MoE defaults (moe_grouped_gemm None and backend 'auto': torch's grouped GEMM with
the counts kept on the device, permutation and router fused) train what the old settings
(Transformer Engine's grouped experts, unfused; and mcore's SequentialMLP, the default before
session 9) train: 20 steps from the same initial weights on the same data give the same losses
within bf16 rounding. And a checkpoint written with TE's grouped experts
resumes under the defaults (the two share mcore's checkpoint layout). Skipped without CUDA."""

import pytest
from toy import TokenRows, fit, fit_with_checkpoints, tiny_config

from lightning_mcore import OptimizerSettings

pytestmark = [pytest.mark.gpu]


def moe(backend: str, **overrides):
    return tiny_config(**{**dict(num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4,
                                 seq_length=128, vocab_size=1024, transformer_impl="transformer_engine",
                                 num_moe_experts=8, moe_ffn_hidden_size=128, moe_router_topk=2,
                                 moe_aux_loss_coeff=0.01, moe_grouped_gemm=True,
                                 moe_grouped_gemm_backend=backend), **overrides})


def test_defaults_train_as_the_old_settings(tmp_path):
    data = TokenRows(n=16, seq=128, vocab=1024)  # 16 rows seen 10 times: memorised, the loss falls
    configs = {"te": moe("te"), "sequential": moe("auto", moe_grouped_gemm=False),
               "defaults": moe("auto", moe_grouped_gemm=None)}
    assert configs["defaults"].torch_experts and not configs["sequential"].grouped_experts
    runs = {name: fit(tmp_path, steps=20, gbs=8, mbs=2, config=config, dataset=data, name=name,
                      optim=OptimizerSettings(lr=3e-3), accelerator="gpu", precision="bf16-mixed",
                      start_method="popen")
            for name, config in configs.items()}
    new = runs["defaults"]
    print("losses", runs)
    for name in ("te", "sequential"):
        old = runs[name]
        assert len(old) == len(new) == 20
        assert old[-1] < old[0] - 1.0, f"the reference ({name}) did not learn"
        for step, (a, b) in enumerate(zip(old, new)):
            assert b == pytest.approx(a, rel=1e-2), f"step {step}: {name} {a} vs defaults {b}"


def test_te_checkpoint_resumes_under_the_defaults(tmp_path):
    common = dict(accelerator="gpu", start_method="popen", precision="bf16-mixed")
    straight = fit_with_checkpoints(tmp_path, "straight", 1, config=moe("te", vocab_size=512), **common)
    fit_with_checkpoints(tmp_path, "first", 1, stop=3, config=moe("te", vocab_size=512), **common)
    saved = str(tmp_path / "first-ckpts" / "epoch=0-step=3.ckpt")
    resumed = fit_with_checkpoints(tmp_path, "resumed", 1, ckpt_path=saved, config=moe("auto", vocab_size=512),
                                   **common)
    print("straight", straight, "resumed", resumed)
    assert len(resumed) == 3 and resumed == pytest.approx(straight[3:], rel=1e-2)
