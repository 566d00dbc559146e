"""On GPU, torch's grouped GEMM (moe_grouped_gemm_backend='torch', the counts kept on the device)
trains what Transformer Engine's grouped experts train: 20 steps of the same bf16 MoE, from the
same initial weights on the same data, give the same losses within bf16 rounding. Skipped
without CUDA."""

import pytest
from toy import TokenRows, fit, tiny_config

pytestmark = [pytest.mark.gpu]


def moe(backend: str):
    return tiny_config(num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4,
                       seq_length=128, vocab_size=1024, transformer_impl="transformer_engine",
                       num_moe_experts=8, moe_ffn_hidden_size=128, moe_router_topk=2,
                       moe_aux_loss_coeff=0.01, moe_grouped_gemm=True, moe_grouped_gemm_backend=backend,
                       extra={"moe_permute_fusion": True})


def test_torch_experts_train_as_te_grouped_experts(tmp_path):
    data = TokenRows(n=160, seq=128, vocab=1024)
    runs = {backend: fit(tmp_path, steps=20, gbs=8, mbs=2, config=moe(backend), dataset=data, name=backend,
                         accelerator="gpu", precision="bf16-mixed", start_method="popen")
            for backend in ("te", "torch")}
    te, ours = runs["te"], runs["torch"]
    assert len(te) == len(ours) == 20
    assert te[-1] < te[0] - 0.1, "the reference did not learn"
    for step, (a, b) in enumerate(zip(te, ours)):
        assert b == pytest.approx(a, rel=1e-2), f"step {step}: te {a} vs torch {b}"
    print("losses te", te, "torch", ours)
